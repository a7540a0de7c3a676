"""The block pool: ref counts, the LRU free queue and the prefix-cache map.

State lives in the pool segment's flat arrays; the only Python-side index is
the per-group map from block hash to cached block id(s), which `rebuild()`
recreates from the segment.

Semantics (vLLM v1): block 0 is the null block, never allocated, freed or
cached.  The free queue is an LRU doubly linked list: allocation pops from the
head, a block whose ref count drops to 0 is appended at the tail, and a
prefix-cache hit on a free block takes it out of the middle.  Pools of vLLM
0.32's semantics (`Semantics.lifo_unhashed_free`) put a freed block that is
not cached at the head instead, to be reused first.  Each block's free
stamp orders the queue (the head's is the smallest): appended blocks take
stamps counting up, prepended ones stamps counting down below the head's.
Blocks in the free queue keep their hash until they are reused (evicted on
allocation).
The map does not deduplicate: several blocks may be cached under one hash,
and lookups return the earliest cached one.

Readiness (`track_ready`, the coordinator's pools): a block cached before
its K/V are written is *pending* (FLAG_PENDING, the segment's `writer` names
the request slot that writes it, and `pending` maps it to its writer's
session).  Lookups by the writer's session see it, as vLLM's own
manager would (the same batch computes it); other sessions' lookups stop at
it and count it as in flight.  `mark_ready` clears the mark; a pending
block whose writer lets go of it is uncached (`drop_pending`), never
served.  The marks need no undo entries: a ready mark states a fact about
the arena that outlives any frame, and an uncached block only costs a hit.

Partial entries (vLLM 0.32, `PoolConfig.partial_entry_groups`): a
full-attention block spanning several hash blocks may also be cached under
the key of a prefix that ends inside it, the request's prompt boundary
(`cache_partial`, FLAG_PARTIAL, the segment's `partial_hashes` and
`partial_tokens`).  A block has at most one: only the request that
allocated a block takes one for it (a hit is a full block below the
boundary of the request that hits it).  No lookup asks for a partial key
(lookups ask for each block's last hash, a partial key is a hash inside a
block), so a partial entry is seen only by KV events (stored when it is
made, removed when its block is evicted, after the full entry's removal)
and by the free order (a block with one counts as hashed).  A block whose
only entry is partial and that becomes full drops it before it is cached
(vLLM's promotion: a removed event first).  It counts as neither cached
(`num_cached_blocks`) nor evicted; a partial-only block carries the cache
stamp of its entry, so repair drops it with the frame that made it, and a
full block's partial entry is made in the call that caches the block.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from kvshm.core.errors import InvalidArgument, NoFreeBlocks
from kvshm.core.events import EventLog
from kvshm.core.hashing import HASH_SLOT_BYTES, digest_size
from kvshm.core.hash_map import BlockHashMap
from kvshm.core.state import (ALLOCATED_WORD, EVICTED_WORD, FLAG_CACHED, FLAG_NULL,
    FLAG_PARTIAL, FLAG_PENDING, FLAG_SINK, FREE_WORD as _FREE, SEQ_WORD as _SEQ, STATS_WORD,
    SegmentState)

NULL_BLOCK = 0
_H = HASH_SLOT_BYTES
# A block with a prefix-cache entry of either kind (what the free order asks).
HASHED = FLAG_CACHED | FLAG_PARTIAL


def hashed_tokens(flags, partial_tokens, block: int, end: int) -> int:
    """The prefix length `block`'s entry stands for, the block ending at token
    `end` of a request that holds it: `end` for a full entry, the partial
    entry's length for a block with only that, else 0 (vLLM 0.32's
    `block_hash_num_tokens`).  `flags`, `partial_tokens`: the segment's."""
    f = flags[block]
    if f & FLAG_CACHED:
        return end
    return partial_tokens[block] if f & FLAG_PARTIAL else 0


class BlockPool:
    """Allocation, freeing and caching of block ids over a `SegmentState`.

    Args:
        segment: a freshly created segment (`attach=False`), or one that holds
            state to adopt (`attach=True`: the hash maps are rebuilt).

    Read-only state for the managers and the checker (hot loops bind it once
    per call and index it directly):
        ref_cnt: the segment's int32 ref count per block id (0 for a free
            block; the null block's is not maintained).
        digest_size: bytes of a block hash under the pool's hash algorithm.
        hash_to_block(group_id): one group's prefix-cache index.
    """

    def __init__(self, segment: SegmentState, *, attach: bool = False) -> None:
        cfg = segment.config
        self.segment = segment
        self.num_blocks = cfg.num_blocks
        self.enable_caching = cfg.enable_caching
        self.hash_block_size = cfg.hash_block_size
        self._sentinel = cfg.num_blocks
        self.ref_cnt = segment.ref_cnt
        self._next = segment.next_delta
        self._prev = segment.prev_delta
        self._free_stamp = segment.free_stamp
        self._cache_stamp = segment.cache_stamp
        self._group = segment.hash_group
        self._flags = segment.flags
        self._writer = segment.writer
        self._parent = segment.parent
        self._hashes = segment.hashes
        self._partial_hashes = segment.partial_hashes
        self._partial_tokens = segment.partial_tokens
        self._words = segment.words
        self._journal = segment.journal
        self.digest_size = digest_size(cfg.hash_algorithm)
        self.num_cached_blocks = 0
        # group id -> its prefix-cache index (hash -> earliest cached block)
        self._maps: list[BlockHashMap] = [BlockHashMap() for _ in cfg.groups]
        # Prefix-cache statistics: lookups, lookups with a hit, tokens asked
        # for, tokens hit.
        self.stats = [0, 0, 0, 0]
        # KV-cache events (core/events.py) when the pool publishes them: the
        # managers record what they cache, the pool what it evicts or resets.
        self.events: EventLog | None = None
        # Readiness (see the module doc): whether blocks cached ahead of
        # their K/V are marked pending, the session whose frame runs now
        # (it writes what it caches and sees its own pending blocks), and
        # pending block -> writer session.
        self.track_ready = False
        self.reader = 0
        self.pending: dict[int, int] = {}
        self.num_dropped_pending = 0
        # Where freed blocks go (module doc): all to the tail, or those
        # without a hash to the head.
        self._lifo_unhashed = cfg.semantics.lifo_unhashed_free
        # How often a cached block lost its hash in this process (evicted,
        # dropped pending, or reset): while it stays the same, every hit a
        # lookup found is still cached under the hash it was found by.
        self.uncached = 0
        if attach:
            # The adopting process is the only writer: read fields directly
            # (a dead writer may have left the mutation counter odd).
            self.num_free_blocks = segment.get("num_free_blocks")
            self.stats = [segment.get(f) for f in ("queries", "hits", "query_tokens",
                                                    "hit_tokens")]
            self._next_free_stamp = max(self._free_stamp, default=0) + 1
            self._front_free_stamp = min(min(self._free_stamp, default=0), 0)
            self._next_cache_stamp = max(self._cache_stamp, default=0) + 1
            self.rebuild()
        else:
            self._next_free_stamp = 1
            self._front_free_stamp = 0     # never-used blocks: stamp 0, in id order
            self._next_cache_stamp = 1
            # Block 0 becomes the null block, then each sink group takes its
            # blocks from the head of the queue, in group order.
            self.num_free_blocks = cfg.num_blocks
            self._flags[NULL_BLOCK] = FLAG_NULL
            self._popleft_n(1)
            for b in self._popleft_n(cfg.num_sink_blocks):
                self._flags[b] = FLAG_SINK
            self.publish()

    def hash_to_block(self, group_id: int) -> BlockHashMap:
        """The prefix-cache index of group `group_id` itself (not a copy, and
        the same map for the pool's lifetime, so it may be bound once):
        hash -> the earliest cached block id (kvshm.core.hash_map).  For
        lookups; change it only through this class."""
        return self._maps[group_id]

    @property
    def next_cache_stamp(self) -> int:
        """The cache stamp the next cached block gets."""
        return self._next_cache_stamp

    def publish(self) -> None:
        """Write the free count to the segment header and close the mutation
        (the counterpart of `SegmentState.begin_mutation`)."""
        w = self._words
        w[_FREE] = self.num_free_blocks
        w[_SEQ] = (w[_SEQ] | 1) + 1

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one prefix-cache lookup (published to the header at once)."""
        st = self.stats
        self._journal.stats(st)
        st[0] += 1
        st[2] += num_tokens
        if num_hit_tokens:
            st[1] += 1
            st[3] += num_hit_tokens
        self._words[STATS_WORD:STATS_WORD + 4] = array("Q", st)

    # -- free queue (private) -------------------------------------------------
    def _popleft_n(self, n: int) -> list[int]:
        if n == 0:
            return []
        nxt = self._next
        s = self._sentinel
        out = []
        b = s + nxt[s]
        for _ in range(n):
            out.append(b)
            b += nxt[b]
        nxt[s] = b - s
        self._prev[b] = s - b
        self.num_free_blocks -= n
        return out

    def _remove(self, b: int) -> None:
        nxt, prv = self._next, self._prev
        p = b + prv[b]
        q = b + nxt[b]
        nxt[p] = q - p
        prv[q] = p - q
        self.num_free_blocks -= 1

    def _append_n(self, blocks: list[int]) -> None:
        s = self._sentinel
        t = self._next_free_stamp
        self._next_free_stamp = t + len(blocks)
        self._link(s + self._prev[s], s, blocks, t)

    def _prepend_n(self, blocks: list[int]) -> None:
        # blocks[0] becomes the head: the next block allocated.
        s = self._sentinel
        t = self._front_free_stamp = self._front_free_stamp - len(blocks)
        self._link(s, s + self._next[s], blocks, t)

    def _link(self, after: int, before: int, blocks: list[int], t: int) -> None:
        """Put `blocks` into the free queue between nodes `after` and
        `before` (neighbours; the sentinel is both ends), with free stamps
        from `t` on."""
        nxt, prv, stamp = self._next, self._prev, self._free_stamp
        last = after
        for b in blocks:
            prv[b] = last - b
            nxt[last] = b - last
            stamp[b] = t
            t += 1
            last = b
        nxt[last] = before - last
        prv[before] = last - before
        self.num_free_blocks += len(blocks)

    def free_queue(self, limit: int | None = None) -> list[int]:
        """Block ids of the free queue in eviction order (next to go first)."""
        nxt = self._next
        s = self._sentinel
        n = self.num_free_blocks if limit is None else min(limit, self.num_free_blocks)
        out = []
        append = out.append
        b = s + nxt[s]
        for _ in range(n):
            append(b)
            b += nxt[b]
        return out

    # -- allocation --------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Pop `num_blocks` blocks from the head of the free queue, evicting
        their cached hashes, with ref count 1.  Raises NoFreeBlocks."""
        if num_blocks <= 0:
            return []
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocks(num_blocks, self.num_free_blocks)
        out = self._popleft_n(num_blocks)
        self._words[ALLOCATED_WORD] += num_blocks
        ref, flags = self.ref_cnt, self._flags
        for b in out:
            if flags[b]:
                self._evict(b)
            ref[b] = 1
        return out

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on prefix-cache hits; a hit that sat in the free
        queue leaves it."""
        ref = self.ref_cnt
        for b in blocks:
            if b:
                r = ref[b]
                if r == 0:
                    self._remove(b)
                ref[b] = r + 1

    def free_blocks(self, ordered_blocks: Iterable[int]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the tail of
        the free queue in the given order (the first one is evicted first),
        or, with `lifo_unhashed_free`, those not cached (all with caching
        off) the head, the first of them becoming the head."""
        ref = self.ref_cnt
        freed = []
        for b in ordered_blocks:
            if b:
                r = ref[b] - 1
                assert r >= 0, f"block {b} freed more often than referenced"
                ref[b] = r
                if r == 0:
                    freed.append(b)
        if freed:
            if self.pending:
                for b in freed:
                    self.drop_pending(b)
            if not self._lifo_unhashed:
                self._append_n(freed)
                return
            if self.enable_caching:
                flags = self._flags
                front = [b for b in freed if not flags[b] & HASHED]
                if front:
                    self._prepend_n(front)
                    freed = [b for b in freed if flags[b] & HASHED]
                if freed:
                    self._append_n(freed)
            else:
                self._prepend_n(freed)

    # -- prefix cache ------------------------------------------------------
    def get_cached_block(self, block_hash: bytes, group_ids: Sequence[int]) -> list[int] | None:
        """The cached block for `block_hash` in every group of `group_ids`, or
        None if any group misses."""
        out = []
        maps = self._maps
        pending = self.pending
        for g in group_ids:
            m = maps[g]
            hit = m.get(block_hash)
            if hit is None:
                return None
            if pending:
                hit = self.visible(m, block_hash, hit)
                if hit is None:
                    return None
            out.append(hit)
        return out

    def visible(self, m: BlockHashMap, block_hash: bytes, first: int) -> int | None:
        """The block a lookup by the current `reader` takes from under
        `block_hash` in `m` (`first` is `m[block_hash]`): the earliest cached
        one that is ready or pending by the reader itself, or None."""
        pending, me = self.pending, self.reader
        w = pending.get(first)
        if w is None or w == me:
            return first
        shared = m.shared(block_hash)
        if shared is not None:
            for b in shared:
                w = pending.get(b)
                if w is None or w == me:
                    return b
        return None

    def in_flight(self, m: BlockHashMap, block_hash: bytes, first: int) -> bool:
        """Whether a block under `block_hash` in `m` (`first` is
        `m[block_hash]`) is one another session is writing."""
        pending, me = self.pending, self.reader
        shared = m.shared(block_hash)
        if shared is None:
            w = pending.get(first)
            return w is not None and w != me
        return any(pending.get(b, me) != me for b in shared)

    def cache_block(self, block: int, block_hash: bytes, group_id: int,
                    writer: int = -1, parent: int = 0) -> None:
        """Record `block` (full, uncached, not null) under (hash, group);
        `writer` >= 0: its K/V are not written yet, and the request in that
        request-table slot (of the current reader's session) writes them.
        `parent`: the block before it in the caching request's chain (0:
        none), which `corrupt` follows to the blocks computed from it.  A
        block whose only entry is partial drops it first (module doc)."""
        if self._flags[block] & FLAG_PARTIAL:
            self._evict(block)
        self._maps[group_id].add(block_hash, block)
        self._parent[block] = parent
        off = block * _H
        self._hashes[off:off + len(block_hash)] = block_hash
        self._group[block] = group_id
        # The flag last: a block a crash leaves flagged carries this stamp
        # and writer, so repair knows it for the cut-off frame's and uncaches
        # it (core/recovery.py); set first, it kept an older stamp (or none)
        # and stayed cached with K/V nobody wrote.
        self._cache_stamp[block] = self._next_cache_stamp
        self._next_cache_stamp += 1
        if writer >= 0:
            self._writer[block] = writer
            self._flags[block] = FLAG_CACHED | FLAG_PENDING
            self.pending[block] = self.reader
        else:
            self._flags[block] = FLAG_CACHED
        self.num_cached_blocks += 1

    def mark_ready(self, block: int) -> None:
        """Block `block`'s K/V are in the arena: every lookup may hit it."""
        if self.pending.pop(block, None) is not None:
            self._flags[block] &= ~FLAG_PENDING

    def drop_pending(self, block: int) -> None:
        """Uncache `block` if it is still pending (its writer let go of it
        before its K/V were written)."""
        if self._flags[block] & FLAG_PENDING:
            self._evict(block)
            self.num_dropped_pending += 1

    def block_hash(self, block: int) -> bytes | None:
        """The hash `block` is cached under, or None."""
        if not self._flags[block] & FLAG_CACHED:
            return None
        off = block * _H
        return bytes(self._hashes[off:off + self.digest_size])

    def _evict(self, b: int) -> None:
        """Drop block `b`'s prefix-cache entries, the full one first."""
        f = self._flags[b]
        if not f & HASHED:
            return
        g = self._group[b]
        m = self._maps[g]
        events = self.events
        if f & FLAG_CACHED:
            off = b * _H
            key = bytes(self._hashes[off:off + self.digest_size])
            m.remove(key, b)
            if f & FLAG_PENDING:
                self.pending.pop(b, None)
            self.num_cached_blocks -= 1
            self.uncached += 1
            self._words[EVICTED_WORD] += 1
            if events is not None:
                events.removed(key, g)
        if f & FLAG_PARTIAL:
            self._drop_partial(b)
        self._flags[b] = 0

    def _drop_partial(self, b: int) -> None:
        """Drop block `b`'s partial entry from the index (the caller clears
        its flag)."""
        off = b * _H
        key = bytes(self._partial_hashes[off:off + self.digest_size])
        g = self._group[b]
        self._maps[g].remove(key, b)
        if self.events is not None:
            self.events.removed(key, g)

    def cache_partial(self, block: int, block_hash: bytes, group_id: int,
                      num_tokens: int) -> bool:
        """Give `block` (of group `group_id`, not null) the partial entry
        `block_hash`, the key of the request's first `num_tokens` tokens, a
        prefix ending inside the block (module doc).  Returns whether the
        entry is new (the caller records its KV event); one the block has
        already is kept as it is.  A block never takes a second one (module
        doc); were it given one, it would replace the first (its removed
        event first, as vLLM when the first is the block's only entry)."""
        flags = self._flags
        f = flags[block]
        off = block * _H
        slot = self._partial_hashes
        if f & FLAG_PARTIAL:
            if slot[off:off + len(block_hash)] == block_hash:
                return False
            self._drop_partial(block)
            f &= ~FLAG_PARTIAL
            flags[block] = f
        slot[off:off + len(block_hash)] = block_hash
        self._partial_tokens[block] = num_tokens
        self._maps[group_id].add(block_hash, block)
        if f & FLAG_CACHED:
            flags[block] = f | FLAG_PARTIAL
            return True
        # The only entry: it takes a cache stamp (repair drops it with its
        # frame) and the group; the flag last, as in cache_block.
        self._group[block] = group_id
        self._parent[block] = 0
        self._cache_stamp[block] = self._next_cache_stamp
        self._next_cache_stamp += 1
        flags[block] = FLAG_PARTIAL
        return True

    def hashed_tokens(self, block: int, end: int) -> int:
        """`hashed_tokens` (module level) of this pool."""
        return hashed_tokens(self._flags, self._partial_tokens, block, end)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Remove each listed block from the prefix cache if it is cached; the
        blocks stay where they are.  Raises InvalidArgument (and changes
        nothing) if an id is out of range."""
        ids = list(block_ids)
        n = self.num_blocks
        for b in ids:
            if b.__class__ is not int or not 0 <= b < n:
                raise InvalidArgument(f"block id {b!r} is not in [0, {n})")
        # vLLM takes the ids as a set and visits them in its order: the
        # order of the BlockRemoved events.
        for b in set(ids):
            self._evict(b)

    def corrupt(self, block_ids: Iterable[int]) -> list[int]:
        """Uncache blocks whose K/V were found wrong, and every cached block
        whose chain runs through one of them (computed with the bad K/V in
        its context, or reachable only through it): the ids uncached, the
        reported ones first.  Ids must be in [1, num_blocks) (InvalidArgument,
        nothing changed); one that is not cached is skipped.

        A block's chain is its `parent` links (cache_block); a link counts
        while the child was cached after its parent (a parent block reused
        since is another block).  The walk scans the pool once: about 0.3 s
        at a million blocks, for a fault that should never happen."""
        ids = list(block_ids)
        n = self.num_blocks
        for b in ids:
            if b.__class__ is not int or not 0 < b < n:
                raise InvalidArgument(f"block id {b!r} is not in [1, {n})")
        flags, parent, stamp = self._flags, self._parent, self._cache_stamp
        children: dict[int, list[int]] = {}
        for b, p in enumerate(parent):
            if p and flags[b] & FLAG_CACHED and stamp[b] > stamp[p]:
                children.setdefault(p, []).append(b)
        out: list[int] = []
        seen: set[int] = set()
        todo = [b for b in dict.fromkeys(ids) if flags[b] & FLAG_CACHED]
        while todo:
            b = todo.pop(0)
            if b in seen:
                continue
            seen.add(b)
            out.append(b)
            todo.extend(children.get(b, ()))
        for b in out:
            self._evict(b)
        return out

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use
        (sink blocks count as in use).  Returns whether it happened."""
        if self.num_blocks - self.num_free_blocks != 1:
            return False
        for m in self._maps:
            m.clear()
        self.pending.clear()
        # Every block but the null block is free here (no sink blocks either:
        # they count as used), so its flags are 0, CACHED or PARTIAL.
        # One copy that keeps the null block's flag: a crash part-way leaves
        # some blocks cached (harmless) but never the null block unmarked.
        flags = self._flags
        cleared = bytearray(len(flags))
        cleared[NULL_BLOCK] = FLAG_NULL
        flags[:] = cleared
        self.num_cached_blocks = 0
        self.uncached += 1
        if self.events is not None:
            self.events.cleared()
        return True

    def cached_blocks(self) -> list[tuple[int, bytes, int]]:
        """(block, hash, group) of every cached block (its full entry), in
        the order they were cached."""
        return self._entries(FLAG_CACHED, self._hashes)

    def partial_entries(self) -> list[tuple[int, bytes, int]]:
        """(block, partial key, group) of every partial entry, ordered by
        the cache stamps of their blocks."""
        return self._entries(FLAG_PARTIAL, self._partial_hashes) if len(self._partial_hashes) \
            else []

    def _entries(self, flag: int, hashes) -> list[tuple[int, bytes, int]]:
        flags, stamp, group = self._flags, self._cache_stamp, self._group
        marked = [b for b in range(self.num_blocks) if flags[b] & flag]
        marked.sort(key=lambda b: stamp[b])
        ds = self.digest_size
        return [(b, bytes(hashes[b * _H:b * _H + ds]), group[b]) for b in marked]

    def rebuild(self) -> None:
        """Recreate the hash maps from the segment (cached blocks ordered by
        the stamp of their caching, so 'earliest cached wins' survives)."""
        cached = self.cached_blocks()
        self.num_cached_blocks = len(cached)
        maps = self._maps
        for m in maps:
            m.clear()
        for b, key, g in cached + self.partial_entries():
            maps[g].add(key, b)

    def get_usage(self) -> float:
        total = self.num_blocks - 1
        return 1.0 - self.num_free_blocks / total if total else 0.0
