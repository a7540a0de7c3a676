"""Hybrid pools (groups of more than one attention type) on tiny pools, with
exact block ids; each single attention type is in test_managers.py.

Every expected value was derived by running vLLM 0.14.0's own KVCacheManager
on the same sequence of calls.  All pools use 4-token blocks and
hash_block_size 4 unless a test says otherwise; block 0 is the null block
(the placeholder for skipped / out-of-window positions).
"""

from __future__ import annotations

from kvshm import FullSpec, KVCacheManager, MambaSpec, Request, SlidingWindowSpec

from helpers import assert_clean, ids, lookup, make_config, step, tokens

FULL = FullSpec(4)
SW8 = SlidingWindowSpec(4, sliding_window=8)


# -- hybrid models -------------------------------------------------------------------------


def test_hybrid_full_and_sliding_window():
    """full + window 8: both groups allocate, only the window group is trimmed,
    and the hit is the longest length both accept."""
    with KVCacheManager(make_config([FULL, SW8], num_blocks=24)) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 20), h)
        assert ids(m.allocate_slots(a, 20)) == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
        step(a, 20, [20])
        m.remove_skipped_blocks("a", 20)
        assert m.get_block_ids("a") == ([1, 2, 3, 4, 5], [0, 0, 0, 9, 10])
        assert m.block_pool.free_queue()[-3:] == [8, 7, 6]
        b = Request("b", tokens(0, 23), h)
        assert lookup(m, b) == ([[1, 2, 3, 4, 5], [0, 0, 0, 9, 10]], 20)
        # Without window block 9 the window needs 2 contiguous blocks ending
        # earlier: 7-8 (free, still cached) at 12 tokens.
        m.evict_blocks([9])
        hits, n = m.get_computed_blocks(b)
        assert ids(hits) == [[1, 2, 3], [0, 7, 8]] and n == 12
        assert ids(m.allocate_slots(b, 11, 12, hits)) == [[11, 12, 13], [14, 15, 16]]
        assert m.get_block_ids("b") == ([1, 2, 3, 11, 12, 13], [0, 7, 8, 14, 15, 16])
        assert m.get_num_common_prefix_blocks("a") == [3, 0]
        m.free(a)
        m.free(b)
        assert m.block_pool.free_queue() == [17, 18, 19, 20, 21, 22, 23, 6, 5, 4, 10, 9,
                                             13, 12, 11, 3, 2, 1, 16, 15, 14, 8, 7]
        assert_clean(m)


def test_regression_hybrid_without_any_hit_returns_empty_and_zero():
    """Trap: a hybrid lookup on an empty cache is ([], []) and 0 tokens."""
    with KVCacheManager(make_config([FULL, SW8], num_blocks=24)) as m:
        h = m.make_hasher()
        assert lookup(m, Request("x", tokens(0, 23), h)) == ([[], []], 0)
    with KVCacheManager(make_config([FULL, MambaSpec(4)], num_blocks=24)) as m:
        h = m.make_hasher()
        assert lookup(m, Request("x", tokens(0, 23), h)) == ([[], []], 0)


def test_regression_hybrid_with_hits_in_only_one_type_returns_zero():
    """Trap: the full group hits every block but the window (or mamba) group
    has nothing cached: the hit is 0 tokens and no blocks for any group."""
    with KVCacheManager(make_config([FULL, SW8], num_blocks=24)) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 20), h)
        assert ids(m.allocate_slots(a, 20)) == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
        m.free(a)
        m.evict_blocks([6, 7, 8, 9, 10])
        assert lookup(m, Request("b", tokens(0, 23), h)) == ([[], []], 0)
        assert m.num_free_blocks == 23
        assert_clean(m)
    with KVCacheManager(make_config([FULL, MambaSpec(4)], num_blocks=24)) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 12), h)
        assert ids(m.allocate_slots(a, 12)) == [[1, 2, 3], [4, 5, 6]]
        m.free(a)
        m.evict_blocks([4, 5, 6])
        assert lookup(m, Request("b", tokens(0, 13), h)) == ([[], []], 0)


def test_hybrid_groups_with_equal_specs_are_looked_up_together():
    """Two identical full groups + a window group: a block index hits only if
    both full groups still cache it."""
    with KVCacheManager(make_config([FULL, FULL, SW8], num_blocks=24)) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 13), h)
        assert ids(m.allocate_slots(a, 13)) == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
        b = Request("b", tokens(0, 13), h)
        assert lookup(m, b) == ([[1, 2, 3], [5, 6, 7], [0, 10, 11]], 12)
        m.evict_blocks([6])  # group 1's second block only
        assert lookup(m, b) == ([[1], [5], [9]], 4)
        m.evict_blocks([5])  # group 1's first block
        assert lookup(m, b) == ([[], [], []], 0)


def test_hybrid_hit_length_is_a_multiple_of_the_lcm_block_size():
    """full (block 4) + window 16 (block 8): lcm 8, so 3 cached full blocks
    (12 tokens) give an 8-token hit; the 8-token group caches 2 blocks."""
    groups = [FULL, SlidingWindowSpec(8, sliding_window=16)]
    with KVCacheManager(make_config(groups, num_blocks=24)) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 13), h)
        assert ids(m.allocate_slots(a, 13)) == [[1, 2, 3, 4], [5, 6]]
        assert lookup(m, Request("b", tokens(0, 14), h)) == ([[1, 2], [5]], 8)
        step(a, 13, tokens(13, 20))
        assert ids(m.allocate_slots(a, 7)) == [[7], [8]]
        assert m.get_block_ids("a") == ([1, 2, 3, 4, 7], [5, 6, 8])
        assert lookup(m, Request("c", tokens(0, 17), h)) == ([[1, 2, 3, 4], [5, 6]], 16)
        assert lookup(m, Request("d", tokens(0, 21), h)) == ([[1, 2, 3, 4], [5, 6]], 16)
        assert_clean(m)


def test_hybrid_full_and_mamba():
    """full + mamba (both block 4): mamba keeps its last block only, and the hit
    is the rightmost mamba state within the full-attention hit."""
    with KVCacheManager(make_config([FULL, MambaSpec(4)], num_blocks=24)) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 10), h)
        assert ids(m.allocate_slots(a, 10)) == [[1, 2, 3], [4, 5, 6]]
        step(a, 10, [10])
        assert ids(m.allocate_slots(a, 1)) == [[], []]
        assert m.get_block_ids("a") == ([1, 2, 3], [0, 0, 6])
        assert m.block_pool.free_queue()[-2:] == [5, 4]
        assert lookup(m, Request("c", tokens(0, 7), h)) == ([[1], [4]], 4)
        b = Request("b", tokens(0, 12), h)
        hits, n = m.get_computed_blocks(b)
        assert ids(hits) == [[1, 2], [0, 5]] and n == 8
        assert ids(m.allocate_slots(b, 4, 8, hits)) == [[7], [8]]
        assert m.get_block_ids("b") == ([1, 2, 7], [0, 5, 8])
        assert m.get_num_common_prefix_blocks("a") == [2, 0]
        m.free(a)
        m.free(b)
        assert m.block_pool.free_queue()[-8:] == [4, 3, 6, 7, 2, 1, 8, 5]
        assert_clean(m)


def test_hybrid_full_and_mamba_with_a_larger_mamba_block():
    """full (4) + mamba (8): hits are multiples of 8 tokens; the mamba hit is
    its block at the end of the hit, nulls before it."""
    with KVCacheManager(make_config([FULL, MambaSpec(8)], num_blocks=24)) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 17), h)
        assert ids(m.allocate_slots(a, 17)) == [[1, 2, 3, 4, 5], [6, 7, 8]]
        assert lookup(m, Request("b", tokens(0, 15), h)) == ([[1, 2], [6]], 8)
        assert lookup(m, Request("c", tokens(0, 18), h)) == ([[1, 2, 3, 4], [0, 7]], 16)
