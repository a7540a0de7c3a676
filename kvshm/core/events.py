"""KV-cache events: what the prefix cache gained and lost, in vLLM's wire form.

KV-aware routers (llm-d's indexer, Dynamo's KV router, SGLang's router)
learn what each engine caches from vLLM's KV-event stream.  A pool records
the same events, for the same operations and in the same order, as vLLM
0.14's block pool:

- `BlockStored` when a request's full blocks are cached (one event per
  caching call and KV-cache group: the new blocks' hashes, the hash of the
  block before them, their tokens);
- `BlockRemoved` when a cached block is evicted (its reuse for another
  request, or `evict_blocks`);
- `AllBlocksCleared` when the prefix cache is reset.

The Structs encode (msgpack, tagged, positional) exactly as vLLM's:
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name]`, `["BlockRemoved", block_hashes, medium]`,
`["AllBlocksCleared"]`, batched as `[ts, [events], data_parallel_rank]`.
Block hashes are 64-bit integers: the low 64 bits of the block's hash
digest read big-endian, as vLLM sends them by default.  With the pool's
`vllm-sha256` hashing they are the integers a vLLM engine would send.

A pool of vLLM 0.32's semantics (`Semantics.event_maps`) records 0.32's
form instead: each event a msgpack map whose first key is "type", every
`BlockStored` with its group's index, spec kind and sliding window and one
extra-keys entry per block (`block_event_keys`), every `BlockRemoved` with
its group; fields 0.32 leaves unset (None) are left out, as vLLM does.

Several KV-cache groups: vLLM 0.14 emits nothing group-specific (it turns
events off for hybrid models).  Later vLLM versions added trailing fields:
`extra_keys` and `group_idx` on `BlockStored`, `group_idx` on
`BlockRemoved`.  A pool of several groups sends them the same way
(`group_idx`: the index in `PoolConfig.groups`; `extra_keys` None); a
single-group pool sends 0.14's arrays, byte for byte.

A request added by its block hashes (`Request.from_block_hashes`) has no
token ids here: its `BlockStored` events carry `token_ids` [].  A tenant's
requests cache under its namespaced hashes, and that is what the events
name.  LoRA adapters get ids 1, 2, ... in order of first use, as vLLM's
`LoRARequest` ids would be numbered by a server that loads them so.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from kvshm.core.extra_keys import block_event_keys

MEDIUM_GPU = "GPU"   # what vLLM's block pool reports on every backend (CPU too)
_LOW64 = (1 << 64) - 1


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                   tag=True):
    """One change to the prefix cache (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


# The events of a pool of several KV-cache groups: the same tags, with later
# vLLM's trailing fields.  msgspec writes every field of an array-like
# Struct, defaults too, so these are separate classes: a single-group
# stream stays 0.14's.  They also decode 0.14's shorter arrays (the extra
# fields default to None): `kvshm events` reads any stream with them.
class GroupBlockStored(BlockStored, tag="BlockStored"):
    extra_keys: list[Any] | None = None     # per block in later vLLM; kvshm sends None
    group_idx: int | None = None


class GroupBlockRemoved(BlockRemoved, tag="BlockRemoved"):
    group_idx: int | None = None


# vLLM 0.32's form: the same events as maps, tagged under "type", with
# 0.32's fields after 0.14's (the order vLLM writes them in), those left
# unset (None) left out.
class MapBlockStored(BlockStored, array_like=False, tag="BlockStored"):
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class MapBlockRemoved(BlockRemoved, array_like=False, tag="BlockRemoved"):
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class MapAllBlocksCleared(AllBlocksCleared, array_like=False, tag="AllBlocksCleared"):
    pass


# A group spec's `type` -> the spec kind vLLM 0.32's events name.
SPEC_KINDS = {"full": "full_attention", "mla": "mla_attention",
              "sink_full": "sink_full_attention", "sliding_window": "sliding_window",
              "chunked_local": "chunked_local_attention", "mamba": "mamba",
              "cross_attention": "cross_attention"}

Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]
AnyEvent = Union[GroupBlockStored, GroupBlockRemoved, AllBlocksCleared]   # for decoding
MapAnyEvent = Union[MapBlockStored, MapBlockRemoved, MapAllBlocksCleared]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one message of the stream carries (decode with `AnyEvent`
    events: `EventBatchIn`)."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class EventBatchIn(EventBatch):
    events: list[AnyEvent]


_decode_arrays = msgspec.msgpack.Decoder(list[AnyEvent]).decode
_decode_maps = msgspec.msgpack.Decoder(list[MapAnyEvent]).decode


def decode_events(payload: bytes) -> list:
    """Events from their msgpack wire form (b"": none): 0.14's arrays and
    later vLLM's longer ones alike (see GroupBlockStored), or 0.32's maps."""
    if not payload:
        return []
    try:
        return _decode_arrays(payload)
    except msgspec.ValidationError:
        return _decode_maps(payload)


def external_hash(digest: bytes) -> int:
    """A block hash as the stream names it: the low 64 bits, big-endian."""
    return int.from_bytes(digest, "big") & _LOW64


class EventLog:
    """The events a pool recorded since the last `take()`.

    Args:
        num_groups: the pool's KV-cache groups (more than one: events carry
            `group_idx`).
        maps: vLLM 0.32's form: per group its (spec kind as `SPEC_KINDS`
            names it, sliding window or None); None for 0.14's arrays.
    """

    __slots__ = ("events", "_lora_ids", "_groups", "_maps")

    def __init__(self, num_groups: int = 1,
                 maps: list[tuple[str, int | None]] | None = None) -> None:
        self.events: list = []
        self._lora_ids: dict[str, int] = {}
        self._groups = num_groups > 1
        self._maps = maps

    def lora_id(self, name: str | None) -> int | None:
        """The adapter id of LoRA `name` (1, 2, ... in order of first use)."""
        if not name:
            return None
        ids = self._lora_ids
        lid = ids.get(name)
        if lid is None:
            lid = ids[name] = len(ids) + 1
        return lid

    def stored(self, digests: list[bytes], parent: bytes | None, token_ids: list[int],
               block_size: int, request, group: int,
               indices: list[int] | None = None) -> None:
        """`request`: the request that cached the blocks, for its LoRA: a
        kvshm Request (`lora_name`; ids by first use) or, in a vLLM engine's
        embedded pool, vLLM's own (`lora_request`: its name and adapter id);
        None for none.  `indices`: the blocks' places in the request (for
        0.32's extra keys; None: no keys known)."""
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            name, lid = lora.name, lora.adapter_id
        else:
            name = getattr(request, "lora_name", None) or None
            lid = self.lora_id(name)
        args = ([external_hash(d) for d in digests],
                None if parent is None else external_hash(parent),
                token_ids, block_size, lid, MEDIUM_GPU, name)
        if self._maps is not None:
            kind, window = self._maps[group]
            keys = (None if not indices or request is None   # (vLLM: None, not [])
                    else block_event_keys(request, indices, block_size))
            self.events.append(MapBlockStored(
                *args, extra_keys=keys, group_idx=group, kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window))
            return
        self.events.append(GroupBlockStored(*args, group_idx=group) if self._groups
                           else BlockStored(*args))

    def removed(self, digest: bytes, group: int) -> None:
        hashes = [external_hash(digest)]
        if self._maps is not None:
            self.events.append(MapBlockRemoved(hashes, MEDIUM_GPU, group_idx=group))
            return
        self.events.append(GroupBlockRemoved(hashes, MEDIUM_GPU, group_idx=group)
                           if self._groups else BlockRemoved(hashes, MEDIUM_GPU))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared() if self._maps is None else MapAllBlocksCleared())

    def take(self) -> list[Event]:
        """The events recorded since the last call, oldest first."""
        out, self.events = self.events, []
        return out
