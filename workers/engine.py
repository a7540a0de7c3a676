"""The CPU worker's engine: a scheduler loop against the coordinator plus real
numpy compute on the shared KV arena, checking every prefix-cache hit.

Each step is one `Client.batch`, in this order: the bookkeeping of the last
step (`Advance`, `Free` of finished requests), then `AllocateSlots` for
running requests (decode, or the next prefill chunk) in FCFS order, then
`AddRequest` + `Admit` for waiting ones while the token budget,
`max_running` and the pool's free blocks allow.  A running request whose
allocation fails preempts the newest running ones (freed, requeued,
recomputed later), as vLLM's scheduler does, in a follow-up batch.

Full blocks are cached when they are allocated, as in vLLM, but pending:
the `Advance` of the next batch says their K/V are in the arena, and only
then can another worker hit them (block readiness, core/block_pool.py).
This worker's own requests hit its pending blocks in the step that
computes them, as vLLM's do: a request whose hits another request of the
step writes is computed after it (`phase`).  When an admission's lookup
stops at blocks another worker is writing (`Admitted.num_in_flight_tokens`
>= `wait_in_flight`), the request waits for them instead of computing them
again: it keeps its place in line but takes no budget, and each step looks
it up again (a `GetComputedBlocks` probe) until fewer are in flight, or
until its hit has not grown for `in_flight_deadline` seconds (then it
computes the rest).  A writer that dies or is preempted uncaches them, so
the wait ends at the next step.

A conversation's next turn arrives only once its previous turn is over
(workers/turns.py: the run's TurnBoard, across workers), as a user sends
a follow-up after reading the answer; until then it waits in `pending`,
and its time to first token counts from its arrival.

`kvshm demo` and the service benchmark schedule with kvshm/workload/scheduler.py
instead, a compute-free, seed-only scheduler with the same policies: its
docstring says why the two are kept apart; change both together.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from kvshm.core.specs import FullSpec, MLASpec, PoolConfig, SlidingWindowSpec
from kvshm.ops import protocol as p
from kvshm.ops.errors import ReplyLost, ResumeFailed
from kvshm.workers.compute import MODELS, ExactCompute, LoadOnlyCompute
from kvshm.workers.engine_types import EngineOptions, EngineStats
from kvshm.workload.items import Item
from kvshm.workers.transformer import TransformerCompute
from kvshm.workers.turns import LocalTurns

SUPPORTED_SPECS = (FullSpec, MLASpec, SlidingWindowSpec)


class UnsupportedModel(ValueError):
    """The pool's groups include an attention type the CPU worker cannot model."""


def make_compute(name: str, config: PoolConfig, arena, opts, stats, tag: int):
    """The compute of model `name` (one of MODELS), or none (opts.load_only)."""
    if opts.load_only:
        return LoadOnlyCompute(config, arena, opts, stats, tag)
    if name == "exact":
        return ExactCompute(config, arena, opts, stats, tag)
    if name == "transformer":
        return TransformerCompute(config, arena, opts, stats, tag)
    raise ValueError(f"unknown model {name!r} (one of {', '.join(MODELS)})")


def check_supported(config: PoolConfig, model: str = "exact") -> None:
    """Raise UnsupportedModel unless the CPU worker can serve `config`'s pool
    with `model` (one of compute.MODELS)."""
    if model not in MODELS:
        raise UnsupportedModel(f"unknown model {model!r} (one of {', '.join(MODELS)})")
    for g, spec in enumerate(config.groups):
        if not isinstance(spec, SUPPORTED_SPECS):
            raise UnsupportedModel(
                f"the CPU worker models full, MLA and sliding-window attention; "
                f"group {g} is {type(spec).__name__}")
    if not config.enable_caching:
        raise UnsupportedModel("the CPU worker needs a pool with prefix caching on")
    if config.kv is None:
        raise UnsupportedModel("the pool has no kv shape, so no KV arena to compute into")
    if config.kv.layout != "blocks":
        raise UnsupportedModel(f"the pool's arena is laid out by {config.kv.layout} for vLLM "
                               "engines; the CPU worker computes into a \"blocks\" arena")
    if model == "transformer" and (len(config.groups) != 1
                                   or not isinstance(config.groups[0], (FullSpec, MLASpec))):
        raise UnsupportedModel("the transformer model runs on one full-attention group "
                               "(e.g. preset tiny); use --model exact for this pool")


class Seq:
    """A request as the engine sees it."""

    __slots__ = ("rid", "item", "arrived", "tokens", "prompt_len", "generated", "num_computed",
                 "tables", "ctx", "scheduled", "added", "admitted_once", "to_advance",
                 "append", "wait_until", "wait_hit", "phase", "num_hit")

    def __init__(self, item: Item) -> None:
        self.rid = item.rid
        self.item = item
        self.arrived = time.monotonic()    # queued for admission (for TTFT)
        self.tokens = list(item.prompt)
        self.prompt_len = len(item.prompt)
        self.generated = 0
        self.num_computed = 0
        self.tables: list[list[int]] = []
        self.ctx = None
        self.scheduled = 0
        self.added = False
        self.admitted_once = False
        self.to_advance = False
        self.append: list[int] = []
        self.wait_until = 0.0    # waiting for a prefix in flight until then (0: not waiting,
                                 # -1: its wait timed out: it computes at its next admission)
        self.wait_hit = 0        # its hit tokens when the wait last made progress
        self.phase = 0           # computed after the requests of lower phases in its step
        self.num_hit = -1        # hit tokens of an admission this step (-1: none)


class Engine:
    """One worker's scheduler and model over a connected client and its
    mapped arena.  `await run(items, deadline)` until the items are done or
    the deadline passes (then running requests are finished, waiting ones
    dropped)."""

    def __init__(self, client, arena, config: PoolConfig, opts: EngineOptions,
                 stats: EngineStats | None = None, turns=None,
                 worker: int | None = None) -> None:
        check_supported(config, opts.model)
        if opts.load_only and (opts.verify_hits or opts.check_decode):
            raise ValueError("load_only computes no K/V to check: verify_hits and check_decode "
                             "must be 0")
        self.client = client
        self.arena = arena
        self.config = config
        self.opts = opts
        self.stats = stats or EngineStats()
        self.groups = [(g, spec.block_size) for g, spec in enumerate(config.groups)]
        # The model on the arena (workers/compute.py): K/V, attention, checks.
        self.compute = make_compute(opts.model, config, arena, opts, self.stats,
                                    tag=client.session_id)
        self.model = self.compute.model
        # When a follow-up turn may arrive (workers/turns.py): the run's
        # TurnBoard, or a board of this worker's own turns (with `worker`,
        # its index; None: every turn arrives at once).
        self.turns = turns if turns is not None else LocalTurns(worker)
        self.pending: list[Seq] = []         # turns whose previous turn is not done yet
        self.waiting: deque[Seq] = deque()   # arrived, not admitted
        self.running: list[Seq] = []
        self.finishing: list[Seq] = []       # freed in the next batch (after caching)
        self.released: list[Seq] = []        # freed by the batch being sent
        self.num_free_blocks = config.num_blocks - 1

    # -- the loop ------------------------------------------------------------------------------
    async def run(self, items, deadline: float, on_step=None,
                  hard_deadline: float | None = None) -> EngineStats:
        """Serve `items` (an iterator of `Item`) until exhausted or `deadline`
        (time.monotonic()): then admit nothing new and let running requests
        finish, until `hard_deadline` (pushed back by the time coordinator
        restarts took), where the rest are aborted (freed).
        `on_step(stats)` after every step."""
        source = iter(items)
        while True:
            # Time the coordinator was away (restarting) does not count
            # against the running requests' grace.
            if (hard_deadline is not None
                    and time.monotonic() >= hard_deadline + self._time_away()):
                await self._abort_all()
                break
            past = time.monotonic() >= deadline
            if not past:
                self._arrivals(source)
            elif self.waiting or self.pending:
                self.stats.aborted += sum(1 for s in self.waiting if s.added)
                # Waiting requests that were never admitted are dropped; any that
                # were preempted still own a coordinator entry: forget it.
                await self._forget([s for s in self.waiting if s.added])
                self._over(list(self.waiting) + self.pending)
                self.waiting.clear()
                self.pending.clear()
            # (_arrivals pulls until the queue is full or the source is dry.)
            if not (self.running or self.waiting or self.finishing or self.pending):
                break
            if not await self.step():
                # Nothing could run (every block is held by other workers, or
                # the requests wait for prefixes in flight): give the others
                # a moment instead of spinning on the coordinator.
                await asyncio.sleep(0.01 if self.waiting else 0.002)
            if on_step is not None:
                on_step(self.stats)
        await self._flush()
        return self.stats

    def _arrivals(self, source) -> None:
        """Queue the requests that have arrived: pending turns whose previous
        turn is now done, then new items from `source` (a turn that must
        wait goes to `pending`), until enough are queued to fill a step."""
        turns = self.turns
        if self.pending:
            now = time.monotonic()
            still = []
            for seq in self.pending:
                it = seq.item
                if turns.ready(it.key, it.turn, it.after):
                    seq.arrived = now          # TTFT counts from here
                    self.waiting.append(seq)
                else:
                    still.append(seq)
            self.pending = still
        cap = self.opts.max_running
        while len(self.waiting) < cap and len(self.pending) < 4 * cap:
            item = next(source, None)
            if item is None:
                return
            if not self._fits(item):
                self.stats.rejected += 1
                turns.done(item.key, item.turn)
            elif turns.ready(item.key, item.turn, item.after):
                self.waiting.append(Seq(item))
            else:
                self.pending.append(Seq(item))

    def _over(self, seqs) -> None:
        """These requests are over (finished, aborted or dropped): their
        conversations' next turns may come."""
        for seq in seqs:
            self.turns.done(seq.item.key, seq.item.turn)

    def _fits(self, item: Item) -> bool:
        """Whether the request can ever be served: its whole length must fit
        the model and (at once) the pool."""
        total = len(item.prompt) + len(item.output)
        if total > self.config.max_model_len:
            return False
        need = self.config.blocks_for_request(total)
        return need <= self.config.num_blocks - 1

    async def step(self) -> bool:
        """One scheduler step; returns whether any request ran."""
        st = self.stats
        st.steps += 1
        ops = self._bookkeeping()
        released = self.released
        budget = self.opts.token_budget
        allocs: list[tuple[Seq, int]] = []      # (request, index of its op)
        for seq in self.running:
            if budget <= 0:
                seq.scheduled = 0
                continue
            n = min(budget, len(seq.tokens) - seq.num_computed)
            seq.scheduled = n
            budget -= n
            allocs.append((seq, len(ops)))
            ops.append(p.AllocateSlots(seq.rid, n))
        admits, probes = self._admissions(ops, budget, [s for s, _ in allocs])
        t0 = time.perf_counter()
        results = await self._batch(ops)
        self._over(released)     # cached and freed (or lost with a restart: over too)
        if results is None:
            return True
        rtt = time.perf_counter() - t0
        st.batch_us.append(int(rtt * 1e6))
        st.coord_s += rtt
        failed = []
        writers: dict[int, Seq] = {}    # block -> the request of this step writing it
        for seq, i in allocs:
            res = results[i]
            self.num_free_blocks = res.num_free_blocks
            seq.phase = 0
            if res.new_block_ids is None:
                failed.append(seq)
            else:
                self._extend(seq, res.new_block_ids)
                self._writes(seq, writers)
        refused = []
        for seq, i in admits:
            self.num_free_blocks = results[i].num_free_blocks
            if not self._admitted(seq, results[i], writers):
                refused.append(seq)
        self.waiting.extendleft(reversed(refused))   # FCFS: first in line next step
        for seq, i in probes:
            self._probed(seq, results[i])
        if failed:
            await self._preempt(failed)
        return self._compute()

    # -- building a batch ------------------------------------------------------------------------
    def _bookkeeping(self) -> list:
        ops: list = []
        for seq in [s for s in self.running if s.to_advance] + self.finishing:
            # The tokens computed last step are in the arena now: their
            # blocks become hits for every worker.
            ops.append(p.Advance(seq.rid, seq.num_computed, seq.append))
            seq.to_advance, seq.append = False, []
        ops += [p.Free(seq.rid) for seq in self.finishing]
        self.released = self.finishing   # over once these ops are sent
        self.finishing = []
        return ops

    def _admissions(self, ops: list, budget: int, allocs: list[Seq]
                    ) -> tuple[list[tuple[Seq, int]], list[tuple[Seq, int]]]:
        """Append Add + Admit ops for waiting requests, FCFS, while the budget,
        max_running and (an estimate of) the free blocks allow, and a lookup
        (a probe, no budget) for each request waiting for a prefix in
        flight; returns the admitted and the probed requests, each with the
        index of its op."""
        admits: list[tuple[Seq, int]] = []
        free = self.num_free_blocks - sum(self._blocks_needed(s, s.scheduled) for s in allocs)
        waiting = self.waiting
        i = 0
        while (i < len(waiting) and budget > 0
               and len(self.running) + len(admits) < self.opts.max_running):
            seq = waiting[i]
            if seq.wait_until > 0:
                i += 1          # waits in its place: probed below
                continue
            n = min(budget, len(seq.tokens))
            need = self._blocks_needed(seq, n)
            if need > free and (admits or self.running):
                break   # would likely fail: let running requests free blocks first
            del waiting[i]
            if not seq.added:   # (a preempted request is still known to the coordinator)
                ops.append(p.AddRequest(seq.rid, list(seq.tokens)))
                seq.added = True
            admits.append((seq, len(ops)))
            wait = 0 if seq.wait_until else self.opts.wait_in_flight
            ops.append(p.Admit(seq.rid, n, wait_in_flight=wait))
            budget -= n
            free -= need
        probes = []
        for seq in waiting:
            if seq.wait_until > 0:
                probes.append((seq, len(ops)))
                ops.append(p.GetComputedBlocks(seq.rid))
        return admits, probes

    def _probed(self, seq: Seq, res: p.ComputedBlocks) -> None:
        """A waiting request's lookup: it is admitted next step (in its
        place in line) once fewer than `wait_in_flight` tokens are in flight;
        its deadline moves while its hit grows (the writer is making
        progress), and when it passes, the request computes the rest."""
        now = time.monotonic()
        if res.num_in_flight_tokens < self.opts.wait_in_flight:
            seq.wait_until = 0.0
        elif res.num_computed_tokens > seq.wait_hit:
            seq.wait_hit = res.num_computed_tokens
            seq.wait_until = now + self.opts.in_flight_deadline
        elif now >= seq.wait_until:
            seq.wait_until = -1.0
            self.stats.in_flight_timeouts += 1

    def _blocks_needed(self, seq: Seq, n: int) -> int:
        total = 0
        for g, bs in self.groups:
            have = len(seq.tables[g]) if seq.tables else 0
            total += max(0, -(-(seq.num_computed + n) // bs) - have)
        return total

    # -- results -----------------------------------------------------------------------------------
    def _extend(self, seq: Seq, new_ids) -> None:
        for table, ids in zip(seq.tables, new_ids):
            table.extend(ids)

    def _admitted(self, seq: Seq, res: p.Admitted, writers: dict[int, "Seq"]) -> bool:
        """Start a request that `Admit` allocated; False if it was refused
        (short of blocks, or waiting for tokens in flight).  `writers`: the
        blocks this step's requests write so far (this one's join them)."""
        if res.new_block_ids is None:
            if (not seq.wait_until
                    and 0 < self.opts.wait_in_flight <= res.num_in_flight_tokens):
                seq.wait_until = time.monotonic() + self.opts.in_flight_deadline
                seq.wait_hit = res.num_computed_tokens
                self.stats.in_flight_waits += 1
            return False
        st = self.stats
        seq.wait_until = 0.0
        seq.tables = [list(h) + list(n) for h, n in zip(res.hit_block_ids, res.new_block_ids)]
        seq.num_computed = res.num_computed_tokens
        seq.scheduled = res.num_new_tokens
        if not seq.admitted_once:
            seq.admitted_once = True
            st.queue_ms.append(int((time.monotonic() - seq.arrived) * 1000))
            st.prompt_tokens += seq.prompt_len
            st.hit_tokens += min(res.num_computed_tokens, seq.prompt_len)
        # Hits on blocks another request of this step writes: computed (and
        # checked) after it.
        seq.phase = 1 + max((writers[b].phase for b in res.hit_block_ids[0] if b in writers),
                            default=-1)
        seq.num_hit = res.num_computed_tokens
        self._writes(seq, writers)
        self.running.append(seq)
        return True

    def _writes(self, seq: Seq, writers: dict[int, "Seq"]) -> None:
        """Record the blocks the request's scheduled tokens write this step
        (a block it held already is completed by them, too)."""
        bs = self.groups[0][1]
        start = seq.num_computed
        table = seq.tables[0]
        writers.update((b, seq) for b in table[start // bs:-(-(start + seq.scheduled) // bs)])

    async def _preempt(self, failed: list[Seq]) -> None:
        """Preempt the newest running requests until every request in
        `failed` got its slots (or was itself preempted).

        NOTE: newest first also keeps same-step hits sound: a request that
        hit blocks another request of this step writes was admitted after
        that writer, so it is preempted before the writer is (a preempted
        writer's pending blocks are uncached, and nobody left holds them
        expecting their K/V)."""
        st = self.stats
        pending = list(failed)
        while pending:
            victim = self.running.pop()
            ops = [p.Free(victim.rid, preempted=True), p.Advance(victim.rid, 0, victim.append)]
            victim.append = []
            victim.to_advance = False
            victim.num_computed = victim.scheduled = 0
            victim.tables = []
            victim.ctx = None
            victim.num_hit, victim.phase = -1, 0
            st.preemptions += 1
            self.waiting.appendleft(victim)
            pending = [s for s in pending if s is not victim]
            retry = list(pending)
            ops += [p.AllocateSlots(s.rid, s.scheduled) for s in retry]
            t0 = time.perf_counter()
            results = await self._batch(ops)
            self.stats.coord_s += time.perf_counter() - t0
            if results is None:
                return
            pending = []
            for seq, res in zip(retry, results[2:]):
                self.num_free_blocks = res.num_free_blocks
                if res.new_block_ids is None:
                    pending.append(seq)
                else:
                    self._extend(seq, res.new_block_ids)

    async def _abort_all(self) -> None:
        """Stop now: cache what is computed, free every request."""
        ops = self._bookkeeping()
        live = self.running + [s for s in self.waiting if s.added]
        ops += [p.Free(s.rid) for s in live]
        self.stats.aborted += len(live)
        over = self.released + self.running + list(self.waiting) + self.pending
        self.running, self.waiting, self.pending = [], deque(), []
        if ops:
            await self._batch(ops)
        self._over(over)

    async def _forget(self, seqs: list[Seq]) -> None:
        if seqs:
            await self._batch([p.Free(s.rid) for s in seqs])

    async def _flush(self) -> None:
        """Send the last step's bookkeeping (caching and frees)."""
        ops = self._bookkeeping()
        if ops:
            await self._batch(ops)
        self._over(self.released)

    # -- coordinator restarts ----------------------------------------------------------------------
    async def _batch(self, ops: list) -> list | None:
        """`client.batch(ops)`; None when a coordinator restart lost requests
        (they are requeued by `_requests_lost`).  The client resumes by
        itself, so an ordinary restart is only a delay here."""
        self.stats.ops += len(ops)
        try:
            return await self.client.batch(ops)
        except (ResumeFailed, ReplyLost) as e:
            self._requests_lost(e)
            return None

    def _requests_lost(self, err: Exception) -> None:
        """Requests the coordinator no longer holds for us (the session could
        not be resumed, or a reply was lost): start them over."""
        st = self.stats
        known = self.client.requests
        if not st.first_error:
            st.first_error = f"{type(err).__name__}: {err}"
        keep = []
        for seq in self.running:
            if seq.rid in known:
                keep.append(seq)
                continue
            st.requests_lost += 1
            st.recomputed_tokens += seq.num_computed
            seq.num_computed = seq.scheduled = 0
            seq.tables, seq.ctx, seq.added = [], None, False
            seq.to_advance, seq.append = False, []
            self.waiting.appendleft(seq)
        self.running = keep
        self.finishing = [s for s in self.finishing if s.rid in known]
        for seq in self.waiting:
            if seq.rid not in known:
                seq.added = False

    def _time_away(self) -> float:
        return sum(back - lost for lost, back in self.client.restarts)

    def restart_stats(self) -> None:
        """Copy the client's record of coordinator restarts into the stats."""
        c, st = self.client, self.stats
        st.coordinator_restarts = len(c.restarts)
        st.requests_resumed = c.resumed_requests
        st.stalls_ms = [int((back - lost) * 1000) for lost, back in c.restarts]

    # -- the model -------------------------------------------------------------------------------
    def _compute(self) -> bool:
        """Run the model on this step's scheduled tokens (K/V into the arena,
        decode attention), then sample (teacher-forced).  Returns whether
        anything ran."""
        st = self.stats
        scheduled = [seq for seq in self.running if seq.scheduled]
        compute = self.compute
        for phase in range(max((s.phase for s in scheduled), default=0) + 1):
            batch = [s for s in scheduled if s.phase == phase]
            for seq in batch:       # admitted this step: its hits are written now
                if seq.num_hit > 0:
                    compute.admitted(seq, seq.num_hit)
                elif seq.num_hit == 0:
                    compute.started(seq)
                seq.num_hit = -1
            compute.run(batch)
        now = time.monotonic()
        still = []
        for seq in self.running:
            n = seq.scheduled
            if not n:
                still.append(seq)
                continue
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
        return bool(scheduled)

    def _error(self, message: str) -> None:
        if not self.stats.first_error:
            self.stats.first_error = message
