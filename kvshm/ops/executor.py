"""The op executor: protocol operations -> core calls, sans-IO.

`OpExecutor.execute(owner, msg)` runs one protocol message (an op or a
`Batch`) for `owner` (a `Owner`: the session id, its tenant's hasher, its
rights) on a `KVCacheManager` and returns the reply struct.  It keeps the
request upkeep a scheduler-facing service needs: each request's `Request`
object (tokens, hashes, computed count), its owner, and the hits of its last
lookup (for `AllocateSlots(use_computed_blocks=True)`).  The coordinator
(server.py) adds only sockets, sessions and framing around it; the embedded
replay, the benchmarks and the tests call it directly.  Sessions open, end
and resume through `executor.lifecycle` (lifecycle.py).

With `resumable=True` (the coordinator) sessions get records in the segment
(ops/sessions.py): `execute_frame` runs a frame as one journaled core
frame that also records its seq and reply, and after a restart
`lifecycle.adopt()` rebuilds what a resuming session takes back
(`lifecycle.resume`): its requests, held as placeholders until the client
restores them with `AddRequest`.
"""

from __future__ import annotations

import logging
from time import perf_counter_ns

import msgspec

from kvshm.core.errors import (
    DuplicateRequest,
    InvalidArgument,
    KvshmError,
    StaleHits,
    UnknownRequest,
)
from kvshm.core.metrics import (
    FIRST_BOUND_BITS,
    LAST_BUCKET,
    OP_BUCKETS,
    OP_NS,
    MetricsWriter,
    global_word,
    op_base,
)
from kvshm.core.request import Request
from kvshm.core.state import REPLIES_KEPT
from kvshm.ops import protocol as p
from kvshm.ops.errors import BatchTooLarge, Forbidden, InternalError, NotOwner
from kvshm.ops.lifecycle import SessionLifecycle
from kvshm.ops.owner import Owner, ReqState
from kvshm.ops.protocol import encode_frame
from kvshm.ops.sessions import SessionTable
from kvshm.ops.tenants import TenantBook, check_request_id, unscoped
from kvshm.pool.kv_cache_manager import KVCacheManager

log = logging.getLogger("kvshm.coordinator")

# Counts beyond this are certainly mistakes (and would only feed huge
# arithmetic); max_model_len bounds every real count far below it.
MAX_COUNT = 2**31 - 1
_encode_events = msgspec.msgpack.Encoder().encode
FREE_HEAD_MAX = 4096
DONE = p.Done()   # frozen: one instance serves every reply without a value

FRAMES_WORD = global_word("frames")
PREEMPTIONS_WORD = global_word("preemptions")
# The ops that name a request (its id is scoped to the tenant).
_REQ_OPS = frozenset((p.AddRequest, p.Advance, p.GetComputedBlocks, p.AllocateSlots, p.Admit,
                      p.CacheBlocks, p.Free, p.RemoveSkippedBlocks, p.GetBlockIds,
                      p.NumCommonPrefixBlocks, p.ReportCorrupt, p.EstimateCachedTokens))
_ALLOC_COUNTS = ("num_new_tokens", "num_new_computed_tokens", "num_lookahead_tokens",
                 "num_external_computed_tokens", "num_encoder_tokens", "reserved_blocks")


class OpExecutor:
    """Runs protocol ops on `mgr` for explicit owners.

    Args:
        mgr: the pool's manager (the executor does not close it).
        max_batch_ops: the most ops a `Batch` may hold.
        time_ops: count each op's latency into the segment's per-op
            histograms (core/metrics.py; two clock reads and two shared
            stores an op, about 0.3 us).  The coordinator always does; an
            in-process executor nobody watches may not, as vLLM's own
            manager runs with `log_stats` off (the conformance replay).
            Every other counter is kept either way.
    """

    def __init__(self, mgr: KVCacheManager, *, max_batch_ops: int = p.MAX_BATCH_OPS,
                 resumable: bool = False, quotas: dict[str, int] | None = None,
                 time_ops: bool = True) -> None:
        self.mgr = mgr
        self.time_ops = time_ops
        self._pool = mgr.block_pool
        self.metrics = MetricsWriter(mgr.segment.metrics)
        self._mwords = self.metrics.words
        self.tenants = TenantBook(mgr, self.metrics, quotas)
        self.config = mgr.config
        self.max_batch_ops = max_batch_ops
        self.requests: dict[str, ReqState] = {}
        self.owners: dict[int, Owner] = {}
        self.sessions = SessionTable(mgr.segment) if resumable else None
        self._base_hasher = mgr.make_hasher()
        self._hashers: dict[str, object] = {}
        self._dispatch = {
            p.AddRequest: self._add, p.Advance: self._advance,
            p.GetComputedBlocks: self._hits, p.AllocateSlots: self._alloc, p.Admit: self._admit,
            p.CacheBlocks: self._cache, p.Free: self._free,
            p.RemoveSkippedBlocks: self._skip, p.GetBlockIds: self._ids,
            p.NumCommonPrefixBlocks: self._common, p.ResetPrefixCache: self._reset,
            p.EvictBlocks: self._evict, p.GetStats: self._stats,
            p.TakeEvents: self._take_events, p.ReportCorrupt: self._corrupt,
            p.RestoreHits: self._restore_hits, p.NewStepStarts: self._step,
            p.EstimateCachedTokens: self._cached_tokens,
        }
        self._op_base = {cls: op_base(cls.__struct_config__.tag) for cls in self._dispatch}
        self.lifecycle = SessionLifecycle(self)

    @property
    def handlers(self) -> dict:
        """Message class -> its handler, `handler(owner, msg) -> reply`, which
        raises on errors; `execute` wraps it with the tenant's scope, op
        timing and error replies (scripts/profile_replay.py times the two
        apart)."""
        return self._dispatch

    def hasher_for(self, tenant: str):
        """The block hasher of `tenant`'s namespace (None: caching off)."""
        if self._base_hasher is None:
            return None
        h = self._hashers.get(tenant)
        if h is None:
            h = self._hashers[tenant] = self._base_hasher.for_namespace(tenant)
        return h

    # -- execution -----------------------------------------------------------------------
    def execute_frame(self, owner: Owner, msg) -> bytes:
        """Run frame `msg` for `owner` as one journaled frame that records
        its seq and reply; returns the encoded reply frame."""
        mgr = self.mgr
        seq = owner.seq + 1
        mgr.begin_frame()
        tenants = self.tenants
        start = tenants.begin(owner.tenant, owner.mbase)
        reply = self.execute(owner, msg)
        tenants.end(owner.mbase, start)
        self._mwords[FRAMES_WORD] += 1
        frame = encode_frame(reply)
        if owner.record is not None:
            self.sessions.record_frame(owner.record, seq, frame)
        mgr.commit_frame()
        owner.seq = seq
        return frame

    def kept_replies(self, owner: Owner, first: int) -> tuple[int, list[bytes]]:
        """The reply bodies of `owner`'s frames from `first` (at most the
        last REPLIES_KEPT) to its last applied one: (the seq of the first
        one given, the bodies; b"" for a reply no longer kept)."""
        if owner.record is None or not 0 < first <= owner.seq:
            return 0, []
        first = max(first, owner.seq - REPLIES_KEPT + 1)
        replies = []
        for seq in range(first, owner.seq + 1):
            frame = self.sessions.reply(owner.record, seq)
            replies.append(b"" if frame is None else frame[4:])
        return first, replies

    def execute(self, owner: Owner, msg):
        """The reply to one op or `Batch` run for `owner`; errors are `Error`
        replies (a batch stops at its first one, the ops before it stand)."""
        cls = msg.__class__
        handler = self._dispatch.get(cls)
        if handler is not None:   # one op: _run's loop, unrolled (the embedded hot path)
            self._pool.reader = owner.id
            if owner.scope and cls in _REQ_OPS:
                msg = msgspec.structs.replace(msg, req=owner.scope + msg.req)
            if not self.time_ops:
                try:
                    return handler(owner, msg)
                except Exception as e:  # noqa: BLE001 (as below)
                    return self._error(owner, msg, e)
            t = perf_counter_ns()
            try:
                reply = handler(owner, msg)
            except Exception as e:  # noqa: BLE001 (a bug is an INTERNAL reply, logged)
                return self._error(owner, msg, e)
            ns = perf_counter_ns() - t
            w = self._mwords
            base = self._op_base[cls]
            w[base + OP_NS] += ns
            b = ns.bit_length() - FIRST_BOUND_BITS
            w[base + OP_BUCKETS + (0 if b < 0 else b if b < LAST_BUCKET else LAST_BUCKET)] += 1
            return reply
        if cls is p.Batch:
            ops = msg.ops
            if len(ops) > self.max_batch_ops:
                self.metrics.error(None, BatchTooLarge.code)
                return p.Error(BatchTooLarge.code, f"a batch holds at most "
                               f"{self.max_batch_ops} ops (got {len(ops)})")
            results: list = []
            err = self._run(owner, ops, results)
            if err is not None:
                results.append(err)
            return p.BatchReply(results)
        self.metrics.error(None, InvalidArgument.code)
        return p.Error(InvalidArgument.code, f"{type(msg).__name__} is not an operation")

    def _run(self, owner: Owner, ops, results: list) -> p.Error | None:
        """Run `ops` in order, each reply appended to `results`; at the first
        failure, its Error reply (the ops after it do not run).  Each op is
        timed into its latency histogram (core/metrics.py's layout, with
        `latency_bucket` inline and one clock read an op: this is the hot
        path), and a tenant's request ids get its scope.  `execute` runs a
        single op the same way, inline."""
        dispatch, bases, w, scope = self._dispatch, self._op_base, self._mwords, owner.scope
        self._pool.reader = owner.id   # lookups see its pending blocks, caching marks them
        op = None
        if not self.time_ops:
            try:
                for op in ops:
                    if scope and op.__class__ in _REQ_OPS:
                        op = msgspec.structs.replace(op, req=scope + op.req)
                    results.append(dispatch[op.__class__](owner, op))
            except Exception as e:  # noqa: BLE001 (as below)
                return self._error(owner, op, e)
            return None
        try:
            t = perf_counter_ns()
            for op in ops:
                cls = op.__class__
                if scope and cls in _REQ_OPS:
                    op = msgspec.structs.replace(op, req=scope + op.req)
                results.append(dispatch[cls](owner, op))
                now = perf_counter_ns()
                ns, t = now - t, now
                base = bases[cls]
                w[base + OP_NS] += ns
                b = ns.bit_length() - FIRST_BOUND_BITS
                w[base + OP_BUCKETS + (0 if b < 0 else b if b < LAST_BUCKET else LAST_BUCKET)] += 1
        except Exception as e:  # noqa: BLE001 (a bug is an INTERNAL reply, logged)
            return self._error(owner, op, e)
        return None

    def _error(self, owner: Owner, op, e: Exception) -> p.Error:
        reply = error_reply(op, e)
        self.metrics.error(self._op_base.get(op.__class__), reply.code)
        scope = owner.scope
        if scope:   # what the client sent, not the scoped id
            reply = p.Error(reply.code, unscoped(scope, reply.message),
                            {k: unscoped(scope, v) if v.__class__ is str else v
                             for k, v in reply.fields.items()})
        return reply

    def _owned(self, owner: Owner, rid: str) -> ReqState:
        """The state of request `rid` if `owner` may act on it; raises
        UnknownRequest / NotOwner / InvalidArgument otherwise (the hot
        handlers test the good case inline and call this for the reason)."""
        st = self.requests.get(rid)
        if st is None:
            raise UnknownRequest(rid)
        if st.owner is not owner:
            if st.owner.tenant != owner.tenant:   # another tenant's: not to be known
                raise UnknownRequest(rid)
            raise NotOwner(f"request {rid!r} belongs to another session")
        if st.request is None:
            raise InvalidArgument(f"request {rid!r} was taken over from the previous "
                                  "coordinator: restore it with add_request (its tokens) "
                                  "first")
        return st

    def _claim(self, st: ReqState, rid: str) -> None:
        """Record the request's owner in its table slot, once it has one
        (until a free releases the slot)."""
        if not st.claimed:
            table = self.mgr.table
            table.set_owner(rid, st.owner.id)
            st.claimed = rid in table.slot_of

    # -- operations ----------------------------------------------------------------------
    def _add(self, owner: Owner, op: p.AddRequest):
        rid = op.req
        check_request_id(rid[len(owner.scope):])
        held = self.requests.get(rid)
        if held is not None and not (held.request is None and held.owner is owner):
            raise DuplicateRequest(rid)
        req = self._new_request(owner, op)
        if held is not None:   # restoring a request taken over after a restart
            self._check_restore(req)
            held.request = req
            return DONE
        if self.mgr.events is not None:
            self.mgr.events.lora_id(req.lora_name)   # adapter ids in order of first use
        self.requests[rid] = ReqState(req, owner)
        owner.requests.add(rid)
        return DONE

    def _new_request(self, owner: Owner, op: p.AddRequest) -> Request:
        rid = op.req
        max_len = self.config.max_model_len
        if op.block_hashes is not None:
            if op.prompt is not None or op.prompt_embeds is not None or op.mm_features:
                raise InvalidArgument(
                    "add_request takes block_hashes or a prompt (token ids, embeds and "
                    "multimodal items), not both: the hashes already cover them")
            check_count("num_tokens", op.num_tokens, max_len)
            return Request.from_block_hashes(
                rid, op.block_hashes, op.num_tokens, owner.hasher, lora_name=op.lora_name,
                cache_salt=op.cache_salt, skip_reading_prefix_cache=op.skip_reading_prefix_cache)
        prompt = op.prompt
        if prompt is None:
            if op.prompt_embeds is None:
                raise InvalidArgument("add_request needs either prompt or block_hashes")
            check_count("num_tokens", op.num_tokens, max_len)
            prompt = [0] * op.num_tokens     # vLLM's placeholder ids for embeds
        if len(prompt) > max_len:
            raise InvalidArgument(f"prompt of {len(prompt)} tokens exceeds "
                                  f"max_model_len {max_len}")
        n = op.num_prompt_tokens or len(prompt)
        if not 0 <= n <= len(prompt):
            raise InvalidArgument(f"num_prompt_tokens must be in 0..{len(prompt)} "
                                  f"(got {op.num_prompt_tokens}; 0: the whole prompt)")
        req = Request(rid, prompt[:n] if n < len(prompt) else prompt, owner.hasher,
                      lora_name=op.lora_name, lora_path=op.lora_path, cache_salt=op.cache_salt,
                      mm_features=op.mm_features, prompt_embeds=op.prompt_embeds,
                      skip_reading_prefix_cache=op.skip_reading_prefix_cache)
        if n < len(prompt):
            req.append_token_ids(prompt[n:])
        return req

    def _check_restore(self, req: Request) -> None:
        """The restored request's hashes must be those of the cached blocks
        it holds (else its tokens are not the ones it had)."""
        mgr = self.mgr
        pool = mgr.block_pool
        group_of = mgr.segment.hash_group
        rid = req.request_id
        for g, m in enumerate(mgr.groups.managers):
            blocks = m.req_to_blocks.get(rid) or ()
            keys = m.group_hashes(req.block_hashes)
            for i in range(min(m.num_cached_block.get(rid, 0), len(blocks))):
                b = blocks[i]
                h = pool.block_hash(b) if b else None
                if h is not None and group_of[b] == g and (i >= len(keys) or h != keys[i]):
                    raise InvalidArgument(
                        f"restoring {rid!r}: its block {i} of group {g} is cached for other "
                        "tokens than the ones sent (restore a request with the tokens it had)")

    def _advance(self, owner: Owner, op: p.Advance):
        st = self.requests.get(op.req)
        if st is None or st.owner is not owner or st.request is None:
            st = self._owned(owner, op.req)   # raises, saying why
        req = st.request
        n = op.num_computed_tokens
        # It may run ahead of the tokens (speculative drafts are computed
        # before they are accepted): only its sign and size are checked.
        if not 0 <= n <= MAX_COUNT:
            check_count("num_computed_tokens", n, MAX_COUNT)
        if op.append_hashes or op.num_appended:
            check_count("num_appended", req.num_tokens + op.num_appended, MAX_COUNT)
            req.append_block_hashes(op.append_hashes, op.num_appended)
        elif op.append:
            req.append_token_ids(op.append)
        req.num_computed_tokens = n
        if self._pool.pending:   # its K/V up to n are written: its pending blocks are ready
            self.mgr.mark_computed(req)
        return DONE

    def _hits(self, owner: Owner, op: p.GetComputedBlocks):
        st = self.requests.get(op.req)
        if st is None or st.owner is not owner or st.request is None:
            st = self._owned(owner, op.req)   # raises, saying why
        if op.hold_at:
            check_count("hold_at", op.hold_at, MAX_COUNT)
        mgr = self.mgr
        blocks, n = mgr.get_computed_blocks(st.request, op.hold_at)
        st.hits = blocks
        return p.ComputedBlocks(blocks, n, mgr.num_in_flight_tokens, mgr.shared_prefix_boundary)

    def _alloc(self, owner: Owner, op: p.AllocateSlots):
        st = self.requests.get(op.req)
        if st is None or st.owner is not owner or st.request is None:
            st = self._owned(owner, op.req)   # raises, saying why
        if op.use_computed_blocks and st.hits is None and op.num_new_computed_tokens:
            raise StaleHits(f"request {op.req!r} has no prefix-cache lookup to use (call "
                            "get_computed_blocks first; a lookup made before a coordinator "
                            "restart is kept only if the pool finds the same blocks again)")
        if (op.num_new_tokens | op.num_new_computed_tokens | op.num_lookahead_tokens
                | op.num_external_computed_tokens | op.num_encoder_tokens
                | op.reserved_blocks) > MAX_COUNT:
            for name in _ALLOC_COUNTS:
                check_count(name, max(getattr(op, name), 0), MAX_COUNT)
        mgr = self.mgr
        res = mgr.allocate_slots(
            st.request, op.num_new_tokens, op.num_new_computed_tokens,
            st.hits if op.use_computed_blocks else None, op.num_lookahead_tokens,
            op.num_external_computed_tokens, op.delay_cache_blocks, op.num_encoder_tokens,
            op.full_sequence_must_fit, op.waiting, op.has_scheduled_reqs, op.reserved_blocks)
        if res is None and mgr.refused_by_floor:
            self.tenants.refused(owner.slot)
        if not st.claimed:
            self._claim(st, op.req)
        # res is a tuple of fresh lists: msgspec encodes it as is.
        return p.Allocated(res, mgr.block_pool.num_free_blocks)

    def _admit(self, owner: Owner, op: p.Admit):
        st = self._owned(owner, op.req)
        if not 1 <= op.max_new_tokens <= MAX_COUNT:
            raise InvalidArgument(f"max_new_tokens must be in [1, {MAX_COUNT}] "
                                  f"(got {op.max_new_tokens})")
        check_count("num_lookahead_tokens", op.num_lookahead_tokens, MAX_COUNT)
        check_count("wait_in_flight", op.wait_in_flight, MAX_COUNT)
        mgr = self.mgr
        req = st.request
        if req.num_computed_tokens:
            raise InvalidArgument(f"request {op.req!r} already has "
                                  f"{req.num_computed_tokens} computed tokens; Admit is "
                                  "for a waiting request (free it with preempted=true first)")
        # (a lookup that holds the request back is not counted: hold_at)
        hits, num_hit = mgr.get_computed_blocks(req, op.wait_in_flight)
        in_flight = mgr.num_in_flight_tokens
        n = min(op.max_new_tokens, req.num_tokens - num_hit)
        if 0 < op.wait_in_flight <= in_flight:    # it waits for them: nothing allocated
            return p.Admitted(hits, num_hit, n, None, mgr.block_pool.num_free_blocks, in_flight)
        new = mgr.allocate_slots(req, n, num_hit, hits, op.num_lookahead_tokens, 0,
                                 op.delay_cache_blocks)
        if new is None and mgr.refused_by_floor:
            self.tenants.refused(owner.slot)
        self._claim(st, op.req)
        return p.Admitted(hits, num_hit, n, new, mgr.block_pool.num_free_blocks, in_flight)

    def _cache(self, owner: Owner, op: p.CacheBlocks):
        st = self.requests.get(op.req)
        if st is None or st.owner is not owner or st.request is None:
            st = self._owned(owner, op.req)   # raises, saying why
        self.mgr.cache_blocks(st.request, op.num_computed_tokens)
        self._claim(st, op.req)
        return DONE

    def _free(self, owner: Owner, op: p.Free):
        st = self.requests.get(op.req)
        if st is None or st.owner is not owner:   # (a placeholder may be freed as it is)
            st = self._owned(owner, op.req)       # raises, saying why
        mgr = self.mgr
        mgr.free(op.req)
        st.claimed = False   # the slot is released
        if op.preempted and st.request is not None:
            st.request.num_preemptions += 1
            self.metrics.words[PREEMPTIONS_WORD] += 1
            self.metrics.tenant_add(owner.slot, "preemptions", 1)
        else:  # finished or aborted (or a placeholder): the request is gone
            del self.requests[op.req]
            owner.requests.discard(op.req)
        return p.FreeBlocks(mgr.block_pool.num_free_blocks)

    def _skip(self, owner: Owner, op: p.RemoveSkippedBlocks):
        st = self._owned(owner, op.req)
        check_count("total_computed_tokens", op.total_computed_tokens, MAX_COUNT)
        mgr = self.mgr
        mgr.remove_skipped_blocks(op.req, op.total_computed_tokens)
        self._claim(st, op.req)
        return p.FreeBlocks(mgr.block_pool.num_free_blocks)

    def _ids(self, owner: Owner, op: p.GetBlockIds):
        self._owned(owner, op.req)
        return p.BlockIds(list(self.mgr.get_block_ids(op.req)))

    def _common(self, owner: Owner, op: p.NumCommonPrefixBlocks):
        st = self._owned(owner, op.req)
        counts = self.mgr.get_num_common_prefix_blocks(op.req)
        self._claim(st, op.req)
        return p.CommonPrefix(counts)

    def _step(self, owner: Owner, op: p.NewStepStarts):
        self.mgr.new_step_starts()
        return DONE

    def _cached_tokens(self, owner: Owner, op: p.EstimateCachedTokens):
        self._owned(owner, op.req)
        return p.CachedTokens(self.mgr.estimate_cached_tokens(op.req))

    def _corrupt(self, owner: Owner, op: p.ReportCorrupt):
        self._owned(owner, op.req)
        held = {b for group in self.mgr.get_block_ids(op.req) for b in group if b}
        for b in op.block_ids:
            if b.__class__ is not int or b not in held:   # (tenants share no blocks)
                raise InvalidArgument(f"block {b!r} is not one of the blocks of request "
                                      f"{op.req!r}: report only the blocks a request read")
        uncached = self.mgr.report_corrupt(op.block_ids)
        m = self.metrics
        m.add("corrupt_reported", len(set(op.block_ids)))
        m.add("corrupt_evicted", len(uncached))
        log.warning("session %d (tenant %r) reported %d block(s) of request %r with wrong "
                    "K/V: %s; uncached %d block(s) with the blocks computed from them",
                    owner.id, owner.tenant, len(set(op.block_ids)), unscoped(owner.scope, op.req),
                    sorted(set(op.block_ids))[:16], len(uncached))
        return p.Uncached(uncached)

    def _restore_hits(self, owner: Owner, op: p.RestoreHits):
        st = self._owned(owner, op.req)
        st.hits = self.mgr.find_hits_again(st.request, op.block_ids)
        return p.HitsRestored(st.hits is not None)

    def _reset(self, owner: Owner, op: p.ResetPrefixCache):
        _need_admin(owner, "reset_prefix_cache")
        return p.ResetResult(self.mgr.reset_prefix_cache())

    def _evict(self, owner: Owner, op: p.EvictBlocks):
        _need_admin(owner, "evict_blocks")
        self.mgr.evict_blocks(op.block_ids)
        return p.FreeBlocks(self.mgr.block_pool.num_free_blocks)

    def _stats(self, owner: Owner, op: p.GetStats):
        pool = self.mgr.block_pool
        q, h, qt, ht = pool.stats
        head = []
        if op.free_head:
            _need_admin(owner, "the free queue (GetStats.free_head)")
            head = pool.free_queue(min(max(op.free_head, 0), FREE_HEAD_MAX))
        return p.Stats(self.config.num_blocks, pool.num_free_blocks, pool.num_cached_blocks,
                       pool.get_usage(), len(self.mgr.table), len(self.owners),
                       q, h, qt, ht, head)

    # -- KV-cache events ------------------------------------------------------------------
    def _take_events(self, owner: Owner, op: p.TakeEvents):
        if owner.events is None:         # from now on its frames' events are kept
            owner.events = []
            if self.mgr.events is None:  # nobody recorded them yet
                self.mgr.enable_events()
                self.mgr.take_events()   # (an adopted pool's restatement is not its own)
        out, owner.events = owner.events, []
        dropped, owner.events_dropped = owner.events_dropped, 0
        return p.Events(_encode_events(out) if out else b"", dropped)

    def route_events(self, owner: Owner | None) -> list:
        """The KV-cache events recorded since the last call, which the frame
        `owner` just ran caused: kept for `owner` if it takes its own, and
        returned (for the pool's publisher)."""
        events = self.mgr.take_events()
        if events and owner is not None and owner.events is not None:
            owner.add_events(events)
        return events


def _need_admin(owner: Owner, what: str) -> None:
    if not owner.admin:
        raise Forbidden(f"{what} acts on every tenant's blocks: it needs an admin session "
                        "(connect with the coordinator's admin token)")


def error_reply(op, e: Exception) -> p.Error:
    """The `Error` reply for exception `e` raised by `op`."""
    if isinstance(e, KvshmError):
        return p.Error(e.code, str(e), e.wire_fields())
    # A bug: report it, keep serving the others.
    log.exception("internal error on %r", op)
    return p.Error(InternalError.code, f"{type(e).__name__}: {e}")


def check_count(name: str, value: int, limit: int) -> None:
    """Raise InvalidArgument unless 0 <= value <= limit."""
    if not 0 <= value <= limit:
        raise InvalidArgument(f"{name} must be in [0, {limit}] (got {value})")
