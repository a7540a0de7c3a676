"""A synthetic scheduler workload over an embedded `KVCacheManager`.

Requests share a few system prompts (so prefix caching matters), arrive over
time, are prefilled in chunks under a token budget, decode until their output
length, and are preempted (freed and recomputed later) when the pool runs
out, as vLLM's scheduler does.  Used by `kvshm demo` and the benchmarks.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field

from kvshm.core.manager import KVCacheManager
from kvshm.core.request import Request


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


class _Seq:
    __slots__ = ("req", "target", "scheduled")

    def __init__(self, req: Request, target: int) -> None:
        self.req = req
        self.target = target
        self.scheduled = 0


def run_workload(mgr: KVCacheManager, spec: WorkloadSpec = WorkloadSpec()) -> WorkloadResult:
    """Drive `mgr` through `spec`; every request is freed at the end."""
    rng = random.Random(spec.seed)
    hasher = mgr.make_hasher()
    max_len = mgr.max_model_len
    systems = [[rng.randrange(spec.vocab) for _ in range(rng.randint(*spec.system_len))]
               for _ in range(spec.num_system_prompts)]
    pending: deque[_Seq] = deque()
    for i in range(spec.num_requests):
        prompt = list(rng.choice(systems)) + [
            rng.randrange(spec.vocab) for _ in range(rng.randint(*spec.user_len))]
        prompt = prompt[:max_len - 1]
        target = min(len(prompt) + rng.randint(*spec.output_len), max_len)
        pending.append(_Seq(Request(f"req-{i}", prompt, hasher), target))
    waiting: deque[_Seq] = deque()
    running: list[_Seq] = []
    res = WorkloadResult()
    t0 = time.perf_counter()
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
            req = seq.req
            n = min(budget, req.num_tokens - req.num_computed_tokens)
            res.manager_calls += 1
            while mgr.allocate_slots(req, n) is None:
                victim = running.pop()      # preempt the newest request
                res.manager_calls += 1
                mgr.free(victim.req)
                victim.req.num_computed_tokens = 0
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
            req = seq.req
            hits, num_hit = mgr.get_computed_blocks(req)
            n = min(budget, req.num_tokens - num_hit)
            res.manager_calls += 2
            if mgr.allocate_slots(req, n, num_hit, hits) is None:
                break
            waiting.popleft()
            res.prompt_tokens += req.num_tokens
            res.hit_tokens += num_hit
            req.num_computed_tokens += num_hit
            seq.scheduled = n
            running.append(seq)
            budget -= n
        res.peak_usage = max(res.peak_usage, mgr.usage)
        # "Run the model": scheduled tokens are computed; a request whose
        # tokens are all computed samples one more (or finishes).
        still = []
        for seq in running:
            req = seq.req
            req.num_computed_tokens += seq.scheduled
            seq.scheduled = 0
            if req.num_computed_tokens >= req.num_tokens:
                if req.num_tokens >= seq.target:
                    res.manager_calls += 1
                    mgr.free(req)
                    res.finished += 1
                    continue
                req.append_token_ids([rng.randrange(spec.vocab)])
            still.append(seq)
        running = still
    res.seconds = time.perf_counter() - t0
    return res
