"""Per-attention-type behaviour on tiny pools, with exact block ids;
hybrid pools are in test_hybrid_managers.py.

Every expected value was derived by running vLLM 0.14.0's own KVCacheManager
on the same sequence of calls.  All pools use 4-token blocks and
hash_block_size 4 unless a test says otherwise; block 0 is the null block
(the placeholder for skipped / out-of-window positions).
"""

from __future__ import annotations

import pytest

from kvshm import (ChunkedLocalSpec, ConfigError, CrossAttentionSpec, FullSpec,
    KVCacheManager, MambaSpec, MLASpec, PoolConfig, Request, SinkFullSpec,
    SlidingWindowSpec)

import helpers
from helpers import assert_clean, ids, lookup, step, tokens

FULL = FullSpec(4)
SW8 = SlidingWindowSpec(4, sliding_window=8)


def make_config(groups, num_blocks=12, **changes) -> PoolConfig:
    return helpers.make_config(groups, num_blocks, **changes)


def assert_no_duplicates_in_free_queue(m: KVCacheManager) -> None:
    q = m.block_pool.free_queue()
    assert len(q) == len(set(q)) == m.num_free_blocks
    assert 0 not in q


# -- full attention and MLA ----------------------------------------------------------


def test_mla_alone_behaves_like_full_attention():
    """A single MLA group allocates, hits and counts common prefix blocks
    exactly like full attention."""
    with KVCacheManager(make_config([MLASpec(4)], num_blocks=10)) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 10), h)
        assert ids(m.allocate_slots(a, 10)) == [[1, 2, 3]]
        b = Request("b", tokens(0, 10), h)
        hits, n = m.get_computed_blocks(b)
        assert ids(hits) == [[1, 2]] and n == 8
        assert ids(m.allocate_slots(b, 2, 8, hits)) == [[4]]
        assert m.get_num_common_prefix_blocks("a") == [2]
        c = Request("c", tokens(50, 55), h)
        assert ids(m.allocate_slots(c, 5)) == [[5, 6]]
        assert m.get_num_common_prefix_blocks("a") == [0]
        assert m.block_pool.free_queue() == [7, 8, 9]
        assert_clean(m)


def test_full_and_mla_are_distinct_specs_in_a_hybrid_pool():
    """full + MLA is a valid hybrid pool (two specs), each group gets its own
    blocks, and a hit needs both types to hit."""
    with KVCacheManager(make_config([FULL, MLASpec(4)], num_blocks=24)) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 9), h)
        assert ids(m.allocate_slots(a, 9)) == [[1, 2, 3], [4, 5, 6]]
        b = Request("b", tokens(0, 10), h)
        assert lookup(m, b) == ([[1, 2], [4, 5]], 8)
        m.evict_blocks([5])  # the MLA group's second block only
        assert lookup(m, b) == ([[1], [4]], 4)
        assert m.get_num_common_prefix_blocks("a") == [3, 3]
        m.free(a)
        assert m.block_pool.free_queue()[-6:] == [3, 2, 1, 6, 5, 4]
        assert_clean(m)
    # The same two groups as full + full would be one spec: not a hybrid pool.
    with pytest.raises(ConfigError):
        make_config([FULL, FULL], num_blocks=24)


def test_num_common_prefix_blocks_counts_blocks_every_request_shares():
    """A full-attention block is common when its ref count equals the number of
    requests holding blocks; caching off always gives 0."""
    with KVCacheManager(make_config([FULL])) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 13), h)
        assert ids(m.allocate_slots(a, 13)) == [[1, 2, 3, 4]]
        assert m.get_num_common_prefix_blocks("a") == [4]
        b = Request("b", tokens(0, 13), h)
        hits, n = m.get_computed_blocks(b)
        assert ids(hits) == [[1, 2, 3]] and n == 12
        assert ids(m.allocate_slots(b, 1, n, hits)) == [[5]]
        assert m.get_num_common_prefix_blocks("a") == [3]
        assert m.get_num_common_prefix_blocks("b") == [3]
        c = Request("c", tokens(0, 6), h)
        hits, n = m.get_computed_blocks(c)
        assert ids(hits) == [[1]] and n == 4
        assert ids(m.allocate_slots(c, 2, n, hits)) == [[6]]
        assert m.get_num_common_prefix_blocks("a") == [1]
        m.free(c)
        assert m.get_num_common_prefix_blocks("b") == [3]
        # As in vLLM, probing an unknown id creates an empty entry that counts
        # as a request until it is freed.
        assert m.get_num_common_prefix_blocks("zz") == [0]
        assert m.get_num_common_prefix_blocks("b") == [0]
        m.free("zz")
        assert m.get_num_common_prefix_blocks("b") == [3]


# -- sink full attention --------------------------------------------------------------


def test_sink_blocks_are_reserved_at_the_start():
    """sink_len 8 / block size 4 reserves blocks 1 and 2 for good: 7 free
    blocks, usage 2/9 on an idle pool, reset_prefix_cache always fails."""
    with KVCacheManager(make_config([SinkFullSpec(4, sink_len=8)], num_blocks=10)) as m:
        h = m.make_hasher()
        assert m.num_free_blocks == 7
        assert m.block_pool.free_queue() == [3, 4, 5, 6, 7, 8, 9]
        assert m.usage == pytest.approx(2 / 9, abs=1e-12)
        assert m.reset_prefix_cache() is False
        a = Request("a", tokens(0, 9), h)
        assert ids(m.allocate_slots(a, 9)) == [[3, 4, 5]]
        b = Request("b", tokens(0, 10), h)
        assert lookup(m, b) == ([[3, 4]], 8)
        m.free(a)
        assert m.num_free_blocks == 7
        assert m.block_pool.free_queue() == [6, 7, 8, 9, 5, 4, 3]
        assert m.reset_prefix_cache() is False
        assert m.usage == pytest.approx(2 / 9, abs=1e-12)
        assert lookup(m, b) == ([[3, 4]], 8)  # the failed reset kept the cache
        assert_clean(m)


def test_sink_groups_reserve_in_group_order():
    """Each sink group takes its blocks from the queue head in group order
    (sink 8 -> blocks 1, 2; sink 4 -> block 3)."""
    groups = [FULL, SinkFullSpec(4, sink_len=8), SinkFullSpec(4, sink_len=4)]
    with KVCacheManager(make_config(groups, num_blocks=12)) as m:
        h = m.make_hasher()
        assert m.num_free_blocks == 8
        assert m.block_pool.free_queue() == [4, 5, 6, 7, 8, 9, 10, 11]
        a = Request("a", tokens(0, 5), h)
        assert ids(m.allocate_slots(a, 5)) == [[4, 5], [6, 7], [8, 9]]
        assert m.num_free_blocks == 2
        assert_clean(m)


# -- sliding window ---------------------------------------------------------------------


def computed_20_then_skipped(m):
    """Request "a" of 20 tokens, all computed in one step (blocks 1-5 of 4
    tokens), then its skipped blocks removed; returns the pool's hasher."""
    h = m.make_hasher()
    a = Request("a", tokens(0, 20), h)
    assert ids(m.allocate_slots(a, 20)) == [[1, 2, 3, 4, 5]]
    step(a, 20, [20])
    m.remove_skipped_blocks("a", 20)
    return h


def test_sliding_window_remove_skipped_blocks_nulls_and_frees_them():
    """Window 8 at 20 computed tokens skips 13 tokens = 3 blocks: they become 0
    and are freed last-first ([3, 2, 1] to the tail)."""
    with KVCacheManager(make_config([SW8])) as m:
        computed_20_then_skipped(m)
        assert m.get_block_ids("a") == ([0, 0, 0, 4, 5],)
        assert m.num_free_blocks == 9
        assert m.block_pool.free_queue() == [6, 7, 8, 9, 10, 11, 3, 2, 1]
        # Idempotent: the same call again frees nothing.
        m.remove_skipped_blocks("a", 20)
        assert m.block_pool.free_queue() == [6, 7, 8, 9, 10, 11, 3, 2, 1]
        assert_clean(m)


def test_sliding_window_hit_is_searched_right_to_left_for_contiguous_blocks():
    """Window 8 needs ceil(7/4) = 2 contiguous cached blocks: the rightmost
    such run wins, earlier positions are null."""
    with KVCacheManager(make_config([SW8])) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 20), h)
        m.allocate_slots(a, 20)
        step(a, 20, [20])
        m.remove_skipped_blocks("a", 20)
        b = Request("b", tokens(0, 23), h)
        assert lookup(m, b) == ([[0, 0, 0, 4, 5]], 20)
        # Break the run 4-5: the next run right to left is 2-3 (free, cached).
        m.evict_blocks([4])
        hits, n = m.get_computed_blocks(b)
        assert ids(hits) == [[0, 2, 3]] and n == 12
        assert ids(m.allocate_slots(b, 11, 12, hits)) == [[6, 7, 8]]
        assert m.get_block_ids("b") == ([0, 2, 3, 6, 7, 8],)
        assert m.block_pool.free_queue() == [9, 10, 11, 1]
        assert m.get_num_common_prefix_blocks("b") == [0]
        m.free(a)
        assert m.block_pool.free_queue() == [9, 10, 11, 1, 5, 4]
        m.free(b)
        assert m.block_pool.free_queue() == [9, 10, 11, 1, 5, 4, 8, 7, 6, 3, 2]
        assert_clean(m)


def test_sliding_window_hit_skips_a_run_that_is_too_short():
    """A single cached block at the right end is not enough; the hit nulls the
    blocks below the window of the adopted run."""
    with KVCacheManager(make_config([SW8])) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 24), h)
        assert ids(m.allocate_slots(a, 24)) == [[1, 2, 3, 4, 5, 6]]
        m.free(a)
        assert m.block_pool.free_queue() == [7, 8, 9, 10, 11, 6, 5, 4, 3, 2, 1]
        m.evict_blocks([5])
        b = Request("b", tokens(0, 25), h)
        hits, n = m.get_computed_blocks(b)
        assert ids(hits) == [[0, 0, 3, 4]] and n == 16
        assert ids(m.allocate_slots(b, 9, 16, hits)) == [[7, 8, 9]]
        assert m.get_block_ids("b") == ([0, 0, 3, 4, 7, 8, 9],)
        assert m.block_pool.free_queue() == [10, 11, 6, 5, 2, 1]
        assert_clean(m)


@pytest.mark.parametrize(
    "window, hits",
    [
        (5, [0, 0, 0, 0, 0, 6]),  # ceil(4/4) = 1 block: the lone last block
        (6, [0, 0, 3, 4]),  # ceil(5/4) = 2
        (8, [0, 0, 3, 4]),  # ceil(7/4) = 2
        (9, [0, 0, 3, 4]),  # ceil(8/4) = 2
        (13, [0, 2, 3, 4]),  # ceil(12/4) = 3
        (17, [1, 2, 3, 4]),  # ceil(16/4) = 4: the run from block 0
        (21, [1, 2, 3, 4]),  # 5 never found: fall back to the run at block 0
    ],
)
def test_sliding_window_hit_needs_ceil_window_minus_1_over_block_contiguous_blocks(window, hits):
    """Blocks 1..6 cached, block 5 evicted: runs are [6] (length 1) at the
    right and [1, 2, 3, 4] from block 0."""
    with KVCacheManager(make_config([SlidingWindowSpec(4, window)])) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 24), h)
        assert ids(m.allocate_slots(a, 24)) == [[1, 2, 3, 4, 5, 6]]
        m.free(a)
        m.evict_blocks([5])
        assert lookup(m, Request("b", tokens(0, 25), h)) == ([hits], 4 * len(hits))


def test_regression_remove_skipped_then_free_never_frees_a_block_twice():
    """Trap: a sliding-window block dropped by remove_skipped_blocks must not be
    freed again by free(), also when it was shared with another request's
    prefix hit and that request trims and frees it too."""
    with KVCacheManager(make_config([SW8], num_blocks=14)) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 20), h)
        assert ids(m.allocate_slots(a, 20)) == [[1, 2, 3, 4, 5]]
        b = Request("b", tokens(0, 23), h)
        hits, n = m.get_computed_blocks(b)
        assert ids(hits) == [[0, 0, 0, 4, 5]] and n == 20
        assert ids(m.allocate_slots(b, 3, 20, hits)) == [[6]]
        assert m.get_block_ids("b") == ([0, 0, 0, 4, 5, 6],)
        assert m.block_pool.free_queue() == [7, 8, 9, 10, 11, 12, 13]

        step(a, 20, tokens(20, 28))
        assert ids(m.allocate_slots(a, 8)) == [[7, 8]]
        assert m.get_block_ids("a") == ([0, 0, 0, 4, 5, 7, 8],)
        assert m.block_pool.free_queue() == [9, 10, 11, 12, 13, 3, 2, 1]
        step(a, 28, [28])
        m.remove_skipped_blocks("a", 28)
        assert m.get_block_ids("a") == ([0, 0, 0, 0, 0, 7, 8],)
        # 4 and 5 are still held by b: nothing joins the free queue.
        assert m.block_pool.free_queue() == [9, 10, 11, 12, 13, 3, 2, 1]
        m.remove_skipped_blocks("a", 28)
        m.free(a)
        assert m.block_pool.free_queue() == [9, 10, 11, 12, 13, 3, 2, 1, 8, 7]
        assert_no_duplicates_in_free_queue(m)

        step(b, 23, [99])
        m.remove_skipped_blocks("b", 23)
        assert m.get_block_ids("b") == ([0, 0, 0, 0, 5, 6],)
        m.free(b)
        assert m.num_free_blocks == 13
        assert m.block_pool.free_queue() == [9, 10, 11, 12, 13, 3, 2, 1, 8, 7, 4, 6, 5]
        m.free(b)  # freeing again is a no-op
        assert m.block_pool.free_queue() == [9, 10, 11, 12, 13, 3, 2, 1, 8, 7, 4, 6, 5]
        assert_no_duplicates_in_free_queue(m)
        assert_clean(m)


def test_regression_failed_allocation_still_frees_out_of_window_blocks():
    """Trap: allocate_slots that returns None has already trimmed the
    request's out-of-window blocks (16 computed, window 8: blocks 1 and 2)."""
    with KVCacheManager(make_config([SW8], num_blocks=8)) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 16), h)
        assert ids(m.allocate_slots(a, 16)) == [[1, 2, 3, 4]]
        step(a, 16, [16])
        assert m.block_pool.free_queue() == [5, 6, 7]
        assert m.allocate_slots(a, 30) is None
        assert m.get_block_ids("a") == ([0, 0, 3, 4],)
        assert m.num_free_blocks == 5
        assert m.block_pool.free_queue() == [5, 6, 7, 2, 1]
        assert ids(m.allocate_slots(a, 1)) == [[5]]
        assert m.get_block_ids("a") == ([0, 0, 3, 4, 5],)
        m.free(a)
        assert m.block_pool.free_queue() == [6, 7, 2, 1, 5, 4, 3]
        assert_no_duplicates_in_free_queue(m)
        assert_clean(m)


# -- chunked local attention ------------------------------------------------------------


def test_chunked_local_frees_blocks_before_the_current_chunk():
    """Chunk 8 at 20 computed tokens: tokens 0..15 are out of the chunk, so 4
    blocks become 0; a hit starts at the current chunk."""
    spec = ChunkedLocalSpec(4, attention_chunk_size=8)
    with KVCacheManager(make_config([spec])) as m:
        h = computed_20_then_skipped(m)
        assert m.get_block_ids("a") == ([0, 0, 0, 0, 5],)
        assert m.block_pool.free_queue() == [6, 7, 8, 9, 10, 11, 4, 3, 2, 1]
        b = Request("b", tokens(0, 23), h)
        assert lookup(m, b) == ([[0, 0, 0, 0, 5]], 20)
        # Within the first chunk's second half: block 3 (tokens 8..11) hits.
        d = Request("d", tokens(0, 13), h)
        assert lookup(m, d) == ([[0, 0, 3]], 12)
        assert_clean(m)


def test_chunked_local_prompt_past_a_chunk_boundary_hits_nulls_without_cache():
    """A 17-token prompt never seen before 'hits' the 16 tokens of the
    finished chunks as 4 null blocks; adopting them allocates just one block."""
    spec = ChunkedLocalSpec(4, attention_chunk_size=8)
    with KVCacheManager(make_config([spec])) as m:
        h = m.make_hasher()
        c = Request("c", tokens(500, 517), h)
        hits, n = m.get_computed_blocks(c)
        assert ids(hits) == [[0, 0, 0, 0]] and n == 16
        assert ids(m.allocate_slots(c, 1, 16, hits)) == [[1]]
        assert m.get_block_ids("c") == ([0, 0, 0, 0, 1],)
        assert m.num_free_blocks == 10
        assert_clean(m)


# -- mamba -----------------------------------------------------------------------------


def test_mamba_keeps_only_the_block_of_the_last_computed_token():
    """At 10 computed tokens only block 3 (tokens 8..11) is needed; a hit is
    the rightmost cached block with nulls before it."""
    with KVCacheManager(make_config([MambaSpec(4)])) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 10), h)
        assert ids(m.allocate_slots(a, 10)) == [[1, 2, 3]]
        step(a, 10, [10])
        m.remove_skipped_blocks("a", 10)
        assert m.get_block_ids("a") == ([0, 0, 3],)
        assert m.block_pool.free_queue() == [4, 5, 6, 7, 8, 9, 10, 11, 2, 1]
        assert ids(m.allocate_slots(a, 1)) == [[]]
        b = Request("b", tokens(0, 12), h)
        hits, n = m.get_computed_blocks(b)
        assert ids(hits) == [[0, 2]] and n == 8
        assert ids(m.allocate_slots(b, 4, 8, hits)) == [[4]]
        assert m.get_block_ids("b") == ([0, 2, 4],)
        assert m.get_num_common_prefix_blocks("b") == [0]
        m.free(a)
        m.free(b)
        assert m.block_pool.free_queue() == [5, 6, 7, 8, 9, 10, 11, 1, 3, 4, 2]
        assert_clean(m)


def test_mamba_speculative_blocks_are_allocated_beyond_the_need():
    """num_speculative_blocks=2 adds 2 blocks: 10 tokens take 5 blocks."""
    with KVCacheManager(make_config([MambaSpec(4, num_speculative_blocks=2)])) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 10), h)
        assert ids(m.allocate_slots(a, 10)) == [[1, 2, 3, 4, 5]]
        step(a, 10, [10])
        assert ids(m.allocate_slots(a, 1)) == [[]]
        assert m.get_block_ids("a") == ([0, 0, 3, 4, 5],)
        assert m.block_pool.free_queue() == [6, 7, 8, 9, 10, 11, 2, 1]
        assert_clean(m)


def test_mamba_without_caching_holds_one_block_per_request():
    """Caching off, mamba block size = max_model_len: the mamba group holds a
    single block while the full group grows."""
    cfg = make_config([FULL, MambaSpec(64)], num_blocks=20, enable_caching=False)
    with KVCacheManager(cfg) as m:
        a = Request("a", tokens(0, 10))
        assert ids(m.allocate_slots(a, 10)) == [[1, 2, 3], [4]]
        step(a, 10, [10])
        assert ids(m.allocate_slots(a, 1)) == [[], []]
        step(a, 11, tokens(11, 17))
        assert ids(m.allocate_slots(a, 6)) == [[5, 6], []]
        m.remove_skipped_blocks("a", 17)
        assert m.get_block_ids("a") == ([1, 2, 3, 5, 6], [4])
        assert m.get_num_common_prefix_blocks("a") == [0, 0]
        m.free(a)
        assert m.block_pool.free_queue()[-6:] == [6, 5, 3, 2, 1, 4]
        assert_clean(m)


# -- cross attention ---------------------------------------------------------------------


def test_cross_attention_allocates_encoder_blocks_once():
    """ceil(num_encoder_tokens / 4) cross blocks come with the first
    allocation; later steps (num_encoder_tokens=0) add none; free goes group
    by group, each tail first."""
    cfg = make_config([FULL, CrossAttentionSpec(4)], enable_caching=False)
    with KVCacheManager(cfg) as m:
        a = Request("a", tokens(0, 5))
        assert lookup(m, a) == ([[], []], 0)
        assert ids(m.allocate_slots(a, 5, num_encoder_tokens=10)) == [[1, 2], [3, 4, 5]]
        step(a, 5, [5, 6, 7, 8])
        assert ids(m.allocate_slots(a, 4)) == [[6], []]
        assert m.get_block_ids("a") == ([1, 2, 6], [3, 4, 5])
        b = Request("b", tokens(0, 5))
        assert ids(m.allocate_slots(b, 5, num_encoder_tokens=3)) == [[7, 8], [9]]
        assert m.get_num_common_prefix_blocks("a") == [0, 0]
        m.free(a)
        assert m.block_pool.free_queue() == [10, 11, 6, 2, 1, 5, 4, 3]
        m.free(b)
        assert m.block_pool.free_queue() == [10, 11, 6, 2, 1, 5, 4, 3, 8, 7, 9]
        assert m.block_pool.num_cached_blocks == 0
        assert_clean(m)


# -- EAGLE ---------------------------------------------------------------------------------


def test_eagle_drops_the_last_matched_full_attention_block():
    """With use_eagle, 3 matching blocks give a 2-block hit; 1 gives none."""
    with KVCacheManager(make_config([FULL], use_eagle=True)) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 13), h)
        assert ids(m.allocate_slots(a, 13)) == [[1, 2, 3, 4]]
        assert lookup(m, Request("b", tokens(0, 13), h)) == ([[1, 2]], 8)
        assert lookup(m, Request("c", tokens(0, 5), h)) == ([[]], 0)


def test_eagle_sliding_window_needs_one_more_contiguous_block():
    """Window 8 with EAGLE needs 3 contiguous blocks and then drops one; a
    run too short anywhere falls back to the run at block 0."""
    with KVCacheManager(make_config([SW8], use_eagle=True)) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 20), h)
        assert ids(m.allocate_slots(a, 20)) == [[1, 2, 3, 4, 5]]
        b = Request("b", tokens(0, 21), h)
        assert lookup(m, b) == ([[0, 0, 3, 4]], 16)
        m.evict_blocks([3])
        assert lookup(m, b) == ([[1]], 4)


# -- decode context parallel ---------------------------------------------------------------


def test_dcp_world_size_2_doubles_the_block_size():
    """block_size 4 with dcp 2 is an 8-token block everywhere (hash_block_size
    8): 17 tokens take 3 blocks and hits are whole 8-token blocks."""
    cfg = make_config([FULL], hash_block_size=8, dcp_world_size=2)
    with KVCacheManager(cfg) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 17), h)
        assert ids(m.allocate_slots(a, 17)) == [[1, 2, 3]]
        b = Request("b", tokens(0, 20), h)
        hits, n = m.get_computed_blocks(b)
        assert ids(hits) == [[1, 2]] and n == 16
        assert lookup(m, Request("c", tokens(0, 16), h)) == ([[1]], 8)
        assert ids(m.allocate_slots(b, 4, 16, hits)) == [[4]]
        assert m.get_block_ids("b") == ([1, 2, 4],)
        assert m.get_num_common_prefix_blocks("a") == [2]
        assert m.block_pool.free_queue() == [5, 6, 7, 8, 9, 10, 11]
        assert_clean(m)
