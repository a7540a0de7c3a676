"""Engines and scripts of the vLLM tests (imported as `vllm_engines`).

`start_engine` runs `python -m kvshm.vllm.engine`, and `run_python` any
command line, in the environment of a vLLM release.  By default each is
forked from a server that has imported torch and vLLM once
(tests/vllm_zygote.py), one server per release and pytest process: an
engine's start then costs about 2 CPU seconds instead of 15.
KVSHM_VLLM_FORK=0 starts each as a fresh interpreter instead, to rule the
fork server out when a test fails strangely.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYTHONS = {
    "0.14.0": Path(os.environ.get("KVSHM_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python")),
    "0.32.0": Path(os.environ.get("KVSHM_VLLM_032_PYTHON",
                                  REPO / ".venv-vllm-0.32.0" / "bin" / "python"))}
ENGINE_TIMEOUT = 300
ZYGOTE_TIMEOUT = 300


class ForkServer:
    """One tests/vllm_zygote.py process of a vLLM environment."""

    def __init__(self, python: Path):
        self.log = tempfile.TemporaryFile("w+")       # its stderr: not pytest's of one test
        zygote = Path(__file__).with_name("vllm_zygote.py")
        self.proc = subprocess.Popen([str(python), str(zygote)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     cwd=REPO)
        self.lock = threading.Lock()
        ready = self._read()
        if "error" in ready:
            raise RuntimeError(f"the vLLM fork server of {python} refused: {ready['error']}")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=ZYGOTE_TIMEOUT)
            self.log.seek(0)
            raise RuntimeError(f"the vLLM fork server exited ({self.proc.returncode}): "
                               f"{self.log.read()[-4000:]}")
        return json.loads(line)

    def ask(self, **req) -> dict:
        with self.lock:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            return self._read()

    def close(self) -> None:
        self.proc.stdin.close()           # it kills the children it still has
        self.proc.wait(timeout=30)
        self.log.close()


_servers: dict[str, ForkServer] = {}


def fork_server(release: str) -> ForkServer:
    if release not in _servers:
        _servers[release] = ForkServer(PYTHONS[release])
    return _servers[release]


@atexit.register
def _close_servers() -> None:
    for server in _servers.values():
        server.close()


def forking() -> bool:
    return os.environ.get("KVSHM_VLLM_FORK", "1") != "0"


class ForkedProcess:
    """A forked process with the part of Popen's interface the tests use;
    its output goes to the files `stdout` and `stderr`."""

    def __init__(self, release: str, argv: list[str], env: dict, stdout: Path, stderr: Path):
        self.server, self.stdout_path, self.stderr_path = fork_server(release), stdout, stderr
        self.pid = self.server.ask(op="spawn", argv=argv, env=env, cwd=os.getcwd(),
                                   stdout=str(stdout), stderr=str(stderr))["pid"]
        self.returncode: int | None = None

    def _wait(self, timeout: float) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.ask(op="wait", pid=self.pid,
                                              timeout=timeout)["returncode"]
        return self.returncode

    def poll(self) -> int | None:
        return self._wait(0)

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        if self._wait(ENGINE_TIMEOUT if timeout is None else timeout) is None:
            raise subprocess.TimeoutExpired(["kvshm.vllm.engine"], timeout)
        return self.stdout_path.read_text(), self.stderr_path.read_text()


def run_python(release: str, argv: list, *, env: dict | None = None,
               timeout: float = ENGINE_TIMEOUT) -> subprocess.CompletedProcess:
    """`python ARGV...` in vLLM `release`'s environment, run to its end, its
    output captured as text (subprocess.run's result)."""
    argv = [str(a) for a in argv]
    env = dict(os.environ if env is None else env)
    if not forking():
        return subprocess.run([str(PYTHONS[release]), *argv], env=env, capture_output=True,
                              text=True, timeout=timeout)
    with tempfile.TemporaryDirectory() as tmp:
        proc = ForkedProcess(release, argv, env, Path(tmp) / "stdout", Path(tmp) / "stderr")
        try:
            out, err = proc.communicate(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def start_engine(model: Path, workload: dict, tmp: Path, name: str, *, pool: str | None,
                 extra: tuple[str, ...] = (), env: dict | None = None,
                 release: str = "0.14.0"):
    """Start one engine process of vLLM `release` on `workload`; finish it
    with `finish()`."""
    wl = tmp / f"{name}.workload.json"
    wl.write_text(json.dumps(workload))
    out = tmp / f"{name}.json"
    e = {k: v for k, v in os.environ.items() if k not in ("KVSHM_POOL", "PYTHONHASHSEED")}
    e["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    e["VLLM_CPU_KVCACHE_SPACE"] = "1"
    if pool is not None:
        e["KVSHM_POOL"] = pool
    e.update(env or {})
    argv = ["-m", "kvshm.vllm.engine", str(model), str(wl), "--out", str(out), *extra]
    if forking():
        proc = ForkedProcess(release, argv, e, tmp / f"{name}.stdout", tmp / f"{name}.stderr")
    else:
        proc = subprocess.Popen([str(PYTHONS[release]), *argv], env=e, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    proc.report_path = out
    return proc


def finish(proc, check: bool = True):
    """The engine's report (or, with check=False, the finished process with
    its `stderr_text`)."""
    try:
        _, proc.stderr_text = proc.communicate(timeout=ENGINE_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, proc.stderr_text = proc.communicate()
        raise
    if not check:
        return proc
    assert proc.returncode == 0, proc.stderr_text[-4000:]
    return json.loads(proc.report_path.read_text())


def run_engine(model: Path, workload: dict, tmp: Path, name: str, *, pool: str | None,
               extra: tuple[str, ...] = (), env: dict | None = None, check: bool = True,
               release: str = "0.14.0"):
    """Run one engine process to its end (see `finish`)."""
    return finish(start_engine(model, workload, tmp, name, pool=pool, extra=extra, env=env,
                               release=release), check)


@pytest.fixture(params=list(PYTHONS))
def release(request) -> str:
    """The vLLM release a test runs on (each in turn; a test file imports
    this fixture).  A release without its environment skips, or fails
    where KVSHM_REQUIRE_VLLM=1 (the test command sets it)."""
    python = PYTHONS[request.param]
    if not python.exists():
        if os.environ.get("KVSHM_REQUIRE_VLLM") == "1":
            pytest.fail(f"KVSHM_REQUIRE_VLLM=1 but there is no vLLM {request.param} "
                        f"environment at {python} (run ./scripts/vllm_env.sh {request.param})")
        pytest.skip(f"no vLLM {request.param} environment at {python}")
    return request.param
