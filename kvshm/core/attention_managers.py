"""Per-attention-type managers: one per KV-cache group.

Each manager owns its group's request -> block-ids lists and cached-block
counts, and decides, for its attention type, how many blocks a request needs,
which prefix-cache hits it can use and which blocks fall out of its window.
Block ids are plain ints; block 0 is the null placeholder.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvshm.core.block_pool import NULL_BLOCK, BlockPool
from kvshm.core.request import Request
from kvshm.core.specs import (ChunkedLocalSpec, CrossAttentionSpec, FullSpec, GroupSpec,
    MambaSpec, MLASpec, PoolConfig, SinkFullSpec, SlidingWindowSpec)
from kvshm.core.table import RequestTable


class SingleTypeManager:
    """Behaviour shared by every attention type (full attention's, mostly).

    `req_to_blocks` entries come into being where vLLM's defaultdict creates
    them (allocation, caching, window trimming, the common-prefix probe), and
    `get_num_common_prefix_blocks` counts them, so the same calls create them
    here.
    """

    def __init__(self, spec: GroupSpec, group_id: int, pool: BlockPool,
                 table: RequestTable, config: PoolConfig) -> None:
        self.spec = spec
        self.group_id = group_id
        self.block_size = spec.block_size * config.dcp_world_size
        self.pool = pool
        self.table = table
        self.enable_caching = config.enable_caching
        self.use_eagle = config.use_eagle
        # Tokens of this group's block per request hash (hybrid block sizes).
        self.hash_stride = self.block_size // config.hash_block_size or 1
        self.req_to_blocks: dict[str, list[int]] = {}
        self.num_cached_block: dict[str, int] = {}
        # Readiness (block_pool.py): per request, the indices of the blocks
        # it cached ahead of their K/V and has not reported computed yet.
        self.pending_of: dict[str, list[int]] = {}
        # Tokens in flight past the last hit found (blocks other sessions
        # are writing), for the full-attention search.
        self.in_flight_tokens = 0
        # Every group's prefix-cache index, bound once: the pool keeps each
        # group's BlockHashMap for its lifetime.
        self._hash_to_block = [pool.hash_to_block(g) for g in range(len(config.groups))]
        # Tokens of extra slots this type allocates beyond the need (Mamba's
        # speculative blocks).
        self.extra_tokens = 0
        # The most blocks an admission must find free for a request of any
        # length (vLLM 0.32's windowed types; None: its whole sequence's).
        self.admission_cap: int | None = None
        # Hits end on multiples of this many tokens (a hybrid pool of 0.32
        # sets the lcm of its block sizes).
        self.hit_alignment = self.block_size

    # -- entries -------------------------------------------------------------
    def _entry(self, request_id: str) -> list[int]:
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
            self.table.write_blocks(request_id, self.group_id, 0, blocks)
        return blocks

    def _extend(self, request_id: str, blocks: list[int], new: list[int]) -> None:
        start = len(blocks)
        blocks.extend(new)
        self.table.write_blocks(request_id, self.group_id, start, new)

    def _set_num_cached(self, request_id: str, n: int) -> None:
        self.num_cached_block[request_id] = n
        self.table.write_num_cached(request_id, self.group_id, n)

    def group_hashes(self, block_hashes: list[bytes]) -> list[bytes]:
        """The request's hashes at this group's block granularity: for a block
        of k hash-blocks, the hash of its last hash-block (the chain makes it
        identify the whole prefix, so it is as good a key as the
        concatenation of all k)."""
        k = self.hash_stride
        return block_hashes if k == 1 else block_hashes[k - 1::k]

    # -- allocation ----------------------------------------------------------
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[int],
                                   total_computed_tokens: int) -> int:
        """Blocks the pool must supply (new blocks plus hits that would leave
        the free queue) to give the request `num_tokens` slots."""
        bs = self.block_size
        num_required = -(-(num_tokens + self.extra_tokens) // bs)
        held = self.req_to_blocks.get(request_id)
        num_req_blocks = len(held) if held is not None else 0
        if request_id in self.num_cached_block:
            # A running request: no new hits; speculative rejections can leave
            # it holding more than it now needs.
            n = num_required - num_req_blocks
            return n if n > 0 else 0
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // bs
        local = len(new_computed_blocks) + num_req_blocks
        n = num_required - (num_skipped_blocks if num_skipped_blocks > local else local)
        if not new_computed_blocks:
            return n if n > 0 else 0
        # Hits below the window are not taken; hits sitting in the free queue
        # leave it when touched, so they count against the free blocks.
        skip = num_skipped_blocks - num_req_blocks
        ref = self.pool.ref_cnt
        num_evictable = 0
        for b in new_computed_blocks[skip if skip > 0 else 0:]:
            if b and ref[b] == 0:
                num_evictable += 1
        return (n if n > 0 else 0) + num_evictable

    def adopt_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[int],
                              num_local_computed_tokens: int,
                              num_external_computed_tokens: int) -> int:
        """Adopt the prefix-cache hits of a new request (nulls below its
        window).  Returns how many blocks its externally computed tokens
        still need (`allocate_external_blocks`)."""
        if request_id in self.num_cached_block:
            return 0  # a running request has no new hits
        blocks = self._entry(request_id)
        bs = self.block_size
        total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_tokens = self.get_num_skipped_tokens(total)
        num_skipped_blocks = num_skipped_tokens // bs
        if num_skipped_blocks > 0:
            new_computed_blocks = new_computed_blocks[num_skipped_blocks:]
            num_external_computed_tokens = min(total - num_skipped_tokens,
                                               num_external_computed_tokens)
        if self.enable_caching:
            self.pool.touch(new_computed_blocks)
        self._extend(request_id, blocks,
                     [NULL_BLOCK] * num_skipped_blocks + list(new_computed_blocks))
        # Hits (and skipped nulls) are cached already.
        self._set_num_cached(request_id, len(blocks))
        if num_external_computed_tokens > 0:
            return max(-(-total // bs) - len(blocks), 0)
        return 0

    def allocate_external_blocks(self, request_id: str, num_blocks: int) -> None:
        """Append `num_blocks` new blocks for externally computed tokens."""
        self._extend(request_id, self.req_to_blocks[request_id],
                     self.pool.get_new_blocks(num_blocks))

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request to `num_tokens` slots; returns the new blocks."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self._entry(request_id)
        num_new = -(-(num_tokens + self.extra_tokens) // self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new = self.pool.get_new_blocks(num_new)
        self._extend(request_id, blocks, new)
        return new

    def blocks_after_allocation(self, request_id: str, num_tokens: int,
                                num_new_computed: int, total_computed_tokens: int) -> int:
        """An upper bound on the request's block count after an allocation
        (checked against the request-table row before anything changes)."""
        bs = self.block_size
        held = len(self.req_to_blocks.get(request_id, ()))
        return max(held + num_new_computed,
                   -(-total_computed_tokens // bs),
                   -(-(num_tokens + self.extra_tokens) // bs))

    def settled(self, request_id: str, num_tokens: int, total_computed_tokens: int,
                num_cache_tokens: int) -> bool:
        """Whether an allocation of `num_tokens` slots, with the window at
        `total_computed_tokens` and blocks cached up to `num_cache_tokens`,
        changes nothing in this group: the request holds its entry and the
        blocks for them, none leaves the window and none is to be cached (a
        decode step, mostly).  Mirrors remove_skipped_blocks,
        allocate_new_blocks and cache_blocks."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return False
        bs = self.block_size
        n = len(blocks)
        if -(-(num_tokens + self.extra_tokens) // bs) > n:
            return False
        if self.caches and num_cache_tokens // bs > self.num_cached_block.get(request_id, 0):
            return False
        if self.has_window:
            k = self.get_num_skipped_tokens(total_computed_tokens) // bs
            if k > n:
                k = n
            if k > 0 and blocks[k - 1] != NULL_BLOCK:
                return False
        return True

    # -- caching -------------------------------------------------------------
    # Whether cache_blocks caches anything (cross-attention never does).
    caches = True

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Commit the request's full blocks up to `num_tokens` to the cache."""
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        blocks = self._entry(rid)
        k = self.hash_stride
        hashes = request.block_hashes
        assert len(hashes) >= num_full * k, "block hashes lag behind the tokens"
        pool, g = self.pool, self.group_id
        end = min(num_full, len(blocks))
        # Which of the blocks from num_cached on to cache (None: all that
        # are not null); the release may cache only those a hit can reach.
        mask = self.cache_mask(request, num_cached, end) if self.masks_cache else None
        # A request may hold fewer blocks than `num_tokens` covers: cache
        # what it holds.  With readiness, blocks past the computed tokens are
        # cached pending (this step computes them).
        ready = end
        writer = -1
        if pool.track_ready:
            ready = max(request.num_computed_tokens // self.block_size, num_cached)
            if ready < end:
                self.pending_of.setdefault(rid, []).extend(
                    i for i in range(ready, end)
                    if blocks[i] and (mask is None or mask[i - num_cached]))
                writer = self.table.slot_of[rid]
        # Each block's parent in its chain: the block before it (0 for the
        # first, or where a window has dropped that one).
        parent = blocks[num_cached - 1] if 0 < num_cached <= len(blocks) else 0
        # The row's count first: its undo entry opens the frame in the
        # segment (with the frame's first cache stamp) before any block is
        # cached, so a crash in the loop below is rolled back whole
        # (core/recovery.py uncaches what a cut-off frame cached).
        self._set_num_cached(rid, num_full)
        for i in range(num_cached, end):
            b = blocks[i]
            # (null placeholders, out of window, are never cached)
            if b and (mask is None or mask[i - num_cached]):
                pool.cache_block(b, hashes[i * k + k - 1], g, writer if i >= ready else -1,
                                 parent)
                parent = b
        if pool.events is not None:   # (off the hot path when nobody records events)
            indices = [i for i in range(num_cached, end)
                       if blocks[i] and (mask is None or mask[i - num_cached])]
            bs = self.block_size
            tokens = request.all_token_ids
            pool.events.stored(
                [hashes[i * k + k - 1] for i in indices],
                hashes[num_cached * k - 1] if num_cached else None,
                tokens[num_cached * bs:num_full * bs] if tokens is not None else [],
                bs, request, g, indices)

    def new_step_starts(self) -> None:
        """A scheduler step begins (vLLM 0.32; only its Mamba manager acts)."""

    # Whether `cache_mask` chooses which blocks to cache (0.32's windowed
    # types: kvshm/core/release_managers.py); else every one not null is.
    masks_cache = False

    def cache_mask(self, request: Request, start: int, end: int) -> list[bool] | None:
        """Which of the request's blocks `start`..`end` - 1 `cache_blocks`
        caches (where `masks_cache`)."""
        return None

    def readies(self, request_id: str, num_computed_tokens: int) -> bool:
        """Whether `mark_computed` would make one of the request's pending
        blocks ready (most calls: a decode step's blocks are ready)."""
        idx = self.pending_of.get(request_id)
        return bool(idx) and idx[0] < num_computed_tokens // self.block_size

    def mark_computed(self, request_id: str, num_computed_tokens: int) -> None:
        """The request's K/V up to `num_computed_tokens` are in the arena:
        the blocks it cached pending below them become ready."""
        if self.pending_of:
            self._settle_pending(request_id, num_computed_tokens // self.block_size,
                                 self.pool.mark_ready)

    # -- freeing -------------------------------------------------------------
    def free(self, request_id: str) -> None:
        """Free the request's blocks, tail first (so the tail is evicted first).
        Blocks it cached pending are uncached: their K/V will never come."""
        blocks = self.req_to_blocks.pop(request_id, None)
        idx = self.pending_of.pop(request_id, None)
        if idx and blocks:
            drop = self.pool.drop_pending
            for i in idx:
                drop(blocks[i])
        if blocks:
            self.pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request_id, None)
        self.table.drop(request_id, self.group_id)

    # Whether get_num_skipped_tokens can be non-zero (False: never a window).
    has_window = False

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens no longer attended to once `num_computed_tokens` are done."""
        return 0

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Free the blocks that fell out of the attention window, replacing
        them with the null block."""
        num_skipped_tokens = self.get_num_skipped_tokens(total_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self._entry(request_id)
        n = num_skipped_tokens // self.block_size
        if n > len(blocks):
            n = len(blocks)
        if n == 0 or blocks[n - 1] == NULL_BLOCK:
            return  # nothing new left the window
        if self.pending_of:
            # It will never report the K/V of pending blocks it lets go of:
            # they are uncached, so a pending block is always in its
            # writer's row (what adoption rebuilds the index from).
            self._settle_pending(request_id, n, self.pool.drop_pending)
        removed = []
        write_null = self.table.write_null
        for i in range(n - 1, -1, -1):
            b = blocks[i]
            if b == NULL_BLOCK:
                break  # everything before it was trimmed by an earlier call
            removed.append(b)
            blocks[i] = NULL_BLOCK
            write_null(request_id, self.group_id, i)
        if removed:
            self.pool.free_blocks(removed)

    def _settle_pending(self, request_id: str, n: int, settle) -> None:
        """Settle (`pool.mark_ready` or `pool.drop_pending`) the blocks below
        index `n` the request cached pending; the others stay pending."""
        idx = self.pending_of.get(request_id)
        if not idx or idx[0] >= n:   # (indices ascend: cached in order)
            return
        blocks = self.req_to_blocks[request_id]
        keep = []
        for i in idx:
            if i < n:
                settle(blocks[i])
            else:
                keep.append(i)
        if keep:
            self.pending_of[request_id] = keep
        else:
            del self.pending_of[request_id]

    # -- prefix cache hits ---------------------------------------------------
    def get_num_common_prefix_blocks(self, request_id: str) -> int:
        return 0

    def find_longest_cache_hit(self, hashes: list[bytes], max_length: int,
                               group_ids: list[int], alignment: int) -> list[list[int]]:
        """Longest hit (per group of `group_ids`) of at most `max_length`
        tokens, a multiple of `alignment`; `hashes` are at this group's
        granularity."""
        raise NotImplementedError


class FullAttentionManager(SingleTypeManager):
    """Full attention, MLA and sink-full attention."""

    def find_longest_cache_hit(self, hashes, max_length, group_ids, alignment):
        bs = self.block_size
        n = min(max_length // bs, len(hashes))
        pool = self.pool
        self.in_flight_tokens = 0
        if len(group_ids) == 1:
            index = self._hash_to_block[group_ids[0]]
            lookup = index.get
            hit = []
            if pool.pending:
                visible = pool.visible
                for i in range(n):
                    h = hashes[i]
                    b = lookup(h)
                    if b is None:
                        break
                    v = visible(index, h, b)
                    if v is None:
                        self.in_flight_tokens = self._in_flight(index, hashes, i, n)
                        break
                    hit.append(v)
            else:
                for i in range(n):
                    b = lookup(hashes[i])
                    if b is None:
                        break
                    hit.append(b)
            computed = [hit]
        else:
            computed = [[] for _ in group_ids]
            for i in range(n):
                blocks = pool.get_cached_block(hashes[i], group_ids)
                if blocks is None:
                    break
                for c, b in zip(computed, blocks):
                    c.append(b)
        if self.use_eagle and computed[0]:
            for c in computed:
                c.pop()
        if bs != alignment:
            keep = len(computed[0]) * bs // alignment * alignment // bs
            for c in computed:
                del c[keep:]
        return computed

    def _in_flight(self, index, hashes: list[bytes], i: int, n: int) -> int:
        """Tokens of the run of blocks from index `i` that other sessions
        are writing (cached, not ready), up to `n` blocks."""
        in_flight = self.pool.in_flight
        lookup = index.get
        j = i
        while j < n:
            h = hashes[j]
            b = lookup(h)
            if b is None or not in_flight(index, h, b):
                break
            j += 1
        return (j - i) * self.block_size

    def get_num_common_prefix_blocks(self, request_id: str) -> int:
        blocks = self._entry(request_id)
        num_reqs = len(self.req_to_blocks)
        ref = self.pool.ref_cnt
        n = 0
        for b in blocks:
            if ref[b] != num_reqs:
                break
            n += 1
        return n


class SlidingWindowManager(SingleTypeManager):
    has_window = True

    def __init__(self, spec: SlidingWindowSpec, *args) -> None:
        super().__init__(spec, *args)
        self.sliding_window = spec.sliding_window
        # Contiguous blocks a hit needs: the window minus the token being
        # computed (EAGLE needs one more, dropped at the end).
        self.window_blocks = -(-(spec.sliding_window - 1) // self.block_size)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    # vLLM 0.32 (kvshm/core/release_managers.py): a hit that is to lose
    # EAGLE's block must end aligned once it has, and is aligned again after
    # the drop; 0.14 aligns the end of the run it finds.
    realign_eagle = False

    def find_longest_cache_hit(self, hashes, max_length, group_ids, alignment,
                               drop_eagle: bool | None = None):
        """`drop_eagle`: whether EAGLE's extra block is matched and dropped
        in this search (a 0.32 hybrid search says; default: with EAGLE)."""
        drop = self.use_eagle if drop_eagle is None else drop_eagle
        bs = self.block_size
        pool = self.pool
        needed = self.window_blocks + (1 if drop else 0)
        max_blocks = max_length // bs
        computed = [[NULL_BLOCK] * max_blocks for _ in group_ids]
        end_shift = 0 if drop and self.realign_eagle else 1
        run = 0
        found = False
        # Right to left: stop at the first long-enough run of hits.
        for i in range(max_blocks - 1, -1, -1):
            blocks = pool.get_cached_block(hashes[i], group_ids)
            if blocks is None:
                run = 0
                continue
            if run == 0 and bs != alignment and (i + end_shift) * bs % alignment:
                continue  # a hit must end on an aligned boundary
            for c, b in zip(computed, blocks):
                c[i] = b
            run += 1
            if run >= needed:
                found = True
                break
        # Not found: only a run starting at block 0 counts as a (short) hit.
        keep = i + run if found else self._aligned(run, alignment)
        if drop and keep:
            keep -= 1
            if self.realign_eagle:
                keep = self._aligned(keep, alignment)
        for c in computed:
            del c[keep:]
        return computed

    def _aligned(self, num_blocks: int, alignment: int) -> int:
        """The most of `num_blocks` blocks a hit aligned to `alignment` keeps."""
        bs = self.block_size
        return num_blocks if bs == alignment else num_blocks * bs // alignment * alignment // bs


class ChunkedLocalManager(SingleTypeManager):
    has_window = True

    def __init__(self, spec: ChunkedLocalSpec, *args) -> None:
        super().__init__(spec, *args)
        self.chunk = spec.attention_chunk_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.chunk * self.chunk

    def find_longest_cache_hit(self, hashes, max_length, group_ids, alignment):
        bs = self.block_size
        pool = self.pool
        max_blocks = max_length // bs
        # Blocks before the current chunk count as computed (null).
        start = (max_length // self.chunk * self.chunk if max_length > 0 else 0) // bs
        computed = [[NULL_BLOCK] * start for _ in group_ids]
        for i in range(start, max_blocks):
            blocks = pool.get_cached_block(hashes[i], group_ids)
            if blocks is None:
                break
            for c, b in zip(computed, blocks):
                c.append(b)
        return computed


class MambaManager(SingleTypeManager):
    has_window = True

    def __init__(self, spec: MambaSpec, *args) -> None:
        super().__init__(spec, *args)
        self.extra_tokens = spec.block_size * spec.num_speculative_blocks

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # Only the state after the last computed token is needed.
        return num_computed_tokens - 1

    def find_longest_cache_hit(self, hashes, max_length, group_ids, alignment):
        bs = self.block_size
        pool = self.pool
        computed: list[list[int]] = [[] for _ in group_ids]
        # The last cached state wins: search right to left.
        for i in range(max_length // bs - 1, -1, -1):
            blocks = pool.get_cached_block(hashes[i], group_ids)
            if blocks is None:
                continue
            if bs != alignment and (i + 1) * bs % alignment:
                continue
            for c, b in zip(computed, blocks):
                c.extend([NULL_BLOCK] * i)
                c.append(b)
            break
        return computed


class CrossAttentionManager(SingleTypeManager):
    """Encoder states: one allocation per request, never cached or shared."""

    def adopt_computed_blocks(self, request_id, new_computed_blocks,
                              num_local_computed_tokens,
                              num_external_computed_tokens) -> int:
        return 0

    caches = False

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        return  # configs with a cross-attention group never cache


MANAGER_CLASSES: dict[type, type[SingleTypeManager]] = {
    FullSpec: FullAttentionManager,
    MLASpec: FullAttentionManager,
    SinkFullSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalSpec: ChunkedLocalManager,
    MambaSpec: MambaManager,
    CrossAttentionSpec: CrossAttentionManager,
}
