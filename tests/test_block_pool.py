"""Block pool semantics on tiny pools: exact block ids and exact LRU order.

Every expected value here was derived from vLLM 0.14.0's own KVCacheManager
run on the same sequence of calls.  Unless a test says otherwise the pool has
10 blocks (block 0 is the null block, so 9 usable), one full-attention group
with 4-token blocks, and prefix caching on.
"""

from __future__ import annotations

import pytest

from kvshm import InvalidArgument, KVCacheManager, Request
from kvshm.core.hash_map import BlockHashMap

from helpers import assert_clean, lookup, make_config, tokens


# -- allocation and the free queue ------------------------------------------------


def test_initial_state_null_block_is_never_free():
    """Block 0 is taken as the null block: 9 of 10 blocks are free, in id order."""
    with KVCacheManager(make_config()) as m:
        assert m.num_free_blocks == 9
        assert m.block_pool.free_queue() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
        assert m.usage == 0.0
        assert_clean(m)


def test_allocation_pops_from_the_head_and_never_hands_out_block_0():
    """Allocations take the head of the queue; the whole pool is 1..9, then None."""
    with KVCacheManager(make_config()) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 10), h)
        assert m.allocate_slots(a, 10) == ([1, 2, 3],)
        assert m.block_pool.free_queue() == [4, 5, 6, 7, 8, 9]
        b = Request("b", tokens(100, 124), h)
        assert m.allocate_slots(b, 24) == ([4, 5, 6, 7, 8, 9],)
        assert m.num_free_blocks == 0
        assert m.block_pool.free_queue() == []
        c = Request("c", [1], h)
        assert m.allocate_slots(c, 1) is None
        assert m.get_block_ids("c") == ([],)
        assert m.usage == 1.0
        assert_clean(m)


def test_free_appends_each_request_tail_first():
    """free() returns a request's blocks last block first, after the blocks
    that were already free."""
    with KVCacheManager(make_config()) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 10), h)
        b = Request("b", tokens(100, 106), h)
        assert m.allocate_slots(a, 10) == ([1, 2, 3],)
        assert m.allocate_slots(b, 6) == ([4, 5],)
        assert m.block_pool.free_queue() == [6, 7, 8, 9]
        m.free(a)
        assert m.num_free_blocks == 7
        assert m.block_pool.free_queue() == [6, 7, 8, 9, 3, 2, 1]
        m.free("b")  # by id works too
        assert m.block_pool.free_queue() == [6, 7, 8, 9, 3, 2, 1, 5, 4]
        assert m.get_block_ids("a") == ([],)
        assert_clean(m)


def test_prefix_hit_on_free_blocks_takes_them_out_of_the_middle_of_the_queue():
    """A hit on cached free blocks removes exactly those blocks from the queue;
    the new block still comes from the head."""
    with KVCacheManager(make_config()) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 10), h)
        b = Request("b", tokens(100, 106), h)
        m.allocate_slots(a, 10)
        m.allocate_slots(b, 6)
        m.free(a)
        m.free(b)
        assert m.block_pool.free_queue() == [6, 7, 8, 9, 3, 2, 1, 5, 4]

        c = Request("c", tokens(0, 10), h)
        assert lookup(m, c) == ([[1, 2]], 8)
        hits, n = m.get_computed_blocks(c)
        # A lookup changes no block state.
        assert m.block_pool.free_queue() == [6, 7, 8, 9, 3, 2, 1, 5, 4]
        assert m.allocate_slots(c, 2, 8, hits) == ([6],)
        assert m.get_block_ids("c") == ([1, 2, 6],)
        assert m.block_pool.free_queue() == [7, 8, 9, 3, 5, 4]
        assert m.num_free_blocks == 6

        # b's first block (tokens 100..103) is still cached, sitting at the tail.
        d = Request("d", tokens(100, 106), h)
        assert lookup(m, d) == ([[4]], 4)
        assert_clean(m)


def test_usage_counts_the_pool_without_the_null_block():
    """usage = 1 - free / (num_blocks - 1)."""
    with KVCacheManager(make_config()) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 10), h)
        m.allocate_slots(a, 10)
        assert m.usage == pytest.approx(1 - 6 / 9, abs=1e-12)
        b = Request("b", tokens(50, 58), h)
        m.allocate_slots(b, 8)
        assert m.usage == pytest.approx(1 - 4 / 9, abs=1e-12)
        m.free(a)
        m.free(b)
        assert m.usage == 0.0


# -- prefix caching ---------------------------------------------------------------


def test_reusing_a_cached_free_block_evicts_its_hash():
    """When a cached free block is handed out again it stops hitting; the
    other cached blocks still hit."""
    with KVCacheManager(make_config()) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 8), h)
        assert m.allocate_slots(a, 8) == ([1, 2],)
        m.free(a)
        assert m.block_pool.free_queue() == [3, 4, 5, 6, 7, 8, 9, 2, 1]
        # 8 blocks: the 7 uncached ones, then block 2 (a's second block).
        big = Request("big", tokens(200, 232), h)
        assert m.allocate_slots(big, 32) == ([3, 4, 5, 6, 7, 8, 9, 2],)
        assert m.block_pool.free_queue() == [1]
        assert m.block_pool.block_hash(2) == big.block_hashes[7]
        c = Request("c", tokens(0, 9), h)
        assert lookup(m, c) == ([[1]], 4)
        assert_clean(m)


def test_the_header_counts_blocks_allocated_and_evicted():
    """Pool churn in the segment header (kvshm stats): every block handed
    out, and every cached hash dropped, by reuse or evict_blocks; a reset
    is not an eviction, hits are not allocations."""
    from kvshm.pool.stats import read_stats
    with KVCacheManager(make_config()) as m:
        seg = m.segment

        def churn():
            st = read_stats(seg)
            return st["blocks_allocated"], st["blocks_evicted"]

        assert churn() == (0, 0)            # the null block is not an allocation
        h = m.make_hasher()
        a = Request("a", tokens(0, 8), h)
        assert m.allocate_slots(a, 8) == ([1, 2],)
        m.free(a)
        assert churn() == (2, 0)
        big = Request("big", tokens(200, 232), h)
        assert m.allocate_slots(big, 32) == ([3, 4, 5, 6, 7, 8, 9, 2],)
        assert churn() == (10, 1)           # block 2's hash went with it
        c = Request("c", tokens(0, 9), h)
        hits, n = m.get_computed_blocks(c)
        assert m.allocate_slots(c, 9 - n, n, hits) is None   # the hit is not counted
        assert churn() == (10, 1)
        m.evict_blocks([1, 3])              # 1 cached, 3 in use and cached
        assert churn() == (10, 3)
        m.free(big)
        assert m.reset_prefix_cache()
        assert churn() == (10, 3)
        assert_clean(m)


def test_identical_content_is_cached_twice_and_the_earliest_block_wins():
    """No dedup: a second request with the same prompt (not reading the cache)
    caches its own copies; lookups return the earliest cached block per hash,
    falling back to the later copy once the earlier one is evicted."""
    with KVCacheManager(make_config()) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 9), h)
        b = Request("b", tokens(0, 9), h)
        assert m.allocate_slots(a, 9) == ([1, 2, 3],)
        assert m.allocate_slots(b, 9) == ([4, 5, 6],)
        assert m.block_pool.num_cached_blocks == 4
        assert m.block_pool.block_hash(1) == m.block_pool.block_hash(4)
        assert m.block_pool.block_hash(2) == m.block_pool.block_hash(5)

        c = Request("c", tokens(0, 9), h)
        assert lookup(m, c) == ([[1, 2]], 8)
        m.evict_blocks([1])
        assert lookup(m, c) == ([[4, 2]], 8)

        m.free(a)
        m.free(b)
        assert m.block_pool.free_queue() == [7, 8, 9, 3, 2, 1, 6, 5, 4]
        hits, n = m.get_computed_blocks(c)
        assert list(hits) == [[4, 2]]
        assert m.allocate_slots(c, 1, 8, hits) == ([7],)
        assert m.get_block_ids("c") == ([4, 2, 7],)
        assert m.block_pool.free_queue() == [8, 9, 3, 1, 6, 5]
        assert_clean(m)


def test_hit_is_capped_below_the_last_token_of_a_block_aligned_prompt():
    """A fully cached 8-token prompt hits only 4 tokens (the last block is
    recomputed); a 9-token prompt over the same blocks hits 8."""
    with KVCacheManager(make_config()) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 12), h)
        assert m.allocate_slots(a, 12) == ([1, 2, 3],)
        assert m.block_pool.num_cached_blocks == 3
        e = Request("e", tokens(0, 8), h)
        assert lookup(m, e) == ([[1]], 4)
        f = Request("f", tokens(0, 9), h)
        assert lookup(m, f) == ([[1, 2]], 8)
        g = Request("g", tokens(0, 12), h)
        assert lookup(m, g) == ([[1, 2]], 8)
        one = Request("one", [0], h)
        assert lookup(m, one) == ([[]], 0)


def test_partial_last_block_is_not_cached_until_it_is_full():
    """Only full blocks enter the cache; cache_blocks commits a block once its
    tokens are there."""
    with KVCacheManager(make_config()) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 6), h)
        assert m.allocate_slots(a, 6) == ([1, 2],)
        assert m.block_pool.num_cached_blocks == 1
        assert m.block_pool.block_hash(2) is None
        a.num_computed_tokens = 6
        a.append_token_ids([6, 7])
        m.cache_blocks(a, 8)
        assert m.block_pool.block_hash(2) == a.block_hashes[1]
        assert m.block_pool.num_cached_blocks == 2
        assert_clean(m)


def test_delay_cache_blocks_defers_caching():
    """delay_cache_blocks=True allocates without caching; a later cache_blocks
    commits the blocks."""
    with KVCacheManager(make_config()) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 9), h)
        assert m.allocate_slots(a, 9, delay_cache_blocks=True) == ([1, 2, 3],)
        assert m.block_pool.num_cached_blocks == 0
        b = Request("b", tokens(0, 9), h)
        assert lookup(m, b) == ([[]], 0)
        m.cache_blocks(a, 9)
        assert lookup(m, b) == ([[1, 2]], 8)


def test_cache_salt_and_lora_name_separate_the_cache():
    """Equal tokens only hit under an equal cache salt and an equal LoRA name;
    the salt only keys block 0 but changes every later hash via chaining."""
    with KVCacheManager(make_config()) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 9), h, cache_salt="s1")
        assert m.allocate_slots(a, 9) == ([1, 2, 3],)
        assert lookup(m, Request("b", tokens(0, 9), h, cache_salt="s2")) == ([[]], 0)
        assert lookup(m, Request("c", tokens(0, 9), h)) == ([[]], 0)
        assert lookup(m, Request("d", tokens(0, 9), h, cache_salt="s1")) == ([[1, 2]], 8)

        lo = Request("l", tokens(0, 9), h, lora_name="lora0")
        assert lookup(m, lo) == ([[]], 0)
        assert m.allocate_slots(lo, 9) == ([4, 5, 6],)
        assert lookup(m, Request("l2", tokens(0, 9), h, lora_name="lora0")) == ([[4, 5]], 8)
        assert lookup(m, Request("l3", tokens(0, 9), h, lora_name="lora1")) == ([[]], 0)
        # Salted hashes differ from unsalted ones in every block, not just block 0.
        plain = Request("p", tokens(0, 9), h)
        salted = Request("q", tokens(0, 9), h, cache_salt="s1")
        assert plain.block_hashes[0] != salted.block_hashes[0]
        assert plain.block_hashes[1] != salted.block_hashes[1]


def test_skip_reading_prefix_cache_gets_no_hit_but_still_caches():
    """A request with skip_reading_prefix_cache never hits, yet the blocks it
    computes are cached for others."""
    with KVCacheManager(make_config()) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 9), h)
        m.allocate_slots(a, 9)
        s = Request("s", tokens(0, 9), h, skip_reading_prefix_cache=True)
        assert lookup(m, s) == ([[]], 0)
        assert m.allocate_slots(s, 9) == ([4, 5, 6],)
        m.free(a)
        m.evict_blocks([1, 2])
        assert lookup(m, Request("t", tokens(0, 9), h)) == ([[4, 5]], 8)


def test_caching_off_never_hits_and_has_no_hasher():
    """With enable_caching=False there is no hasher, no hit, and no caching."""
    with KVCacheManager(make_config(enable_caching=False)) as m:
        assert m.make_hasher() is None
        a = Request("a", tokens(0, 9))
        assert m.allocate_slots(a, 9) == ([1, 2, 3],)
        m.cache_blocks(a, 9)  # a no-op
        assert m.block_pool.num_cached_blocks == 0
        assert lookup(m, Request("b", tokens(0, 9))) == ([[]], 0)
        assert m.get_num_common_prefix_blocks("a") == [0]
        m.free(a)
        assert m.block_pool.free_queue() == [4, 5, 6, 7, 8, 9, 3, 2, 1]
        assert_clean(m)


def test_xxh3_hash_algorithm_hits_like_sha256():
    """The hash algorithm changes the digests, not the caching behaviour."""
    with KVCacheManager(make_config(hash_algorithm="xxh3_128")) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 9), h)
        assert len(a.block_hashes[0]) == 16
        assert m.allocate_slots(a, 9) == ([1, 2, 3],)
        assert lookup(m, Request("b", tokens(0, 9), h)) == ([[1, 2]], 8)
        assert lookup(m, Request("c", tokens(1, 10), h)) == ([[]], 0)
        assert_clean(m)


# -- evict_blocks -----------------------------------------------------------------


def _two_cached_requests(m: KVCacheManager):
    """a = [1, 2, 3] (freed, blocks 1 and 2 cached), b = [4, 5, 6] (running,
    blocks 4 and 5 cached)."""
    h = m.make_hasher()
    a = Request("a", tokens(0, 9), h)
    b = Request("b", tokens(50, 59), h)
    assert m.allocate_slots(a, 9) == ([1, 2, 3],)
    assert m.allocate_slots(b, 9) == ([4, 5, 6],)
    m.free(a)
    assert m.block_pool.free_queue() == [7, 8, 9, 3, 2, 1]
    return h, a, b


def test_evict_blocks_uncaches_free_and_in_use_blocks_without_moving_them():
    """Evicting a free cached block (1), an in-use cached block (4), an
    uncached block (3, 6) and the null block only drops hashes: free counts,
    queue order and the requests' blocks stay as they were."""
    with KVCacheManager(make_config()) as m:
        h, _, _ = _two_cached_requests(m)
        assert m.block_pool.num_cached_blocks == 4
        m.evict_blocks([1, 4, 0, 3, 6])
        assert m.num_free_blocks == 6
        assert m.block_pool.free_queue() == [7, 8, 9, 3, 2, 1]
        assert m.get_block_ids("b") == ([4, 5, 6],)
        assert m.block_pool.block_hash(1) is None
        assert m.block_pool.block_hash(4) is None
        assert m.block_pool.num_cached_blocks == 2  # 2 and 5 remain
        # The first block of each prompt misses, so neither prompt hits at all.
        assert lookup(m, Request("a2", tokens(0, 9), h)) == ([[]], 0)
        assert lookup(m, Request("b2", tokens(50, 59), h)) == ([[]], 0)
        m.evict_blocks([])
        m.evict_blocks(set())
        assert m.block_pool.num_cached_blocks == 2
        assert_clean(m)


def test_evict_blocks_of_an_in_use_block_then_free_keeps_it_uncached():
    """A block evicted while in use goes back to the free queue uncached."""
    with KVCacheManager(make_config()) as m:
        h, _, b = _two_cached_requests(m)
        m.evict_blocks([5])
        m.free(b)
        assert m.block_pool.free_queue() == [7, 8, 9, 3, 2, 1, 6, 5, 4]
        assert lookup(m, Request("b2", tokens(50, 59), h)) == ([[4]], 4)
        assert_clean(m)


@pytest.mark.parametrize("bad", [10, -1, 2**40, True, "1", 1.0])
def test_evict_blocks_rejects_a_bad_id_and_evicts_nothing(bad):
    """An out-of-range (or non-int) id raises InvalidArgument before any block
    of the call is evicted."""
    with KVCacheManager(make_config()) as m:
        h, _, _ = _two_cached_requests(m)
        with pytest.raises(InvalidArgument):
            m.evict_blocks([1, 4, bad])
        assert m.block_pool.num_cached_blocks == 4
        assert m.block_pool.block_hash(1) is not None
        assert m.block_pool.block_hash(4) is not None
        assert m.num_free_blocks == 6
        assert m.block_pool.free_queue() == [7, 8, 9, 3, 2, 1]
        assert lookup(m, Request("a2", tokens(0, 9), h)) == ([[1, 2]], 8)
        assert_clean(m)


# -- reset_prefix_cache -----------------------------------------------------------


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    """reset_prefix_cache fails while any block is held, succeeds once all are
    free, drops every hash and leaves the queue order alone."""
    with KVCacheManager(make_config()) as m:
        h, _, b = _two_cached_requests(m)
        assert m.reset_prefix_cache() is False
        assert m.block_pool.num_cached_blocks == 4
        m.free(b)
        assert m.block_pool.free_queue() == [7, 8, 9, 3, 2, 1, 6, 5, 4]
        assert m.reset_prefix_cache() is True
        assert m.block_pool.num_cached_blocks == 0
        assert m.block_pool.free_queue() == [7, 8, 9, 3, 2, 1, 6, 5, 4]
        assert lookup(m, Request("a2", tokens(0, 9), h)) == ([[]], 0)
        assert m.reset_prefix_cache() is True  # idempotent
        assert m.usage == 0.0
        assert_clean(m)


def test_reset_prefix_cache_on_a_fresh_pool():
    """An untouched pool (only the null block used) can always be reset."""
    with KVCacheManager(make_config()) as m:
        assert m.reset_prefix_cache() is True
        assert m.block_pool.free_queue() == [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_the_hash_map_keeps_every_block_under_a_hash_earliest_first():
    m = BlockHashMap()
    h, other = b"\x01" * 32, b"\x02" * 32
    m.add(h, 5)
    assert m.get(h) == 5 and m.blocks(h) == [5] and m.shared(h) is None
    m.add(h, 9)
    m.add(h, 7)
    m.add(other, 3)
    assert m.get(h) == 5 and m.blocks(h) == [5, 9, 7] and m.blocks(other) == [3]
    m.remove(h, 5)                    # the next earliest takes its place
    assert m.get(h) == 9 and m.blocks(h) == [9, 7]
    m.remove(h, 7)
    assert m.get(h) == 9 and m.shared(h) is None
    m.remove(h, 9)
    assert h not in m and m.blocks(h) == [] and dict(m.entries()) == {other: [3]}
    m.add(other, 4)
    m.clear()
    assert len(m) == 0 and m.blocks(other) == [] and m.shared(h) is None
