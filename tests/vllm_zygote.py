"""A fork server for the vLLM tests' processes (run by a vLLM environment's
Python; tests/vllm_engines.py starts and drives it).

An engine process spends most of its start importing torch and vLLM: about
12 of its 15 CPU seconds here, and the vLLM tests start dozens of engines
and scripts.  This process imports them once, then forks one child per
process asked for.  A child takes the environment, directory, command line
and output files it is given and runs `python -m MODULE ...`, `python -c
CODE ...` or `python SCRIPT ...` as a fresh interpreter would, exit
handlers included.

Nothing here may start a thread or an OpenMP pool before a fork: a child
would inherit locks held by threads it does not have.  The server checks
that it is single-threaded (/proc/self/task) before it answers that it is
ready.  numpy's OpenBLAS starts its thread pool when it is loaded, so the
server loads it with OPENBLAS_NUM_THREADS=1: the engines' own BLAS is
torch's, whose OpenMP pool starts in the child, and numpy's matrix products
in an engine then run on one thread.

Protocol: one JSON object a line on the pipes the server is started with
(its stdin and stdout; it moves them off fds 0 and 1 first):
    {"op": "spawn", "argv": [...], "env": {...}, "cwd": ..., "stdout": path,
     "stderr": path}                      -> {"pid": N}
    {"op": "wait", "pid": N, "timeout": s} -> {"returncode": rc or null}
"argv" is what follows `python` on a command line.  A return code is
Popen's: negative for a signal.  At EOF on its stdin the
server kills the children it still has and exits.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

PRELOAD = ("torch", "vllm", "vllm.entrypoints.llm", "vllm.v1.engine.core",
           "vllm.v1.engine.llm_engine", "vllm.v1.worker.cpu_worker",
           "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.models.llama",
           "vllm.model_executor.model_loader", "kvshm.vllm", "kvshm.vllm.manager",
           "kvshm.vllm.binding", "kvshm.vllm.gate")
# (not kvshm.vllm.engine: `-m` runs a module that is not imported yet)


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def serve(ctl_in, ctl_out) -> dict | None:
    """Answer requests until EOF (then None); in a forked child, return its
    request."""
    children: set[int] = set()
    for line in ctl_in:
        req = json.loads(line)
        if req["op"] == "spawn":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                ctl_in.close()
                ctl_out.close()
                return req
            children.add(pid)
            reply = {"pid": pid}
        elif req["op"] == "wait":
            reply = {"returncode": reap(req["pid"], req["timeout"])}
            if reply["returncode"] is not None:
                children.discard(req["pid"])
        else:
            reply = {"error": f"unknown op {req['op']!r}"}
        ctl_out.write(json.dumps(reply) + "\n")
        ctl_out.flush()
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    return None


def reap(pid: int, timeout: float) -> int | None:
    """The child's return code, or None if it is still running after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:         # reaped by an earlier wait
            return None
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


def become(req: dict) -> None:
    """In the child: take the request's files, environment and directory,
    then run its command line as the interpreter would."""
    import runpy
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    argv = req["argv"]
    if argv[0] == "-m":
        sys.path[0] = req["cwd"]
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.path[0] = ""
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    ctl_in = os.fdopen(os.dup(0), "r")
    ctl_out = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)                         # what the imports print goes to stderr
    os.environ["OPENBLAS_NUM_THREADS"] = "1"      # (a child gets its own environment)
    import importlib
    for name in PRELOAD:
        importlib.import_module(name)
    ready = {"ready": True, "threads": threads()}
    if ready["threads"] != 1:
        ready = {"error": f"{ready['threads']} threads after the imports: forking is unsafe"}
    ctl_out.write(json.dumps(ready) + "\n")
    ctl_out.flush()
    if "error" in ready:
        raise SystemExit(1)
    req = serve(ctl_in, ctl_out)
    if req is not None:
        become(req)                       # then the interpreter exits as after a script


if __name__ == "__main__":
    main()
