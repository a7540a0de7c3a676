"""check_segment: an intact pool is clean, and each kind of corruption is
reported with its own message.

Every corruption test starts from the same small, busy pool (see `busy`),
asserts it is clean, corrupts one thing in the segment (or the owner's hash
index) and asserts the report names that problem.  Where a corruption is
self-contained (the rest of the pool stays consistent) the report must hold
exactly that one problem.

Then: pools are clean after (and throughout) replays of real conformance
traces, and a checker in another process never sees a half-done mutation
of a pool that is being driven as it checks.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvshm import (
    FullSpec,
    KVCacheManager,
    PoolConfig,
    Request,
    SinkFullSpec,
    SlidingWindowSpec,
    check_segment,
)
from kvshm.core.state import FLAG_CACHED, FLAG_NULL, FLAG_SINK, SEQ_WORD, SLOT_META_FIELDS
from kvshm.replay import EmbeddedReplayer, differs, load_trace, replay_trace, trace_pool_config

TRACES = Path(__file__).parent / "data" / "conformance" / "traces"

N = 16  # blocks in the test pool (0 is the null block)


def full_config(**kw) -> PoolConfig:
    base = dict(num_blocks=N, hash_block_size=4, max_model_len=64, groups=(FullSpec(4),),
                max_num_seqs=4)
    base.update(kw)
    return PoolConfig(**base)


def busy(m: KVCacheManager) -> dict[str, Request]:
    """Requests a (blocks 1-4), b (a's first three blocks plus block 5) and a
    finished c (blocks 6, 7 cached and 8, back in the free queue).

    Afterwards: ref 1->2, 2->2, 3->2, 4->1, 5->1; free queue
    [9, 10, 11, 12, 13, 14, 15, 8, 7, 6]; cached blocks 1, 2, 3, 6, 7.
    """
    h = m.make_hasher()
    a = Request("a", list(range(14)), h)
    assert m.allocate_slots(a, 14) == ([1, 2, 3, 4],)
    a.num_computed_tokens = 14
    b = Request("b", list(range(12)) + [50, 51, 52], h)
    hits, n = m.get_computed_blocks(b)
    assert (list(hits[0]), n) == ([1, 2, 3], 12)
    assert m.allocate_slots(b, 3, n, hits) == ([5],)
    c = Request("c", list(range(100, 109)), h)
    assert m.allocate_slots(c, 9) == ([6, 7, 8],)
    m.free(c)
    assert m.block_pool.free_queue() == [9, 10, 11, 12, 13, 14, 15, 8, 7, 6]
    assert [m.segment.ref_cnt[i] for i in range(1, 6)] == [2, 2, 2, 1, 1]
    assert sorted(b for b in range(N) if m.segment.flags[b] & FLAG_CACHED) == [1, 2, 3, 6, 7]
    return {"a": a, "b": b, "c": c}


def report(m: KVCacheManager, pool: bool = True):
    return check_segment(m.segment, m.block_pool if pool else None, timeout=0.05)


def assert_clean(m: KVCacheManager) -> None:
    rep = report(m)
    assert rep.clean, rep.summary()


def assert_reports(m: KVCacheManager, *needles: str, only: bool = False, pool: bool = True):
    rep = report(m, pool)
    assert not rep.clean, "corruption not detected"
    text = "\n".join(rep.problems)
    for needle in needles:
        assert needle in text, f"{needle!r} not reported; got:\n{text}"
    if only:
        assert len(rep.problems) == len(needles), f"expected only {needles}; got:\n{text}"
    return rep


@pytest.fixture
def m():
    with KVCacheManager(full_config()) as mgr:
        busy(mgr)
        assert_clean(mgr)
        yield mgr


# -- free-queue link surgery (keeps everything else consistent) ----------------------

def _next(seg, b):
    return b + seg.next_delta[b]


def _prev(seg, b):
    return b + seg.prev_delta[b]


def _link(seg, a, b):
    """Make b the successor of a."""
    seg.next_delta[a] = b - a
    seg.prev_delta[b] = a - b


def unlink(seg, b):
    _link(seg, _prev(seg, b), _next(seg, b))
    seg.set("num_free_blocks", seg.get("num_free_blocks") - 1)


def append_to_tail(seg, b, stamp):
    s = seg.config.num_blocks
    last = _prev(seg, s)
    _link(seg, last, b)
    _link(seg, b, s)
    seg.free_stamp[b] = stamp
    seg.set("num_free_blocks", seg.get("num_free_blocks") + 1)


def slot_of(m, rid):
    return m.table.slot_of[rid]


# -- an intact pool ------------------------------------------------------------------

def test_fresh_and_busy_pools_are_clean():
    with KVCacheManager(full_config()) as mgr:
        rep = report(mgr)
        assert rep.clean, rep.summary()
        assert (rep.num_blocks, rep.num_free_blocks, rep.num_cached_blocks, rep.num_requests) \
            == (N, N - 1, 0, 0)
        busy(mgr)
        rep = report(mgr)
        assert rep.clean, rep.summary()
        assert (rep.num_free_blocks, rep.num_cached_blocks, rep.num_requests) == (10, 5, 2)
        assert rep.summary().startswith("clean:")


def test_report_summary_lists_problems(m):
    m.segment.ref_cnt[4] += 1
    rep = report(m)
    assert rep.summary().startswith("BROKEN (1 problems)")
    assert "block 4: ref count 2" in rep.summary()


# -- ref counts ----------------------------------------------------------------------

def test_wrong_ref_count(m):
    m.segment.ref_cnt[4] += 1
    assert_reports(m, "block 4: ref count 2, but 1 request-table references", only=True)


def test_ref_count_too_low_on_a_shared_block(m):
    m.segment.ref_cnt[2] = 1
    assert_reports(m, "block 2: ref count 1, but 2 request-table references", only=True)


def test_negative_ref_count(m):
    m.segment.ref_cnt[9] = -1
    assert_reports(m, "block 9: negative ref count -1")


def test_block_both_free_and_referenced(m):
    # Block 4 (held by a) also joins the tail of the free queue, consistently linked.
    append_to_tail(m.segment, 4, stamp=10**6)
    assert_reports(m, "block 4 is both free and referenced (ref count 1)", only=True)


def test_free_block_with_a_reference(m):
    m.segment.ref_cnt[9] = 1
    assert_reports(m, "block 9 is both free and referenced",
                   "block 9: ref count 1, but 0 request-table references", only=True)


def test_leaked_block(m):
    unlink(m.segment, 12)  # ref 0, no longer in the free queue, header count adjusted
    assert_reports(m, "block 12 has ref count 0 but is not in the free queue (leaked)",
                   only=True)


# -- the free queue ------------------------------------------------------------------

def test_broken_next_link(m):
    seg = m.segment
    seg.next_delta[10] = 2  # 10 -> 12, but prev of 12 is still 11
    assert_reports(m, "free queue: next of 10 is 12, but prev of 12 is 11")


def test_broken_prev_link(m):
    seg = m.segment
    seg.prev_delta[12] = -3  # prev of 12 claims 9, its predecessor is 11
    assert_reports(m, "free queue: next of 11 is 12, but prev of 12 is 9", only=True)


def test_link_out_of_range(m):
    m.segment.next_delta[13] = 1000
    assert_reports(m, f"free queue: block 13 links to 1013, outside [0, {N}]")


def test_free_queue_cycle(m):
    seg = m.segment
    _link(seg, 6, 9)  # the tail points back at the head
    assert_reports(m, "free queue: block 9 appears twice (cycle)")


def test_self_loop_is_a_cycle_not_a_hang(m):
    seg = m.segment
    seg.next_delta[11] = 0  # 11 -> 11
    seg.prev_delta[11] = 0
    t0 = time.monotonic()
    assert_reports(m, "free queue: block 11 appears twice (cycle)")
    assert time.monotonic() - t0 < 1.0


def test_header_free_count_disagrees(m):
    m.segment.set("num_free_blocks", 3)
    assert_reports(m, "free queue holds 10 blocks, the header says 3", only=True)


def test_free_queue_out_of_lru_order(m):
    seg = m.segment
    seg.free_stamp[7], seg.free_stamp[6] = seg.free_stamp[6], seg.free_stamp[7]
    assert_reports(m, "free queue: block 6 (stamp", "is out of LRU order", only=False)


# -- flags, stamps and the hash index ------------------------------------------------

def test_stale_index_entry_for_an_uncached_block(m):
    pool = m.block_pool
    pool.hash_to_block(0).add(b"\x42" * pool.digest_size, 9)  # block 9 is free and not cached
    assert_reports(m, "maps to block 9, which is not cached (stale entry)",
                   "index holds 6 entries, the segment 5 (cached blocks and partial entries)",
                   only=True)


def test_cached_flag_cleared_under_the_index(m):
    m.segment.flags[6] &= ~FLAG_CACHED
    assert_reports(m, "maps to block 6, which is not cached (stale entry)",
                   "index holds 5 entries, the segment 4 (cached blocks and partial entries)",
                   only=True)


def test_stale_index_not_checked_without_the_pool(m):
    m.block_pool.hash_to_block(0).add(b"\x42" * m.block_pool.digest_size, 9)
    assert report(m, pool=False).clean


def test_cached_block_missing_from_the_index(m):
    pool = m.block_pool
    key = pool.block_hash(7)
    pool.hash_to_block(0).remove(key, 7)
    assert_reports(m, "index holds 4 entries, the segment 5 (cached blocks and partial entries)",
                   only=True)


def test_cached_hash_bytes_corrupted(m):
    m.segment.hashes[3 * 32] ^= 0xFF
    assert_reports(m, "maps to block 3, which is cached under another hash or group",
                   only=True)


def test_cached_under_a_group_that_does_not_exist(m):
    m.segment.hash_group[6] = 7
    assert_reports(m, "block 6 is cached for group 7 (no such group)",
                   "maps to block 6, which is cached under another hash or group", only=True)


def test_cached_without_a_cache_stamp(m):
    m.segment.cache_stamp[1] = 0
    assert_reports(m, "block 1 is cached without a cache stamp", only=True)


def test_cached_hash_under_the_wrong_group():
    cfg = PoolConfig(num_blocks=40, hash_block_size=4, max_model_len=64, max_num_seqs=4,
                     groups=(FullSpec(4), SlidingWindowSpec(4, sliding_window=8)))
    with KVCacheManager(cfg) as mgr:
        r = Request("a", list(range(18)), mgr.make_hasher())
        new = mgr.allocate_slots(r, 18)
        assert new is not None
        assert_clean(mgr)
        b = new[0][0]  # a cached group-0 block
        assert mgr.segment.flags[b] & FLAG_CACHED and mgr.segment.hash_group[b] == 0
        mgr.segment.hash_group[b] = 1  # a real group, but not this block's
        assert_reports(mgr, f"maps to block {b}, which is cached under another hash or group",
                       only=True)


def test_block_referenced_from_two_groups():
    cfg = PoolConfig(num_blocks=40, hash_block_size=4, max_model_len=64, max_num_seqs=4,
                     groups=(FullSpec(4), SlidingWindowSpec(4, sliding_window=8)))
    with KVCacheManager(cfg) as mgr:
        h = mgr.make_hasher()
        a = Request("a", list(range(10)), h)
        b = Request("b", list(range(100, 110)), h)
        assert mgr.allocate_slots(a, 10) == ([1, 2, 3], [4, 5, 6])
        assert mgr.allocate_slots(b, 10) == ([7, 8, 9], [10, 11, 12])
        seg = mgr.segment
        # b's last group-1 block becomes a's first group-0 block (block 1), with
        # ref counts kept consistent: 1 is referenced twice, 12 is freed.
        w = seg.layout.widths[1]
        seg.tables[1][slot_of(mgr, "b") * w + 2] = 1
        seg.ref_cnt[1] = 2
        seg.ref_cnt[12] = 0
        append_to_tail(seg, 12, stamp=10**6)
        assert_reports(mgr, "block 1")


def test_index_blocks_not_in_caching_order():
    with KVCacheManager(full_config()) as mgr:
        h = mgr.make_hasher()
        # Same prompt twice, the second without reading the cache: two blocks
        # under each hash (the map does not deduplicate).
        a = Request("a", list(range(9)), h)
        b = Request("b", list(range(9)), h, skip_reading_prefix_cache=True)
        assert mgr.allocate_slots(a, 9) == ([1, 2, 3],)
        assert mgr.allocate_slots(b, 9) == ([4, 5, 6],)
        assert mgr.block_pool.hash_to_block(0).blocks(mgr.block_pool.block_hash(1)) == [1, 4]
        assert_clean(mgr)
        seg = mgr.segment
        seg.cache_stamp[1], seg.cache_stamp[4] = seg.cache_stamp[4], seg.cache_stamp[1]
        assert_reports(mgr, "are not in caching order", only=True)


def test_null_block_unmarked(m):
    m.segment.flags[0] = 0
    assert_reports(m, "block 0 is not marked as the null block")


def test_second_null_block(m):
    m.segment.flags[9] = FLAG_NULL
    assert_reports(m, "block 9 is marked null; only block 0 is")


def test_sink_block_count_and_state():
    cfg = full_config(groups=(SinkFullSpec(4, sink_len=8),))
    with KVCacheManager(cfg) as mgr:
        seg = mgr.segment
        sinks = [b for b in range(N) if seg.flags[b] & FLAG_SINK]
        assert sinks == [1, 2]
        assert_clean(mgr)
        seg.ref_cnt[1] = 1
        assert_reports(mgr, "sink block 1 is free, referenced, or held by a request", only=True)
        seg.ref_cnt[1] = 0
        assert_clean(mgr)
        seg.flags[2] = 0  # no longer a sink: one sink short, and block 2 is leaked
        assert_reports(mgr, "1 sink blocks, the config reserves 2",
                       "block 2 has ref count 0 but is not in the free queue (leaked)",
                       only=True)
        seg.flags[2] = FLAG_SINK
        assert_clean(mgr)


# -- the request table ---------------------------------------------------------------

def test_request_row_with_an_out_of_range_block_id(m):
    seg = m.segment
    w = seg.layout.widths[0]
    slot = slot_of(m, "b")
    assert list(seg.tables[0][slot * w:slot * w + 4]) == [1, 2, 3, 5]
    seg.tables[0][slot * w + 3] = 999
    assert_reports(m, f"slot {slot} group 0: block id 999 out of range",
                   "block 5: ref count 1, but 0 request-table references", only=True)


def test_request_row_with_a_negative_block_id(m):
    seg = m.segment
    w = seg.layout.widths[0]
    seg.tables[0][slot_of(m, "a") * w] = -2
    assert_reports(m, "block id -2 out of range")


def test_request_row_longer_than_its_capacity(m):
    seg = m.segment
    slot = slot_of(m, "a")
    seg.slot_counts[(slot * 1 + 0) * 2] = seg.layout.widths[0] + 1
    assert_reports(m, f"slot {slot} group 0: {seg.layout.widths[0] + 1} blocks, row holds "
                      f"{seg.layout.widths[0]}")


def test_header_request_count_disagrees(m):
    m.segment.set("num_requests", 7)
    assert_reports(m, "2 request slots in use, the header says 7", only=True)


def test_free_slot_with_block_rows(m):
    seg = m.segment
    free_slot = next(s for s in range(4) if not seg.slot_meta[s * SLOT_META_FIELDS + 2])
    seg.slot_counts[free_slot * 2] = 0
    assert_reports(m, f"slot {free_slot} is free but has block rows", only=True)


def test_bad_request_id_length(m):
    seg = m.segment
    slot = slot_of(m, "a")
    seg.slot_meta[slot * SLOT_META_FIELDS] = 0
    assert_reports(m, f"slot {slot}: request id length 0 out of range", only=True)


# -- the mutation counter ------------------------------------------------------------

def test_odd_mutation_counter_is_reported_after_the_timeout(m):
    seg = m.segment
    seg.begin_mutation()  # a writer that never published (died mid-mutation)
    assert seg.words[SEQ_WORD] & 1
    t0 = time.monotonic()
    rep = check_segment(seg, m.block_pool, timeout=0.05)
    elapsed = time.monotonic() - t0
    assert "a mutation is in progress or was interrupted (odd mutation counter)" \
        in rep.problems, rep.summary()
    assert len(rep.problems) == 1, rep.summary()  # the arrays themselves are fine
    assert elapsed < 1.0, f"timeout=0.05 took {elapsed:.2f}s"
    m.block_pool.publish()  # the writer finishes
    assert_clean(m)


def test_corrupted_pool_still_closes():
    with KVCacheManager(full_config()) as mgr:
        busy(mgr)
        seg = mgr.segment
        name = seg.name
        seg.next_delta[N] = 5000
        seg.ref_cnt[3] = -7
        seg.begin_mutation()
        assert not report(mgr).clean
    assert not Path(f"/dev/shm/{name}").exists()


def test_many_problems_are_capped(m):
    seg = m.segment
    for b in range(1, N):
        seg.ref_cnt[b] += 100
    for b in range(1, N):
        seg.cache_stamp[b] = 0
        seg.flags[b] |= FLAG_CACHED
        seg.hash_group[b] = 9
    rep = report(m)
    # 15 ref-count and 15 group problems, 15 missing stamps, free-and-referenced
    # blocks, ...: listed up to 50, then one line saying there are more.
    assert len(rep.problems) == 51
    assert rep.problems[-1] == "... (more problems not listed)"
    assert not rep.clean


# -- clean after real workloads ------------------------------------------------------

WORKLOADS = [
    "full16-tiny-chat-s1000",
    "full16-nocache-tiny-chunk-s1204",
    "sink32-tiny-chat-s1732",
    "sw16-tiny-chat-s1416",
    "chunked32-tiny-chat-s1632",
    "mamba16-specblk1-tiny-chat-s1820",
    "mamba-nocache-tiny-chat-s1830",
    "hyb-full32-sw16-tiny-chat-s2100",
    "hyb3-full-sw-mamba-tiny-chat-s2330",
    "encdec-enc64-tiny-chat-s1964",
    "eagle-full16-tiny-chat-s2500",
    "pd-sw64-tiny-chat-s2920",
    "dcp2-full16-tiny-chat-s2700",
    "spec-hyb-full-sw64-tiny-chat-s2610",
]


@pytest.mark.parametrize("trace", WORKLOADS)
def test_clean_after_replaying_a_trace(trace):
    cfg, ops = load_trace(TRACES / f"{trace}.jsonl.gz")
    reports = []
    mismatch = replay_trace(cfg, ops, after=lambda mgr: reports.append(
        check_segment(mgr.segment, mgr.block_pool, timeout=0.5)))
    assert mismatch is None, str(mismatch)
    assert len(reports) == 1
    assert reports[0].clean, reports[0].summary()


@pytest.mark.parametrize("trace", WORKLOADS[:8])
def test_clean_throughout_a_trace(trace):
    """Check every 20 ops (and catch the first op after which it breaks)."""
    cfg, ops = load_trace(TRACES / f"{trace}.jsonl.gz")
    r = EmbeddedReplayer(trace_pool_config(cfg, ops))
    try:
        for i, op in enumerate(ops):
            got = r.apply(op)
            assert not differs(op, got), f"op {i} {op['op']}: expected {op.get('expect')}, " \
                                         f"got {got}"
            if i % 20 == 0 or i == len(ops) - 1:
                rep = check_segment(r.mgr.segment, r.mgr.block_pool, timeout=0.5)
                assert rep.clean, f"after op {i} ({op['op']}): {rep.summary()}"
    finally:
        r.close()


# -- checking a live pool from another process ---------------------------------------

_CHECKER = r"""
import json, sys, time
from kvshm import PoolSegment, check_segment
seg = PoolSegment.attach(sys.argv[1])
print("ready", flush=True)
checks, problems = 0, []
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    rep = check_segment(seg, timeout=5.0)
    checks += 1
    problems += rep.problems
    if problems:
        break
seg.close()
print(json.dumps({"checks": checks, "problems": problems[:10]}), flush=True)
"""


def test_checking_a_pool_while_it_is_being_mutated_sees_no_problems():
    """`kvshm check` on a live pool: a checker in another process that copies
    the segment between two equal, even mutation counters must never see a
    half-done mutation (every writer path is bracketed)."""
    import json
    import random
    import subprocess
    import sys

    from invariant_sim import CONFIGS, Sim, random_op
    sim = Sim(CONFIGS["hybrid_full_sw"])
    try:
        child = subprocess.Popen([sys.executable, "-c", _CHECKER, sim.m.segment.name, "3"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready", child.stderr.read()
            rnd = random.Random(1)
            steps = 0
            t_end = time.monotonic() + 1.5
            while time.monotonic() < t_end and child.poll() is None:
                random_op(sim, rnd)
                steps += 1
            out, err = child.communicate(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        assert child.returncode == 0, err
        result = json.loads(out)
        assert result["problems"] == [], result
        assert result["checks"] >= 3 and steps >= 50, (result, steps)
        sim.check()
    finally:
        sim.close()
