"""The undo log and repair, in-process: a frame left open (its writer gone)
is rolled back exactly to the last committed state; a garbled log is
refused.  The same, through real crashes of a coordinator, is
test_crash_points.py."""

from __future__ import annotations

import pytest

from helpers import make_config, tokens
from kvshm import FullSpec, KVCacheManager, Request, SlidingWindowSpec
from kvshm.core.check import check_segment
from kvshm.core.errors import SegmentError
from kvshm.core.recovery import needs_repair, repair
from kvshm.core.state import UNDO_LEN_WORD, frame_bound
from kvshm.pool.segment import PoolSegment

CFG = make_config(groups=(FullSpec(4), SlidingWindowSpec(4, 8)), num_blocks=40,
                  max_num_seqs=8)


def state(seg: PoolSegment):
    """The authoritative state and the derived sets that must come back."""
    n = CFG.num_blocks
    rows = bytes(seg.slot_counts.cast("B")), [bytes(t.cast("B")) for t in seg.tables]
    meta = bytes(seg.slot_meta.cast("B")), bytes(seg.slot_rid)
    free = {b for b in range(n) if seg.ref_cnt[b] == 0} - {0}
    return rows, meta, free, bytes(seg.ref_cnt.cast("B")), seg.get("queries")


def cached(seg: PoolSegment) -> dict[int, bytes]:
    return {b: bytes(seg.hashes[b * 32:b * 32 + 32]) for b in range(CFG.num_blocks)
            if seg.flags[b] & 2}


@pytest.fixture
def pool():
    mgr = KVCacheManager(CFG, name=None)
    yield mgr
    mgr.close()


def test_an_open_frame_is_rolled_back_to_the_last_commit(pool):
    h = pool.make_hasher()
    a = Request("a", tokens(0, 18), h)
    pool.allocate_slots(a, 18)
    b = Request("b", tokens(0, 18), h)
    hits, n = pool.get_computed_blocks(b)
    pool.allocate_slots(b, 18 - n, n, hits)
    seg = pool.segment
    before, cache_before = state(seg), cached(seg)

    pool.begin_frame()                 # a frame that never commits
    pool.free(a)
    pool.remove_skipped_blocks("b", 18)            # nulls ids of b's window group
    c = Request("c", tokens(100, 117), h)
    pool.get_computed_blocks(c)
    pool.allocate_slots(c, 17)                     # takes a's freed blocks, caches
    pool.evict_blocks([1])
    assert needs_repair(seg) and seg.words[UNDO_LEN_WORD] > 0

    other = PoolSegment.attach(seg.name)
    try:
        report = repair(other)
        assert report.torn and report.undo_entries > 0 and report.uncached > 0
        assert state(other) == before
        after = cached(other)
        assert after.items() <= cache_before.items()   # only evictions are lost
        assert set(cache_before) - set(after) <= {1}
        assert check_segment(other).clean
        assert not needs_repair(other)
        assert repair(other).torn is False               # idempotent
    finally:
        other.close()
    pool.commit_frame()


def test_a_garbled_undo_log_is_refused(pool):
    seg = pool.segment
    pool.begin_frame()
    pool.allocate_slots(Request("a", tokens(0, 9), pool.make_hasher()), 9)
    seg.undo[1] = 99                                  # an entry of no known kind
    other = PoolSegment.attach(seg.name)
    try:
        with pytest.raises(SegmentError, match="unknown kind 99"):
            repair(other)
        seg.undo[1] = 1                               # a ROW entry ...
        seg.undo[2] = 1000                            # ... naming slot 1000
        with pytest.raises(SegmentError, match="slot 1000"):
            repair(other)
        seg.words[UNDO_LEN_WORD] = len(seg.undo) + 1
        with pytest.raises(SegmentError, match="undo log length"):
            repair(other)
    finally:
        other.close()
    pool.commit_frame()


def test_the_log_holds_the_largest_frame():
    """Every row, slot and counter touched in one frame fits frame_bound()."""
    cfg = make_config(groups=(FullSpec(4), SlidingWindowSpec(4, 8)), num_blocks=200,
                      max_num_seqs=6)
    with KVCacheManager(cfg) as mgr:
        h = mgr.make_hasher()
        reqs = [Request(f"r{i}", tokens(10 * i, 10 * i + 60), h) for i in range(6)]
        for r in reqs:
            mgr.allocate_slots(r, 60)
        mgr.begin_frame()
        for r in reqs:                       # touch everything, twice over
            mgr.remove_skipped_blocks(r.request_id, 60)
            mgr.free(r)
            mgr.get_computed_blocks(r)
            mgr.allocate_slots(r, 60)
        assert mgr.journal.n <= frame_bound(cfg.max_num_seqs, mgr.table.widths)
        mgr.commit_frame()
