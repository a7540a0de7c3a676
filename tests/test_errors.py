"""Caller mistakes get typed errors and leave the pool exactly as it was.

Each test snapshots the observable pool state (free count, free-queue order,
cached blocks, the requests' block lists, request-table occupancy) before a bad
call and compares after it.  Pools: 10 blocks of 4 tokens, one full-attention
group, caching on, unless a test says otherwise.
"""

from __future__ import annotations

import pickle

import pytest

from kvshm import (
    CrossAttentionSpec,
    FullSpec,
    InvalidArgument,
    KVCacheManager,
    Request,
    RequestTableFull,
    RequestTooLong,
    SinkFullSpec,
)

from helpers import assert_clean, ids, make_config, tokens
from kvshm.ops.errors import ERROR_CLASSES, error_from_wire


def snapshot(m: KVCacheManager, *request_ids: str):
    return (
        m.num_free_blocks,
        m.block_pool.free_queue(),
        m.block_pool.num_cached_blocks,
        len(m.table),
        {rid: m.get_block_ids(rid) for rid in request_ids},
    )


def setup_pool(m: KVCacheManager):
    """a running with [1, 2, 3] (10 tokens, 2 cached blocks); b's blocks
    [4, 5] freed (cached block 4 in the queue)."""
    h = m.make_hasher()
    a = Request("a", tokens(0, 10), h)
    assert ids(m.allocate_slots(a, 10)) == [[1, 2, 3]]
    b = Request("b", tokens(50, 56), h)
    assert ids(m.allocate_slots(b, 6)) == [[4, 5]]
    m.free(b)
    assert m.block_pool.free_queue() == [6, 7, 8, 9, 5, 4]
    return h, a


# -- allocate_slots arguments ------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_new_tokens=-1),
        dict(num_new_tokens=4, num_new_computed_tokens=-4),
        dict(num_new_tokens=4, num_lookahead_tokens=-1),
        dict(num_new_tokens=4, num_external_computed_tokens=-4),
        dict(num_new_tokens=4, num_encoder_tokens=-1),
    ],
)
@pytest.mark.parametrize("running", [False, True])
def test_negative_token_counts(kwargs, running):
    with KVCacheManager(make_config()) as m:
        h, a = setup_pool(m)
        r = a if running else Request("c", tokens(0, 10), h)
        before = snapshot(m, "a", "c")
        with pytest.raises(InvalidArgument):
            m.allocate_slots(r, **kwargs)
        assert snapshot(m, "a", "c") == before
        assert_clean(m)


def test_zero_new_tokens_without_external_tokens():
    with KVCacheManager(make_config()) as m:
        h, a = setup_pool(m)
        c = Request("c", tokens(0, 10), h)
        before = snapshot(m, "a", "c")
        with pytest.raises(InvalidArgument):
            m.allocate_slots(c, 0)
        with pytest.raises(InvalidArgument):
            m.allocate_slots(a, 0, num_lookahead_tokens=3)
        assert snapshot(m, "a", "c") == before


def test_zero_new_tokens_with_external_tokens_is_legal():
    """num_new_tokens=0 is fine with external tokens: their blocks are
    allocated (from the head) but not reported as new, and cached."""
    with KVCacheManager(make_config()) as m:
        h = m.make_hasher()
        e = Request("e", tokens(100, 110), h)
        assert ids(m.allocate_slots(e, 0, num_external_computed_tokens=8)) == [[]]
        assert m.get_block_ids("e") == ([1, 2],)
        assert m.block_pool.num_cached_blocks == 2
        e.num_computed_tokens = 8
        assert ids(m.allocate_slots(e, 2)) == [[3]]
        assert_clean(m)


@pytest.mark.parametrize(
    "hits",
    [
        ([4], []),  # two groups on a one-group pool
        ([10],),  # == num_blocks
        ([-1],),
        ([4, 2**31],),
        (["4"],),
        ([True],),
    ],
    ids=["two-groups", "id-10", "id-minus-1", "id-huge", "id-str", "id-bool"],
)
def test_bad_new_computed_blocks(hits):
    with KVCacheManager(make_config()) as m:
        h, _ = setup_pool(m)
        c = Request("c", tokens(50, 56), h)
        before = snapshot(m, "a", "c")
        with pytest.raises(InvalidArgument):
            m.allocate_slots(c, 2, 4, hits)
        assert snapshot(m, "a", "c") == before
        assert_clean(m)


def test_prefix_hits_for_a_running_request():
    """A request that already holds blocks cannot adopt prefix-cache hits."""
    with KVCacheManager(make_config()) as m:
        h, a = setup_pool(m)
        a.num_computed_tokens = 10
        a.append_token_ids([10])
        before = snapshot(m, "a")
        with pytest.raises(InvalidArgument):
            m.allocate_slots(a, 1, 4, ([4],))
        assert snapshot(m, "a") == before
        assert ids(m.allocate_slots(a, 1)) == [[]]  # the normal step still works
        assert_clean(m)


def test_external_tokens_for_a_running_request_on_a_caching_off_pool():
    """External computed tokens only make sense for a request with no blocks."""
    with KVCacheManager(make_config(enable_caching=False)) as m:
        a = Request("a", tokens(0, 10))
        assert ids(m.allocate_slots(a, 10)) == [[1, 2, 3]]
        a.num_computed_tokens = 10
        a.append_token_ids([10, 11, 12, 13, 14])
        before = snapshot(m, "a")
        with pytest.raises(InvalidArgument):
            m.allocate_slots(a, 1, num_external_computed_tokens=4)
        assert snapshot(m, "a") == before


def test_prefix_hits_on_a_caching_off_pool_are_rejected():
    """BUG: on a caching-off pool allocate_slots adopts new_computed_blocks
    without taking a reference, so the request ends up holding another
    request's block at ref count 1: freeing it puts block 1 in the free queue
    while 'a' still holds it (check_segment: 'block 1: ref count 0, but 1
    request-table references').  vLLM asserts here.  Expected:
    InvalidArgument and nothing changed."""
    with KVCacheManager(make_config(enable_caching=False)) as m:
        a = Request("a", tokens(0, 4))
        assert ids(m.allocate_slots(a, 4)) == [[1]]
        b = Request("b", tokens(0, 5))
        before = snapshot(m, "a", "b")
        try:
            with pytest.raises(InvalidArgument):
                m.allocate_slots(b, 1, 4, ([1],))
            assert snapshot(m, "a", "b") == before
        finally:
            m.free(b)
        assert m.get_block_ids("a") == ([1],)
        assert 1 not in m.block_pool.free_queue()
        assert_clean(m)


def test_a_sink_block_passed_as_a_prefix_hit_is_rejected():
    """BUG: sink blocks have ref count 0 but are not in the free queue; a sink
    id in new_computed_blocks passes the range check, and touch() then
    'removes' it from a queue it is not in.  Observed: allocate_slots returns
    ([3],), b holds [1, 2, 3], num_free_blocks says 4 while the linked queue
    still holds 6 blocks (check_segment: 'free queue holds 6 blocks, the
    header says 4', 'sink block 1 is free, referenced, or held by a
    request').  Expected: InvalidArgument, pool unchanged."""
    with KVCacheManager(make_config(groups=(SinkFullSpec(4, 8),))) as m:
        h = m.make_hasher()
        assert m.block_pool.free_queue() == [3, 4, 5, 6, 7, 8, 9]
        b = Request("b", tokens(0, 9), h)
        before = snapshot(m, "b")
        with pytest.raises(InvalidArgument):
            m.allocate_slots(b, 1, 8, ([1, 2],))
        assert snapshot(m, "b") == before
        assert_clean(m)


def test_allocation_larger_than_the_pool_returns_none_and_changes_nothing():
    """A failing allocation leaves the hits it was given in the free queue
    and the request without blocks; a smaller one then succeeds."""
    with KVCacheManager(make_config()) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 12), h)
        assert ids(m.allocate_slots(a, 12)) == [[1, 2, 3]]
        m.free(a)
        assert m.block_pool.free_queue() == [4, 5, 6, 7, 8, 9, 3, 2, 1]
        b = Request("b", tokens(0, 40), h)
        hits, n = m.get_computed_blocks(b)
        assert ids(hits) == [[1, 2, 3]] and n == 12
        before = snapshot(m, "b")
        # 40 tokens = 10 blocks: 7 new + 3 hits leaving the queue > 9 free.
        assert m.allocate_slots(b, 28, 12, hits) is None
        assert snapshot(m, "b") == before
        assert m.get_block_ids("b") == ([],)
        # 36 tokens = 9 blocks fits exactly.
        assert ids(m.allocate_slots(b, 24, 12, hits)) == [[4, 5, 6, 7, 8, 9]]
        assert m.get_block_ids("b") == ([1, 2, 3, 4, 5, 6, 7, 8, 9],)
        assert m.num_free_blocks == 0
        assert_clean(m)


def test_running_request_growth_beyond_the_pool_returns_none():
    with KVCacheManager(make_config()) as m:
        h, a = setup_pool(m)
        a.num_computed_tokens = 10
        a.append_token_ids(tokens(10, 40))
        before = snapshot(m, "a")
        assert m.allocate_slots(a, 30) is None
        assert snapshot(m, "a") == before
        assert_clean(m)


# -- request table ------------------------------------------------------------------------


def test_request_table_full():
    """max_num_seqs=2: a third request with blocks raises RequestTableFull
    until one of the first two is freed."""
    with KVCacheManager(make_config(max_num_seqs=2)) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 4), h)
        b = Request("b", tokens(10, 14), h)
        c = Request("c", tokens(20, 24), h)
        assert ids(m.allocate_slots(a, 4)) == [[1]]
        assert ids(m.allocate_slots(b, 4)) == [[2]]
        before = snapshot(m, "a", "b")
        with pytest.raises(RequestTableFull) as e:
            m.allocate_slots(c, 4)
        assert e.value.capacity == 2
        with pytest.raises(RequestTableFull):
            m.get_num_common_prefix_blocks("c")
        assert snapshot(m, "a", "b") == before
        assert m.get_block_ids("c") == ([],)
        # A lookup needs no slot.
        assert m.get_computed_blocks(c)[1] == 0
        m.free(a)
        assert ids(m.allocate_slots(c, 4)) == [[3]]
        assert len(m.table) == 2
        assert_clean(m)


def test_cross_attention_encoder_longer_than_max_encoder_len():
    """A row holds ceil(max_encoder_len / block) cross blocks: 20 tokens ->
    5 blocks; 21 encoder tokens need 6 -> RequestTooLong."""
    cfg = make_config(groups=(FullSpec(4), CrossAttentionSpec(4)), enable_caching=False,
                      max_encoder_len=20, num_blocks=20)
    with KVCacheManager(cfg) as m:
        r = Request("r", tokens(0, 4))
        with pytest.raises(RequestTooLong) as e:
            m.allocate_slots(r, 4, num_encoder_tokens=21)
        assert (e.value.group, e.value.needed, e.value.capacity) == (1, 6, 5)
        assert m.num_free_blocks == 19
        assert m.get_block_ids("r") == ([], [])
        assert len(m.table) == 0
        assert ids(m.allocate_slots(r, 4, num_encoder_tokens=20)) == [[1], [2, 3, 4, 5, 6]]
        assert_clean(m)


def test_external_tokens_beyond_max_model_len():
    """External computed tokens past max_model_len would not fit the row."""
    with KVCacheManager(make_config(max_model_len=16, num_blocks=20)) as m:
        h = m.make_hasher()
        r = Request("r", tokens(0, 30), h)
        with pytest.raises(RequestTooLong) as e:
            m.allocate_slots(r, 1, num_external_computed_tokens=24)
        assert (e.value.group, e.value.needed, e.value.capacity) == (0, 6, 4)
        assert m.num_free_blocks == 19
        assert len(m.table) == 0


def test_invented_or_stale_hits_are_rejected():
    """Hits must be blocks in the prefix cache (as get_computed_blocks returns
    them); anything else would share a block that holds other tokens."""
    with KVCacheManager(make_config(max_model_len=8)) as m:
        h = m.make_hasher()
        r = Request("r", tokens(0, 20), h)
        with pytest.raises(InvalidArgument, match="stale or invented hit"):
            m.allocate_slots(r, 1, 12, ([1, 2, 3],))
        assert m.block_pool.free_queue() == [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_request_id_longer_than_64_bytes():
    """Request ids are stored in 64 bytes (UTF-8) in the request table."""
    with KVCacheManager(make_config()) as m:
        h = m.make_hasher()
        ok = Request("x" * 64, tokens(0, 4), h)
        assert ids(m.allocate_slots(ok, 4)) == [[1]]
        before = snapshot(m, "x" * 64)
        for rid in ("y" * 65, "é" * 33):  # 65 and 66 bytes
            with pytest.raises(InvalidArgument):
                m.allocate_slots(Request(rid, tokens(0, 4), h), 4)
            with pytest.raises(InvalidArgument):
                m.get_num_common_prefix_blocks(rid)
        assert snapshot(m, "x" * 64) == before
        assert ids(m.allocate_slots(Request("é" * 32, tokens(0, 4), h), 4)) == [[2]]
        assert_clean(m)


def test_empty_request_id():
    with pytest.raises(InvalidArgument):
        Request("", [1, 2, 3])


# -- token ids -------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [2**32, -1, 1.5, "7", None])
def test_token_id_out_of_range_in_a_full_block(bad):
    """A bad token inside a full block is rejected by Request() and by
    append_token_ids, which leaves the request unchanged."""
    with KVCacheManager(make_config()) as m:
        h = m.make_hasher()
        with pytest.raises(InvalidArgument):
            Request("r", [1, 2, 3, bad, 5], h)
        r = Request("r", [1, 2, 3, 4, 5, 6], h)
        hashes = list(r.block_hashes)
        with pytest.raises(InvalidArgument):
            r.append_token_ids([7, bad, 9])
        assert r.all_token_ids == [1, 2, 3, 4, 5, 6]
        assert r.num_tokens == 6
        assert r.block_hashes == hashes
        r.append_token_ids([7, 8])
        assert len(r.block_hashes) == 2


def test_token_id_bounds_are_inclusive_of_0_and_2_pow_32_minus_1():
    with KVCacheManager(make_config()) as m:
        h = m.make_hasher()
        r = Request("r", [0, 2**32 - 1, 0, 2**32 - 1], h)
        assert len(r.block_hashes) == 1


def test_token_id_out_of_range_in_a_partial_block_is_rejected_at_once():
    """BUG: tokens are only checked when their block is hashed.
    Request("r", [1, 2**32], hasher) on a 4-token-block pool succeeds; the
    error surfaces later, from an innocent append_token_ids([3, 4]) that
    completes the block, and every later append fails the same way (the
    request can never grow).  Likewise append_token_ids([-1]) to a 1-token
    request is accepted.  Expected: InvalidArgument from the call that
    brings the bad token in."""
    with KVCacheManager(make_config()) as m:
        h = m.make_hasher()
        with pytest.raises(InvalidArgument):
            Request("r", [1, 2**32], h)
        s = Request("s", [1], h)
        with pytest.raises(InvalidArgument):
            s.append_token_ids([-1])
        assert s.all_token_ids == [1]


# -- cache_blocks, remove_skipped_blocks, free ------------------------------------------------


@pytest.mark.parametrize("n", [11, 100, -1])
def test_cache_blocks_outside_the_request(n):
    with KVCacheManager(make_config()) as m:
        _, a = setup_pool(m)
        before = snapshot(m, "a")
        with pytest.raises(InvalidArgument):
            m.cache_blocks(a, n)
        assert snapshot(m, "a") == before


def test_request_without_a_hasher_on_a_caching_pool():
    """A request with no block hashes cannot be cached: allocate_slots and
    cache_blocks raise InvalidArgument and change nothing."""
    with KVCacheManager(make_config()) as m:
        setup_pool(m)
        r = Request("r", tokens(0, 10))  # no hasher
        assert r.block_hashes == []
        before = snapshot(m, "a", "r")
        with pytest.raises(InvalidArgument):
            m.allocate_slots(r, 10)
        assert snapshot(m, "a", "r") == before
        with pytest.raises(InvalidArgument):
            m.cache_blocks(r, 8)
        assert snapshot(m, "a", "r") == before
        assert_clean(m)


def test_remove_skipped_blocks_with_a_negative_count():
    with KVCacheManager(make_config()) as m:
        setup_pool(m)
        before = snapshot(m, "a")
        with pytest.raises(InvalidArgument):
            m.remove_skipped_blocks("a", -1)
        assert snapshot(m, "a") == before


def test_freeing_an_unknown_request_is_a_no_op():
    with KVCacheManager(make_config()) as m:
        setup_pool(m)
        before = snapshot(m, "a", "nobody")
        m.free("nobody")
        m.free(Request("nobody", [1, 2]))
        assert snapshot(m, "a", "nobody") == before
        m.free("a")
        m.free("a")  # twice: also a no-op
        assert m.block_pool.free_queue() == [6, 7, 8, 9, 5, 4, 3, 2, 1]
        assert len(m.table) == 0
        assert_clean(m)


def test_hits_reused_for_other_tokens_since_the_lookup_are_stale():
    """A hit block that was evicted and re-cached with other content between
    get_computed_blocks and allocate_slots (another session's allocation, in
    the coordinator) is refused with StaleHits, and nothing changes."""
    from kvshm.core.errors import StaleHits

    with KVCacheManager(make_config(num_blocks=5)) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 8), h)
        assert ids(m.allocate_slots(a, 8)) == [[1, 2]]
        m.free(a)
        b = Request("b", tokens(0, 9), h)
        hits, n = m.get_computed_blocks(b)
        assert (ids(hits), n) == ([[1, 2]], 8)
        # Another request takes every free block (evicting 1 and 2) and
        # caches its own tokens in them.
        c = Request("c", tokens(100, 116), h)
        assert ids(m.allocate_slots(c, 16)) == [[3, 4, 2, 1]]
        before = (m.num_free_blocks, m.block_pool.free_queue(), ids(m.get_block_ids("c")))
        with pytest.raises(StaleHits, match="block 1 is not cached for this request"):
            m.allocate_slots(b, 1, n, hits)
        assert (m.num_free_blocks, m.block_pool.free_queue(), ids(m.get_block_ids("c"))) == before
        assert ids(m.get_block_ids("b")) == [[]]
        assert_clean(m)


@pytest.mark.parametrize("cls", [c for c in ERROR_CLASSES.values() if c.template],
                         ids=lambda c: c.__name__)
def test_an_error_made_from_its_fields_crosses_the_wire_whole(cls):
    """A templated error is raised with its fields' values: its message
    names them, and the client's copy (code -> class, message, fields) is
    the same error."""
    values = tuple(f"v-{f}" if f in ("path", "name", "request_id", "field", "rule")
                   else 1000 + i for i, f in enumerate(cls.fields))
    err = cls(*values)
    assert {f: getattr(err, f) for f in cls.fields} == dict(zip(cls.fields, values))
    for v in values:
        assert (f"{v:,}" if isinstance(v, int) else v) in str(err) or str(v) in str(err)
    back = error_from_wire(err.code, str(err), err.wire_fields())
    assert type(back) is cls and str(back) == str(err)
    assert back.wire_fields() == err.wire_fields()
    copy = pickle.loads(pickle.dumps(err))  # as a multiprocessing pool returns it
    assert type(copy) is cls and str(copy) == str(err)
    assert copy.wire_fields() == err.wire_fields()
    with pytest.raises(TypeError, match=cls.__name__):
        cls(*values[:-1])
