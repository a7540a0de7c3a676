"""The compute-free scheduler: the scheduling policy (policy.py, `Planner`)
driven with no model, over any workload (spec.py; by default the system
prompts of items.system_prompts).  Used by `kvshm demo`,
scripts/bench_service.py and scripts/service_load.py.

It computes nothing and depends on nothing but its spec: scheduled tokens
count as computed in the step that scheduled them, and requests arrive
`arrivals_per_step` a step.  So it runs in-process in a fraction of a
second (`kvshm demo`) and gives the service benchmark an op stream that is
the same on every run and every commit (its coordinator figures compare
across commits only because of that).  The CPU workers' engine
(kvshm/workers/engine.py, `kvshm run`) drives the same planner with what
only a real engine has: the model, the wall clock, turns, other workers,
coordinator restarts.

The loop is sans-IO: `Scheduler.run(config)` yields each step's batch of
protocol ops (and each preemption's follow-up batch) and is sent their
replies; `drive(backend, scheduler)` runs it against a synchronous backend
such as `EmbeddedBackend` (the coordinator's op executor on an in-process
`KVCacheManager`; scripts/service_load.py records the ops it runs);
`run_workload(mgr, scheduler)` is `drive` on one, timed.  An async backend
needs no second copy of the loop, only a second driver that awaits each
batch::

    async def adrive(client, config, scheduler):
        loop, replies = scheduler.run(config), None
        try:
            while True:
                replies = await client.batch(loop.send(replies))
        except StopIteration as stop:
            return stop.value
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, field

from kvshm.core.specs import PoolConfig
from kvshm.ops import protocol as p
from kvshm.ops.errors import batch_results
from kvshm.ops.executor import OpExecutor
from kvshm.pool.kv_cache_manager import KVCacheManager
from kvshm.workload.items import SystemPromptSpec
from kvshm.workload.policy import Planner, Seq, fits
from kvshm.workload.spec import WorkloadSpec, workload_stream


@dataclass
class WorkloadResult:
    """What a run did (the planner's counters among them)."""

    steps: int = 0
    finished: int = 0
    rejected: int = 0               # longer than the model or the whole pool: never admitted
    preemptions: int = 0
    manager_calls: int = 0          # ops sent
    frames: int = 0                 # batches sent
    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    in_flight_waits: int = 0
    in_flight_timeouts: int = 0
    peak_usage: float = 0.0
    seconds: float = 0.0
    queue_ms: list[int] = field(default_factory=list)
    ttft_ms: list[int] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def calls_per_second(self) -> float:
        return self.manager_calls / self.seconds if self.seconds else 0.0


def system_workload(num_requests: int = 200, seed: int = 0,
                    max_len: int = 4096) -> WorkloadSpec:
    """The scheduler's default workload: `num_requests` system-prompt
    requests (items.SystemPromptSpec) of at most `max_len` tokens."""
    return WorkloadSpec(kind="system", system=SystemPromptSpec(
        seed=seed, num_requests=num_requests, max_len=max_len))


class Scheduler:
    """One run of the policy over a workload, with no model.

    Args:
        workload: the requests (default: `system_workload()`).
        token_budget, max_running: the planner's (tokens per step,
            requests running at once).
        arrivals_per_step: requests that arrive each step.
    """

    def __init__(self, workload: WorkloadSpec | None = None, *, token_budget: int = 512,
                 max_running: int = 32, arrivals_per_step: int = 2) -> None:
        for name, v in (("token_budget", token_budget), ("max_running", max_running),
                        ("arrivals_per_step", arrivals_per_step)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.workload = workload if workload is not None else system_workload()
        self.token_budget = token_budget
        self.max_running = max_running
        self.arrivals_per_step = arrivals_per_step

    def run(self, config: PoolConfig) -> Generator[list, list, WorkloadResult]:
        """The loop on a pool of `config` (fresh: all its blocks free):
        yields batches of ops, is sent each one's replies, returns a
        `WorkloadResult` once every request is done and freed."""
        res = WorkloadResult()
        planner = Planner([g.block_size for g in config.groups], config.num_blocks - 1, res,
                          token_budget=self.token_budget, max_running=self.max_running)
        source = workload_stream(self.workload)
        more = True
        while True:
            now = time.monotonic()
            for _ in range(self.arrivals_per_step if more else 0):
                item = next(source, None)
                if item is None:
                    more = False
                elif fits(config, item):
                    planner.waiting.append(Seq(item, now))
                else:
                    res.rejected += 1
            if not (more or planner.running or planner.waiting):
                break
            res.steps += 1
            plan = planner.plan()
            _, _, failed = planner.settle(plan, (yield plan.ops), now)
            if failed:
                batches, replies = planner.preemption(failed), None
                try:
                    while True:
                        replies = yield batches.send(replies)
                except StopIteration:
                    pass
            planner.computed(now)
        ops, _ = planner.bookkeeping()   # the last Advances and Frees
        if ops:
            yield ops
        return res


def drive(backend, scheduler: Scheduler | None = None) -> WorkloadResult:
    """Run `scheduler`'s loop (default: `Scheduler()`) against a synchronous
    backend: `config` and `batch(ops) -> replies` (as `EmbeddedBackend`)."""
    loop = (scheduler or Scheduler()).run(backend.config)
    replies = None
    try:
        while True:
            replies = backend.batch(loop.send(replies))
    except StopIteration as stop:
        return stop.value


class EmbeddedBackend:
    """The scheduler's batches run by the coordinator's op executor on an
    in-process `KVCacheManager` (one session), so embedded runs keep the
    coordinator's request upkeep exactly; counts the ops and frames and the
    peak pool usage (after each batch, when the step's blocks are held).
    `run_frame` is the one place frames go through (scripts/service_load.py
    overrides it to record them)."""

    def __init__(self, mgr: KVCacheManager) -> None:
        self.mgr = mgr
        self.config = mgr.config
        self.executor = OpExecutor(mgr)
        self.owner = self.executor.lifecycle.open(1)
        self.calls = 0
        self.frames = 0
        self.peak_usage = 0.0

    def run_frame(self, ops: list) -> list:
        """Execute `ops` as one Batch frame: their replies (a failed op
        raises its error)."""
        return batch_results(self.executor.execute(self.owner, p.Batch(ops)))

    def batch(self, ops: list) -> list:
        replies = self.run_frame(ops)
        self.calls += len(ops)
        self.frames += 1
        self.peak_usage = max(self.peak_usage, self.mgr.usage)
        return replies


def run_workload(mgr: KVCacheManager, scheduler: Scheduler | None = None) -> WorkloadResult:
    """Drive `mgr` through `scheduler` (default: `Scheduler()`); every
    request is freed at the end."""
    backend = EmbeddedBackend(mgr)
    t0 = time.perf_counter()
    res = drive(backend, scheduler)
    res.seconds = time.perf_counter() - t0
    res.manager_calls = backend.calls
    res.frames = backend.frames
    res.peak_usage = backend.peak_usage
    return res
