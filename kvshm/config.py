"""Pool configs from what users type.

`kvshm serve`, `kvshm run` and the benchmarks describe a pool the same way:
its shape from a model-shaped preset, a config file or a vLLM model
directory (`read_model`: the KV-cache shape its config.json gives, as vLLM
derives it; `model_pool_config`); its size as a block count or a KV memory budget; optionally other
block hashing.  `PoolSource` holds those choices and `resolve_config` turns
them into a `PoolConfig` (kvshm/core/specs.py: the type and its rules; every
PoolConfig checks itself when built).  What a pool takes in /dev/shm is
`kvshm.pool.lifecycle.pool_bytes`.

Each preset gives the KV-cache groups and the model's KV shape (layers per
group, KV heads, head size, dtype), so that a memory budget becomes a block
count and the coordinator can size the KV data arena; a preset made for the
CPU workers' transformer also gives the rest of its decoder (`DecoderShape`).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kvshm.core.errors import ConfigError
from kvshm.core.hashing import DEFAULT_HASH_SEED, HASH_ALGORITHMS
from kvshm.core.semantics import DEFAULT_VLLM_VERSION, VLLM_VERSIONS
from kvshm.core.specs import (
    CrossAttentionSpec,
    FullSpec,
    KV_DTYPES,
    GroupSpec,
    KVShape,
    MambaSpec,
    PoolConfig,
    SERVE_TABLE,
    SlidingWindowSpec,
    check_engine_hash_seed,
    read_config_file,
)

# The KV budget of a preset or vLLM model sized by neither blocks nor memory,
# for `kvshm serve` and `kvshm run` alike.  A pool sized from a budget must
# hold one request of the model's full length (as vLLM requires of its KV
# cache); `resolve_config` refuses it otherwise, naming the memory needed.
DEFAULT_KV_MEMORY = "2G"   # every preset holds a full-length request in it


class DecoderShape(msgspec.Struct, frozen=True, kw_only=True):
    """What the CPU workers' transformer (workers/transformer.py) needs
    beyond the pool's KV shape: query heads per KV head, the hidden size and
    the MLP's intermediate size.  None of them: the transformer derives its
    own from the KV shape (2 query heads per KV head, hidden = query heads x
    head size, MLP = 3 x hidden)."""

    query_per_kv: int = 2
    hidden_size: int | None = None
    intermediate_size: int | None = None


@dataclass(frozen=True)
class Preset:
    description: str
    groups: tuple[GroupSpec, ...]
    kv: KVShape
    max_model_len: int
    enable_caching: bool = True
    decoder: DecoderShape | None = None   # for the CPU workers' transformer

    def config(self, num_blocks: int, **overrides) -> PoolConfig:
        fields = dict(num_blocks=num_blocks, hash_block_size=16,
                      max_model_len=self.max_model_len, groups=self.groups,
                      enable_caching=self.enable_caching, kv=self.kv)
        fields.update(overrides)
        return PoolConfig(**fields)

    @property
    def block_bytes(self) -> int:
        """KV bytes of one block id (all groups share ids)."""
        return self.config(2).kv_block_bytes


def _kv(layers: int, kv_heads: int, head_size: int, dtype: str) -> KVShape:
    return KVShape(num_layers=layers, num_kv_heads=kv_heads, head_size=head_size, dtype=dtype)


PRESETS: dict[str, Preset] = {
    "small": Preset(
        "Llama-3-8B's cost profile at CPU-worker scale, the default of `kvshm run`: "
        "2 full-attention layers, 4 query heads per KV head (1 KV head x 64), "
        "hidden 1,280, MLP 4,480 (3.5 x hidden), fp32: 36M parameters over 256 "
        "K/V values a token, 1.15 x Llama-3-8B's 122k parameters per K/V value, "
        "so a prefill costs what it would next to decode attention",
        (FullSpec(16),), _kv(2, 1, 64, "float32"), 8192,
        decoder=DecoderShape(query_per_kv=4, hidden_size=1280, intermediate_size=4480)),
    "tiny": Preset(
        "small Llama-shaped model for fast CPU worker runs and tests: 4 full-attention "
        "layers, 4 KV heads x 32, fp32 (numpy attention reads it without a cast); "
        "reads about 40x more K/V per parameter than Llama-3-8B",
        (FullSpec(16),), _kv(4, 4, 32, "float32"), 4096),
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
    memory budget in bytes (default: DEFAULT_KV_MEMORY)."""
    preset = PRESETS.get(name)
    if preset is None:
        raise ConfigError("preset", f"unknown preset {name!r} (one of {', '.join(PRESETS)})")
    if num_blocks is None:
        num_blocks = blocks_for_memory(
            preset.block_bytes,
            kv_memory if kv_memory is not None else parse_size(DEFAULT_KV_MEMORY))
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


class PoolSource(msgspec.Struct, frozen=True, kw_only=True):
    """What a user said about a pool.

    Its shape comes from one of `preset`, `config_file` (.toml or .json) and
    `vllm_model` (a model directory; `block_size`, `dtype` and
    `max_model_len` go with it only); none of them means the caller's default
    preset.  Its size is `num_blocks` or `kv_memory` (bytes, or a size such as
    "4G"), not both.  `hash_algorithm`, `hash_seed` and `vllm_version` (the
    vLLM release whose semantics the pool reproduces) override the shape's.
    """

    preset: str | None = None
    config_file: str | None = None
    vllm_model: str | None = None
    num_blocks: int | None = None
    kv_memory: str | int | None = None
    hash_algorithm: str | None = None
    hash_seed: str | None = None
    block_size: int | None = None
    dtype: str | None = None
    max_model_len: int | None = None
    vllm_version: str | None = None

    @classmethod
    def from_args(cls, args) -> "PoolSource":
        """From parsed command-line arguments named like the fields (the
        file is `args.config`); arguments a command lacks are None."""
        values = {f: getattr(args, f, None) for f in cls.__struct_fields__}
        values["config_file"] = getattr(args, "config", None)
        return cls(**values)


def add_pool_arguments(p: argparse.ArgumentParser, *, vllm: bool = True,
                       hashing: bool = True, required: bool = False,
                       default_preset: str | None = None):
    """The flags a command describes a pool with, named as `PoolSource`'s
    fields (`PoolSource.from_args` reads them back): its shape (a preset, a
    config file or, with `vllm`, a vLLM model and the flags that go with it),
    its size (a block count or a KV memory budget) and, with `hashing`, the
    block hashing.  Returns the group of the shape flags, which are mutually
    exclusive, so that a command can add another way to name a pool to it
    (`kvshm run --connect`)."""
    shape = p.add_mutually_exclusive_group(required=required)
    shape.add_argument("--config", help="pool config file (.toml or .json)")
    shape.add_argument("--preset", help="a model-shaped preset: " + ", ".join(PRESETS) +
                       (f" (default {default_preset})" if default_preset else ""))
    if vllm:
        shape.add_argument("--vllm-model", metavar="DIR",
                           help="a pool for vLLM engines serving the model in DIR (its "
                           "config.json): one KV-cache group, the arena laid out as vLLM's "
                           "CPU attention tensors, vLLM's sha256 block hashes (docs/vllm.md)")
        p.add_argument("--block-size", type=int,
                       help="with --vllm-model: tokens per block (vLLM's CPU default, 128)")
        p.add_argument("--dtype", choices=("auto", *KV_DTYPES),
                       help="with --vllm-model: the KV dtype (auto: as vLLM picks it)")
        p.add_argument("--max-model-len", type=int,
                       help="with --vllm-model: longest request (default: the model's)")
    if hashing:
        p.add_argument("--hash-algorithm", choices=HASH_ALGORITHMS,
                       help="block hash algorithm (overrides the config's; vLLM engines "
                       "need vllm-sha256 or vllm-sha256-cbor)")
        p.add_argument("--hash-seed", help="block hash seed (overrides the config's; for "
                       "vLLM algorithms the engines' PYTHONHASHSEED)")
    p.add_argument("--vllm-version", choices=VLLM_VERSIONS,
                   help="the vLLM release whose allocation semantics the pool reproduces "
                   f"(overrides the config's; default {DEFAULT_VLLM_VERSION}; its engines "
                   "must run it)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, help="pool size in blocks")
    size.add_argument("--kv-memory",
                      help="KV memory budget (e.g. 4G) -> blocks (needs a KV shape; a "
                      f"preset or --vllm-model without a size gets {DEFAULT_KV_MEMORY})")
    return shape


def resolve_config(source: PoolSource, *, default_preset: str | None = None,
                   default_kv_memory: str | int = DEFAULT_KV_MEMORY,
                   need_kv: bool = False) -> PoolConfig:
    """The pool `source` describes.  A preset or a vLLM model given no size
    gets `default_kv_memory`, and one sized by a budget must hold a request
    of its full length; a config file keeps its `num_blocks`.
    `need_kv`: the pool must have a KV arena (a `kv` shape).  Raises
    ConfigError naming what to change."""
    shapes = [f for f in ("preset", "config_file", "vllm_model") if getattr(source, f)]
    if len(shapes) > 1:
        raise ConfigError(shapes[1], f"give one of a preset, a config file and a vLLM "
                          f"model (got {' and '.join(shapes)})")
    vllm_only = [flag for flag, v in (("--block-size", source.block_size),
                                      ("--dtype", source.dtype),
                                      ("--max-model-len", source.max_model_len))
                 if v is not None]
    if vllm_only and not source.vllm_model:
        raise ConfigError("vllm_model", f"{', '.join(vllm_only)} go with --vllm-model")
    if source.num_blocks is not None and source.kv_memory is not None:
        raise ConfigError("num_blocks", "give a block count or a KV memory budget, not both")
    budget = None if source.kv_memory is None else _bytes(source.kv_memory)
    if source.vllm_model:
        config = model_pool_config(
            source.vllm_model, kv_memory=budget or _bytes(default_kv_memory),
            block_size=source.block_size or VLLM_CPU_BLOCK_SIZE,
            dtype=source.dtype or "auto", max_model_len=source.max_model_len)
        if source.num_blocks is not None:
            config = config.replace(num_blocks=source.num_blocks)
    elif source.config_file:
        config = PoolConfig.from_file(source.config_file)
        if source.num_blocks is not None:
            config = config.replace(num_blocks=source.num_blocks)
        elif budget is not None:
            if config.kv is None:
                raise ConfigError("kv_memory", "--kv-memory needs a KV shape ([kv] in the "
                                  "config, or --preset); use --num-blocks")
            config = config.replace(num_blocks=blocks_for_memory(config.kv_block_bytes,
                                                                 budget))
    else:
        name = source.preset or default_preset
        if name is None:
            raise ConfigError("config", "give a preset, a config file or a vLLM model")
        config = preset_config(name, num_blocks=source.num_blocks,
                               kv_memory=budget if budget is not None
                               else _bytes(default_kv_memory))
    if source.num_blocks is None and not source.config_file:
        _check_holds_a_request(config, budget if budget is not None
                               else _bytes(default_kv_memory))
    if need_kv and config.kv is None:
        raise ConfigError("kv", f"{source.config_file} has no [kv] shape: workers need a "
                          "KV arena")
    chosen = {f: getattr(source, f) for f in ("hash_algorithm", "hash_seed", "vllm_version")
              if getattr(source, f) is not None}
    config = config.replace(**chosen) if chosen else config
    if config.hash_seed == DEFAULT_HASH_SEED:
        # A vLLM algorithm with kvshm's own default seed: no engine could
        # join.  A seed chosen on purpose (the oracle's, for replays) is
        # the user's call; the vLLM plugin refuses it with the reason.
        check_engine_hash_seed(config)
    return config


def _check_holds_a_request(config: PoolConfig, budget: int) -> None:
    """A pool sized from `budget` must serve one request of max_model_len."""
    need = config.blocks_for_request() + 1          # + the null block
    if config.num_blocks >= need:
        return
    want = -(-need * config.kv_block_bytes // 2**20)   # MiB, rounded up
    raise ConfigError(
        "kv_memory", f"{budget:,} bytes of KV hold {config.num_blocks:,} blocks; one "
        f"{config.max_model_len:,}-token request needs {need:,} (with the null block): "
        f"give --kv-memory {want}M or more")


def _bytes(size: str | int) -> int:
    return size if isinstance(size, int) else parse_size(size)


# -- a vLLM model directory ------------------------------------------------------
# vLLM's CPU backend: its default block size, and what "auto" makes of a
# checkpoint's dtype (float32 checkpoints run in bfloat16).
VLLM_CPU_BLOCK_SIZE = 128
_AUTO_DTYPE = {"float32": "bfloat16", "float": "bfloat16", "bfloat16": "bfloat16",
               "float16": "float16", "half": "float16"}
VLLM_POOL_HASH = ("vllm-sha256", "0")   # vLLM's default algorithm; the seed engines get


@dataclass(frozen=True)
class ModelKV:
    """The KV-cache shape of a decoder model, from its config.json."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    max_model_len: int
    sliding_window: int | None = None


def read_model(directory: str | Path) -> ModelKV:
    """The KV-cache shape of the model in `directory` as vLLM would derive
    it (layers, KV heads, head size, dtype "auto", context length).
    Raises ConfigError for a missing or unreadable config, and for models
    whose layers mix attention types (kvshm sizes one group here)."""
    path = Path(directory) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError("vllm_model", f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError("vllm_model", f"{path} is not JSON: {e}") from None
    cfg = {**cfg.get("text_config", {}), **{k: v for k, v in cfg.items() if k != "text_config"}}

    def need(key: str) -> int:
        value = cfg.get(key)
        if not isinstance(value, int) or value <= 0:
            raise ConfigError("vllm_model", f"{path}: {key} must be a positive integer "
                              f"(got {value!r})")
        return value

    layers = need("num_hidden_layers")
    heads = need("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_size = cfg.get("head_dim") or need("hidden_size") // heads
    raw = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").removeprefix("torch.")
    if raw not in _AUTO_DTYPE:
        raise ConfigError("vllm_model", f"{path}: unsupported torch_dtype {raw!r}")
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    layer_types = set(cfg.get("layer_types") or ())
    if len(layer_types) > 1 or cfg.get("sliding_window_pattern") or cfg.get(
            "interleaved_sliding_window"):
        raise ConfigError("vllm_model", f"{path}: its layers mix attention types "
                          f"({sorted(layer_types) or 'interleaved sliding window'}); "
                          "describe the pool with a config file instead")
    return ModelKV(layers, int(kv_heads), int(head_size), _AUTO_DTYPE[raw],
                   int(cfg.get("max_position_embeddings") or 2048),
                   int(window) if window else None)


def model_pool_config(directory: str | Path, *, kv_memory: int, block_size: int =
                      VLLM_CPU_BLOCK_SIZE, dtype: str = "auto",
                      max_model_len: int | None = None, max_num_seqs: int = 1024,
                      hash_algorithm: str = VLLM_POOL_HASH[0],
                      hash_seed: str = VLLM_POOL_HASH[1]) -> PoolConfig:
    """The pool for vLLM engines serving the model in `directory`:
    one KV-cache group of the model's attention type, `kv_memory` bytes of
    K/V laid out as vLLM's CPU attention expects its per-layer tensors, and
    vLLM's block hashes.  Raises ConfigError."""
    m = read_model(directory)
    dt = m.dtype if dtype == "auto" else dtype
    if dt not in KV_DTYPES:
        raise ConfigError("dtype", f"must be auto, {', '.join(KV_DTYPES)} (got {dtype!r})")
    spec = (SlidingWindowSpec(block_size, m.sliding_window) if m.sliding_window
            else FullSpec(block_size))
    shape = PoolConfig(
        num_blocks=2, hash_block_size=block_size,
        max_model_len=max_model_len or m.max_model_len, groups=(spec,),
        max_num_seqs=max_num_seqs, hash_algorithm=hash_algorithm, hash_seed=hash_seed,
        kv=KVShape(num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
                   head_size=m.head_size, dtype=dt, layout="layers"))
    return shape.replace(num_blocks=blocks_for_memory(shape.kv_block_bytes, kv_memory))


# The keys of a config file's `[serve]` table: lists of the strings that
# `kvshm serve`'s repeatable flag of the same name takes.
SERVE_KEYS = {"tenant": "--tenant", "tenant_quota": "--tenant-quota"}


def serve_options(config_file: str | Path | None) -> dict[str, list[str]]:
    """The coordinator options of a config file's `[serve]` table (key ->
    its strings; every key of SERVE_KEYS present, empty when not given).
    `kvshm serve` adds its flags' values to them.  Raises ConfigError for a
    key it does not know or a value that is not a list of strings."""
    out: dict[str, list[str]] = {k: [] for k in SERVE_KEYS}
    if not config_file:
        return out
    table = read_config_file(config_file).get(SERVE_TABLE, {})
    if not isinstance(table, dict):
        raise ConfigError(SERVE_TABLE, "must be a table of coordinator options "
                          f"({', '.join(SERVE_KEYS)})")
    for key, value in table.items():
        if key not in SERVE_KEYS:
            raise ConfigError(f"{SERVE_TABLE}.{key}", "unknown key; valid keys: "
                              + ", ".join(SERVE_KEYS))
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{SERVE_TABLE}.{key}", "must be a list of strings, each as "
                              f"`kvshm serve {SERVE_KEYS[key]}` takes it")
        out[key] = list(value)
    return out
