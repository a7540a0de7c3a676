"""Group logic: combine the per-group managers of one model.

Three flavours, chosen by `make_group_logic` as vLLM chooses its KV-cache
coordinators: no prefix cache (caching off, any number of groups), unitary
(one group) and hybrid (several groups: a fixed-point search for the longest
hit every attention type accepts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvshm.core.block_pool import BlockPool
from kvshm.core.attention_managers import (CrossAttentionManager, MambaManager,
                                           SingleTypeManager, SlidingWindowManager)
from kvshm.core.release_managers import make_manager
from kvshm.core.request import Request
from kvshm.core.specs import FULL_ATTENTION_TYPES, PoolConfig, attention_types
from kvshm.core.table import RequestTable

BlockIds = tuple[list[int], ...]


class GroupLogic:
    """Fan-out of every manager operation over the groups, in group order."""

    def __init__(self, config: PoolConfig, pool: BlockPool, table: RequestTable) -> None:
        self.config = config
        self.pool = pool
        self.managers: tuple[SingleTypeManager, ...] = tuple(
            make_manager(spec, i, pool, table, config) for i, spec in enumerate(config.groups)
        )
        self.num_groups = len(self.managers)
        # Per group: whether it is cross-attention (sized by the encoder).
        self.cross = tuple(isinstance(m, CrossAttentionManager) for m in self.managers)
        # The manager of a pool of one (non-cross) group, which the core
        # calls directly on its hottest path; None otherwise.
        self.single: SingleTypeManager | None = None
        if self.num_groups == 1 and not self.cross[0]:
            self.single = self.managers[0]
            self._bind_single(self.managers[0])

    def _bind_single(self, m: SingleTypeManager) -> None:
        """One group: call its manager directly (the hot path of most pools)."""
        self.cache_blocks = m.cache_blocks
        self.readies = m.readies
        self.mark_computed = m.mark_computed
        self.free = m.free
        if m.has_window:
            self.remove_skipped_blocks = m.remove_skipped_blocks
        else:
            self.remove_skipped_blocks = _no_window
        count = m.get_num_blocks_to_allocate
        self.get_num_blocks_to_allocate = (
            lambda rid, num_tokens, hits, num_encoder_tokens, total:
            count(rid, num_tokens, hits[0], total))
        allocate = m.allocate_new_blocks
        self.allocate_new_blocks = (
            lambda rid, num_tokens, num_encoder_tokens: (allocate(rid, num_tokens),))

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: BlockIds, num_encoder_tokens: int,
                                   total_computed_tokens: int) -> int:
        n = 0
        g = 0
        for m in self.managers:
            if self.cross[g]:
                n += m.get_num_blocks_to_allocate(request_id, num_encoder_tokens, (), 0)
            else:
                n += m.get_num_blocks_to_allocate(request_id, num_tokens,
                                                  new_computed_blocks[g],
                                                  total_computed_tokens)
            g += 1
        return n

    def get_num_blocks_to_admit(self, request_id: str, num_tokens: int,
                                new_computed_blocks: BlockIds, num_encoder_tokens: int,
                                total_computed_tokens: int) -> int:
        """`get_num_blocks_to_allocate` for a waiting request's whole
        sequence (vLLM 0.32's admission gate): a group with an
        `admission_cap` needs at most that many."""
        n = 0
        for g, m in enumerate(self.managers):
            if self.cross[g]:
                n += m.get_num_blocks_to_allocate(request_id, num_encoder_tokens, (), 0)
                continue
            cap = m.admission_cap
            n += m.get_num_blocks_to_allocate(
                request_id, num_tokens if cap is None else min(num_tokens, cap * m.block_size),
                new_computed_blocks[g], total_computed_tokens)
        return n

    def allocate_new_computed_blocks(self, request_id: str, new_computed_blocks: BlockIds,
                                     num_local_computed_tokens: int,
                                     num_external_computed_tokens: int) -> None:
        """Adopt every group's hits, then allocate blocks for external tokens.

        NOTE: two phases on purpose.  vLLM 0.14.0 interleaves them per group,
        so group 0's external blocks can be popped from the free queue while
        they are still group 1's (free, cached) hits, leaving one block in two
        groups.  Touching all hits first takes them out of the queue; the
        result only differs from vLLM's where vLLM's is corrupt.
        """
        pending = []
        for m, hits in zip(self.managers, new_computed_blocks):
            n = m.adopt_computed_blocks(request_id, hits, num_local_computed_tokens,
                                        num_external_computed_tokens)
            if n:
                pending.append((m, n))
        for m, n in pending:
            m.allocate_external_blocks(request_id, n)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_encoder_tokens: int) -> BlockIds:
        out = []
        for m, cross in zip(self.managers, self.cross):
            out.append(m.allocate_new_blocks(request_id,
                                             num_encoder_tokens if cross else num_tokens))
        return tuple(out)

    def settled(self, request_id: str, num_tokens: int, total_computed_tokens: int,
                num_encoder_tokens: int, num_cache_tokens: int) -> bool:
        """Whether the allocation changes nothing in any group
        (SingleTypeManager.settled)."""
        for m, cross in zip(self.managers, self.cross):
            if not m.settled(request_id, num_encoder_tokens if cross else num_tokens,
                             total_computed_tokens, num_cache_tokens):
                return False
        return True

    def no_new_blocks(self) -> BlockIds:
        """What an allocation that needed no block returns: an empty list
        per group (fresh lists, as allocate_new_blocks gives)."""
        return tuple([] for _ in self.managers)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        for m in self.managers:
            m.cache_blocks(request, num_computed_tokens)

    def readies(self, request_id: str, num_computed_tokens: int) -> bool:
        return any(m.readies(request_id, num_computed_tokens) for m in self.managers)

    def mark_computed(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.managers:
            m.mark_computed(request_id, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for m in self.managers:
            m.free(request_id)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        for m in self.managers:
            m.remove_skipped_blocks(request_id, total_computed_tokens)

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        return [m.get_num_common_prefix_blocks(request_id) for m in self.managers]

    def new_step_starts(self) -> None:
        for m in self.managers:
            m.new_step_starts()

    def estimate_cached_tokens(self, request_id: str) -> int:
        """Per prefix-cached group (not cross-attention) the longest prefix an
        entry of a block the request holds stands for, the least over
        groups; 0 if none."""
        return cached_tokens([m.req_to_blocks.get(request_id, ()) for m in self.managers],
                             [m.block_size for m in self.managers], self.cross,
                             self.pool.hashed_tokens)

    def get_blocks(self, request_id: str) -> BlockIds:
        return tuple(list(m.req_to_blocks.get(request_id) or ()) for m in self.managers)

    # How far past the last hit some group had cached (AlignedHybrid).
    uncached_prefix_tokens = 0

    def find_longest_cache_hit(self, block_hashes: list[bytes],
                               max_length: int) -> tuple[BlockIds, int]:
        raise NotImplementedError

    @property
    def in_flight_tokens(self) -> int:
        """Tokens past the last hit found that other sessions are writing
        now (counted for one full-attention group; 0 otherwise)."""
        return 0


class NoPrefixCache(GroupLogic):
    """Caching off: never a hit, never a common prefix."""

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        return [0] * self.num_groups

    def find_longest_cache_hit(self, block_hashes, max_length):
        return tuple([] for _ in self.managers), 0


class Unitary(GroupLogic):
    """One group."""

    def __init__(self, config: PoolConfig, pool: BlockPool, table: RequestTable) -> None:
        super().__init__(config, pool, table)
        self._manager = self.managers[0]
        self._block_size = self._manager.block_size

    def find_longest_cache_hit(self, block_hashes, max_length):
        hit = self._manager.find_longest_cache_hit(block_hashes, max_length, [0],
                                                   self._block_size)
        return (hit[0],), len(hit[0]) * self._block_size

    @property
    def in_flight_tokens(self) -> int:
        return self._manager.in_flight_tokens


class Hybrid(GroupLogic):
    """Several groups of at least two distinct specs.

    Groups with equal specs are searched together.  Each attention type
    either accepts the candidate hit length or shortens it; any shortening
    restarts the round, until a round changes nothing.  Hit lengths are
    multiples of the lcm of all block sizes.
    """

    def __init__(self, config: PoolConfig, pool: BlockPool, table: RequestTable) -> None:
        super().__init__(config, pool, table)
        types = attention_types(config.groups)
        self.lcm_block_size = math.lcm(*(spec.block_size for spec, _ in types))
        # Full attention first: its left-to-right scan bounds the others.
        types.sort(key=lambda t: not isinstance(t[0], FULL_ATTENTION_TYPES))
        self.attention_types = [
            (isinstance(spec, FULL_ATTENTION_TYPES), ids, self.managers[ids[0]])
            for spec, ids in types
        ]

    def find_longest_cache_hit(self, block_hashes, max_length):
        hit_length = max_length
        hits: list[list[int] | None] = [None] * self.num_groups
        lcm = self.lcm_block_size
        while True:
            cur = hit_length
            for is_full, ids, manager in self.attention_types:
                bs = manager.block_size
                if is_full and hits[ids[0]] is not None:
                    # A full-attention hit is prefix-closed: shorten, not redo.
                    n = cur // bs
                    cur = n * bs
                    for g in ids:
                        del hits[g][n:]
                else:
                    found = manager.find_longest_cache_hit(
                        manager.group_hashes(block_hashes), cur, ids, lcm)
                    cur = len(found[0]) * bs
                    for g, blocks in zip(ids, found):
                        hits[g] = blocks
            if cur < hit_length:
                hit_length = cur
            else:
                break
        return tuple(h if h is not None else [] for h in hits), hit_length


class AlignedHybrid(Hybrid):
    """vLLM 0.32's hybrid logic.  Hits and caching align to the scheduler
    block, the lcm of the block sizes: every group caches only up to a
    multiple of it (with EAGLE, one block more).  The search looks up full attention once
    (later rounds only cap the length by its hit, and its blocks are cut
    to the final length at the end, rounding up), ends after one round for
    full attention plus one other type, and reports how far past the hit
    some type had cached (`uncached_prefix_tokens`: a prefix other
    requests share that a windowed group has not cached; the managers
    cache its tail too)."""

    def __init__(self, config: PoolConfig, pool: BlockPool, table: RequestTable) -> None:
        super().__init__(config, pool, table)
        self.simple = (len(self.attention_types) == 2 and self.attention_types[0][0])
        self.uncached_prefix_tokens = 0
        self.hash_block_size = config.hash_block_size
        for m in self.managers:
            m.hit_alignment = self.lcm_block_size

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        # (EAGLE: one block past the aligned prefix too, which a hit matches
        # and drops)
        n = num_computed_tokens // self.lcm_block_size * self.lcm_block_size
        for m in self.managers:
            m.cache_blocks(request, min(num_computed_tokens, n + m.block_size)
                           if m.use_eagle and n else n)

    def find_longest_cache_hit(self, block_hashes, max_length):
        hit_length = max_length
        longest = 0
        hits: list[list[int] | None] = [None] * self.num_groups
        found_length = [0] * self.num_groups
        lcm = self.lcm_block_size
        # EAGLE: each type drops its extra block once per candidate length
        # (it looks one block further, then drops it; Mamba drops none).
        verified: set[int] = set()
        limit = len(block_hashes) * self.hash_block_size
        while True:
            cur = hit_length
            for t, (is_full, ids, manager) in enumerate(self.attention_types):
                if is_full and hits[ids[0]] is not None:
                    cur = min(cur, found_length[ids[0]])
                    continue
                hashes = manager.group_hashes(block_hashes)
                drop = manager.use_eagle and t not in verified
                # EAGLE: a search that drops matches one block further first
                # (not Mamba's, which drops nothing)
                reach = (min(cur + manager.block_size, limit)
                         if drop and not isinstance(manager, MambaManager) else cur)
                if isinstance(manager, SlidingWindowManager):
                    found = manager.find_longest_cache_hit(hashes, reach, ids, lcm, drop)
                else:
                    # (full attention is looked up once, dropping as EAGLE
                    # does; no EAGLE with chunks)
                    found = manager.find_longest_cache_hit(hashes, reach, ids, lcm)
                if drop:
                    verified.add(t)
                elif len(found[0]) * manager.block_size < cur:
                    verified.clear()    # a shorter candidate: every type drops again
                cur = len(found[0]) * manager.block_size
                for g, blocks in zip(ids, found):
                    hits[g] = blocks
                    found_length[g] = cur
                longest = max(longest, cur)
            if cur >= hit_length:
                break
            hit_length = cur
            if self.simple:
                break
        for is_full, ids, manager in self.attention_types:
            if is_full:
                keep = -(-hit_length // manager.block_size)
                for g in ids:
                    del hits[g][keep:]
        self.uncached_prefix_tokens = longest - hit_length
        return tuple(h if h is not None else [] for h in hits), hit_length


# The hybrid logic of each release (core/semantics.py).
HYBRID_LOGIC: dict[str, type[Hybrid]] = {"0.14.0": Hybrid, "0.32.0": AlignedHybrid}


def make_group_logic(config: PoolConfig, pool: BlockPool, table: RequestTable) -> GroupLogic:
    if not config.enable_caching:
        return NoPrefixCache(config, pool, table)
    if len(config.groups) == 1:
        return Unitary(config, pool, table)
    return HYBRID_LOGIC[config.vllm_version](config, pool, table)


def _no_window(request_id: str, total_computed_tokens: int) -> None:
    return None


def any_blocks(blocks: Sequence[Sequence[int]]) -> bool:
    for b in blocks:
        if b:
            return True
    return False


def cached_tokens(blocks: Sequence[Sequence[int]], block_sizes: Sequence[int],
                  cross: Sequence[bool], hashed_tokens) -> int:
    """vLLM 0.32's `estimate_cached_tokens` of a request holding `blocks`
    (per group): per group but cross-attention's, the longest prefix an
    entry of its blocks stands for (`hashed_tokens(block, end of the block
    in the request)`, kvshm.core.block_pool.hashed_tokens); the least over
    groups; 0 if none.  (The core asks its pool; an engine's backend the
    pool's segment.)"""
    least = None
    for group, size, is_cross in zip(blocks, block_sizes, cross):
        if is_cross:
            continue
        most = 0
        for i, b in enumerate(group):
            if b:
                t = hashed_tokens(b, (i + 1) * size)
                if t > most:
                    most = t
        least = most if least is None or most < least else least
    return least or 0
