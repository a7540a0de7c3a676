"""KV-cache events (kvshm/core/events.py): for every recorded vLLM stream
(tests/data/conformance/events, EVENTS.md), a replay of its trace records
the same events in the same order, the same hashes in the same pattern with
kvshm's hashing and the very same integers with vLLM's; the wire form is
vLLM 0.14's; pools of several groups say which group.  Pools of vLLM 0.32's
semantics record 0.32's streams (tests/data/conformance-0.32.0/events,
written by scripts/vllm_oracle.py --events), maps and all."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from helpers import make_config, tokens
from kvshm.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventBatchIn,
    EventLog,
    GroupBlockRemoved,
    GroupBlockStored,
    MapAllBlocksCleared,
    MapBlockRemoved,
    MapBlockStored,
    decode_events,
    external_hash,
)
from kvshm.core.request import Request
from kvshm.core.specs import FullSpec, SlidingWindowSpec
from kvshm.pool.kv_cache_manager import KVCacheManager
from kvshm.replay import (
    events_trace,
    first_event_difference,
    hash_pattern,
    load_events,
    load_trace,
    replay_events,
    trace_pool_config,
)

DATA = Path(__file__).parent / "data" / "conformance"
STREAMS = sorted((DATA / "events").glob("*.events.jsonl.gz"))
ORACLE_HASHING = dict(hash_algorithm="vllm-sha256", hash_seed="kvshm-oracle-0")


def test_all_event_streams_are_here():
    assert len(STREAMS) == 94    # every single-group caching trace


DATA_032 = Path(__file__).parent / "data" / "conformance-0.32.0"


STREAMS_032 = sorted((DATA_032 / "events").glob("*.events.jsonl.gz"))


def test_all_0_32_event_streams_are_here():
    assert len(STREAMS_032) == 139   # every caching trace of the 0.32 set


@pytest.mark.parametrize("path", STREAMS_032, ids=[p.name.split(".")[0] for p in STREAMS_032])
def test_a_0_32_pool_s_stream_is_vllm_0_32_s_to_the_integer(path):
    """Maps with every field 0.32 sets (group, spec kind, window, each
    block's extra keys: LoRA names, salts), hashes of 0.32's tagged keys,
    partial prefix entries' events."""
    got, want = replayed(path, DATA_032, **ORACLE_HASHING)
    assert first_event_difference(got, want) is None


def replayed(path: Path, data: Path = DATA, **hashing):
    header, want = load_events(path)
    cfg, ops = load_trace(events_trace(path, data / "traces"))
    config = trace_pool_config(cfg, ops)
    if hashing:
        config = config.replace(**hashing)
    mismatch, got = replay_events(config, ops)
    assert mismatch is None, str(mismatch)
    assert sum(len(e) for _, e in want) == header["num_events"]
    return got, want


@pytest.mark.parametrize("path", STREAMS, ids=[p.name.split(".")[0] for p in STREAMS])
def test_the_stream_is_vllm_s_to_the_integer_with_vllm_s_hashing(path):
    got, want = replayed(path, **ORACLE_HASHING)
    assert first_event_difference(got, want) is None


# The same code runs with any hash function: a sample (KVSHM_ALL_EVENTS=1:
# every stream) shows kvshm's own hashing gives vLLM's pattern.
SAMPLE = STREAMS if os.environ.get("KVSHM_ALL_EVENTS") == "1" else STREAMS[::8]


@pytest.mark.parametrize("path", SAMPLE, ids=[p.name.split(".")[0] for p in SAMPLE])
def test_the_stream_has_vllm_s_pattern_with_kvshm_s_hashing(path):
    got, want = replayed(path)
    assert first_event_difference(hash_pattern(got), hash_pattern(want)) is None


def test_a_difference_is_named_by_line_and_event():
    got, want = replayed(STREAMS[0])
    assert first_event_difference(got, want) is not None    # other hashes, same pattern
    line, events = want[1]
    moved = want[:1] + [(line, events[1:] + events[:1])] + want[2:]
    if len(events) > 1:
        assert first_event_difference(moved, want).startswith(f"line {line}, event 0:")
    assert "lines with events" in first_event_difference(want[:-1], want)


# -- the wire form ---------------------------------------------------------------------------
def test_events_encode_as_vllm_0_14_s_positional_arrays():
    batch = EventBatch(1.5, [BlockStored([1, 2], None, [5, 6, 7, 8], 2, None, "GPU", None),
                             BlockRemoved([2], "GPU"), AllBlocksCleared()], 0)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(batch)) == [
        1.5, [["BlockStored", [1, 2], None, [5, 6, 7, 8], 2, None, "GPU", None],
              ["BlockRemoved", [2], "GPU"], ["AllBlocksCleared"]], 0]
    # Later vLLM's trailing fields, for pools of several groups; either
    # form decodes with the same types.
    grouped = [GroupBlockStored([1], 7, [5, 6], 2, 1, "GPU", "ad", group_idx=1),
               GroupBlockRemoved([1], "GPU", group_idx=1)]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(grouped)) == [
        ["BlockStored", [1], 7, [5, 6], 2, 1, "GPU", "ad", None, 1],
        ["BlockRemoved", [1], "GPU", 1]]
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=EventBatchIn)
    assert back.events[0].group_idx is None and back.events[0].block_hashes == [1, 2]
    assert isinstance(back.events[2], AllBlocksCleared)


def test_0_32_events_encode_as_maps_keyed_by_type():
    """vLLM 0.32's form: a map per event, "type" first, unset fields left
    out; decode_events reads it as it reads 0.14's arrays."""
    events = [MapBlockStored([1], None, [5, 6], 2, None, "GPU", None, extra_keys=[None],
                             group_idx=0, kv_cache_spec_kind="full_attention"),
              MapBlockRemoved([1], "GPU", group_idx=0), MapAllBlocksCleared()]
    wire = msgspec.msgpack.encode(events)
    assert msgspec.msgpack.decode(wire) == [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": [5, 6], "block_size": 2, "lora_id": None, "medium": "GPU",
         "lora_name": None, "extra_keys": [None], "group_idx": 0,
         "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"}]
    assert list(msgspec.msgpack.decode(wire))[0].__iter__().__next__() == "type"
    assert decode_events(wire) == events
    assert decode_events(msgspec.msgpack.encode([BlockRemoved([3], "GPU")])) == [
        GroupBlockRemoved([3], "GPU")]


def test_a_0_32_pool_s_events_carry_each_block_s_extra_keys():
    """LoRA name on every block, the salt on block 0, `(identifier, offset
    in the block)` per item a block overlaps, the sha256 of a block's
    embeds rows; group and spec kind on every stored block (the window
    only where there is one: the recorded streams have them)."""
    import hashlib
    config = make_config(vllm_version="0.32.0", hash_algorithm="vllm-sha256", hash_seed="0",
                         groups=(FullSpec(4),), num_blocks=16)
    with KVCacheManager(config, kv_events=True) as mgr:
        h = mgr.make_hasher()
        r = Request("r", tokens(0, 12), h, lora_name="ad", lora_path="/a", cache_salt="s",
                    mm_features=[(2, 4, "img")])
        mgr.allocate_slots(r, 12)
        (stored,) = mgr.take_events()
        assert isinstance(stored, MapBlockStored) and len(stored.block_hashes) == 3
        assert (stored.group_idx, stored.kv_cache_spec_kind,
                stored.kv_cache_spec_sliding_window) == (0, "full_attention", None)
        assert stored.extra_keys == [("ad", ("img", 2), "s"), ("ad", ("img", -2)), ("ad",)]
        rows = bytes(range(12)) * 2                     # 12 tokens of 2 bytes
        e = Request("e", [0] * 12, h, prompt_embeds=rows)
        mgr.allocate_slots(e, 12)
        (stored,) = mgr.take_events()
        assert stored.extra_keys == [(hashlib.sha256(rows[i * 8:(i + 1) * 8]).digest(),)
                                     for i in range(3)]


def test_external_hashes_are_the_low_64_bits_big_endian():
    assert external_hash(bytes(range(32))) == int.from_bytes(bytes(range(24, 32)), "big")
    assert external_hash(b"\x01") == 1


def test_lora_adapters_are_numbered_in_order_of_first_use():
    log = EventLog()
    assert [log.lora_id(n) for n in ("b", "a", "b", None, "")] == [1, 2, 1, None, None]


# -- pools of several groups, and requests without tokens ---------------------------------------
def test_a_hybrid_pool_names_the_group_of_each_event():
    config = make_config(groups=(FullSpec(4), SlidingWindowSpec(4, 8)), num_blocks=12)
    with KVCacheManager(config, kv_events=True) as mgr:
        hasher = mgr.make_hasher()
        req = Request("a", tokens(0, 9), hasher)
        mgr.allocate_slots(req, 9)       # caches the full blocks it allocates
        stored = mgr.take_events()
        assert [(type(e), e.group_idx, len(e.block_hashes)) for e in stored] == [
            (GroupBlockStored, 0, 2), (GroupBlockStored, 1, 2)]
        assert stored[0].token_ids == tokens(0, 8) and stored[0].parent_block_hash is None
        assert stored[0].block_hashes == stored[1].block_hashes   # the same tokens
        mgr.free(req)
        mgr.evict_blocks(range(12))
        removed = mgr.take_events()
        assert {(e.group_idx, e.block_hashes[0]) for e in removed} == {
            (g, h) for g in (0, 1) for h in stored[0].block_hashes}
        assert mgr.take_events() == []
        assert mgr.reset_prefix_cache()
        assert mgr.take_events() == [AllBlocksCleared()]


def test_a_request_added_by_hashes_stores_blocks_without_tokens():
    config = make_config(groups=(FullSpec(4),), num_blocks=12)
    with KVCacheManager(config, kv_events=True) as mgr:
        hasher = mgr.make_hasher()
        hashes = Request("probe", tokens(0, 8), hasher).block_hashes
        req = Request.from_block_hashes("a", list(hashes), 8, hasher, lora_name="ad")
        mgr.allocate_slots(req, 8, delay_cache_blocks=True)
        assert mgr.take_events() == []
        mgr.cache_blocks(req, 4)
        mgr.cache_blocks(req, 8)
        first, second = mgr.take_events()
        assert first.token_ids == second.token_ids == []
        assert second.parent_block_hash == first.block_hashes[0]
        assert (first.lora_id, first.lora_name) == (1, "ad")
        assert type(first) is BlockStored


def test_a_manager_without_events_records_none():
    config = make_config(groups=(FullSpec(4),), num_blocks=12)
    with KVCacheManager(config) as mgr:
        req = Request("a", tokens(0, 8), mgr.make_hasher())
        mgr.allocate_slots(req, 8)
        mgr.cache_blocks(req, 8)
        assert mgr.take_events() == [] and mgr.events is None
