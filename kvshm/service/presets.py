"""Pool presets shaped like real models, for `kvshm serve --preset`.

Each preset gives the KV-cache groups and the bytes one block costs across
all layers of its group (K and V, all KV heads, the dtype), so that
`--kv-memory` can turn a memory budget into a block count.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshm.core.errors import ConfigError
from kvshm.core.specs import (
    CrossAttentionSpec,
    FullSpec,
    GroupSpec,
    MambaSpec,
    PoolConfig,
    SlidingWindowSpec,
)


@dataclass(frozen=True)
class Preset:
    description: str
    groups: tuple[GroupSpec, ...]
    block_bytes: int            # KV bytes of one block id (all groups share ids)
    max_model_len: int
    enable_caching: bool = True

    def config(self, num_blocks: int, **overrides) -> PoolConfig:
        return PoolConfig(num_blocks=num_blocks, hash_block_size=16,
                          max_model_len=self.max_model_len, groups=self.groups,
                          enable_caching=self.enable_caching, **overrides).validate()


def _kv(layers: int, kv_heads: int, head_size: int, dtype_bytes: int, block: int) -> int:
    return 2 * layers * kv_heads * head_size * dtype_bytes * block


PRESETS: dict[str, Preset] = {
    "llama-8b": Preset(
        "Llama-3-8B-like: 32 full-attention layers, 8 KV heads x 128, bf16",
        (FullSpec(16),), _kv(32, 8, 128, 2, 16), 8192),
    "gemma-hybrid": Preset(
        "Gemma-2-like hybrid: full attention + 4096-token sliding window, "
        "21 layers each, 8 KV heads x 256, bf16",
        (FullSpec(16), SlidingWindowSpec(16, 4096)), _kv(21, 8, 256, 2, 16), 8192),
    "jamba-hybrid": Preset(
        "Jamba-like hybrid: 4 full-attention layers + Mamba state, bf16",
        (FullSpec(16), MambaSpec(16)), _kv(4, 8, 128, 2, 16), 8192),
    "whisper-encdec": Preset(
        "Whisper-like encoder-decoder: decoder self-attention + cross-attention "
        "over 1500 encoder frames, 32 layers, 20 heads x 64, fp16 (no prefix cache)",
        (FullSpec(16), CrossAttentionSpec(16)), _kv(32, 20, 64, 2, 16), 448,
        enable_caching=False),
}


def preset_config(name: str, *, num_blocks: int | None = None,
                  kv_memory: int | None = None, **overrides) -> PoolConfig:
    """The pool config of preset `name`, sized by a block count or a KV
    memory budget in bytes (default: 1 GiB of KV)."""
    preset = PRESETS.get(name)
    if preset is None:
        raise ConfigError("preset", f"unknown preset {name!r} (one of {', '.join(PRESETS)})")
    if num_blocks is None:
        budget = kv_memory if kv_memory is not None else 2**30
        num_blocks = budget // preset.block_bytes
    if name == "whisper-encdec":
        overrides.setdefault("max_encoder_len", 1500)
    return preset.config(num_blocks, **overrides)


def parse_size(text: str) -> int:
    """'512M', '4G', '1.5GiB', '1000000' -> bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suffix, m in (("K", 2**10), ("M", 2**20), ("G", 2**30), ("T", 2**40)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    try:
        value = float(t) * mult
    except ValueError:
        raise ConfigError("kv_memory", f"not a size: {text!r} (e.g. 512M, 4G)") from None
    if value <= 0:
        raise ConfigError("kv_memory", f"must be positive (got {text!r})")
    return int(value)
