"""A synthetic scheduler workload, written once, over pluggable backends.

Requests share a few system prompts (so prefix caching matters), arrive over
time, are prefilled in chunks under a token budget, decode until their output
length, and are preempted (freed and recomputed later) when the pool runs
out, as vLLM's scheduler does.  Used by `kvshm demo` and
scripts/bench_service.py.

Why this is not the CPU worker's scheduler (kvshm/workers/engine.py, which
`kvshm run` uses): this one computes nothing and depends on nothing but its
seed, so it runs in-process in a fraction of a second (`kvshm demo`) and
gives the service benchmark an op stream that is the same on every run and
every commit (its coordinator figures compare across commits only because of
that).  The worker's scheduler is built around what a real engine has and
this one must not: the model's compute on the arena (about 20x the time
a `kvshm run` worker waits for the coordinator), one batch per step with
`Admit`, blocks that become ready for other workers once their K/V are
written, waits for prefixes other workers are computing, wall-clock
deadlines, other workers sharing the pool, and coordinator restarts.  The policies are the same (FCFS, chunked
prefill under a token budget, preempt the newest on a failed allocation);
a change to one should be made to the other.

The loop exists once, sans-IO: `Scheduler.run()` (over `make_requests`'
deterministic request set) yields each backend call as `(method, *args)` and
is sent the reply; `drive(backend, spec)` runs it against a synchronous
backend such as `EmbeddedBackend` (the coordinator's op executor on an
in-process `KVCacheManager`; its methods document the interface;
scripts/bench_service.py records the protocol ops it runs); `run_workload(mgr,
spec)` is `drive` on one, timed.  An async backend needs no second copy of
the loop, only a second driver that awaits each call::

    async def adrive(backend, spec):
        loop, reply = Scheduler(spec, backend.max_model_len).run(), None
        try:
            while True:
                name, *args = loop.send(reply)
                reply = await getattr(backend, name)(*args)
        except StopIteration as stop:
            return stop.value
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass, field

from kvshm.ops import protocol as p
from kvshm.ops.errors import raise_reply
from kvshm.ops.executor import OpExecutor
from kvshm.pool.kv_cache_manager import KVCacheManager


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 200
    num_system_prompts: int = 4
    system_len: tuple[int, int] = (200, 600)
    user_len: tuple[int, int] = (20, 200)
    output_len: tuple[int, int] = (16, 128)
    token_budget: int = 512         # tokens scheduled per step
    max_running: int = 32
    arrivals_per_step: int = 2
    vocab: int = 32000
    seed: int = 0


@dataclass
class WorkloadResult:
    steps: int = 0
    finished: int = 0
    preemptions: int = 0
    manager_calls: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    peak_usage: float = 0.0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def calls_per_second(self) -> float:
        return self.manager_calls / self.seconds if self.seconds else 0.0


class Seq:
    """A request as the scheduler sees it: id, prompt, token and computed
    counts, the length at which it finishes, the tokens scheduled this step,
    and whether the backend has been told about it (`add`)."""

    __slots__ = ("rid", "prompt", "num_tokens", "num_computed", "target", "scheduled", "added")

    def __init__(self, rid: str, prompt: list[int], target: int) -> None:
        self.rid, self.prompt, self.num_tokens, self.target = rid, prompt, len(prompt), target
        self.num_computed = self.scheduled = 0
        self.added = False


def make_requests(spec: WorkloadSpec, max_len: int, rng: random.Random) -> list[Seq]:
    """The spec's requests, in arrival order (ids "0", "1", ...): a shared
    system prompt plus a user part, cut to fit `max_len`; drawn from `rng`."""
    systems = [[rng.randrange(spec.vocab) for _ in range(rng.randint(*spec.system_len))]
               for _ in range(spec.num_system_prompts)]
    seqs = []
    for i in range(spec.num_requests):
        prompt = list(rng.choice(systems)) + [
            rng.randrange(spec.vocab) for _ in range(rng.randint(*spec.user_len))]
        prompt = prompt[:max_len - 1]
        target = min(len(prompt) + rng.randint(*spec.output_len), max_len)
        seqs.append(Seq(str(i), prompt, target))
    return seqs


class Scheduler:
    """One run of the scheduler over a spec: its requests (`make_requests`)
    and the rng, which goes on to draw the sampled tokens; `run()` is the loop."""

    def __init__(self, spec: WorkloadSpec, max_len: int) -> None:
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.requests = make_requests(spec, max_len, self.rng)

    def run(self) -> Generator[tuple, object, WorkloadResult]:
        """The loop: yields backend calls `(name, *args)`, is sent each reply,
        returns a `WorkloadResult` (steps, finished, preemptions, prompt and
        hit tokens) when all requests are done.  Each step: arrivals; running
        requests (preempting the newest while an `allocate` fails: `free`,
        `advance` to 0); admissions (`add` the first time, `lookup`,
        `allocate` with the hits); `scheduled`; "run the model": scheduled
        tokens are computed, a request with all computed finishes (`free`) or
        samples a token; each other scheduled one is `advance`d; `end_step`."""
        spec, rng = self.spec, self.rng
        pending = deque(self.requests)
        waiting: deque[Seq] = deque()
        running: list[Seq] = []
        res = WorkloadResult()
        while pending or waiting or running:
            res.steps += 1
            for _ in range(spec.arrivals_per_step):
                if pending:
                    waiting.append(pending.popleft())
            budget = spec.token_budget
            # Running requests first (decode or the rest of a chunked prefill).
            i = 0
            while i < len(running) and budget > 0:
                seq = running[i]
                n = min(budget, seq.num_tokens - seq.num_computed)
                while (yield ("allocate", seq, n)) is None:
                    victim = running.pop()      # preempt the newest request
                    yield ("free", victim, True)
                    victim.num_computed = 0
                    yield ("advance", victim, 0, ())
                    res.preemptions += 1
                    waiting.appendleft(victim)
                    if victim is seq:
                        break
                else:
                    seq.scheduled = n
                    budget -= n
                    i += 1
            # Then admit waiting requests while the budget and the pool allow.
            while waiting and budget > 0 and len(running) < spec.max_running:
                seq = waiting[0]
                if not seq.added:
                    yield ("add", seq)
                    seq.added = True
                hits, num_hit = yield ("lookup", seq)
                n = min(budget, seq.num_tokens - num_hit)
                if (yield ("allocate", seq, n, num_hit, hits)) is None:
                    break
                waiting.popleft()
                res.prompt_tokens += seq.num_tokens
                res.hit_tokens += num_hit
                seq.num_computed = num_hit
                seq.scheduled = n
                running.append(seq)
                budget -= n
            yield ("scheduled",)
            # "Run the model": scheduled tokens are computed; a request whose
            # tokens are all computed samples one more (or finishes).
            still = []
            for seq in running:
                if not seq.scheduled:
                    still.append(seq)
                    continue
                done = seq.num_computed = seq.num_computed + seq.scheduled
                seq.scheduled = 0
                if done >= seq.num_tokens:
                    if seq.num_tokens >= seq.target:
                        yield ("free", seq, False)
                        res.finished += 1
                        continue
                    seq.num_tokens += 1
                    yield ("advance", seq, done, [rng.randrange(spec.vocab)])
                else:
                    yield ("advance", seq, done, ())
                still.append(seq)
            running = still
            yield ("end_step",)
        return res


BACKEND_METHODS = ("add", "lookup", "allocate", "free", "advance", "scheduled", "end_step")


def drive(backend, spec: WorkloadSpec | Scheduler = WorkloadSpec()) -> WorkloadResult:
    """Run the scheduler loop (of `spec`, or a prepared `Scheduler`) against
    a synchronous backend (the methods of `EmbeddedBackend`, `max_model_len`)."""
    sched = spec if isinstance(spec, Scheduler) else Scheduler(spec, backend.max_model_len)
    methods = {name: getattr(backend, name) for name in BACKEND_METHODS}
    send, reply = sched.run().send, None
    try:
        while True:
            call = send(reply)
            reply = methods[call[0]](*call[1:])
    except StopIteration as stop:
        return stop.value


class EmbeddedBackend:
    """The scheduler's calls as protocol ops run by the coordinator's op
    executor on an in-process `KVCacheManager` (one session), so embedded
    runs keep the coordinator's request upkeep exactly; counts the manager
    calls and the peak pool usage.  `run_op` is the one place ops go
    through (scripts/bench_service.py overrides it to record them)."""

    def __init__(self, mgr: KVCacheManager) -> None:
        self.mgr = mgr
        self.max_model_len = mgr.max_model_len
        self.executor = OpExecutor(mgr)
        self.owner = self.executor.lifecycle.open(1)
        self.calls = 0
        self.peak_usage = 0.0

    def run_op(self, op):
        """Execute one protocol op; its reply (an error reply raises it)."""
        reply = self.executor.execute(self.owner, op)
        if reply.__class__ is p.Error:
            raise_reply(reply)
        return reply

    def add(self, seq: Seq) -> None:
        """A new request (its prompt), before its first lookup."""
        self.run_op(p.AddRequest(seq.rid, seq.prompt))

    def lookup(self, seq: Seq):
        """Prefix-cache hits of a waiting request: (blocks, num hit tokens)."""
        self.calls += 1
        r = self.run_op(p.GetComputedBlocks(seq.rid))
        return r.block_ids, r.num_computed_tokens

    def allocate(self, seq: Seq, n: int, num_hit: int = 0, hits=None):
        """Slots for `n` new tokens (after `num_hit` cached ones on admission,
        with the hits of the last `lookup` when `hits` is given): the new
        block ids, or None if out of blocks."""
        self.calls += 1
        op = (p.AllocateSlots(seq.rid, n) if hits is None
              else p.AllocateSlots(seq.rid, n, num_hit, True))
        return self.run_op(op).new_block_ids

    def free(self, seq: Seq, preempted: bool) -> None:
        """Free the request's blocks; a preempted request is kept (and re-admitted)."""
        self.calls += 1
        self.run_op(p.Free(seq.rid, True) if preempted else p.Free(seq.rid))

    def advance(self, seq: Seq, num_computed_tokens: int, appended) -> None:
        """Bookkeeping: set the computed-token count, append sampled tokens."""
        self.run_op(p.Advance(seq.rid, num_computed_tokens, list(appended)) if appended
                    else p.Advance(seq.rid, num_computed_tokens))

    def scheduled(self) -> None:
        """This step's scheduling is done; the model runs next."""
        self.peak_usage = max(self.peak_usage, self.mgr.usage)

    def end_step(self) -> None:
        """The step is over."""


def run_workload(mgr: KVCacheManager, spec: WorkloadSpec = WorkloadSpec()) -> WorkloadResult:
    """Drive `mgr` through `spec`; every request is freed at the end."""
    backend = EmbeddedBackend(mgr)
    sched = Scheduler(spec, mgr.max_model_len)
    t0 = time.perf_counter()
    res = drive(backend, sched)
    res.seconds = time.perf_counter() - t0
    res.manager_calls = backend.calls
    res.peak_usage = backend.peak_usage
    return res
