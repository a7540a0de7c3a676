"""KV-cache group specs and the pool config, with the rules vLLM enforces.

A config loads from a conformance-trace config line, a JSON file or a TOML
file, or is built in code; either way it checks itself when built, and a
broken rule raises `ConfigError` naming the field and the rule, so no
invalid `PoolConfig` exists.  (Turning command-line flags into one is
kvshm/config.py's job.)
"""

from __future__ import annotations

import difflib
import json
import math
import tomllib
from pathlib import Path
from typing import Any, Union

import msgspec
import msgspec.inspect

from kvshm.core.errors import ConfigError
from kvshm.core.semantics import DEFAULT_VLLM_VERSION, VLLM_VERSIONS, Semantics, semantics
from kvshm.core.hashing import (
    DEFAULT_HASH_ALGORITHM,
    DEFAULT_HASH_SEED,
    HASH_ALGORITHMS,
    VLLM_HASH_ALGORITHMS,
    BlockHasher,
)


class FullSpec(msgspec.Struct, frozen=True, tag="full", tag_field="type"):
    """Full attention."""

    block_size: int


class MLASpec(msgspec.Struct, frozen=True, tag="mla", tag_field="type"):
    """Multi-head latent attention: allocates like full attention, but is a
    distinct spec (never looked up together with a `FullSpec` group)."""

    block_size: int


class SinkFullSpec(msgspec.Struct, frozen=True, tag="sink_full", tag_field="type"):
    """Full attention plus `sink_len // block_size` permanently reserved blocks."""

    block_size: int
    sink_len: int


class SlidingWindowSpec(
    msgspec.Struct, frozen=True, tag="sliding_window", tag_field="type"
):
    """Sliding-window attention over the last `sliding_window` tokens."""

    block_size: int
    sliding_window: int


class ChunkedLocalSpec(
    msgspec.Struct, frozen=True, tag="chunked_local", tag_field="type"
):
    """Chunked local attention: a token attends within its chunk only."""

    block_size: int
    attention_chunk_size: int


class MambaSpec(msgspec.Struct, frozen=True, tag="mamba", tag_field="type"):
    """Mamba (linear attention) state; keeps only the last computed block."""

    block_size: int
    num_speculative_blocks: int = 0


class CrossAttentionSpec(
    msgspec.Struct, frozen=True, tag="cross_attention", tag_field="type"
):
    """Encoder-decoder cross attention: one static allocation per request."""

    block_size: int


GroupSpec = Union[
    FullSpec,
    MLASpec,
    SinkFullSpec,
    SlidingWindowSpec,
    ChunkedLocalSpec,
    MambaSpec,
    CrossAttentionSpec,
]

# Specs whose hit search is the left-to-right full-attention scan (vLLM's
# FullAttentionSpec and its subclasses).
FULL_ATTENTION_TYPES = (FullSpec, MLASpec, SinkFullSpec)


# Block ids, table entries and free-queue links are int32 in shared memory;
# the free queue's sentinel is id num_blocks.
MAX_NUM_BLOCKS = 2**31 - 2

# Element types the KV arena can hold, and their sizes in bytes.
KV_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}
KV_LAYOUTS = ("blocks", "layers")


class KVShape(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What one block holds in the KV data arena: K and V of `block_size`
    tokens for `num_layers` layers (every group has that many layers, as in
    vLLM's grouping of hybrid models), `num_kv_heads` heads of `head_size`
    elements of `dtype`.

    `layout` orders the arena's data (kvshm/pool/arena.py): "blocks" (a block's
    K/V of every layer together: kvshm's workers) or "layers" (one
    contiguous [K|V, block, head, token, dim] tensor per layer: vLLM's CPU
    attention, so engines use the arena as their KV-cache tensors)."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str = "float16"
    layout: str = "blocks"

    @property
    def itemsize(self) -> int:
        return KV_DTYPES[self.dtype]


class PoolConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything that defines a pool; two processes agree on a pool iff their
    configs are equal (see `fingerprint`).

    num_blocks counts the null block (id 0).  max_num_seqs is the number of
    request slots in the shared-memory request table; max_encoder_len bounds
    the cross-attention allocation of one request (defaults to
    max_model_len).  `kv`, when set, shapes the KV data arena that the
    coordinator creates beside the pool segment (kvshm/pool/arena.py).
    """

    num_blocks: int
    hash_block_size: int
    max_model_len: int
    groups: tuple[GroupSpec, ...]
    enable_caching: bool = True
    use_eagle: bool = False
    dcp_world_size: int = 1
    max_num_seqs: int = 1024
    max_encoder_len: int | None = None
    hash_algorithm: str = DEFAULT_HASH_ALGORITHM
    hash_seed: str = DEFAULT_HASH_SEED
    kv: KVShape | None = None   # set: the coordinator also creates a KV data arena
    vllm_version: str = DEFAULT_VLLM_VERSION   # whose allocation semantics (core/semantics.py)
    watermark: float = 0.0   # 0.32: share of num_blocks kept free when admitting
    max_in_flight_tokens: int | None = None   # 0.32: bounds windowed groups at admission

    @property
    def semantics(self) -> Semantics:
        """The allocation semantics of the pool's vLLM release."""
        return semantics(self.vllm_version)

    # -- derived values ------------------------------------------------------
    def effective_block_size(self, group: int) -> int:
        """Tokens per block of `group` as the allocator sees it (block_size
        times dcp_world_size)."""
        return self.groups[group].block_size * self.dcp_world_size

    @property
    def partial_entry_groups(self) -> tuple[int, ...]:
        """The groups whose blocks take partial prefix entries
        (`Semantics.partial_entries`): with caching on, in a hybrid pool,
        full-attention and MLA groups whose block spans several hash blocks."""
        if not (self.semantics.partial_entries and self.enable_caching
                and len(self.groups) > 1):
            return ()
        return tuple(i for i, g in enumerate(self.groups)
                     if isinstance(g, (FullSpec, MLASpec))
                     and g.block_size > self.hash_block_size)

    @property
    def num_sink_blocks(self) -> int:
        return sum(
            g.sink_len // (g.block_size * self.dcp_world_size)
            for g in self.groups
            if isinstance(g, SinkFullSpec)
        )

    @property
    def encoder_len(self) -> int:
        return self.max_model_len if self.max_encoder_len is None else self.max_encoder_len

    @property
    def kv_block_size(self) -> int:
        """Tokens one arena block holds: the largest group block size (block
        ids are shared by all groups)."""
        return max(self.effective_block_size(g) for g in range(len(self.groups)))

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of K/V data per block id (0 without a `kv` shape)."""
        kv = self.kv
        if kv is None:
            return 0
        per_token = kv.num_kv_heads * kv.head_size * kv.itemsize
        return 2 * kv.num_layers * self.kv_block_size * per_token

    def blocks_for_request(self, num_tokens: int | None = None) -> int:
        """Most blocks one request of `num_tokens` tokens (default: the
        longest, max_model_len) holds at once, over all groups: a sliding
        window or a local chunk holds only its span (+1 block), Mamba one
        state block (+ speculative ones), cross-attention the encoder's
        blocks.  A pool needs this many blocks besides the null (and sink)
        blocks to serve such a request at all."""
        n = self.max_model_len if num_tokens is None else num_tokens
        total = self.num_sink_blocks
        for g, spec in enumerate(self.groups):
            bs = self.effective_block_size(g)
            full = -(-n // bs)
            if isinstance(spec, SlidingWindowSpec):
                total += min(full, -(-spec.sliding_window // bs) + 1)
            elif isinstance(spec, ChunkedLocalSpec):
                total += min(full, -(-spec.attention_chunk_size // bs) + 1)
            elif isinstance(spec, MambaSpec):
                total += 1 + spec.num_speculative_blocks
            elif isinstance(spec, CrossAttentionSpec):
                total += -(-self.encoder_len // bs)
            else:
                total += full
        return total

    def row_capacity(self, group: int) -> int:
        """Most blocks one request can hold in `group`."""
        spec = self.groups[group]
        bs = self.effective_block_size(group)
        if isinstance(spec, CrossAttentionSpec):
            return -(-self.encoder_len // bs)
        extra = spec.num_speculative_blocks if isinstance(spec, MambaSpec) else 0
        return -(-self.max_model_len // bs) + extra

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    def to_json(self) -> bytes:
        """Canonical encoding: equal configs give equal bytes."""
        return msgspec.json.encode(self, order="sorted")

    def replace(self, **changes: Any) -> "PoolConfig":
        """A copy with `changes` (checked like any new config)."""
        return msgspec.structs.replace(self, **changes)

    def block_hasher(self) -> BlockHasher | None:
        """The block hasher requests of this pool must use (None: caching off)."""
        if not self.enable_caching:
            return None
        return BlockHasher(self.hash_algorithm, self.hash_seed, self.hash_block_size,
                           tagged=self.semantics.tagged_extra_keys)

    # -- validation ----------------------------------------------------------
    def __post_init__(self) -> None:
        # Runs for every way a config is made: the constructor, decoding
        # (msgspec.convert), and replace().
        self._check_types()
        self._check_rules()

    def _check_types(self) -> None:
        """Field types, for configs built in code (decoding checks them too,
        but a constructor does not)."""
        for f in msgspec.structs.fields(self):
            try:
                msgspec.convert(msgspec.to_builtins(getattr(self, f.name)), f.type)
            except (msgspec.ValidationError, TypeError) as e:
                raise ConfigError(f.name + _subpath(str(e)), str(e)) from None

    def _check_rules(self) -> None:
        _positive("num_blocks", self.num_blocks)
        if self.num_blocks < 2:
            raise ConfigError("num_blocks", "must be at least 2 (block 0 is the null block)")
        if self.num_blocks > MAX_NUM_BLOCKS:
            raise ConfigError("num_blocks", f"must be at most {MAX_NUM_BLOCKS:,} (block ids "
                              f"and free-queue links are int32; got {self.num_blocks:,})")
        _positive("hash_block_size", self.hash_block_size)
        _positive("max_model_len", self.max_model_len)
        _positive("max_num_seqs", self.max_num_seqs)
        if self.max_encoder_len is not None:
            _positive("max_encoder_len", self.max_encoder_len)
        if self.vllm_version not in VLLM_VERSIONS:
            raise ConfigError("vllm_version", f"must be one of {', '.join(VLLM_VERSIONS)}: the "
                              f"vLLM releases whose semantics kvshm reproduces "
                              f"(got {self.vllm_version!r})")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError("watermark", f"must be in [0, 1) (got {self.watermark})")
        if self.watermark and not self.semantics.admission_gate:
            raise ConfigError("watermark", f"vLLM {self.vllm_version} has no watermark "
                              "(vllm_version = \"0.32.0\" has)")
        if self.max_in_flight_tokens is not None:
            _positive("max_in_flight_tokens", self.max_in_flight_tokens)
            if not self.semantics.admission_gate:
                raise ConfigError("max_in_flight_tokens", f"vLLM {self.vllm_version} has no "
                                  "admission gate (vllm_version = \"0.32.0\" has)")
        if self.dcp_world_size not in (1, 2, 4, 8):
            raise ConfigError("dcp_world_size", "must be 1, 2, 4 or 8")
        if self.hash_algorithm not in HASH_ALGORITHMS:
            raise ConfigError(
                "hash_algorithm", f"must be one of {', '.join(HASH_ALGORITHMS)}"
            )
        if not self.groups:
            raise ConfigError("groups", "at least one KV-cache group is required")
        if len(self.groups) > 255:
            raise ConfigError("groups", "at most 255 groups")
        for i, g in enumerate(self.groups):
            self._validate_group(i, g)
        self._validate_combination()
        if self.kv is not None:
            _positive("kv.num_layers", self.kv.num_layers)
            _positive("kv.num_kv_heads", self.kv.num_kv_heads)
            _positive("kv.head_size", self.kv.head_size)
            if self.kv.dtype not in KV_DTYPES:
                raise ConfigError("kv.dtype", f"must be one of {', '.join(KV_DTYPES)} "
                                  f"(got {self.kv.dtype!r})")
            if self.kv.layout not in KV_LAYOUTS:
                raise ConfigError("kv.layout", f"must be one of {', '.join(KV_LAYOUTS)} "
                                  f"(got {self.kv.layout!r})")
        if self.num_sink_blocks >= self.num_blocks - 1:
            raise ConfigError(
                "num_blocks",
                f"must exceed 1 + the {self.num_sink_blocks} sink blocks",
            )

    def _validate_group(self, i: int, g: GroupSpec) -> None:
        where = f"groups[{i}]"
        sem = self.semantics
        kind = g.__struct_config__.tag
        if kind not in sem.group_types:
            raise ConfigError(f"{where}.type", f"a pool of vLLM {sem.version}'s semantics takes "
                              f"no {kind} group: {sem.missing_types[kind]}")
        _positive(f"{where}.block_size", g.block_size)
        if isinstance(g, SlidingWindowSpec):
            _positive(f"{where}.sliding_window", g.sliding_window)
        elif isinstance(g, ChunkedLocalSpec):
            _positive(f"{where}.attention_chunk_size", g.attention_chunk_size)
        elif isinstance(g, SinkFullSpec):
            _positive(f"{where}.sink_len", g.sink_len)
            bs = g.block_size * self.dcp_world_size
            if g.sink_len % bs:
                raise ConfigError(
                    f"{where}.sink_len",
                    f"must be a multiple of the block size {bs} (got {g.sink_len})",
                )
        elif isinstance(g, MambaSpec):
            if g.num_speculative_blocks < 0:
                raise ConfigError(f"{where}.num_speculative_blocks", "must be >= 0")
        elif isinstance(g, CrossAttentionSpec) and self.enable_caching:
            raise ConfigError(
                f"{where}.type",
                "cross_attention groups require enable_caching = false "
                "(encoder states are never prefix-cached)",
            )
        if self.dcp_world_size > 1 and isinstance(
            g, (SlidingWindowSpec, ChunkedLocalSpec, MambaSpec)
        ):
            raise ConfigError(
                "dcp_world_size",
                f"{where} ({type(g).__name__}) does not support dcp_world_size > 1",
            )
        if self.use_eagle and isinstance(g, ChunkedLocalSpec) and self.enable_caching:
            raise ConfigError(
                "use_eagle", f"{where}: EAGLE is not supported with chunked local attention"
            )

    def _validate_combination(self) -> None:
        if not self.enable_caching:
            return
        if len(self.groups) == 1:
            bs = self.effective_block_size(0)
            if self.hash_block_size != bs:
                raise ConfigError(
                    "hash_block_size",
                    f"with one group and caching on it must equal block_size * "
                    f"dcp_world_size = {bs} (got {self.hash_block_size})",
                )
            return
        if self.dcp_world_size != 1:
            raise ConfigError(
                "dcp_world_size", "hybrid models (several groups) need dcp_world_size = 1"
            )
        for i, g in enumerate(self.groups):
            if g.block_size % self.hash_block_size:
                raise ConfigError(
                    f"groups[{i}].block_size",
                    f"must be a multiple of hash_block_size {self.hash_block_size} "
                    f"in a hybrid model (got {g.block_size})",
                )
        distinct = attention_types(self.groups)
        if len(distinct) < 2:
            raise ConfigError(
                "groups",
                "with caching on, several groups need at least two distinct specs "
                "(merge identical groups into one)",
            )
        lcm = math.lcm(*(spec.block_size for spec, _ in distinct))
        for spec, ids in distinct:
            if isinstance(spec, ChunkedLocalSpec) and spec.block_size != lcm:
                raise ConfigError(
                    f"groups[{ids[0]}].block_size",
                    "chunked local attention in a hybrid model needs the block size "
                    f"to equal the lcm of all block sizes ({lcm})",
                )
            if (
                self.use_eagle
                and isinstance(spec, SlidingWindowSpec)
                and spec.block_size != lcm
                and not self.semantics.eagle_windows_of_any_block_size
            ):
                raise ConfigError(
                    f"groups[{ids[0]}].block_size",
                    "EAGLE with sliding window needs the window group's block size "
                    f"to equal the lcm of all block sizes ({lcm})",
                )

    # -- loading -------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], *, strict: bool = False,
                  **overrides: Any) -> "PoolConfig":
        """Build from a mapping; raises ConfigError.  Unknown keys are
        ignored (a trace's config line has its own), or with `strict`
        refused (see `check_keys`)."""
        if not isinstance(data, dict):
            raise ConfigError("config", f"expected a mapping, got {type(data).__name__}")
        if strict:
            check_keys(data, cls)
        data = {**data, **overrides}
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as e:
            if isinstance(e.__cause__, ConfigError):   # a rule, raised by __post_init__
                raise e.__cause__ from None
            raise ConfigError(_path_of(str(e)), str(e)) from None

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> "PoolConfig":
        """Load a `.toml` or `.json` file; a key that is no field (of the
        config, a group spec or `kv`) is refused, naming the valid ones.
        Its `serve` table holds the coordinator's options, not the pool's
        (`kvshm.config.serve_options` reads it)."""
        data = read_config_file(path)
        data.pop(SERVE_TABLE, None)
        return cls.from_dict(data, strict=True, **overrides)

    @classmethod
    def from_json(cls, raw: bytes) -> "PoolConfig":
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError("config", f"not valid JSON: {e}") from None
        return cls.from_dict(data)


SERVE_TABLE = "serve"


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping a `.toml` or `.json` config file holds.  Raises
    ConfigError when it cannot be read or parsed."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError("config", f"cannot read {path}: {e.strerror}") from None
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(raw.decode())
        else:
            data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError("config", f"{path} is not valid {path.suffix[1:] or 'JSON'}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} holds {type(data).__name__}, not a mapping of keys")
    return data


def check_keys(data: Any, cls: type, path: str = "") -> None:
    """Refuse a key of mapping `data` that no field of the msgspec Struct
    `cls` has, nor of the Structs nested in it (a tagged union's member is
    the one its tag names): ConfigError naming the key's path
    (`groups[0].blocksize`), the close match if there is one and the valid
    names.  Values of any other shape are left to decoding, which names
    them.  `path` prefixes the paths it names."""
    _check_keys(data, msgspec.inspect.type_info(cls), path)


def _check_keys(data: Any, info: msgspec.inspect.Type, path: str) -> None:
    mi = msgspec.inspect
    if isinstance(info, mi.UnionType):
        for member in info.types:
            if isinstance(member, mi.StructType) and isinstance(data, dict) and (
                    member.tag_field is None or data.get(member.tag_field) == member.tag):
                _check_keys(data, member, path)
                return
    elif isinstance(info, (mi.ListType, mi.VarTupleType)) and isinstance(data, list):
        for i, item in enumerate(data):
            _check_keys(item, info.item_type, f"{path}[{i}]")
    elif isinstance(info, mi.StructType) and isinstance(data, dict):
        fields = {f.encode_name: f for f in info.fields}
        valid = [*fields, *([info.tag_field] if info.tag_field else [])]
        for key in data:
            if key not in valid:
                near = difflib.get_close_matches(str(key), valid, n=1)
                hint = f"did you mean `{near[0]}`? " if near else ""
                raise ConfigError(f"{path}.{key}" if path else str(key),
                                  f"unknown key; {hint}valid keys: {', '.join(valid)}")
        for key, value in data.items():
            if key in fields:
                _check_keys(value, fields[key].type, f"{path}.{key}" if path else key)


def attention_types(groups: tuple[GroupSpec, ...]) -> list[tuple[GroupSpec, list[int]]]:
    """Groups with equal specs, in order of first appearance: [(spec, ids)]."""
    out: list[tuple[GroupSpec, list[int]]] = []
    for i, g in enumerate(groups):
        for spec, ids in out:
            if spec == g:
                ids.append(i)
                break
        else:
            out.append((g, [i]))
    return out


def is_pythonhashseed(seed: str) -> bool:
    """Whether `seed` is a value Python accepts as PYTHONHASHSEED."""
    return seed.isascii() and seed.isdigit() and int(seed) < 2**32


def check_engine_hash_seed(config: PoolConfig) -> None:
    """For a pool vLLM engines join: with a vLLM hash algorithm the seed is
    the engines' PYTHONHASHSEED, which Python accepts only as an integer in
    [0, 4294967295].  (A pool that replays traces may hash with any seed,
    e.g. the oracle's `kvshm-oracle-0`.)  Raises ConfigError otherwise."""
    if config.hash_algorithm in VLLM_HASH_ALGORITHMS and not is_pythonhashseed(config.hash_seed):
        raise ConfigError(
            "hash_seed", "a vLLM hash algorithm's seed is the engines' PYTHONHASHSEED: an "
            f"integer in [0, 4294967295] (got {config.hash_seed!r})")


def _positive(field: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(field, f"must be a positive integer (got {value})")


def _subpath(message: str) -> str:
    # msgspec: "Expected `int`, got `str` - at `$[0].block_size`" -> "[0].block_size"
    return message.rsplit(" - at `$", 1)[1].rstrip("`") if " - at `$" in message else ""


def _path_of(message: str) -> str:
    # msgspec: "Expected `int`, got `str` - at `$.groups[0].block_size`"
    if " - at `$." in message:
        return message.rsplit(" - at `$.", 1)[1].rstrip("`")
    if "`" in message:
        return message.split("`")[1]
    return "config"
