"""Per-type managers where a vLLM release's differ from 0.14's, and
`make_manager`, which gives a pool's group the manager of the pool's
release (`PoolConfig.vllm_version`, core/semantics.py).

vLLM 0.32's sliding window caches only the blocks a later request can hit:
a hit needs the window's worth of contiguous cached blocks ending where a
replay of the prompt can resume (`num_prompt_tokens - 1`; with EAGLE, the
block boundaries below the resend and the extension of the prompt, plus
the block above, which EAGLE matches and drops), so only that tail is
cached (its `prefix_cache_retention_interval` 0, the engines' default);
0.14 cached every full block.  Its Mamba manager likewise caches only the
state at that boundary, and puts off a request whose last hit was cached
in the same scheduler step.  Both also keep the tail reaching the prefix
the request's last lookup found others share (`shared_prefix_boundary`);
on a hybrid pool boundaries align to the lcm of the block sizes
(`hit_alignment`, set by `AlignedHybrid` in group_logic.py), and the
sliding window's search is told whether EAGLE's extra block is dropped in
each call (0.32 drops it once per candidate length).

Its full attention (and MLA) in a hybrid pool whose blocks span several
hash blocks also caches the prefix a prompt ends at inside a block, as a
partial entry of that block (`PartialEntryFullManager`; the block pool's
"Partial entries").

Its admission gate (`KVCacheManagerCore.allocate_slots`) asks a windowed
group for at most its `admission_cap` blocks, whatever the request's
length: the window (or local chunk) plus the tokens in flight
(`PoolConfig.max_in_flight_tokens`), as the blocks behind the window are
freed as the request goes.
"""

from __future__ import annotations

from kvshm.core.attention_managers import (MANAGER_CLASSES, ChunkedLocalManager,
                                           FullAttentionManager, MambaManager,
                                           SingleTypeManager, SlidingWindowManager)
from kvshm.core.block_pool import BlockPool
from kvshm.core.request import Request
from kvshm.core.specs import (ChunkedLocalSpec, GroupSpec, MambaSpec, PoolConfig,
                              SlidingWindowSpec)
from kvshm.core.table import RequestTable


def replay_boundaries(num_prompt_tokens: int, block_size: int, use_eagle: bool) -> list[int]:
    """Token positions a later request replaying a prompt of
    `num_prompt_tokens` can resume at (see the module doc)."""
    if not use_eagle:
        return [num_prompt_tokens - 1]
    resend = (num_prompt_tokens - 1) // block_size * block_size
    extension = num_prompt_tokens // block_size * block_size
    return sorted({max(resend - block_size, 0), max(extension - block_size, 0)})


def _in_flight(config: PoolConfig) -> int:
    """The tokens a request may have scheduled and not settled."""
    n = config.max_in_flight_tokens
    return config.max_model_len if n is None else n


def reachable(request: Request, alignment: int, use_eagle: bool) -> list[int]:
    """Where a later request can resume from `request`'s blocks: its replay
    boundaries, and the prefix its last lookup found others share."""
    out = replay_boundaries(request.num_prompt_tokens, alignment, use_eagle)
    if request.shared_prefix_boundary:
        out.append(request.shared_prefix_boundary)
    return out


class ReachableSlidingWindowManager(SlidingWindowManager):
    """vLLM 0.32's sliding window: caches the tails a replay can hit, and
    admits a request needing at most its window and the tokens in flight
    (+1 block: a window need not start on a block's first token)."""

    masks_cache = True
    realign_eagle = True

    def __init__(self, spec: SlidingWindowSpec, group_id, pool, table, config) -> None:
        super().__init__(spec, group_id, pool, table, config)
        held = min(spec.sliding_window - 1 + _in_flight(config), config.max_model_len)
        self.admission_cap = -(-held // spec.block_size) + 1

    def cache_mask(self, request: Request, start: int, end: int) -> list[bool]:
        bs, align = self.block_size, self.hit_alignment
        need = self.window_blocks + (1 if self.use_eagle else 0)
        shift = 1 if self.use_eagle else 0
        mask = [False] * (end - start)
        for boundary in reachable(request, align, self.use_eagle):
            stop = boundary // align * align // bs + shift
            for j in range(max(start, stop - need), min(end, stop)):
                mask[j - start] = True
        return mask


class StepMambaManager(MambaManager):
    """vLLM 0.32's Mamba manager ("none" cache mode): caches only the state
    block at the boundary a replay of the prompt resumes from, and does not
    admit a request whose last hit was cached in the same scheduler step
    (`new_step_starts` begins one): its state may not be written yet.  The
    step's cached hashes live in this process only, so a coordinator
    restarted mid-step admits such a request at once."""

    masks_cache = True

    def __init__(self, spec: MambaSpec, group_id, pool, table, config) -> None:
        super().__init__(spec, group_id, pool, table, config)
        self.cached_this_step: set[bytes] = set()

    def new_step_starts(self) -> None:
        self.cached_this_step.clear()

    def cache_mask(self, request: Request, start: int, end: int) -> list[bool]:
        bs, align = self.block_size, self.hit_alignment
        mask = [False] * (end - start)
        for boundary in reachable(request, align, self.use_eagle):
            j = boundary // align * align // bs - 1
            if start <= j < end:
                mask[j - start] = True
        return mask

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        before = self.num_cached_block.get(rid, 0)
        super().cache_blocks(request, num_tokens)
        blocks, pool = self.req_to_blocks.get(rid, ()), self.pool
        for i in range(before, min(self.num_cached_block.get(rid, 0), len(blocks))):
            digest = pool.block_hash(blocks[i]) if blocks[i] else None
            if digest is not None:
                self.cached_this_step.add(digest)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks, total_computed_tokens: int) -> int:
        if (new_computed_blocks and new_computed_blocks[-1]
                and self.pool.block_hash(new_computed_blocks[-1]) in self.cached_this_step):
            return self.pool.num_blocks + 1       # more than the pool: not this step
        return super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks,
                                                  total_computed_tokens)


class CappedChunkedLocalManager(ChunkedLocalManager):
    """vLLM 0.32's chunked local attention: admits a request needing at
    most its chunk and the tokens in flight."""

    def __init__(self, spec: ChunkedLocalSpec, group_id, pool, table, config) -> None:
        super().__init__(spec, group_id, pool, table, config)
        held = min(spec.attention_chunk_size + _in_flight(config), config.max_model_len)
        self.admission_cap = -(-held // spec.block_size)


class PartialEntryFullManager(FullAttentionManager):
    """vLLM 0.32's full attention and MLA in the pool's
    `partial_entry_groups` (`make_manager` gives it to those groups only):
    caching also gives the block a prompt's last hash boundary falls in a
    partial entry for that prefix, once the tokens cached reach it (the
    boundary: the prompt less the token a resend recomputes, or the whole
    prompt with EAGLE, rounded down to the hash block; none where it ends a
    block)."""

    def __init__(self, spec, group_id, pool, table, config) -> None:
        super().__init__(spec, group_id, pool, table, config)
        self.hash_block_size = config.hash_block_size

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        super().cache_blocks(request, num_tokens)
        hbs, bs = self.hash_block_size, self.block_size
        limit = request.num_prompt_tokens - (0 if self.use_eagle else 1)
        boundary = limit // hbs * hbs
        if boundary == 0 or boundary > num_tokens or boundary % bs == 0:
            return
        blocks = self.req_to_blocks.get(request.request_id, ())
        index = boundary // bs
        if index >= len(blocks) or not blocks[index]:
            return
        n = boundary // hbs
        hashes = request.block_hashes
        pool = self.pool
        if pool.cache_partial(blocks[index], hashes[n - 1], self.group_id, boundary) \
                and pool.events is not None:
            tokens = request.all_token_ids
            pool.events.stored([hashes[n - 1]], hashes[n - 2] if n > 1 else None,
                               tokens[boundary - hbs:boundary] if tokens is not None else [],
                               hbs, request, self.group_id, [n - 1])


RELEASE_MANAGERS: dict[str, dict[type, type[SingleTypeManager]]] = {
    "0.14.0": MANAGER_CLASSES,
    "0.32.0": {**MANAGER_CLASSES, SlidingWindowSpec: ReachableSlidingWindowManager,
               ChunkedLocalSpec: CappedChunkedLocalManager, MambaSpec: StepMambaManager},
}


def make_manager(spec: GroupSpec, group_id: int, pool: BlockPool,
                 table: RequestTable, config: PoolConfig) -> SingleTypeManager:
    """The manager of group `group_id` under the pool's release (a group
    that takes partial entries, only a 0.32 pool's: `PartialEntryFullManager`,
    so that no other group pays for them)."""
    if group_id in config.partial_entry_groups:
        cls = PartialEntryFullManager
    else:
        cls = RELEASE_MANAGERS[config.vllm_version][type(spec)]
    return cls(spec, group_id, pool, table, config)
