"""vLLM 0.32's partial prefix entries (kvshm/core/block_pool.py, "Partial
entries"): on a hybrid pool whose full-attention blocks span two hash
blocks, the block a prompt's last hash boundary falls in is also cached
under that prefix's key.  No lookup takes it; KV events and the free order
see it, and it outlives adoption.  The recorded 0.32 traces and event
streams check the same against vLLM on whole workloads
(tests/test_conformance.py, tests/test_events.py); these tests pin each
rule on a tiny pool: 4-token hash blocks, full attention in 8-token blocks
beside a 16-token sliding window in 4-token blocks (with EAGLE, the shape
of the 0.32 set's `eagle-hyb-mla16-full32-sw32` traces: MLA in 4-token
blocks, an 8-token window block)."""

from __future__ import annotations

import pytest

from kvshm import KVCacheManager, Request
from kvshm.core.check import check_segment
from kvshm.core.events import external_hash
from kvshm.core.specs import FullSpec, MLASpec, SlidingWindowSpec
from kvshm.core.state import FLAG_CACHED, FLAG_PARTIAL
from kvshm.pool.lifecycle import adopt_pool, create_pool

from helpers import assert_clean, make_config, step, tokens

GROUPS = (FullSpec(8), SlidingWindowSpec(4, 16))
EAGLE_GROUPS = (FullSpec(8), MLASpec(4), SlidingWindowSpec(8, 16))


def config(**changes):
    return make_config(GROUPS, num_blocks=24, **{"vllm_version": "0.32.0", **changes})


def eagle_config():
    return make_config(EAGLE_GROUPS, num_blocks=30, vllm_version="0.32.0", use_eagle=True)


def stored(events) -> list[tuple[list[int], int]]:
    return [(e.block_hashes, e.block_size) for e in events
            if type(e).__name__.endswith("Stored") and e.group_idx == 0]


def removed(events) -> list[int]:
    return [h for e in events if type(e).__name__.endswith("Removed") and e.group_idx == 0
            for h in e.block_hashes]


def full_group_blocks(m, rid: str) -> list[int]:
    return m.get_block_ids(rid)[0]


def test_which_pools_take_partial_entries():
    assert config().partial_entry_groups == (0,)
    assert make_config((MLASpec(8), SlidingWindowSpec(4, 16)), vllm_version="0.32.0",
                       num_blocks=24).partial_entry_groups == (0,)
    assert config(vllm_version="0.14.0").partial_entry_groups == ()
    assert config(enable_caching=False).partial_entry_groups == ()
    assert make_config((FullSpec(4), SlidingWindowSpec(4, 16)), vllm_version="0.32.0",
                       num_blocks=24).partial_entry_groups == ()
    assert make_config((FullSpec(8),), hash_block_size=8, vllm_version="0.32.0",
                       num_blocks=24).partial_entry_groups == ()


def test_a_full_block_also_takes_the_prompt_s_partial_entry():
    """Prompt of 14 tokens: its last hash boundary a resend reaches is 12,
    inside full block 1 (tokens 8-15).  Once block 1 is cached full, it is
    cached under the 12-token prefix too: a stored event of one hash block
    (tokens 8-11, parented by the 8-token prefix), after the full block's."""
    with KVCacheManager(config(), kv_events=True) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 14), h)
        m.allocate_slots(a, 14)
        assert stored(m.take_events()) == [([external_hash(a.block_hashes[1])], 8)]
        step(a, 14, [100, 101])
        m.allocate_slots(a, 2)
        events = m.take_events()
        b1 = full_group_blocks(m, "a")[1]
        assert stored(events) == [([external_hash(a.block_hashes[3])], 8),
                                  ([external_hash(a.block_hashes[2])], 4)]
        partial = [e for e in events if e.block_size == 4 and e.group_idx == 0][0]
        assert partial.parent_block_hash == external_hash(a.block_hashes[1])
        assert partial.token_ids == tokens(8, 12)
        assert m.segment.flags[b1] == FLAG_CACHED | FLAG_PARTIAL
        assert m.segment.partial_tokens[b1] == 12
        assert_clean(m)
        # A second request of the same prompt does not hit the partial key
        # (a lookup asks for whole blocks): it hits block 0 only.
        b = Request("b", tokens(0, 14), h)
        hits, n = m.get_computed_blocks(b)
        assert n == 8 and hits[0] == full_group_blocks(m, "a")[:1]


def test_evicting_the_block_removes_both_entries_full_first():
    with KVCacheManager(config(), kv_events=True) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 14), h)
        m.allocate_slots(a, 14)
        step(a, 14, [100, 101])
        m.allocate_slots(a, 2)
        m.free(a)
        m.take_events()
        # Take every free block (60 tokens: 8 + 15 blocks): the hashed ones
        # go last, a's among them.
        big = Request("big", tokens(500, 560), h)
        assert m.allocate_slots(big, 60) is not None and m.num_free_blocks == 0
        gone = removed(m.take_events())
        full, partial = external_hash(a.block_hashes[3]), external_hash(a.block_hashes[2])
        assert sorted(gone) == sorted([external_hash(a.block_hashes[1]), full, partial])
        assert gone.index(partial) == gone.index(full) + 1
        assert not any(f & FLAG_PARTIAL for f in m.segment.flags)
        assert_clean(m)


def test_with_eagle_the_partial_entry_comes_first_and_gives_way_to_the_full_one():
    """EAGLE caches the full group one block past the aligned prefix: a
    13-token prompt (its boundary 12, EAGLE reading the whole prompt) gets
    a partial entry for block 1 before block 1 is full.  It is the block's
    only entry: freed, the block counts as hashed (the free queue's tail);
    filled, the entry is removed, the full one stored, and the partial one
    stored again beside it."""
    with KVCacheManager(eagle_config(), kv_events=True) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 13), h)
        m.allocate_slots(a, 13)
        b1 = full_group_blocks(m, "a")[1]
        assert m.segment.flags[b1] == FLAG_PARTIAL
        assert stored(m.take_events())[-1] == ([external_hash(a.block_hashes[2])], 4)
        # What estimate_cached_tokens counts for the block: its entry's prefix
        assert m.block_pool.hashed_tokens(b1, 16) == 12
        assert_clean(m)
        step(a, 13, [100, 101, 102])
        m.allocate_slots(a, 3)
        events = m.take_events()
        assert removed(events) == [external_hash(a.block_hashes[2])]
        assert stored(events) == [([external_hash(a.block_hashes[3])], 8),
                                  ([external_hash(a.block_hashes[2])], 4)]
        assert m.segment.flags[b1] == FLAG_CACHED | FLAG_PARTIAL
        assert_clean(m)


def test_a_block_with_only_a_partial_entry_is_freed_to_the_tail():
    with KVCacheManager(eagle_config()) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 13), h)
        m.allocate_slots(a, 13)
        held = [b for g in m.get_block_ids("a") for b in g if b]
        b1 = full_group_blocks(m, "a")[1]
        m.free(a)
        hashed = [b for b in held if m.segment.flags[b]]
        assert b1 in hashed and set(m.block_pool.free_queue()[-len(hashed):]) == set(hashed)
        assert_clean(m)
    with KVCacheManager(eagle_config()) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 11), h)        # boundary 8: a block's end, no entry
        m.allocate_slots(a, 11)
        held = [b for g in m.get_block_ids("a") for b in g if b]
        b1 = full_group_blocks(m, "a")[1]
        m.free(a)
        unhashed = [b for b in held if not m.segment.flags[b]]
        assert b1 in unhashed and set(m.block_pool.free_queue()[:len(unhashed)]) == set(unhashed)


def test_an_adopted_pool_keeps_its_partial_entries(pool_name):
    cfg = config()
    first = create_pool(cfg, pool_name)
    m = first.mgr
    h = m.make_hasher()
    a = Request("a", tokens(0, 14), h)
    m.allocate_slots(a, 14)
    step(a, 14, [100, 101])
    m.allocate_slots(a, 2)
    a.num_computed_tokens = 16
    m.mark_computed(a)          # (a coordinator's pool: its K/V are written)
    m.free(a)
    entries = m.block_pool.partial_entries()
    assert len(entries) == 1 and entries[0][1] == a.block_hashes[2]
    first.close(unlink=False)
    second = adopt_pool(cfg, pool_name)
    try:
        mgr = second.mgr
        assert mgr.block_pool.partial_entries() == entries
        assert_clean(mgr)
        # Publishing, it restates the cache: the partial entry after its
        # block's full one, in the hash block's size.
        mgr.enable_events()
        restated = mgr.take_events()
        assert type(restated[0]).__name__.endswith("AllBlocksCleared")
        full, partial = external_hash(a.block_hashes[3]), external_hash(a.block_hashes[2])
        group0 = [(e.block_hashes[0], e.block_size) for e in restated[1:] if e.group_idx == 0]
        assert group0.index((partial, 4)) == group0.index((full, 8)) + 1
        big = Request("big", tokens(500, 560), mgr.make_hasher())
        assert mgr.allocate_slots(big, 60) is not None
        assert partial in removed(mgr.take_events())
        assert not mgr.block_pool.partial_entries()
        assert_clean(mgr)
    finally:
        second.close()


@pytest.mark.parametrize("damage, problem", [
    ("tokens", "covers 16 tokens"),
    ("group", "takes none"),
    ("index", "index holds"),
])
def test_check_finds_a_broken_partial_entry(damage, problem):
    with KVCacheManager(config()) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 14), h)
        m.allocate_slots(a, 14)
        step(a, 14, [100, 101])
        m.allocate_slots(a, 2)
        b1 = full_group_blocks(m, "a")[1]
        if damage == "tokens":
            m.segment.partial_tokens[b1] = 16
        elif damage == "group":
            m.segment.hash_group[b1] = 1
        else:
            m.segment.flags[b1] = FLAG_CACHED
        report = check_segment(m.segment, m.block_pool)
        assert any(problem in p for p in report.problems), report.problems
