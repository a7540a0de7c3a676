"""The KV-cache manager a vLLM scheduler gets from the plugin: vLLM's
`KVCacheManager` interface over a kvshm pool (embedded or a coordinator).

It takes vLLM's `Request` objects as they are (their `block_hashes` are the
pool's keys: kvshm's `vllm-sha256` hashes are vLLM's, byte for byte) and
answers with vLLM's own `KVCacheBlocks` and `PrefixCacheStats`.  Runs inside
vLLM processes only.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from vllm.v1 import kv_cache_interface as vi
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import RequestStatus

from kvshm.core.errors import ConfigError
from kvshm.core.events import BlockRemoved, BlockStored
from kvshm.vllm.binding import Backend, current_binding

# A request the scheduler admits from its waiting queue (new or preempted).
_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def _block_class(backend: Backend) -> type:
    """vLLM's block type, with `block_hash` read from the pool (so
    `get_unhashed_block_ids()` tells what the pool has cached now)."""
    def block_hash(self):
        return backend.block_hash(self.block_id)
    return type("PoolBlock", (KVCacheBlock,), {"block_hash": property(block_hash)})


class PoolKVCacheManager:
    """Drop-in for vLLM 0.14's `KVCacheManager` (same constructor and
    methods), backed by the pool `KVSHM_POOL` names."""

    def __init__(self, kv_cache_config, max_model_len: int, hash_block_size: int,
                 enable_caching: bool = True, use_eagle: bool = False,
                 log_stats: bool = False, enable_kv_cache_events: bool = False,
                 dcp_world_size: int = 1, pcp_world_size: int = 1,
                 metrics_collector=None) -> None:
        self._open(kv_cache_config, max_model_len, hash_block_size, enable_caching, use_eagle,
                   log_stats, enable_kv_cache_events, dcp_world_size, pcp_world_size,
                   metrics_collector, {})

    def _open(self, kv_cache_config, max_model_len: int, hash_block_size: int,
              enable_caching: bool, use_eagle: bool, log_stats: bool,
              enable_kv_cache_events: bool, dcp_world_size: int, pcp_world_size: int,
              metrics_collector, release: dict) -> None:
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.kv_cache_config = kv_cache_config
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.backend = backend = current_binding().open_backend(
            kv_cache_config, max_model_len=max_model_len, hash_block_size=hash_block_size,
            enable_caching=enable_caching, use_eagle=use_eagle,
            dcp_world_size=dcp_world_size, pcp_world_size=pcp_world_size, release=release)
        block = _block_class(backend)
        self._blocks = [block(i, is_null=(i == 0)) for i in range(backend.num_blocks)]
        # KV-cache events: what this engine's own calls cached and evicted,
        # as vLLM's manager reports them (a shared pool's whole stream is
        # the coordinator's --kv-events-config).
        self.enable_kv_cache_events = enable_kv_cache_events
        if enable_kv_cache_events:
            backend.start_events()
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups)))

    # -- conversions ---------------------------------------------------------------
    def create_kv_cache_blocks(self, block_ids: Sequence[Sequence[int]] | None) -> KVCacheBlocks:
        """vLLM blocks of block ids per group (the shared empty value when
        there are none)."""
        if not block_ids or not any(block_ids):
            return self.empty_kv_cache_blocks
        blocks = self._blocks
        return KVCacheBlocks(tuple([blocks[b] for b in group] for group in block_ids))

    @staticmethod
    def _ids(blocks: KVCacheBlocks | None) -> list[list[int]] | None:
        if blocks is None or not any(blocks.blocks):
            return None
        return [[b.block_id for b in group] for group in blocks.blocks]

    # -- what the scheduler calls ---------------------------------------------------
    @property
    def usage(self) -> float:
        return self.backend.usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The lookups since the last call (None unless stats are logged)."""
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def get_computed_blocks(self, request) -> tuple[KVCacheBlocks, int]:
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        ids, n, _ = self.backend.get_computed_blocks(request)
        # A lookup that holds the request back to wait for a prefix another
        # engine is computing is looked up again: only the one that admits
        # it counts, as on the engine's own cache.
        if self.log_stats and not self.backend.holds(request.request_id):
            self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=n,
                                           preempted=request.num_preemptions > 0)
        return self.create_kv_cache_blocks(ids), n

    def allocate_slots(self, request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0) -> KVCacheBlocks | None:
        new = self.backend.allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, self._ids(new_computed_blocks),
            num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
            num_encoder_tokens)
        return None if new is None else self.create_kv_cache_blocks(new)

    def free(self, request) -> None:
        self.backend.free(request)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        self.backend.remove_skipped_blocks(request_id, total_computed_tokens)

    def evict_blocks(self, block_ids) -> None:
        self.backend.evict_blocks(list(block_ids))

    def reset_prefix_cache(self) -> bool:
        if not self.backend.reset_prefix_cache():
            return False
        if self.log_stats:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return self.backend.get_num_common_prefix_blocks(running_request_id)

    def take_events(self) -> list:
        if not self.enable_kv_cache_events:
            return []
        return [_vllm_event(e) for e in self.backend.take_events()]

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return self.create_kv_cache_blocks(self.backend.get_block_ids(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(list(g) for g in self.backend.get_block_ids(request_id))

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        if self.enable_caching:
            self.backend.cache_blocks(request, num_computed_tokens)


def _vllm_event(event):
    """A kvshm event (kvshm.core.events) as vLLM's own struct, which the
    engine's publisher encodes: the same fields, in the same order."""
    from vllm.distributed import kv_events as ve
    if isinstance(event, BlockStored):
        return ve.BlockStored(block_hashes=event.block_hashes,
                              parent_block_hash=event.parent_block_hash,
                              token_ids=event.token_ids, block_size=event.block_size,
                              lora_id=event.lora_id, medium=event.medium,
                              lora_name=event.lora_name)
    if isinstance(event, BlockRemoved):
        return ve.BlockRemoved(block_hashes=event.block_hashes, medium=event.medium)
    return ve.AllBlocksCleared()


class PoolKVCacheManager032(PoolKVCacheManager):
    """Drop-in for vLLM 0.32's `KVCacheManager`: the constructor, the
    three-valued lookup, stats counted at admission (the scheduler calls
    `record_prefix_cache_stats`), the admission arguments of
    `allocate_slots`, the step hooks, and the attributes the scheduler and
    engine core read.  Its pool reproduces 0.32's semantics
    (`vllm_version = "0.32.0"`, kvshm/core/semantics.py).

    The hooks that hand the scheduler block copies, state offloads and
    blocks to zero answer empty: they only ever have content for sub-block
    hits, Mamba's "align" mode or mixed-precision caches, which the
    constructor refuses.  So does an engine whose MTP drafter re-prefills
    tokens (`num_prefill_lookahead` above 1)."""

    def __init__(self, kv_cache_config, max_model_len: int, scheduler_block_size: int,
                 hash_block_size: int, max_in_flight_tokens: int | None = None,
                 enable_caching: bool = True, use_eagle: bool = False,
                 num_prefill_lookahead: int = 0, log_stats: bool = False,
                 enable_kv_cache_events: bool = False, dcp_world_size: int = 1,
                 pcp_world_size: int = 1, metrics_collector=None, watermark: float = 0.0,
                 enable_mamba_shared_prefix_checkpoint: bool = False) -> None:
        refused = []
        if num_prefill_lookahead > 1:
            refused.append(f"a drafter that re-prefills tokens (num_prefill_lookahead "
                           f"{num_prefill_lookahead})")
        if enable_mamba_shared_prefix_checkpoint:
            refused.append("Mamba shared-prefix checkpoints")
        if kv_cache_config.needs_kv_cache_zeroing:
            refused.append("a KV cache whose new blocks must be zeroed (Mamba layers or "
                           "mixed precision)")
        sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
        if scheduler_block_size != hash_block_size or any(s != hash_block_size for s in sizes):
            # (the pool reproduces their semantics, partial entries
            # included; no engine of that shape has run on one)
            refused.append(f"KV-cache groups of other block sizes than the hash block "
                           f"(scheduler {scheduler_block_size}, hash {hash_block_size}, "
                           f"groups {sizes}: untried with an engine)")
        if refused:
            raise ConfigError("KVSHM_POOL", "kvshm's plugin does not run vLLM 0.32 engines "
                              "with " + "; ".join(refused) + ": unset KVSHM_POOL to run this "
                              "engine on vLLM's own KV-cache manager")
        self._open(kv_cache_config, max_model_len, hash_block_size, enable_caching, use_eagle,
                   log_stats, enable_kv_cache_events, dcp_world_size, pcp_world_size,
                   metrics_collector,
                   dict(vllm_version="0.32.0", watermark=watermark,
                        max_in_flight_tokens=max_in_flight_tokens))
        self.mamba_shared_prefix_checkpoint = False
        self.coordinator = _Coordinator(kv_cache_config)
        specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        # Which groups' blocks cover computed tokens (not cross-attention's).
        self._clipped = [isinstance(s, vi.AttentionSpec) and not isinstance(
            s, (vi.CrossAttentionSpec, vi.EncoderOnlyAttentionSpec)) for s in specs]

    def prefix_cache_lookup_enabled(self, request) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def get_computed_blocks(self, request) -> tuple[KVCacheBlocks, int, int]:
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        ids, n, boundary = self.backend.get_computed_blocks(request)
        return self.create_kv_cache_blocks(ids), n, boundary

    def record_prefix_cache_stats(self, request, num_hits: int) -> None:
        """An admitted request's lookup (0.32 counts admissions, not lookups)."""
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                                       preempted=request.num_preemptions > 0)

    def allocate_slots(self, request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids: tuple[int, ...] = ()) -> KVCacheBlocks | None:
        # (no block is ever zeroed: skip_zeroing_group_ids has nothing to skip)
        waiting = request.status in _WAITING
        new = self.backend.allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, self._ids(new_computed_blocks),
            num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
            num_encoder_tokens, full_sequence_must_fit, waiting, has_scheduled_reqs,
            reserved_blocks)
        return None if new is None else self.create_kv_cache_blocks(new)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        self.backend.remove_skipped_blocks(request_id, processed_computed_tokens)

    def get_block_ids_for_computed_tokens(self, request_id: str,
                                          num_computed_tokens: int) -> tuple[list[int], ...]:
        """The request's blocks that hold its first `num_computed_tokens`
        tokens (cross-attention's whole)."""
        out = []
        for ids, clipped, group in zip(self.get_block_ids(request_id), self._clipped,
                                       self.kv_cache_config.kv_cache_groups):
            size = group.kv_cache_spec.block_size
            out.append(ids[:-(-num_computed_tokens // size)] if clipped else ids)
        return tuple(out)

    def estimate_cached_tokens(self, request) -> int:
        return self.backend.estimate_cached_tokens(request.request_id)

    def new_step_starts(self) -> None:
        self.backend.new_step_starts()

    def take_new_block_ids(self) -> list[int]:
        return []

    def take_kv_cache_block_copies(self) -> tuple[list, list]:
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return {}

    def take_events(self) -> list:
        if not self.enable_kv_cache_events:
            return []
        return [_vllm_032_event(e) for e in self.backend.take_events()]


class _Coordinator:
    """What vLLM 0.32's scheduler and engine core read of the manager's
    coordinator: each group's block size and spec, and that hits never end
    inside a block."""

    enable_partial_hash_hits = False

    def __init__(self, kv_cache_config) -> None:
        self.single_type_managers = [_GroupView(g.kv_cache_spec)
                                     for g in kv_cache_config.kv_cache_groups]


class _GroupView:
    __slots__ = ("kv_cache_spec", "block_size")

    def __init__(self, spec) -> None:
        self.kv_cache_spec = spec
        self.block_size = spec.block_size


def _vllm_032_event(event):
    """A pool's event in vLLM 0.32's form (kvshm.core.events.MapBlockStored
    and kin: its pool reproduces 0.32) as vLLM's own struct, field for field."""
    from vllm.distributed import kv_events as ve
    cls = {"BlockStored": ve.BlockStored, "BlockRemoved": ve.BlockRemoved,
           "AllBlocksCleared": ve.AllBlocksCleared}[event.__struct_config__.tag]
    return cls(**msgspec.structs.asdict(event))


# The manager class of each release the plugin speaks.
MANAGERS = {"0.14.0": PoolKVCacheManager, "0.32.0": PoolKVCacheManager032}
