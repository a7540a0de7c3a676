"""A host of vLLM servers on one kvshm pool (`kvshm host`): the coordinator
for a model, one `vllm serve` per NUMA node pinned to its node's CPUs with
the pool set, and a front door (`vllm-router`) in front of them.

    coordinator (kvshm serve, supervised) <- engine 0 .. engine N-1 <- vllm-router <- clients

The host restarts a coordinator that dies (it adopts its pool, and the
engines' sessions resume: they see a delay), reports an engine or a front
door that dies, and stops everything on `stop()` (Ctrl-C, SIGTERM) in order:
the front door, the engines, then the coordinator, which removes the pool's
segments, so nothing is left in /dev/shm.

`mode="own"` runs the same engines on caches of their own instead (vLLM's
own KV-cache manager, each with the pool's blocks divided among them), the
baseline `scripts/bench_serve.py` compares against.

Engines run vLLM's own command line through `python -m kvshm.vllm.command`
(which works on the CPU wheels, whose own `vllm` command may not start),
from this interpreter's environment.  Runs outside vLLM's processes: it
imports nothing of vLLM.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvshm.core.errors import ConfigError
from kvshm.core.specs import PoolConfig
from kvshm.service.handshake import default_socket_path
from kvshm.service.process import CoordinatorProcess, die_with_parent, exit_text
from kvshm.vllm.engine import rendezvous_port
from kvshm.vllm.release import vllm_cache_root
from kvshm.workers.topology import Plan, discover, format_cpulist, pin, plan

# The front door's routing policies (vllm-router's names), "none" for none.
ROUTER_POLICIES = ("round_robin", "power_of_two", "cache_aware", "random", "none")
# vllm-router's cache-aware policy routes by a prompt's tokens, which it asks
# each engine for (POST /v1/completions/render, else /tokenize).  vLLM
# releases that keep the render endpoint behind a flag answer it 403
# without the flag, and the router then routes by load alone; with
# cache-aware routing their engines get the flag.
TOKENS_FOR_ROUTER = {"0.32.0": "--enable-scale-out"}
GiB = 1 << 30


class HostError(RuntimeError):
    """A part of the host did not start, or died: the message says which,
    with the end of its log."""


@dataclass
class HostOptions:
    """What `kvshm host` runs.  `config`: the pool for the model (its block
    size, context length and dtype are the engines' too); `engines`: how
    many `vllm serve` (0: one per NUMA node, at least 2, as `kvshm run`);
    `port`: the front door's (the engines listen on the ports after it);
    `serve_args`: passed to every `vllm serve` as they are."""

    model: str
    config: PoolConfig
    name: str = "kvshm"
    engines: int = 0
    host: str = "127.0.0.1"
    port: int = 8000
    router: str = "round_robin"
    mode: str = "pool"                  # or "own": each engine its own cache
    serve_args: list[str] = field(default_factory=list)
    engine_env: dict[str, str] = field(default_factory=dict)   # more for every engine
    pin: bool = True
    log_dir: str | None = None          # the engines' and the router's logs (default: a
                                        # temporary folder, kept if something failed)
    start_timeout: float = 900.0        # seconds for every engine to answer /health


@dataclass
class Engine:
    index: int
    cpus: tuple[int, ...]
    port: int
    log: Path
    proc: subprocess.Popen | None = None
    exit: str = ""                       # how it ended, once it has

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def engine_count(requested: int) -> int:
    """How many engines: `requested`, or one per real NUMA node, at least 2
    (virtual nodes on a single-node host, as `kvshm run` has)."""
    if requested < 0:
        raise ConfigError("engines", f"must be at least 1 (got {requested})")
    return requested or max(2, sum(1 for node in discover() if not node.virtual))


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether GET `url` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def router_command() -> list[str]:
    """The command that runs vllm-router from this environment.  Raises
    ConfigError with the fix when it is not installed."""
    exe = Path(sys.executable).with_name("vllm-router")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("vllm-router")
    if found:
        return [found]
    raise ConfigError("router", "vllm-router is not installed in this environment: "
                      "pip install 'kvshm[router]' (or vllm-router), or --router none")


class Host:
    """The processes of one host (see the module doc); `start()` brings
    them up, `poll()` supervises them, `stop()` ends them."""

    def __init__(self, opts: HostOptions, out=sys.stdout) -> None:
        if opts.mode not in ("pool", "own"):
            raise ConfigError("mode", f"must be pool or own (got {opts.mode!r})")
        if opts.router not in ROUTER_POLICIES:
            raise ConfigError("router", f"must be one of {', '.join(ROUTER_POLICIES)} "
                              f"(got {opts.router!r})")
        if opts.config.kv is None or opts.config.kv.layout != "layers":
            raise ConfigError("config", "a host's pool is made for a vLLM model "
                              "(--vllm-model): its arena in vLLM's layout")
        self.opts = opts
        self.out = out
        self.router_cmd = router_command() if opts.router != "none" else None
        n = engine_count(opts.engines)
        self.plan: Plan = plan(n, discover()) if opts.pin else None
        first = opts.port + 1
        for p in [opts.port, *range(first, first + n)]:
            if not port_free(opts.host if p == opts.port else "127.0.0.1", p):
                raise ConfigError("port", f"port {p} is in use (the front door takes "
                                  f"--port, the engines the {n} ports after it)")
        self._own_logs = opts.log_dir is None
        self.log_dir = Path(opts.log_dir or tempfile.mkdtemp(prefix="kvshm-host-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cpus = [tuple(node.cpus) for node in self.plan.workers] if self.plan else [()] * n
        self.engines = [Engine(i, cpus[i], first + i, self.log_dir / f"engine-{i}.log")
                        for i in range(n)]
        self.coordinator: CoordinatorProcess | None = None
        self.socket = default_socket_path(opts.name)   # where `kvshm serve --name` listens
        self.router: subprocess.Popen | None = None
        self.router_log = self.log_dir / "router.log"
        self.failed = False

    # -- starting -------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Where clients send requests (the front door, or the first engine
        without one)."""
        if self.router_cmd is None:
            return self.engines[0].url
        return f"http://{self.opts.host}:{self.opts.port}"

    def say(self, line: str) -> None:
        print(f"kvshm host: {line}", file=self.out, flush=True)

    def start(self) -> None:
        """Start the coordinator, the engines and the front door, and wait
        until each answers.  Raises HostError (everything started is
        stopped) when one does not."""
        try:
            self._start()
        except BaseException:
            self.failed = True
            self.stop()
            raise

    def _start(self) -> None:
        opts, cfg = self.opts, self.opts.config
        if self.plan is not None:
            for note in self.plan.notes:
                self.say(note)
        if opts.mode == "pool":
            self.coordinator = CoordinatorProcess(cfg, name=opts.name, new_session=True,
                                                  with_parent=True, default_socket=True)
            try:
                self.coordinator.wait_ready(timeout=60)
            except RuntimeError as e:
                raise HostError(f"the pool {opts.name!r} did not start: {e}") from None
            self._pin_coordinator()
            self.say(f"pool {opts.name!r}: {cfg.num_blocks} blocks of "
                     f"{cfg.groups[0].block_size} tokens, vLLM {cfg.vllm_version} semantics, "
                     f"socket {self.coordinator.socket}")
        for e in self.engines:
            self._spawn(e)
        deadline = time.monotonic() + opts.start_timeout
        waiting = list(self.engines)
        while waiting:
            for e in list(waiting):
                if e.proc.poll() is not None:
                    raise HostError(f"engine {e.index} exited with "
                                    f"{exit_text(e.proc.returncode)} while starting; its "
                                    f"log ({e.log}) ends:\n{tail(e.log)}")
                if http_ok(f"{e.url}/health"):
                    waiting.remove(e)
                    where = f"CPUs {format_cpulist(e.cpus)}" if e.cpus else "not pinned"
                    self.say(f"engine {e.index} ready at {e.url} (pid {e.proc.pid}, {where})")
            self._check_coordinator()
            if waiting and time.monotonic() > deadline:
                raise HostError(f"engines {[e.index for e in waiting]} did not answer within "
                                f"{opts.start_timeout:.0f} s (logs in {self.log_dir})")
            time.sleep(0.5)
        if self.router_cmd is not None:
            self._start_router()
        self.say(f"ready: {self.url}/v1 ({len(self.engines)} engines, "
                 f"{'one shared pool' if opts.mode == 'pool' else 'caches of their own'}, "
                 f"front door {opts.router})")

    def engine_env(self, e: Engine) -> dict[str, str]:
        """Engine `e`'s environment: the pool (KVSHM_POOL, its node), its
        CPUs (vLLM's VLLM_CPU_OMP_THREADS_BIND), the KV-cache space vLLM
        checks against free memory, its own rendezvous ports, and the
        options' `engine_env` (the plugin's knobs, for example)."""
        opts, cfg = self.opts, self.opts.config
        env = {**os.environ, **opts.engine_env}
        env.pop("KVSHM_POOL", None)
        if opts.mode == "pool":
            env["KVSHM_POOL"] = str(self.socket)
            env["KVSHM_NODE"] = str(e.index)
        arena = cfg.num_blocks * cfg.kv_block_bytes
        if opts.mode == "own":
            arena //= len(self.engines)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(arena / GiB))))
        if e.cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = format_cpulist(e.cpus)
        env.setdefault("VLLM_CACHE_ROOT", vllm_cache_root(cfg.vllm_version))
        port = rendezvous_port(os.getpid() + e.index)
        if port is not None:
            env.setdefault("VLLM_PORT", str(port))
        return env

    def engine_argv(self, e: Engine) -> list[str]:
        """`vllm serve` for engine `e` with the pool's block size and
        context length (an engine on a pool must have them; one on its own
        cache gets the same, and its share of the blocks), and behind
        cache-aware routing what the router needs to read its prompts'
        tokens (TOKENS_FOR_ROUTER)."""
        opts, cfg = self.opts, self.opts.config
        argv = [sys.executable, "-m", "kvshm.vllm.command", "serve", opts.model,
                "--host", "127.0.0.1", "--port", str(e.port),
                "--block-size", str(cfg.groups[0].block_size),
                "--max-model-len", str(cfg.max_model_len)]
        if opts.mode == "own":
            share = (cfg.num_blocks - 1) // len(self.engines) + 1
            argv += ["--num-gpu-blocks-override", str(share)]
        flag = TOKENS_FOR_ROUTER.get(cfg.vllm_version)
        if opts.router == "cache_aware" and flag and flag not in opts.serve_args:
            argv.append(flag)
        return argv + list(opts.serve_args)

    def _spawn(self, e: Engine) -> None:
        with open(e.log, "ab") as log:
            e.proc = subprocess.Popen(self.engine_argv(e), env=self.engine_env(e),
                                      stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=die_with_parent)

    def _start_router(self) -> None:
        opts = self.opts
        metrics_port = _free_port()
        argv = [*self.router_cmd, "--host", opts.host, "--port", str(opts.port),
                "--policy", opts.router, "--worker-urls", *(e.url for e in self.engines),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
        with open(self.router_log, "ab") as log:
            self.router = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True,
                                           preexec_fn=die_with_parent)
        deadline = time.monotonic() + 60
        while not http_ok(f"{self.url}/v1/models"):
            if self.router.poll() is not None or time.monotonic() > deadline:
                raise HostError(f"the front door (vllm-router) did not start; its log "
                                f"({self.router_log}) ends:\n{tail(self.router_log)}")
            time.sleep(0.2)

    # -- supervising ----------------------------------------------------------------------
    def poll(self) -> bool:
        """One look at every process: restart a dead coordinator, report a
        dead engine or front door.  False once the host cannot serve (no
        engine left, or the front door is gone)."""
        self._check_coordinator()
        for e in self.engines:
            if e.proc is not None and not e.exit and e.proc.poll() is not None:
                e.exit = exit_text(e.proc.returncode)
                self.failed = True
                self.say(f"engine {e.index} (pid {e.proc.pid}, {e.url}) exited with "
                         f"{e.exit}; its log ({e.log}) ends:\n{tail(e.log)}")
        if self.router is not None and self.router.poll() is not None:
            self.failed = True
            self.say(f"the front door exited with {exit_text(self.router.returncode)}; its "
                     f"log ({self.router_log}) ends:\n{tail(self.router_log)}")
            return False
        return any(not e.exit for e in self.engines)

    def _check_coordinator(self) -> None:
        c = self.coordinator
        if c is None or c.proc.poll() is None:
            return
        died = time.monotonic()
        how = exit_text(c.proc.returncode)
        try:
            c.restart(wait=False)
            c.wait_ready(timeout=60)
        except (OSError, RuntimeError) as e:
            self.failed = True
            raise HostError(f"the coordinator exited with {how} and did not come back: "
                            f"{e}") from None
        self._pin_coordinator()
        ms = int((time.monotonic() - died) * 1000)
        self.say(f"the coordinator exited with {how}; restarted, it adopted the pool in "
                 f"{ms} ms (the engines' sessions resume)")

    def _pin_coordinator(self) -> None:
        """On the CPU the plan keeps for it, if it keeps one."""
        if self.plan is not None and self.plan.coordinator_cpus:
            pin(self.plan.coordinator_cpus, self.coordinator.proc.pid)

    def serve_forever(self, period: float = 0.5) -> None:
        """Supervise until stopped (a signal's handler raises) or the host
        cannot serve any more (`poll`)."""
        while self.poll():
            time.sleep(period)

    # -- stopping -------------------------------------------------------------------------
    def stop(self, timeout: float = 30.0) -> None:
        """End the front door, the engines (SIGTERM to each one's process
        group, SIGKILL after `timeout` s), then the coordinator, which
        removes the pool.  Idempotent."""
        if self.router is not None:
            _end_group(self.router, 10.0)
            self.router = None
        running = [e for e in self.engines if e.proc is not None]
        # NOTE: SIGTERM to each server alone: it stops its engine core and
        # workers in order, and they remove their shared memory.  A signal to
        # the whole group would stop them beside it, leaving vLLM's segments
        # in /dev/shm.  What is left of the group after `timeout` is killed.
        for e in running:
            if e.proc.poll() is None:
                e.proc.terminate()
        deadline = time.monotonic() + timeout
        for e in running:
            try:
                e.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _end_group(e.proc, max(0.0, deadline - time.monotonic()))
            e.proc = None
        if self.coordinator is not None:
            self.coordinator.stop(owns_pool=True)
            self.coordinator = None
        if self._own_logs and not self.failed:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> "Host":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _end_group(proc: subprocess.Popen, timeout: float) -> None:
    """Wait up to `timeout` s for what is left of `proc`'s process group
    (vLLM's engine core and workers, which outlive their server while they
    stop) to end, then SIGKILL the rest."""
    if proc.poll() is None and timeout:
        proc.terminate()
    deadline = time.monotonic() + timeout
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal_group(proc, signal.SIGKILL)
    proc.wait()


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (zombies have ended)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
