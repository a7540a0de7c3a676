"""The hot path's short cuts give what the full path gives: an allocation
that changes nothing (a decode step inside the blocks a request holds)
returns at once and leaves every byte of the segment as it was; its error
and refusal cases stay those of the full path; an executor that does not
time its ops keeps every other counter; the replay's quick reply check
agrees with the full comparison."""

from __future__ import annotations

import msgspec
import pytest

from kvshm import FullSpec, InvalidArgument, KVCacheManager, Request, SlidingWindowSpec
from kvshm.core.metrics import read_metrics
from kvshm.ops import protocol as p
from kvshm.ops.executor import OpExecutor
from kvshm.replay import TraceTranslator, check_reply, prefix_sources

import helpers
from helpers import assert_clean, ids, step, tokens


def segment_bytes(m: KVCacheManager) -> bytes:
    with open(f"/dev/shm/{m.segment.name}", "rb") as f:
        return f.read()


@pytest.mark.parametrize("groups", [[FullSpec(4)], [FullSpec(4), SlidingWindowSpec(4, 8)]],
                         ids=["full", "full+sliding"])
def test_a_step_inside_held_blocks_changes_no_byte(groups):
    with KVCacheManager(helpers.make_config(groups, num_blocks=24)) as m:
        r = Request("r", tokens(0, 6), m.make_hasher())
        assert ids(m.allocate_slots(r, 6)) == [[1, 2], [3, 4]][:len(groups)]
        step(r, 6, [6])
        before = segment_bytes(m)
        assert ids(m.allocate_slots(r, 1)) == [[]] * len(groups)   # slot 7 of 8
        assert segment_bytes(m) == before
        step(r, 7, [7])
        assert ids(m.allocate_slots(r, 1)) == [[]] * len(groups)   # slot 8, caches block 2
        assert segment_bytes(m) != before
        assert m.block_pool.block_hash(2) == r.block_hashes[1]
        step(r, 8, [8])
        new = m.allocate_slots(r, 1)   # a new block in every group
        assert all(len(g) == 1 for g in new)
        assert_clean(m)


def test_the_window_sliding_past_a_block_takes_the_full_path():
    with KVCacheManager(helpers.make_config([FullSpec(4), SlidingWindowSpec(4, 4)],
                                            num_blocks=24)) as m:
        r = Request("r", tokens(0, 7), m.make_hasher())
        m.allocate_slots(r, 7)
        free = m.num_free_blocks
        step(r, 7, [7])
        assert ids(m.allocate_slots(r, 1)) == [[], []]   # inside the blocks held...
        assert m.num_free_blocks == free + 1             # ...but block 0 of the window left
        assert m.get_block_ids("r")[1][0] == 0
        assert_clean(m)


def test_a_quota_floor_refuses_even_a_step_that_needs_no_block():
    with KVCacheManager(helpers.make_config([FullSpec(4)], num_blocks=12)) as m:
        r = Request("r", tokens(0, 6), m.make_hasher())
        m.allocate_slots(r, 6)
        step(r, 6, [6])
        m.free_floor = m.num_free_blocks + 1   # a tenant over its quota
        assert m.allocate_slots(r, 1) is None and m.refused_by_floor
        m.free_floor = 0
        assert ids(m.allocate_slots(r, 1)) == [[]]


def test_a_request_whose_hashes_lag_is_refused_on_a_quiet_step_too():
    with KVCacheManager(helpers.make_config([FullSpec(4)], num_blocks=12)) as m:
        r = Request("r", tokens(0, 6), m.make_hasher())
        m.allocate_slots(r, 6)
        step(r, 6, [6])
        r.block_hashes.pop()   # as a request hashed by another pool's hasher might
        before = segment_bytes(m)
        with pytest.raises(InvalidArgument, match="lacks block hashes"):
            m.allocate_slots(r, 1)
        assert segment_bytes(m) == before


def test_an_untimed_executor_keeps_every_other_counter():
    with KVCacheManager(helpers.make_config([FullSpec(4)], num_blocks=12)) as m:
        ex = OpExecutor(m, time_ops=False)
        owner = ex.lifecycle.open(1)
        assert ex.execute(owner, p.AddRequest("a", tokens(0, 6))) == p.Done()
        assert ex.execute(owner, p.Batch([p.AllocateSlots("a", 6), p.Free("a", True)])
                          ).results[1].num_free_blocks == 11
        bad = ex.execute(owner, p.Advance("nobody", 1))
        assert bad.code == "UNKNOWN_REQUEST"
        got = read_metrics(m.segment.metrics)
        assert got["preemptions"] == 1 and got["errors"]["UNKNOWN_REQUEST"] == 1
        assert got["ops"]["advance"]["errors"] == 1
        assert all(sum(op["buckets"]) == 0 and op["seconds"] == 0
                   for op in got["ops"].values())


def test_the_quick_reply_check_agrees_with_the_full_one():
    alloc = {"op": "allocate_slots", "req": "a", "num_new_tokens": 1,
             "expect": {"new_block_ids": [[3]], "num_free_blocks": 7}}
    quick, full = TraceTranslator.matches, TraceTranslator.got
    for reply, same in [(p.Allocated(([3],), 7), True), (p.Allocated([[3]], 7), True),
                        (p.Allocated(([4],), 7), False), (p.Allocated(([3],), 6), False),
                        (p.Allocated(None, 7), False), (p.Error("BAD_ARGUMENT", "x"), False)]:
        assert quick(alloc, reply) is same
        assert (check_reply(alloc, full(alloc, reply), 2) is None) is same
    free = {"op": "free", "req": "a", "expect": {"num_free_blocks": 9}}
    assert quick(free, p.FreeBlocks(9)) and not quick(free, p.FreeBlocks(8))
    advance = {"op": "advance", "req": "a", "num_computed_tokens": 3}
    assert quick(advance, p.Done())
    assert not quick(advance, p.Error("UNKNOWN_REQUEST", "x"))
    assert check_reply(advance, full(advance, p.Error("UNKNOWN_REQUEST", "x")), 2) is not None


def test_the_quick_check_of_lookups_and_free_queue_heads():
    quick, full = TraceTranslator.matches, TraceTranslator.got
    hits = {"op": "get_computed_blocks", "req": "a",
            "expect": {"block_ids": [[1, 2]], "num_computed_tokens": 32}}
    check = {"op": "check", "expect": {"num_free_blocks": 5, "free_head": [3, 4]}}
    usage = {"op": "usage", "expect": {"usage": 0.5}}
    stats = p.Stats(10, 5, 0, 0.5, 0, 0, 0, 0, 0, 0, [3, 4])
    cases = [(hits, p.ComputedBlocks(([1, 2],), 32), True),
             (hits, p.ComputedBlocks(((1, 2),), 32), True),
             (hits, p.ComputedBlocks(([1],), 16), False),
             (hits, p.ComputedBlocks(([1, 2],), 16), False),
             (check, stats, True),
             (check, msgspec.structs.replace(stats, free_head=[4, 3]), False),
             (check, msgspec.structs.replace(stats, num_free_blocks=6), False),
             (usage, stats, False)]   # (a float within tolerance: the full check decides)
    for op, reply, same in cases:
        assert quick(op, reply) is same, (op, reply)
        if same:
            assert check_reply(op, full(op, reply), 2) is None
    assert check_reply(usage, full(usage, stats), 2) is None
    extra = {**hits, "expect": {**hits["expect"], "more": 1}}
    assert not quick(extra, p.ComputedBlocks(([1, 2],), 32))


def test_a_lookup_s_own_hits_skip_the_block_check_only_while_nothing_was_uncached():
    from kvshm.core.errors import StaleHits
    from kvshm.core.kv_cache_manager import Hits

    with KVCacheManager(helpers.make_config([FullSpec(4)], num_blocks=12)) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 12), h)
        m.allocate_slots(a, 12)
        b = Request("b", tokens(0, 9), h)
        hits, n = m.get_computed_blocks(b)
        assert hits.__class__ is Hits and (ids(hits), n) == ([[1, 2]], 8)
        assert hits.request_id == "b" and hits.uncached == m.block_pool.uncached
        # Another request's lookup is checked block by block: b's hashes
        # are not c's, so the blocks are stale for it.
        c = Request("c", tokens(50, 59), h)
        with pytest.raises(StaleHits):
            m.allocate_slots(c, 1, n, hits)
        # Once a block has lost its hash, b's own hits are checked too.
        m.evict_blocks([3])                     # (a cached block b does not use)
        assert hits.uncached != m.block_pool.uncached
        assert ids(m.allocate_slots(b, 1, n, hits)) == [[4]]
        # The same hits again: b holds blocks now.
        with pytest.raises(InvalidArgument, match="already holds blocks"):
            m.allocate_slots(b, 1, n, hits)
        d = Request("d", tokens(0, 9), h)
        hits, n = m.get_computed_blocks(d)
        assert ids(m.allocate_slots(d, 1, n, hits)) == [[5]]   # the quick way
        assert_clean(m)


def test_the_translator_keeps_only_the_tokens_a_later_prompt_copies():
    ops = [{"op": "add_request", "req": "a", "prompt": [1, 2, 3]},
           {"op": "add_request", "req": "b", "prompt": [7]},
           {"op": "advance", "req": "a", "num_computed_tokens": 3, "append": [4]},
           {"op": "advance", "req": "b", "num_computed_tokens": 1, "append": [8]},
           {"op": "free", "req": "a"},
           {"op": "add_request", "req": "c", "prefix": {"req": "a", "len": 4}, "prompt": [9]}]
    sources = prefix_sources(ops)
    assert sources == {"a"}
    for tr in (TraceTranslator(sources), TraceTranslator()):
        msgs = [tr.message(op) for op in ops]
        assert msgs[-1].prompt == [1, 2, 3, 4, 9]        # a's tokens, after its free too
        assert msgs[0].prompt == [1, 2, 3]                # the message did not grow
        assert ("b" in tr.tokens) is (tr.sources is None)
    assert ops[0]["prompt"] == [1, 2, 3]                  # nor did the trace
