"""The launcher <-> worker channel, typed both ways.

The launcher starts each worker with one `WorkerSpec` (msgspec JSON, the
worker's only argument) and reads the worker's stdout: one JSON `Report` a
line, a tagged union of `Ready` (pid, pinned CPUs, session), `Progress`
(every `WorkerSpec.progress` seconds), then `Done` with the full figures or
`Failed` with a message (the worker then exits 1).  Both ends encode and
decode with the Structs below, so a field renamed on one side is a decode
error, not a silently missing figure.  With `wait_for_start` a worker
waits, once Ready, for a "start" line on its stdin, so that workers started
one after another run their workload together.
"""

from __future__ import annotations

import sys
from typing import Union

import msgspec

from kvshm.core.hashing import DEFAULT_HASH_ALGORITHM, DEFAULT_HASH_SEED
from kvshm.workers.engine_types import EngineOptions, EngineStats
from kvshm.workload.spec import WorkloadSpec


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one worker process is told."""

    socket: str                      # the coordinator to join
    index: int = 0                   # this worker's index among num_workers
    num_workers: int = 1
    node: int = -1                   # NUMA node (reported in the Hello)
    cpus: tuple[int, ...] = ()       # pin to these CPUs (empty: do not pin)
    workload: WorkloadSpec = WorkloadSpec()
    engine: EngineOptions = EngineOptions()
    hash_algorithm: str = DEFAULT_HASH_ALGORITHM   # the pool's block hashing
    hash_seed: str = DEFAULT_HASH_SEED
    duration: float = 30.0           # seconds admitting requests
    grace: float = 10.0              # then seconds for running ones to finish
    progress: float = 0.5            # seconds between Progress reports
    reconnect_timeout: float = 60.0  # wait this long for a restarted coordinator
    wait_for_start: bool = False     # after Ready, wait for a "start" line on stdin
    turns: str = ""                  # the run's TurnBoard (workers/turns.py); "": none

    def encode(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def decode(cls, text: str | bytes) -> "WorkerSpec":
        """Raises msgspec.ValidationError / DecodeError naming the bad field."""
        return msgspec.json.decode(text, type=cls)


class _Report(msgspec.Struct, frozen=True, tag_field="event"):
    index: int


class Ready(_Report, tag="ready"):
    """Connected, arena mapped, pinned: about to run."""

    pid: int
    session: int
    cpus: tuple[int, ...]   # the affinity the worker has after pinning itself
    model: str              # the model's fingerprint (all workers of a pool agree)


class Progress(_Report, tag="progress"):
    """The figures so far: without the per-step samples, except in the last
    one a worker sends when it is stopped (SIGTERM), which has them all."""

    elapsed: float
    stats: EngineStats


class Done(_Report, tag="done"):
    """The worker's final figures; it exits 0 after this."""

    seconds: float
    stats: EngineStats


class Failed(_Report, tag="failed"):
    """What stopped the worker; it exits 1 after this."""

    message: str


Report = Union[Ready, Progress, Done, Failed]

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Report)


def emit(report: Report, out=None) -> None:
    """Write one report line to `out` (default: stdout) and flush it."""
    out = out or sys.stdout
    out.write(_encoder.encode(report).decode() + "\n")
    out.flush()


def read_report(line: bytes | str) -> Report | None:
    """The report on `line`; None for a line that is not JSON (a library
    printing to stdout must not break the channel).  A JSON line that is
    not a valid report raises msgspec.ValidationError naming the field."""
    try:
        return _decoder.decode(line)
    except msgspec.ValidationError:
        raise
    except msgspec.DecodeError:
        return None
