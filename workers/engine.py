"""The CPU worker's engine: the scheduling policy (kvshm/workload/policy.py,
`Planner`) against the coordinator, plus real numpy compute on the shared KV
arena, checking every prefix-cache hit.

Each step is one `Client.batch` the planner builds (its module doc gives
the order: last step's bookkeeping, running requests' allocations,
admissions, probes of requests waiting for a prefix in flight), and a
follow-up batch per preemption.  What only a real engine has is here:
- the model (workers/compute.py) on the arena, in phases: full blocks are
  cached when they are allocated, as in vLLM, but pending until the next
  batch's `Advance` says their K/V are in the arena (block readiness,
  core/block_pool.py).  This worker's own requests hit its pending blocks in
  the step that computes them, as vLLM's do, so a request whose hits
  another request of the step writes is computed after it (`phase`);
- the wall clock: the planner's waits for prefixes other workers are
  computing end at `in_flight_deadline`, and the run's soft and hard
  deadlines end the run;
- turns: a conversation's next turn arrives only once its previous turn is
  over (workers/turns.py: the run's TurnBoard, across workers), as a user
  sends a follow-up after reading the answer; until then it waits in
  `pending`, and its time to first token counts from its arrival;
- coordinator restarts: the client resumes by itself; requests a restart
  lost are started over;
- corrupted K/V: blocks the model's checks find wrong are reported
  (`ReportCorrupt`: the pool uncaches them and what was computed from
  them) and the requests that read them start over (`_compute`, `_heal`).

`kvshm demo` and the service benchmark drive the same planner without
compute (kvshm/workload/scheduler.py).
"""

from __future__ import annotations

import asyncio
import time

from kvshm.core.errors import KvshmError
from kvshm.core.specs import FullSpec, MLASpec, PoolConfig, SlidingWindowSpec
from kvshm.ops import protocol as p
from kvshm.ops.errors import ReplyLost, ResumeFailed
from kvshm.workers.compute import MODELS, ExactCompute, LoadOnlyCompute
from kvshm.workers.engine_types import EngineOptions, EngineStats
from kvshm.workers.transformer import TransformerCompute
from kvshm.workers.turns import LocalTurns
from kvshm.workload.items import Item
from kvshm.workload.policy import Planner, Seq, fits

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


class EngineSeq(Seq):
    """A request as the engine sees it: the policy's `Seq`, plus the model's
    context (`ctx`, workers/compute.py) and the phase of its step in which
    it is computed."""

    __slots__ = ("ctx", "phase", "admitted_at")

    def __init__(self, item: Item) -> None:
        super().__init__(item, time.monotonic())
        self.ctx = None
        self.phase = 0           # computed after the requests of lower phases in its step
        self.admitted_at = 0.0   # when the batch that admitted it (granting its hits) left

    def reset(self) -> None:
        super().reset()
        self.ctx = None
        self.phase = 0


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
        self.pending: list[EngineSeq] = []   # turns whose previous turn is not done yet
        self._healing = None   # (requests starting over -> their wrong blocks, their ops)
        self._corrupt_seen: set[int] = set()   # blocks found wrong (and reported)
        # The scheduling policy's requests: waiting, running, finishing.
        self.planner = Planner([bs for _, bs in self.groups], config.num_blocks - 1, self.stats,
                               token_budget=opts.token_budget, max_running=opts.max_running,
                               wait_in_flight=opts.wait_in_flight,
                               in_flight_deadline=opts.in_flight_deadline)

    # -- the loop ------------------------------------------------------------------------------
    async def run(self, items, deadline: float, on_step=None,
                  hard_deadline: float | None = None) -> EngineStats:
        """Serve `items` (an iterator of `Item`) until exhausted or `deadline`
        (time.monotonic()): then admit nothing new and let running requests
        finish, until `hard_deadline` (pushed back by the time coordinator
        restarts took), where the rest are aborted (freed).
        `on_step(stats)` after every step."""
        source = iter(items)
        waiting = self.planner.waiting
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
            elif waiting or self.pending:
                self.stats.aborted += sum(1 for s in waiting if s.added)
                # Waiting requests that were never admitted are dropped; any that
                # were preempted still own a coordinator entry: forget it.
                await self._forget([s for s in waiting if s.added])
                self._over(list(waiting) + self.pending)
                waiting.clear()
                self.pending.clear()
            # (_arrivals pulls until the queue is full or the source is dry.)
            if not (self.planner.busy or self.pending):
                break
            if not await self.step():
                # Nothing could run (every block is held by other workers, or
                # the requests wait for prefixes in flight): give the others
                # a moment instead of spinning on the coordinator.
                await asyncio.sleep(0.01 if waiting else 0.002)
            if on_step is not None:
                on_step(self.stats)
        await self._flush()
        return self.stats

    def _arrivals(self, source) -> None:
        """Queue the requests that have arrived: pending turns whose previous
        turn is now done, then new items from `source` (a turn that must
        wait goes to `pending`), until enough are queued to fill a step."""
        turns, waiting = self.turns, self.planner.waiting
        if self.pending:
            now = time.monotonic()
            still = []
            for seq in self.pending:
                it = seq.item
                if turns.ready(it.key, it.turn, it.after):
                    seq.arrived = now          # TTFT counts from here
                    waiting.append(seq)
                else:
                    still.append(seq)
            self.pending = still
        cap = self.opts.max_running
        while len(waiting) < cap and len(self.pending) < 4 * cap:
            item = next(source, None)
            if item is None:
                return
            if not fits(self.config, item):
                self.stats.rejected += 1
                turns.done(item.key, item.turn)
            elif turns.ready(item.key, item.turn, item.after):
                waiting.append(EngineSeq(item))
            else:
                self.pending.append(EngineSeq(item))

    def _over(self, seqs) -> None:
        """These requests are over (finished, aborted or dropped): their
        conversations' next turns may come."""
        for seq in seqs:
            self.turns.done(seq.item.key, seq.item.turn)

    async def step(self) -> bool:
        """One scheduler step; returns whether any request ran."""
        st = self.stats
        st.steps += 1
        planner = self.planner
        plan = planner.plan()
        t0, sent = time.perf_counter(), time.monotonic()
        results = await self._batch(plan.ops)
        self._over(plan.released)   # cached and freed (or lost with a restart: over too)
        if results is None:
            return True
        rtt = time.perf_counter() - t0
        st.batch_us.append(int(rtt * 1e6))
        st.coord_s += rtt
        allocated, admitted, failed = planner.settle(plan, results, time.monotonic())
        for seq, _ in admitted:
            seq.admitted_at = sent
        self._phases(allocated, admitted)
        if failed:
            await self._preempt(failed)
        ran = self._compute()
        if self._healing is not None:
            await self._heal()
        return ran

    def _phases(self, allocated: list[EngineSeq], admitted: list) -> None:
        """Order this step's compute: a request admitted with hits on blocks
        another request of the step writes is computed after it."""
        bs = self.groups[0][1]
        writers: dict[int, EngineSeq] = {}    # block -> the request of this step writing it

        def writes(seq: EngineSeq) -> None:
            # (a block it held already is completed by its scheduled tokens, too)
            start = seq.num_computed
            writers.update((b, seq) for b in
                           seq.tables[0][start // bs:-(-(start + seq.scheduled) // bs)])

        for seq in self.planner.running:
            seq.phase = 0
        for seq in allocated:
            writes(seq)
        for seq, res in admitted:
            seq.phase = 1 + max((writers[b].phase for b in res.hit_block_ids[0] if b in writers),
                                default=-1)
            writes(seq)

    async def _preempt(self, failed: list[EngineSeq]) -> None:
        """Run the planner's preemption batches (newest first) until every
        request in `failed` got its slots or was itself preempted."""
        batches = self.planner.preemption(failed)
        results = None
        try:
            while True:
                ops = batches.send(results)
                t0 = time.perf_counter()
                results = await self._batch(ops)
                self.stats.coord_s += time.perf_counter() - t0
        except StopIteration:
            pass

    async def _abort_all(self) -> None:
        """Stop now: cache what is computed, free every request."""
        planner = self.planner
        ops, released = planner.bookkeeping()
        live = planner.running + [s for s in planner.waiting if s.added]
        ops += [p.Free(s.rid) for s in live]
        self.stats.aborted += len(live)
        over = released + planner.running + list(planner.waiting) + self.pending
        planner.running, self.pending = [], []
        planner.waiting.clear()
        if ops:
            await self._batch(ops)
        self._over(over)

    async def _forget(self, seqs: list[EngineSeq]) -> None:
        if seqs:
            await self._batch([p.Free(s.rid) for s in seqs])

    async def _flush(self) -> None:
        """Send the last step's bookkeeping (caching and frees)."""
        ops, released = self.planner.bookkeeping()
        if ops:
            await self._batch(ops)
        self._over(released)

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
        if not st.first_error:
            st.first_error = f"{type(err).__name__}: {err}"
        lost, recomputed = self.planner.requeue_lost(self.client.requests)
        st.requests_lost += lost
        st.recomputed_tokens += recomputed

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
        decode attention) in phase order, then let the planner sample
        (teacher-forced).  Returns whether anything ran.

        A request whose hits are found wrong (before it runs, or by the
        check of the step it ran in) is not computed, or its step is
        discarded, and so are those of this step's later requests that hit
        blocks it was to write; they start over, and `_heal` reports the bad
        blocks."""
        scheduled = [seq for seq in self.planner.running if seq.scheduled]
        compute = self.compute
        bs = self.groups[0][1]
        poisoned: set[int] = set()       # blocks that requests starting over were to write
        over: dict = {}                  # request starting over -> its wrong hit blocks

        def start_over(seq, bad: list[int]) -> None:
            start = seq.num_computed
            poisoned.update(seq.tables[0][start // bs:-(-(start + seq.scheduled) // bs)])
            over[seq] = bad

        for phase in range(max((s.phase for s in scheduled), default=0) + 1):
            batch = []
            for seq in (s for s in scheduled if s.phase == phase):
                hit, seq.num_hit = seq.num_hit, -1
                if hit > 0 and poisoned and not poisoned.isdisjoint(seq.tables[0][:hit // bs]):
                    start_over(seq, [])
                    continue
                if hit > 0:     # admitted this step: its hits are written now
                    compute.admitted(seq, hit)
                elif hit == 0:
                    compute.started(seq)
                batch.append(seq)
            found = compute.take_found()
            compute.run([s for s in batch if s not in found])
            found.update(compute.take_found())   # (checks made within the step)
            for seq, bad in found.items():
                start_over(seq, bad)
        if over:   # (out of the running requests before they are counted as computed)
            self._healing = (over, self.planner.requeue(list(over)))
        self.planner.computed(time.monotonic())
        return bool(scheduled)

    async def _heal(self) -> None:
        """Report the blocks found wrong (while their requests still hold
        them), then free those requests (`Planner.requeue` queued them
        again): the pool has uncached the bad blocks and everything computed
        from them, so their next admission computes them again."""
        (over, restart), self._healing = self._healing, None
        st = self.stats
        reports = [(seq, bad) for seq, bad in over.items() if bad]
        if reports:
            try:
                results = await self._batch([p.ReportCorrupt(seq.rid, bad)
                                             for seq, bad in reports])
            except KvshmError as e:
                st.hit_mismatches += sum(len(bad) for _, bad in reports)
                self._error(f"reporting corrupt blocks failed: {type(e).__name__}: {e}")
                results = None
            done = time.monotonic()
            for (seq, bad), res in zip(reports, results or ()):
                st.corrupt_blocks_evicted += len(res.block_ids)
                st.corrupt_log.extend((b, seq.admitted_at, done) for b in bad)
                self._corrupt_seen.update(bad)
            st.corrupt_blocks_found = len(self._corrupt_seen)
        st.corrupt_requeued += len(over)
        await self._batch(restart)

    def _error(self, message: str) -> None:
        if not self.stats.first_error:
            self.stats.first_error = message
