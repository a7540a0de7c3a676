"""Pool presets shaped like real models, for `kvshm serve --preset` and `kvshm run`.

Each preset gives the KV-cache groups and the model's KV shape (layers per
group, KV heads, head size, dtype), so that `--kv-memory` can turn a memory
budget into a block count and the coordinator can size the KV data arena.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshm.core.errors import ConfigError
from kvshm.core.specs import (
    CrossAttentionSpec,
    FullSpec,
    GroupSpec,
    KVShape,
    MambaSpec,
    PoolConfig,
    SlidingWindowSpec,
)


@dataclass(frozen=True)
class Preset:
    description: str
    groups: tuple[GroupSpec, ...]
    kv: KVShape
    max_model_len: int
    enable_caching: bool = True

    def config(self, num_blocks: int, **overrides) -> PoolConfig:
        fields = dict(num_blocks=num_blocks, hash_block_size=16,
                      max_model_len=self.max_model_len, groups=self.groups,
                      enable_caching=self.enable_caching, kv=self.kv)
        fields.update(overrides)
        return PoolConfig(**fields).validate()

    @property
    def block_bytes(self) -> int:
        """KV bytes of one block id (all groups share ids)."""
        return self.config(2).kv_block_bytes


def _kv(layers: int, kv_heads: int, head_size: int, dtype: str) -> KVShape:
    return KVShape(num_layers=layers, num_kv_heads=kv_heads, head_size=head_size, dtype=dtype)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        "small Llama-shaped model for the CPU workers of `kvshm run`: 4 full-attention "
        "layers, 4 KV heads x 32, fp16",
        (FullSpec(16),), _kv(4, 4, 32, "float16"), 4096),
    "tiny-hybrid": Preset(
        "small hybrid for the CPU workers: full attention + 256-token sliding window, "
        "2 layers each, 4 KV heads x 32, fp32",
        (FullSpec(16), SlidingWindowSpec(16, 256)), _kv(2, 4, 32, "float32"), 4096),
    "llama-8b": Preset(
        "Llama-3-8B-like: 32 full-attention layers, 8 KV heads x 128, bf16",
        (FullSpec(16),), _kv(32, 8, 128, "bfloat16"), 8192),
    "gemma-hybrid": Preset(
        "Gemma-2-like hybrid: full attention + 4096-token sliding window, "
        "21 layers each, 8 KV heads x 256, bf16",
        (FullSpec(16), SlidingWindowSpec(16, 4096)), _kv(21, 8, 256, "bfloat16"), 8192),
    "jamba-hybrid": Preset(
        "Jamba-like hybrid: 4 full-attention layers + Mamba state, bf16",
        (FullSpec(16), MambaSpec(16)), _kv(4, 8, 128, "bfloat16"), 8192),
    "whisper-encdec": Preset(
        "Whisper-like encoder-decoder: decoder self-attention + cross-attention "
        "over 1500 encoder frames, 32 layers, 20 heads x 64, fp16 (no prefix cache)",
        (FullSpec(16), CrossAttentionSpec(16)), _kv(32, 20, 64, "float16"), 448,
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
        num_blocks = blocks_for_memory(preset.block_bytes,
                                       kv_memory if kv_memory is not None else 2**30)
    if name == "whisper-encdec":
        overrides.setdefault("max_encoder_len", 1500)
    return preset.config(num_blocks, **overrides)


def blocks_for_memory(block_bytes: int, kv_memory: int) -> int:
    """How many blocks of `block_bytes` a KV budget of `kv_memory` bytes holds
    (raises ConfigError below 2 blocks: the null block and one more)."""
    num_blocks = kv_memory // block_bytes
    if num_blocks < 2:
        raise ConfigError("kv_memory", f"{kv_memory} bytes hold {num_blocks} block(s) of "
                          f"{block_bytes} bytes; at least 2 are needed")
    return num_blocks


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
