"""`KVCacheManagerCore`: the scheduler-facing facade of the allocator core,
on a segment it is given.

Same API and semantics as vLLM v1's KVCacheManager, with block ids (ints)
instead of block objects, state in a segment of flat arrays (core/state.py
says what they mean), and typed errors (raised before anything changes)
instead of asserts for caller mistakes.  `kvshm.KVCacheManager`
(kvshm/pool/kv_cache_manager.py) is this class on a shared-memory segment
that it creates or adopts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from kvshm.core.adoption import adopt_indexes
from kvshm.core.block_pool import BlockPool
from kvshm.core.errors import InvalidArgument, RequestTooLong, StaleHits
from kvshm.core.events import SPEC_KINDS, Event, EventLog
from kvshm.core.group_logic import BlockIds, any_blocks, make_group_logic
from kvshm.core.hashing import BlockHasher
from kvshm.core.recovery import RepairReport, repair
from kvshm.core.request import Request
from kvshm.core.state import SEQ_WORD, SegmentState
from kvshm.core.table import RequestTable


class Hits(tuple):
    """What `get_computed_blocks` returns when it found hits: the blocks per
    group, a tuple as ever, that also knows its lookup (`request_id`, and
    the pool's `uncached` count then).  While the count is unchanged every
    block in it is still cached under the hash it was found by, so
    `allocate_slots` need not look at each again (a lookup the caller built
    itself, or one from before an eviction, is checked block by block)."""

    request_id: str
    uncached: int


class KVCacheManagerCore:
    """The allocator for one pool, on its segment.

    Args:
        segment: the pool's state (its config is the pool's).  Closed by
            `close()`, and unlinked then if the segment's `owner` is set.
        adopt: the segment holds a pool another process wrote (not one just
            initialised): a frame its last writer left cut off is rolled
            back and the derived arrays rebuilt first (`repair_report` says
            what was done), and this process becomes its writer.
        kv_events: record KV-cache events (core/events.py) for
            `take_events()`.
        track_ready: cache blocks ahead of their K/V as pending
            (block_pool.py, "readiness"): for a pool several engines share.
            The session whose calls run now is `block_pool.reader`;
            `mark_computed` reports a request's K/V written.  Without it
            (one engine, as vLLM) a block is a hit for all once cached.
    """

    def __init__(self, segment: SegmentState, *, adopt: bool, kv_events: bool = False,
                 track_ready: bool = False) -> None:
        self.segment = segment
        self.config = config = segment.config
        self.max_model_len = config.max_model_len
        self.enable_caching = config.enable_caching
        self.num_kv_cache_groups = len(config.groups)
        self.repair_report: RepairReport | None = None
        try:
            if adopt:
                self.repair_report = repair(segment)
            segment.begin_mutation()
            self.block_pool = BlockPool(segment, attach=adopt)
            self.block_pool.track_ready = track_ready
            self.table = RequestTable(segment)
            self.groups = make_group_logic(config, self.block_pool, self.table)
            if adopt:
                adopt_indexes(segment, self.block_pool, self.table, self.groups.managers)
                # This process is the pool's writer from now on.
                segment.set("generation", segment.get("generation") + 1)
                segment.set("coordinator_pid", os.getpid())
                segment.set("started_ns", time.time_ns())
            self.block_pool.publish()
        except BaseException:
            self._drop_segment()
            raise
        self.journal = segment.journal
        self.events: EventLog | None = None
        # Free blocks an allocation must leave (a tenant's quota: the
        # coordinator sets it per frame); whether the last refused
        # allocation was refused for it rather than for the pool.
        self.free_floor = 0
        self.refused_by_floor = False
        self.num_in_flight_tokens = 0
        # What the pool's vLLM release does where releases differ
        # (core/semantics.py), and its watermark in blocks.
        self.semantics = sem = config.semantics
        self._watermark_blocks = int(config.watermark * config.num_blocks)
        # 0.32: the shared-prefix boundary of the last lookup (0 but where a
        # hybrid pool's full-attention group cached past the hit).
        self.shared_prefix_boundary = 0
        self._gate = sem.admission_gate
        self._frame = False
        self.empty_blocks: BlockIds = tuple(() for _ in config.groups)
        self._widths = self.table.widths
        self._hbs = config.hash_block_size
        self._slot_of = self.table.slot_of
        # The manager of a pool of one group whose type has no window and
        # allocates no extra slots (full attention, MLA, sink): allocate_slots'
        # shortest path is for it.
        single = self.groups.single
        self._plain = (single if single is not None and not single.has_window
                       and not single.extra_tokens else None)
        self._words = segment.words
        if kv_events:
            self.enable_events()

    def enable_events(self) -> None:
        """Record KV-cache events from now on.  A pool that already caches
        blocks (one adopted from a dead coordinator) first records
        AllBlocksCleared and a BlockStored per cached block (and partial
        entry), oldest first:
        a subscriber that followed the previous coordinator's stream (whose
        last events may have died with it) is then in step again.  The
        segment keeps no tokens, parents or LoRA names: those events carry
        only the block's hash, its size and group."""
        if self.events is not None:
            return
        groups = self.config.groups
        maps = ([(SPEC_KINDS[g.__struct_config__.tag], getattr(g, "sliding_window", None))
                 for g in groups]
                if self.semantics.event_maps else None)
        pool = self.block_pool
        log = self.events = pool.events = EventLog(len(groups), maps)
        # (a 0.32 pool's partial entries too, each in its block's place, after
        # the block's full entry; their size is the hash block's)
        full, partial = pool.cached_blocks(), pool.partial_entries()
        if full or partial:
            log.cleared()
            sizes = [m.block_size for m in self.groups.managers]
            stamp = self.segment.cache_stamp
            entries = sorted([(b, d, g, sizes[g]) for b, d, g in full]
                             + [(b, d, g, self.config.hash_block_size) for b, d, g in partial],
                             key=lambda e: stamp[e[0]])
            for _, digest, group, size in entries:
                log.stored([digest], None, [], size, None, group)   # no LoRA known

    # -- construction helpers --------------------------------------------------
    def make_hasher(self) -> BlockHasher | None:
        """The block hasher requests of this pool must use (None: caching off)."""
        return self.config.block_hasher()

    # -- lifecycle ---------------------------------------------------------------
    def close(self) -> None:
        """Release the segment (and unlink it if this manager created it)."""
        self._drop_segment()

    def _drop_segment(self) -> None:
        seg = self.segment
        if seg.closed:
            return
        seg.close()
        if seg.owner:
            seg.unlink()

    def __enter__(self) -> "KVCacheManagerCore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- queries -----------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Fraction of the pool (null block excluded) not free."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def prefix_cache_stats(self) -> dict[str, int]:
        """Lookups since the pool was created: `queries` and `hits` count
        lookups, `query_tokens` and `hit_tokens` their tokens."""
        q, h, qt, ht = self.block_pool.stats
        return {"queries": q, "hits": h, "query_tokens": qt, "hit_tokens": ht}

    def get_computed_blocks(self, request: Request, hold_at: int = 0) -> tuple[BlockIds, int]:
        """Prefix-cache hit of a waiting request: (blocks per group, tokens).

        Never covers the last token; changes no block state.  With
        readiness, `num_in_flight_tokens` then says how many tokens past the
        hit other sessions are writing now.

        `hold_at`: where the release counts every lookup (0.14), a lookup
        that finds at least this many tokens in flight is not counted: its
        caller holds the request back until they are written and looks it
        up again, and only the lookup that admits it counts, as on an
        engine's own cache (0: every lookup counts).
        """
        self.num_in_flight_tokens = self.shared_prefix_boundary = 0
        if not self.enable_caching or request.skip_reading_prefix_cache:
            request.shared_prefix_boundary = 0
            return self.empty_blocks, 0
        blocks, n = self.groups.find_longest_cache_hit(request.block_hashes,
                                                       request.num_tokens - 1)
        uncached = self.groups.uncached_prefix_tokens
        request.shared_prefix_boundary = self.shared_prefix_boundary = (
            n + uncached if uncached else 0)
        if self.block_pool.pending:
            self.num_in_flight_tokens = self.groups.in_flight_tokens
        if not self.semantics.stats_at_admission and not (
                hold_at and self.num_in_flight_tokens >= hold_at):
            self._begin()
            self.block_pool.record_lookup(request.num_tokens, n)
            self._end()
        if not any_blocks(blocks):
            return self.empty_blocks, n
        hits = Hits(blocks)
        hits.request_id = request.request_id
        hits.uncached = self.block_pool.uncached
        return hits, n

    def find_hits_again(self, request: Request, block_ids: list[list[int]]) -> Hits | None:
        """The lookup `get_computed_blocks` gives `request` now, if it finds
        exactly `block_ids` (per group, as an earlier lookup returned them);
        None otherwise.  Counts no lookup: it repeats one (after a
        coordinator restart, for an allocation that is to use its hits)."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return None
        blocks, _ = self.groups.find_longest_cache_hit(request.block_hashes,
                                                       request.num_tokens - 1)
        if len(blocks) != len(block_ids) or any(
                list(found) != list(want) for found, want in zip(blocks, block_ids)):
            return None
        hits = Hits(blocks)
        hits.request_id = request.request_id
        hits.uncached = self.block_pool.uncached
        return hits

    def estimate_cached_tokens(self, request_id: str) -> int:
        """Tokens the request's cached blocks cover: per prefix-cached group
        the end of its last cached block, the least over groups (0 when it
        holds none).  vLLM 0.32 asks it at a request's first output."""
        return self.groups.estimate_cached_tokens(request_id)

    def new_step_starts(self) -> None:
        """A scheduler step begins (vLLM 0.32's hook: its Mamba manager
        admits no request whose last hit was cached in the same step)."""
        self.groups.new_step_starts()

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Every block the request holds, per group (nulls included)."""
        return self.groups.get_blocks(request_id)

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        """Per group, how many leading blocks of the request every request
        with an allocation shares (zeros where the release has no cascade
        attention, `Semantics.common_prefix_blocks`)."""
        if not self.semantics.common_prefix_blocks:
            return [0] * self.num_kv_cache_groups
        self.table.check_room(request_id)
        self._begin()  # the probe may create an (empty) entry
        try:
            return self.groups.get_num_common_prefix_blocks(request_id)
        finally:
            self._end()

    # -- mutations ---------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: BlockIds | None = None,
                       num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0,
                       full_sequence_must_fit: bool = False, waiting: bool = False,
                       has_scheduled_reqs: bool = True,
                       reserved_blocks: int = 0) -> BlockIds | None:
        """Give the request slots for `num_new_tokens` more tokens (plus
        lookahead), adopting `new_computed_blocks` (from
        `get_computed_blocks`).  Returns the newly allocated block ids per
        group, or None when the pool has too few free blocks.  Blocks out of
        the request's attention window are freed even when it fails.

        Where the release has an admission gate (vLLM 0.32): `waiting` says
        the request is being admitted from the waiting queue (new or
        preempted); with `full_sequence_must_fit` it is admitted only if
        blocks for all its tokens are free; while `has_scheduled_reqs`, a
        waiting request must also leave the pool's watermark free;
        `reserved_blocks` more must stay free after the allocation (what
        vLLM 0.32's scheduler holds back for asynchronous KV loads in
        flight; not counted by the whole-sequence check).

        Raises InvalidArgument (negative counts, no tokens, hits for a running
        request, bad hit lists), RequestTooLong, RequestTableFull; then
        nothing has changed.
        """
        rid = request.request_id
        m = self._plain
        settled_checked = False
        gate = False
        watermark = 0
        if self._gate:
            if waiting and has_scheduled_reqs:
                watermark = self._watermark_blocks
            if full_sequence_must_fit or watermark:
                gate = True
        if gate or reserved_blocks:
            m = None    # the shortest paths below know neither gate nor reserve
        if (m is not None and new_computed_blocks is None and num_new_tokens > 0
                and num_lookahead_tokens >= 0
                and not num_new_computed_tokens | num_external_computed_tokens
                | num_encoder_tokens):
            # A running request's step on a pool of one group without a
            # window (most calls), with the counts checked: when it changes
            # nothing (SingleTypeManager.settled), no frame and no mutation.
            computed = request.num_computed_tokens
            end = computed + num_new_tokens
            need = end + num_lookahead_tokens
            if need <= self.max_model_len and self.free_floor <= self.block_pool.num_free_blocks:
                num_tokens = request.num_tokens
                caching = self.enable_caching and not delay_cache_blocks
                if not caching or (len(request.block_hashes) + 1) * self._hbs > num_tokens:
                    settled_checked = True
                    if m.settled(rid, need, computed, (end if end < num_tokens else num_tokens)
                                 if caching else 0):
                        return ([],)
        if (num_new_tokens | num_new_computed_tokens | num_lookahead_tokens
                | num_external_computed_tokens | num_encoder_tokens | reserved_blocks) < 0:
            raise InvalidArgument(
                "counts must be >= 0 (num_new_tokens="
                f"{num_new_tokens}, num_new_computed_tokens={num_new_computed_tokens}, "
                f"num_lookahead_tokens={num_lookahead_tokens}, "
                f"num_external_computed_tokens={num_external_computed_tokens}, "
                f"num_encoder_tokens={num_encoder_tokens}, reserved_blocks={reserved_blocks})")
        if num_new_tokens == 0 and num_external_computed_tokens == 0 and not (
                num_new_computed_tokens and self.semantics.allocates_without_new_tokens):
            raise InvalidArgument(
                "num_new_tokens must be > 0 when there are no external computed tokens")
        hits = self.empty_blocks
        adopts = num_external_computed_tokens > 0
        if new_computed_blocks is not None and any_blocks(new_computed_blocks):
            self._check_hits(request, new_computed_blocks)
            hits = new_computed_blocks
            adopts = True
        max_len = self.max_model_len
        num_local = request.num_computed_tokens + num_new_computed_tokens
        total_computed = num_local + num_external_computed_tokens
        if total_computed > max_len:
            total_computed = max_len
        num_need_slot = total_computed + num_new_tokens + num_lookahead_tokens
        if num_need_slot > max_len:
            num_need_slot = max_len
        if rid not in self._slot_of:
            self.table.check_room(rid)
        # Growth to num_need_slot (<= max_model_len) always fits a row; only
        # adopted hits, external tokens and encoder tokens need checking.
        if adopts or num_encoder_tokens:
            self._check_fits(rid, hits, num_need_slot,
                             num_local + num_external_computed_tokens, num_encoder_tokens,
                             adopts)
        caching = self.enable_caching and not delay_cache_blocks
        num_tokens = request.num_tokens
        if caching and (len(request.block_hashes) + 1) * self._hbs <= num_tokens:
            self._check_hashes(request)

        groups = self.groups
        pool = self.block_pool
        if (not adopts and not settled_checked and not gate and not reserved_blocks
                and self.free_floor <= pool.num_free_blocks):
            # Nothing to change (a decode step inside its last block, mostly):
            # no frame, no mutation, the answer allocate_new_blocks would give.
            n = total_computed + num_new_tokens
            cache_upto = (n if n < num_tokens else num_tokens) if caching else 0
            single = groups.single
            if single is not None:
                if single.settled(rid, num_need_slot, total_computed, cache_upto):
                    return ([],)
            elif groups.settled(rid, num_need_slot, total_computed, num_encoder_tokens,
                                cache_upto):
                return groups.no_new_blocks()
        # The hot path opens its frame inline (see _begin / _end).
        self._words[SEQ_WORD] |= 1
        own_frame = not self._frame
        if own_frame:
            self.journal.begin(pool.next_cache_stamp)
        try:
            if gate and full_sequence_must_fit:
                # Blocks for the whole sequence, checked before any window
                # moves (as vLLM 0.32).
                full = num_tokens if num_tokens < max_len else max_len
                need = watermark + groups.get_num_blocks_to_admit(
                    rid, full, hits, num_encoder_tokens, total_computed)
                if need > pool.num_free_blocks - self.free_floor:
                    self.refused_by_floor = need <= pool.num_free_blocks
                    return None
            groups.remove_skipped_blocks(rid, total_computed)
            need = watermark + reserved_blocks + groups.get_num_blocks_to_allocate(
                rid, num_need_slot, hits, num_encoder_tokens,
                num_local + num_external_computed_tokens)
            if need > pool.num_free_blocks - self.free_floor:
                self.refused_by_floor = need <= pool.num_free_blocks
                return None
            if adopts:
                groups.allocate_new_computed_blocks(rid, hits, num_local,
                                                    num_external_computed_tokens)
            new_blocks = groups.allocate_new_blocks(rid, num_need_slot, num_encoder_tokens)
            if (waiting and self.semantics.stats_at_admission and self.enable_caching
                    and not request.num_computed_tokens
                    and not request.skip_reading_prefix_cache):
                # The release counts a lookup when its request is admitted.
                pool.record_lookup(num_tokens, num_new_computed_tokens)
            if caching:
                n = total_computed + num_new_tokens
                groups.cache_blocks(request, n if n < num_tokens else num_tokens)
            return new_blocks
        finally:
            pool.publish()
            if own_frame:
                self.journal.commit()

    def _check_hits(self, request: Request, hits: BlockIds) -> None:
        """Hits must be what get_computed_blocks returns for this request now:
        each block cached, for its group, under the request's hash at its
        position (a block reused for other tokens since the lookup is a stale
        hit)."""
        rid = request.request_id
        if (hits.__class__ is Hits and hits.uncached == self.block_pool.uncached
                and hits.request_id == rid):
            # This request's own lookup, nothing uncached since: its blocks
            # stand; only the rule for requests holding blocks is left.
            for m, blocks in zip(self.groups.managers, hits):
                if blocks and (rid in m.num_cached_block or m.req_to_blocks.get(rid)):
                    raise InvalidArgument(
                        f"request {rid!r} already holds blocks: prefix-cache hits are "
                        "only for a new (or preempted) request")
            return
        if not self.enable_caching:
            raise InvalidArgument("prefix-cache hits passed to a pool with caching off")
        if len(hits) != self.num_kv_cache_groups:
            raise InvalidArgument(
                f"new_computed_blocks has {len(hits)} groups, the pool has "
                f"{self.num_kv_cache_groups}")
        n = self.config.num_blocks
        pool = self.block_pool
        group_of = self.segment.hash_group
        for g, (m, blocks) in enumerate(zip(self.groups.managers, hits)):
            if not blocks:
                continue
            if rid in m.num_cached_block or m.req_to_blocks.get(rid):
                raise InvalidArgument(
                    f"request {rid!r} already holds blocks: prefix-cache hits are "
                    "only for a new (or preempted) request")
            keys = m.group_hashes(request.block_hashes)
            if len(blocks) > len(keys):
                raise InvalidArgument(
                    f"group {g}: {len(blocks)} hits for a request of {len(keys)} full blocks")
            for i, b in enumerate(blocks):
                if b.__class__ is not int or not 0 <= b < n:
                    raise InvalidArgument(f"group {g}: block id {b!r} is not in [0, {n})")
                if b and (pool.block_hash(b) != keys[i] or group_of[b] != g):
                    raise StaleHits(
                        f"group {g}: block {b} is not cached for this request's block "
                        f"{i} (a stale or invented hit; call get_computed_blocks again)")

    def _check_hashes(self, request: Request) -> None:
        if (len(request.block_hashes) + 1) * self._hbs <= request.num_tokens:
            raise InvalidArgument(
                f"request {request.request_id!r} lacks block hashes for its tokens "
                "(create it with this pool's make_hasher())")

    def _check_fits(self, rid: str, hits: BlockIds, num_need_slot: int,
                    total_computed: int, num_encoder_tokens: int, adopts: bool) -> None:
        for g, m in enumerate(self.groups.managers):
            if self.groups.cross[g]:
                needed = -(-num_encoder_tokens // m.block_size)
            else:
                if adopts and rid not in m.num_cached_block and m.req_to_blocks.get(rid):
                    raise InvalidArgument(
                        f"request {rid!r} already holds blocks: external computed "
                        "tokens are only for a new (or preempted) request")
                needed = m.blocks_after_allocation(rid, num_need_slot, len(hits[g]),
                                                   total_computed)
            if needed > self._widths[g]:
                raise RequestTooLong(g, needed, self._widths[g])

    def free(self, request: Request | str) -> None:
        """Free every block of the request (tail first).  A request holding
        nothing is fine."""
        rid = request if isinstance(request, str) else request.request_id
        self._begin()
        try:
            self.groups.free(rid)
            self.table.release(rid)
        finally:
            self._end()

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Free the request's blocks that are out of the attention window."""
        if total_computed_tokens < 0:
            raise InvalidArgument(f"total_computed_tokens must be >= 0 (got {total_computed_tokens})")
        self.table.check_room(request_id)
        self._begin()
        try:
            self.groups.remove_skipped_blocks(request_id, total_computed_tokens)
        finally:
            self._end()

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Commit the request's full blocks up to `num_computed_tokens`."""
        if not self.enable_caching:
            return
        if not 0 <= num_computed_tokens <= request.num_tokens:
            raise InvalidArgument(
                f"num_computed_tokens must be in [0, num_tokens={request.num_tokens}] "
                f"(got {num_computed_tokens})")
        self._check_hashes(request)
        self.table.check_room(request.request_id)
        self._begin()
        try:
            self.groups.cache_blocks(request, num_computed_tokens)
        finally:
            self._end()

    def mark_computed(self, request: Request) -> None:
        """The request's K/V up to its `num_computed_tokens` are in the
        arena: its pending blocks below that become hits for every session.
        A call that readies nothing opens no mutation."""
        if not self.block_pool.pending or not self.groups.readies(
                request.request_id, request.num_computed_tokens):
            return
        self._begin()
        try:
            self.groups.mark_computed(request.request_id, request.num_computed_tokens)
        finally:
            self._end()

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the listed blocks from the prefix cache (ids may be free, in
        use, uncached or 0)."""
        self._begin()
        try:
            self.block_pool.evict_blocks(block_ids)
        finally:
            self._end()

    def report_corrupt(self, block_ids: Iterable[int]) -> list[int]:
        """Blocks whose K/V were found wrong leave the prefix cache, with
        every cached block whose chain runs through them
        (`BlockPool.corrupt`); returns the ids uncached.  Raises
        InvalidArgument for an id outside [1, num_blocks), changing nothing."""
        self._begin()
        try:
            return self.block_pool.corrupt(block_ids)
        finally:
            self._end()

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes; fails (False) while any block is in use."""
        self._begin()
        try:
            return self.block_pool.reset_prefix_cache()
        finally:
            self._end()

    def take_events(self) -> list[Event]:
        """The KV-cache events recorded since the last call, oldest first
        ([] when the manager records none)."""
        return self.events.take() if self.events is not None else []

    # -- frames ------------------------------------------------------------------
    def begin_frame(self) -> None:
        """Open a frame: the ops until `commit_frame()` survive a crash of
        this process together or not at all (a restarted coordinator rolls
        a cut-off frame back).  Without one, every op is its own frame."""
        self.journal.begin(self.block_pool.next_cache_stamp)
        self._frame = True

    def commit_frame(self) -> None:
        """Close the frame opened by `begin_frame()`."""
        self._frame = False
        self.journal.commit()

    def _begin(self) -> None:
        self._words[SEQ_WORD] |= 1   # begin_mutation
        if not self._frame:
            self.journal.begin(self.block_pool.next_cache_stamp)

    def _end(self) -> None:
        self.block_pool.publish()
        if not self._frame:
            self.journal.commit()

