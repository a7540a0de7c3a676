"""vLLM's KV-cache config in kvshm's terms: a vLLM engine's `KVCacheConfig`
becomes a `PoolConfig`, and an engine is checked against a pool it joins.

Runs inside vLLM processes only (imports vLLM).
"""

from __future__ import annotations

from vllm.v1 import kv_cache_interface as vi

from kvshm.core.errors import ConfigError
from kvshm.core.hashing import VLLM_HASH_ALGORITHMS
from kvshm.core.specs import (ChunkedLocalSpec, CrossAttentionSpec, FullSpec, GroupSpec,
    MambaSpec, MLASpec, PoolConfig, SinkFullSpec, SlidingWindowSpec)

# vLLM's prefix_caching_hash_algo -> the kvshm algorithm reproducing it.
KVSHM_ALGORITHM = {v: k for k, v in VLLM_HASH_ALGORITHMS.items()}


def group_spec(spec: vi.KVCacheSpec) -> GroupSpec:
    """The kvshm spec of one vLLM KV-cache group spec (the allocator part of
    it: block size and the attention type's window, chunk or sink).
    Raises ConfigError for a spec kvshm does not manage."""
    if isinstance(spec, vi.UniformTypeKVCacheSpecs):
        # One attention type in several shapes: the allocator sees the type.
        specs = list(spec.kv_cache_specs.values())
        return group_spec(specs[0]) if specs else _unsupported(spec)
    # NOTE: subclasses before their bases (MLA and sink are full attention).
    if isinstance(spec, vi.SinkFullAttentionSpec):
        return SinkFullSpec(spec.block_size, spec.sink_len or 0)
    if isinstance(spec, vi.MLAAttentionSpec):
        return MLASpec(spec.block_size)
    if isinstance(spec, vi.FullAttentionSpec):
        return FullSpec(spec.block_size)
    if isinstance(spec, vi.SlidingWindowSpec):
        return SlidingWindowSpec(spec.block_size, spec.sliding_window)
    if isinstance(spec, vi.ChunkedLocalAttentionSpec):
        return ChunkedLocalSpec(spec.block_size, spec.attention_chunk_size)
    if isinstance(spec, vi.MambaSpec):
        return MambaSpec(spec.block_size, spec.num_speculative_blocks)
    if isinstance(spec, vi.CrossAttentionSpec):
        return CrossAttentionSpec(spec.block_size)
    return _unsupported(spec)


def _allocator_fields(spec: GroupSpec) -> dict:
    return {f: getattr(spec, f) for f in spec.__struct_fields__}


def _unsupported(spec) -> GroupSpec:
    raise ConfigError("groups", f"kvshm has no manager for vLLM's {type(spec).__name__}")


def pool_hash_algorithm(vllm_algo: str) -> str:
    """The kvshm hash algorithm reproducing vLLM's `prefix_caching_hash_algo`."""
    try:
        return KVSHM_ALGORITHM[vllm_algo]
    except KeyError:
        raise ConfigError(
            "hash_algorithm",
            f"kvshm reproduces vLLM's prefix-caching hashes "
            f"{' and '.join(sorted(KVSHM_ALGORITHM))}, not {vllm_algo!r}: start the engine "
            "with prefix_caching_hash_algo='sha256'") from None


def pool_config(kv_cache_config: vi.KVCacheConfig, *, max_model_len: int,
                hash_block_size: int, enable_caching: bool, use_eagle: bool,
                dcp_world_size: int, pcp_world_size: int, max_num_seqs: int,
                hash_algorithm: str, hash_seed: str,
                max_encoder_len: int | None = None, vllm_version: str = "0.14.0",
                watermark: float = 0.0,
                max_in_flight_tokens: int | None = None) -> PoolConfig:
    """The pool config of a vLLM engine's KV cache (of the release whose
    semantics it is to reproduce: `vllm_version`, and 0.32's admission
    `watermark` and `max_in_flight_tokens`)."""
    if pcp_world_size != 1:
        raise ConfigError("pcp_world_size", "kvshm pools support prefill context "
                          f"parallelism of 1 only (got {pcp_world_size})")
    groups = tuple(group_spec(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups)
    return PoolConfig(
        num_blocks=kv_cache_config.num_blocks, hash_block_size=hash_block_size,
        max_model_len=max_model_len, groups=groups, enable_caching=enable_caching,
        use_eagle=use_eagle, dcp_world_size=dcp_world_size, max_num_seqs=max_num_seqs,
        max_encoder_len=max_encoder_len, hash_algorithm=hash_algorithm,
        hash_seed=hash_seed, vllm_version=vllm_version, watermark=watermark,
        max_in_flight_tokens=max_in_flight_tokens)


def config_differences(pool: PoolConfig, engine: PoolConfig) -> list[str]:
    """What an engine's KV-cache config has that the pool's does not, field
    by field (request-table size and caching aside: the pool's win)."""
    out = []
    names = ["groups", "hash_block_size", "use_eagle", "dcp_world_size", "hash_algorithm",
             "vllm_version", "watermark"]
    if any(isinstance(g, (SlidingWindowSpec, ChunkedLocalSpec)) for g in pool.groups):
        names.append("max_in_flight_tokens")     # (it bounds windowed groups only)
    for name in names:
        a, b = getattr(pool, name), getattr(engine, name)
        if a != b:
            out.append(f"{name}: pool {_show(a)}, engine {_show(b)}")
    if engine.max_model_len > pool.max_model_len:
        out.append(f"max_model_len: pool {pool.max_model_len}, engine {engine.max_model_len} "
                   "(the engine's must not be larger)")
    return out


def _show(value) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(f"{type(g).__name__}{_allocator_fields(g)}" for g in value) + "]"
    return repr(value)


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def engine_differences(pool: PoolConfig, vllm_config) -> list[str]:
    """Before the engine sizes its KV cache: what keeps it from the pool
    (block size, context length, KV dtype, an arena it can use)."""
    out = []
    kv = pool.kv
    if kv is None or kv.layout != "layers":
        out.append("the pool has no KV arena laid out as vLLM's per-layer tensors")
    bs = vllm_config.cache_config.block_size
    sizes = sorted({g.block_size for g in pool.groups})
    if sizes != [bs]:
        out.append(f"block_size: pool {sizes[0] if len(sizes) == 1 else sizes}, engine {bs}")
    n = vllm_config.model_config.max_model_len
    if n > pool.max_model_len:
        out.append(f"max_model_len: pool {pool.max_model_len}, engine {n}")
    dt = _dtype_name(vllm_config.model_config.dtype)
    if kv is not None and dt != kv.dtype:
        out.append(f"KV dtype: pool {kv.dtype}, engine {dt}")
    return out


def arena_differences(pool: PoolConfig, kv_cache_config: vi.KVCacheConfig) -> list[str]:
    """Whether the engine's KV-cache tensors are the pool arena's per-layer
    regions: same block count, layers, heads, head size, dtype and bytes."""
    from kvshm.pool.arena import ArenaLayout
    kv = pool.kv
    if kv is None or kv.layout != "layers":
        return ["the pool has no KV arena laid out as vLLM's per-layer tensors"]
    out = []
    if kv_cache_config.num_blocks != pool.num_blocks:
        out.append(f"num_blocks: pool {pool.num_blocks}, engine {kv_cache_config.num_blocks}")
    tensors = kv_cache_config.kv_cache_tensors
    # (0.14: one tensor per layer; 0.32: tensors of several layers each)
    v32 = bool(tensors) and hasattr(tensors[0], "layer_stride")
    num_layers = sum(len(t.layers) for t in tensors) if v32 else len(tensors)
    if not tensors or num_layers != kv.num_layers:
        out.append(f"layers: pool {kv.num_layers}, engine {num_layers}")
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if not isinstance(spec, vi.AttentionSpec):
            out.append(f"group {g}: {type(spec).__name__} has no K/V a shared arena can hold")
            continue
        for name, want, got in (("KV heads", kv.num_kv_heads, spec.num_kv_heads),
                                ("head size", kv.head_size, spec.head_size),
                                ("KV dtype", kv.dtype, _dtype_name(spec.dtype))):
            if want != got:
                out.append(f"group {g} {name}: pool {want}, engine {got}")
    if out:
        return out
    layout = ArenaLayout(pool)
    if v32:
        # vLLM 0.32: every tensor places its layers in one backing
        # allocation, which is the arena's data (each layer's place in it
        # vLLM's own, from the tensor's offset and strides).
        size = layout.block_bytes * pool.num_blocks
        if {t.size for t in tensors} != {size}:
            out.append(f"KV cache: pool {size:,} bytes, engine "
                       f"{', '.join(f'{s:,}' for s in sorted({t.size for t in tensors}))}")
        return out
    for i, t in enumerate(tensors):
        size = layout.layer_region(i)[1]
        if t.size != size:
            out.append(f"layer {i} tensor: pool {size:,} bytes, engine {t.size:,}")
            break
    return out
