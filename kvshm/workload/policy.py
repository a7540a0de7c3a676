"""The scheduling policy, written once and sans-IO: `Planner` decides what
each step asks the pool for and what follows from the replies; a driver
sends the ops and runs the model.  The CPU workers' engine
(kvshm/workers/engine.py, `kvshm run`) drives it against the coordinator
with real compute, the compute-free scheduler (scheduler.py: `kvshm demo`,
the service benchmark) against an in-process executor with none.

The policy is vLLM's: FCFS, chunked prefill under a token budget, at most
`max_running` requests, and on a failed allocation the newest running
request is preempted (freed, requeued at the head, recomputed later).

A step is one batch of ops, in this order (`plan`):
1. the bookkeeping of the last step: an `Advance` per request that computed
   tokens (their K/V are in the arena now, so their blocks become hits for
   every session: block readiness, core/block_pool.py), the `Free`s of the
   requests that finished;
2. `AllocateSlots` for the running requests (decode, or the next prefill
   chunk), FCFS, while the budget lasts;
3. `AddRequest` (once) and `Admit` for waiting requests while the budget,
   `max_running` and an estimate of the free blocks allow;
4. a `GetComputedBlocks` probe for each request waiting for a prefix other
   sessions are writing (`Admitted.num_in_flight_tokens` >= `wait_in_flight`):
   it keeps its place in line but takes no budget, until fewer tokens are
   in flight or its hit has not grown for `in_flight_deadline` seconds
   (then it computes the rest).

`settle` takes the batch's replies: refused admissions go back to the head
of the line; failed allocations are the driver's to hand to `preemption`,
which yields the follow-up batches (free the newest, retry) until each got
its slots or was itself preempted.  After the model ran, `computed` counts
the scheduled tokens as computed and samples: the item's next output token
(teacher-forced), or the request finishes (freed by the next batch, after
its blocks are cached).

Times are the driver's (`now`, in seconds); the counters go to `stats`, any
object with the fields `preemptions`, `in_flight_waits`,
`in_flight_timeouts`, `queue_ms`, `ttft_ms`, `prompt_tokens`, `hit_tokens`,
`computed_tokens`, `generated_tokens` and `finished` (the workers'
EngineStats, the scheduler's WorkloadResult).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator
from dataclasses import dataclass

from kvshm.core.specs import PoolConfig
from kvshm.ops import protocol as p
from kvshm.workload.items import Item


def fits(config: PoolConfig, item: Item) -> bool:
    """Whether `item` can ever be served on a pool of `config`: its whole
    length must fit the model and (at once) the pool."""
    total = len(item.prompt) + len(item.output)
    if total > config.max_model_len:
        return False
    return config.blocks_for_request(total) <= config.num_blocks - 1


class Seq:
    """A request as a scheduler sees it: its item, its tokens so far (the
    prompt, then the sampled ones), how many are computed and scheduled this
    step, the blocks it holds per group (`tables`), and its place in the
    policy (added to the pool, admitted, waiting for a prefix in flight).
    A driver with more per-request state subclasses it (and extends
    `reset`)."""

    __slots__ = ("rid", "item", "arrived", "tokens", "prompt_len", "generated", "num_computed",
                 "tables", "scheduled", "added", "admitted_once", "to_advance", "append",
                 "wait_until", "wait_hit", "num_hit")

    def __init__(self, item: Item, arrived: float = 0.0) -> None:
        self.rid = item.rid
        self.item = item
        self.arrived = arrived       # queued for admission (for the time to first token)
        self.tokens = list(item.prompt)
        self.prompt_len = len(item.prompt)
        self.generated = 0
        self.num_computed = 0
        self.tables: list[list[int]] = []
        self.scheduled = 0
        self.added = False           # the pool knows it (AddRequest sent)
        self.admitted_once = False
        self.to_advance = False      # computed tokens the next batch reports
        self.append: list[int] = []  # ... and the tokens it sampled since
        self.wait_until = 0.0        # waiting for a prefix in flight until then (0: not
                                     # waiting, -1: its wait timed out: it computes at its
                                     # next admission)
        self.wait_hit = 0            # its hit tokens when the wait last made progress
        self.num_hit = -1            # hit tokens of an admission this step (-1: none)

    def reset(self) -> None:
        """Start over (preempted, or lost with a coordinator restart): nothing
        computed, no blocks; the sampled tokens stay."""
        self.num_computed = self.scheduled = 0
        self.tables = []
        self.to_advance = False
        self.num_hit = -1


@dataclass
class Step:
    """One step's batch (`ops`) and where its replies are: the running
    requests' allocations, the admissions and the probes, each with the
    index of its op; `released`: the requests its `Free`s finish."""

    ops: list
    allocs: list[tuple[Seq, int]]
    admits: list[tuple[Seq, int]]
    probes: list[tuple[Seq, int]]
    released: list[Seq]


class Planner:
    """The waiting, running and finishing requests of one driver, and the
    policy over them.

    Args:
        block_sizes: the pool's groups' block sizes (for the free-block
            estimate).
        num_free_blocks: the pool's free blocks at the start (every reply
            that allocates updates it).
        stats: where the counters go (see the module doc).
        token_budget, max_running: tokens scheduled per step, requests
            running at once.
        wait_in_flight, in_flight_deadline: wait for a prefix in flight of
            at least this many tokens (0: never), until its hit has not grown
            for this many seconds.
    """

    def __init__(self, block_sizes: list[int], num_free_blocks: int, stats, *,
                 token_budget: int, max_running: int, wait_in_flight: int = 0,
                 in_flight_deadline: float = 2.0) -> None:
        self.block_sizes = list(block_sizes)
        self.num_free_blocks = num_free_blocks
        self.stats = stats
        self.token_budget = token_budget
        self.max_running = max_running
        self.wait_in_flight = wait_in_flight
        self.in_flight_deadline = in_flight_deadline
        self.waiting: deque[Seq] = deque()   # arrived, not admitted
        self.running: list[Seq] = []
        self.finishing: list[Seq] = []       # freed by the next batch (after caching)

    @property
    def busy(self) -> bool:
        """Whether any request is waiting, running or left to free."""
        return bool(self.waiting or self.running or self.finishing)

    # -- a step's batch ------------------------------------------------------------------------
    def plan(self) -> Step:
        """The step's batch (see the module doc)."""
        ops, released = self.bookkeeping()
        budget = self.token_budget
        allocs: list[tuple[Seq, int]] = []
        for seq in self.running:
            if budget <= 0:
                seq.scheduled = 0
                continue
            n = min(budget, len(seq.tokens) - seq.num_computed)
            seq.scheduled = n
            budget -= n
            allocs.append((seq, len(ops)))
            ops.append(p.AllocateSlots(seq.rid, n))
        admits = self._admissions(ops, budget, [s for s, _ in allocs])
        probes = []
        for seq in self.waiting:
            if seq.wait_until > 0:
                probes.append((seq, len(ops)))
                ops.append(p.GetComputedBlocks(seq.rid))
        return Step(ops, allocs, admits, probes, released)

    def bookkeeping(self) -> tuple[list, list[Seq]]:
        """The last step's `Advance`s and the finished requests' `Free`s, and
        the requests those free (each reported once)."""
        ops: list = []
        for seq in [s for s in self.running if s.to_advance] + self.finishing:
            ops.append(p.Advance(seq.rid, seq.num_computed, seq.append))
            seq.to_advance, seq.append = False, []
        ops += [p.Free(seq.rid) for seq in self.finishing]
        released, self.finishing = self.finishing, []
        return ops, released

    def _admissions(self, ops: list, budget: int, allocs: list[Seq]) -> list[tuple[Seq, int]]:
        """Append AddRequest + Admit ops for waiting requests, FCFS, while the
        budget, max_running and the estimated free blocks allow (each taken
        out of the line: `settle` puts the refused back)."""
        admits: list[tuple[Seq, int]] = []
        free = self.num_free_blocks - sum(self._blocks_needed(s, s.scheduled) for s in allocs)
        waiting = self.waiting
        i = 0
        while (i < len(waiting) and budget > 0
               and len(self.running) + len(admits) < self.max_running):
            seq = waiting[i]
            if seq.wait_until > 0:
                i += 1          # waits in its place: probed instead
                continue
            n = min(budget, len(seq.tokens))
            need = self._blocks_needed(seq, n)
            if need > free and (admits or self.running):
                break   # would likely fail: let running requests free blocks first
            del waiting[i]
            if not seq.added:   # (a preempted request is still known to the pool)
                ops.append(p.AddRequest(seq.rid, list(seq.tokens)))
                seq.added = True
            admits.append((seq, len(ops)))
            wait = 0 if seq.wait_until else self.wait_in_flight
            ops.append(p.Admit(seq.rid, n, wait_in_flight=wait))
            budget -= n
            free -= need
        return admits

    def _blocks_needed(self, seq: Seq, n: int) -> int:
        total = 0
        for g, bs in enumerate(self.block_sizes):
            have = len(seq.tables[g]) if seq.tables else 0
            total += max(0, -(-(seq.num_computed + n) // bs) - have)
        return total

    # -- its replies ---------------------------------------------------------------------------
    def settle(self, step: Step, results: list, now: float
               ) -> tuple[list[Seq], list[tuple[Seq, p.Admitted]], list[Seq]]:
        """Take the replies of `step`'s batch: the running requests that got
        their slots, the admitted requests (with their replies) and the
        running requests whose allocation failed (for `preemption`)."""
        allocated, failed = [], []
        for seq, i in step.allocs:
            res = results[i]
            self.num_free_blocks = res.num_free_blocks
            if res.new_block_ids is None:
                failed.append(seq)
            else:
                self._extend(seq, res.new_block_ids)
                allocated.append(seq)
        admitted, refused = [], []
        for seq, i in step.admits:
            res = results[i]
            self.num_free_blocks = res.num_free_blocks
            if self._admitted(seq, res, now):
                admitted.append((seq, res))
            else:
                refused.append(seq)
        self.waiting.extendleft(reversed(refused))   # FCFS: first in line next step
        for seq, i in step.probes:
            self._probed(seq, results[i], now)
        return allocated, admitted, failed

    def _extend(self, seq: Seq, new_ids) -> None:
        for table, ids in zip(seq.tables, new_ids):
            table.extend(ids)

    def _admitted(self, seq: Seq, res: p.Admitted, now: float) -> bool:
        """Start a request that `Admit` allocated; False if it was refused
        (short of blocks, or waiting for tokens in flight)."""
        st = self.stats
        if res.new_block_ids is None:
            if not seq.wait_until and 0 < self.wait_in_flight <= res.num_in_flight_tokens:
                seq.wait_until = now + self.in_flight_deadline
                seq.wait_hit = res.num_computed_tokens
                st.in_flight_waits += 1
            return False
        seq.wait_until = 0.0
        seq.tables = [list(h) + list(n) for h, n in zip(res.hit_block_ids, res.new_block_ids)]
        seq.num_computed = res.num_computed_tokens
        seq.scheduled = res.num_new_tokens
        seq.num_hit = res.num_computed_tokens
        if not seq.admitted_once:
            seq.admitted_once = True
            st.queue_ms.append(int((now - seq.arrived) * 1000))
            st.prompt_tokens += seq.prompt_len
            st.hit_tokens += min(res.num_computed_tokens, seq.prompt_len)
        self.running.append(seq)
        return True

    def _probed(self, seq: Seq, res: p.ComputedBlocks, now: float) -> None:
        """A waiting request's lookup: it is admitted next step (in its place
        in line) once fewer than `wait_in_flight` tokens are in flight; its
        deadline moves while its hit grows (the writer is making progress),
        and when it passes, the request computes the rest."""
        if res.num_in_flight_tokens < self.wait_in_flight:
            seq.wait_until = 0.0
        elif res.num_computed_tokens > seq.wait_hit:
            seq.wait_hit = res.num_computed_tokens
            seq.wait_until = now + self.in_flight_deadline
        elif now >= seq.wait_until:
            seq.wait_until = -1.0
            self.stats.in_flight_timeouts += 1

    def preemption(self, failed: list[Seq]) -> Generator[list, list | None, None]:
        """Preempt the newest running requests until every request in
        `failed` got its slots (or was itself preempted): yields each
        follow-up batch (free the newest, retry the others) and is sent its
        replies (None: the batch was lost; stop).

        Newest first also keeps same-step hits sound: a request that hit
        blocks another request of this step writes was admitted after that
        writer, so it is preempted before the writer is (a preempted
        writer's pending blocks are uncached, and nobody left holds them
        expecting their K/V)."""
        pending = list(failed)
        while pending:
            victim = self.running.pop()
            ops = self._start_over(victim)
            self.stats.preemptions += 1
            retry = [s for s in pending if s is not victim]
            ops += [p.AllocateSlots(s.rid, s.scheduled) for s in retry]
            results = yield ops
            if results is None:
                return
            pending = []
            for seq, res in zip(retry, results[2:]):
                self.num_free_blocks = res.num_free_blocks
                if res.new_block_ids is None:
                    pending.append(seq)
                else:
                    self._extend(seq, res.new_block_ids)

    def _start_over(self, seq: Seq) -> list:
        """The ops that free a request as preempted (its sampled tokens
        reported), which is queued first to be admitted again."""
        ops = [p.Free(seq.rid, preempted=True), p.Advance(seq.rid, 0, seq.append)]
        seq.append = []
        seq.reset()
        self.waiting.appendleft(seq)
        return ops

    def requeue(self, seqs: list[Seq]) -> list:
        """Start these running requests over, their step discarded (they
        read K/V found wrong): the ops that do it (see `_start_over`)."""
        ops = []
        for seq in reversed(seqs):   # (the first ends up first in line)
            self.running.remove(seq)
            ops += self._start_over(seq)
        return ops

    # -- after the model -----------------------------------------------------------------------
    def computed(self, now: float) -> list[Seq]:
        """The model computed the scheduled tokens: count them, and sample
        where a request's tokens are all computed (its item's next output
        token; with none left it finishes).  Returns the requests that
        ran."""
        st = self.stats
        ran, still = [], []
        for seq in self.running:
            n = seq.scheduled
            if not n:
                still.append(seq)
                continue
            ran.append(seq)
            seq.num_computed += n
            seq.scheduled = 0
            st.computed_tokens += n
            if seq.num_computed == len(seq.tokens):
                output = seq.item.output
                if seq.generated == 0:   # its first token: the prompt is done
                    st.ttft_ms.append(int((now - seq.arrived) * 1000))
                if seq.generated < len(output):
                    seq.tokens.append(output[seq.generated])
                    seq.append.append(output[seq.generated])
                    seq.generated += 1
                    st.generated_tokens += 1
                if seq.generated >= len(output):
                    self.finishing.append(seq)
                    st.finished += 1
                    continue
            seq.to_advance = True
            still.append(seq)
        self.running = still
        return ran

    # -- requests the pool lost ----------------------------------------------------------------
    def requeue_lost(self, known) -> tuple[int, int]:
        """Start over the running requests the pool no longer holds (a
        coordinator restart that could not resume them; `known`: the request
        ids it holds): they are requeued at the head, and waiting ones are
        added again.  Returns (requests lost, computed tokens given up)."""
        lost = recomputed = 0
        keep = []
        for seq in self.running:
            if seq.rid in known:
                keep.append(seq)
                continue
            lost += 1
            recomputed += seq.num_computed
            seq.reset()
            seq.added = False
            seq.append = []
            self.waiting.appendleft(seq)
        self.running = keep
        self.finishing = [s for s in self.finishing if s.rid in known]
        for seq in self.waiting:
            if seq.rid not in known:
                seq.added = False
        return lost, recomputed
