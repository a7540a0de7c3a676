"""A coordinator in a child process (`kvshm serve`), for the tools that need
one: IPC replay, the launcher of `kvshm run`, benchmarks and tests."""

from __future__ import annotations

import ctypes
import secrets
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from kvshm.core.errors import SegmentError
from kvshm.pool.lifecycle import remove_pool

_PR_SET_PDEATHSIG = 1


def exit_text(code: int) -> str:
    """A child's return code as a person says it ("status 1", "signal
    SIGKILL")."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


def die_with_parent() -> None:
    """For `preexec_fn`: the child gets SIGTERM when the parent dies, even by
    SIGKILL, so a coordinator or worker is never orphaned with its segments
    (Linux; a no-op elsewhere).  The signal follows the *thread* that
    started the child: start children from a thread that outlives them."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


_early_stop: list[int] = []
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def defer_stop_signals() -> None:
    """Until `serve()` installs its own handlers, remember SIGINT/SIGTERM
    instead of dying of them (call first thing in a coordinator process).
    A coordinator started by CoordinatorProcess has them blocked from its
    first instruction (see `_coordinator_child`), so one sent while Python
    starts is not lost either: it is delivered here, once handled."""
    for sig in _STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: _early_stop.append(signum))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


def early_stop_requested() -> bool:
    """Whether a stop signal arrived before `serve()` could handle it."""
    return bool(_early_stop)


def _coordinator_child(with_parent: bool):
    """The `preexec_fn` of a coordinator child: stop signals blocked until
    `defer_stop_signals()` handles them (a SIGTERM during interpreter start-up
    would otherwise kill it before it can stop cleanly), and with
    `with_parent`, SIGTERM when the parent dies."""
    def setup() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        if with_parent:
            die_with_parent()
    return setup


class CoordinatorProcess:
    """A `kvshm serve` child process on a private socket; a context manager
    that stops it (SIGTERM) and waits for it.  `new_session` keeps it out of
    the terminal's process group, so Ctrl-C reaches only the parent, which
    decides the order of shutdown; `with_parent` stops it (SIGTERM: a clean
    shutdown that unlinks its segments) if the parent dies.  With
    `default_socket` it listens where `kvshm serve --name NAME` does without
    `--socket` (as this process's environment says)."""

    def __init__(self, config, *, name: str | None = None, extra_args: tuple = (),
                 new_session: bool = False, with_parent: bool = False,
                 env: dict | None = None, default_socket: bool = False) -> None:
        from kvshm.service.handshake import default_socket_path
        self._dir = tempfile.TemporaryDirectory(prefix="kvshm-")
        d = Path(self._dir.name)
        self.name = name or f"kvshm-{secrets.token_hex(5)}"
        self.socket = default_socket_path(self.name) if default_socket else d / "pool.sock"
        socket_args = () if default_socket else ("--socket", str(self.socket))
        cfg_path = d / "config.json"
        cfg_path.write_bytes(config.to_json())
        # stderr goes to a file: a pipe nobody reads would block a coordinator
        # that logs a lot.
        self.stderr_path = d / "stderr.log"
        self._stderr = open(self.stderr_path, "w+")
        self._argv = [sys.executable, "-m", "kvshm", "serve", "--config", str(cfg_path),
                      "--name", self.name, *socket_args, "--quiet",
                      *extra_args]
        self._popen = dict(stdout=subprocess.PIPE, stderr=self._stderr, text=True,
                           start_new_session=new_session,
                           preexec_fn=_coordinator_child(with_parent))
        self.restarts = 0
        self.proc = subprocess.Popen(self._argv, env=env, **self._popen)

    def kill(self) -> None:
        """SIGKILL the coordinator and reap it (its segments stay behind)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def restart(self, env: dict | None = None, wait: bool = True) -> None:
        """Start `kvshm serve` again with the same command line (the
        coordinator must have exited): it adopts the pool."""
        if self.proc.poll() is None:
            raise RuntimeError("the coordinator is still running")
        self.proc.stdout.close()
        self.proc = subprocess.Popen(self._argv, env=env, **self._popen)
        self.restarts += 1
        if wait:
            self.wait_ready()

    @property
    def stderr(self) -> str:
        """What the coordinator wrote to stderr so far."""
        return self.stderr_path.read_text() if self.stderr_path.exists() else ""

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Wait for the "ready" line; RuntimeError if it exits or times out."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("ready"):
            self.proc.poll()
            raise RuntimeError(f"coordinator did not start within {timeout}s: "
                               f"{line}{self.stderr}")

    def stop(self, timeout: float = 10.0, owns_pool: bool = False) -> int:
        """SIGTERM (a clean shutdown removes the pool's segments) and wait;
        after `timeout` seconds SIGKILL, and then remove the segments the
        killed coordinator could not.  A coordinator that was already dead
        keeps its segments (a new one may adopt them) unless `owns_pool`:
        the caller is done with the pool however its coordinator ended, so
        nothing is left in /dev/shm.  Returns the exit status."""
        remove = owns_pool and self.proc.poll() is not None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                remove = True
        if remove:
            try:
                remove_pool(self.name)
            except SegmentError:   # it had not created them (or removed them itself)
                pass
        self.proc.stdout.close()
        self._stderr.close()
        self._dir.cleanup()
        return self.proc.returncode

    def __enter__(self) -> "CoordinatorProcess":
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
