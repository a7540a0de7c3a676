"""Block readiness: blocks cached at allocation are pending until their
writer reports their K/V written; its own session hits them, others see
them as in flight; a writer that lets go of them uncaches them; the marks
survive a coordinator restart and are checked (core/block_pool.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import check_pool, make_config, tokens
from kvshm import KVCacheManager, Request
from kvshm.core.check import check_segment
from kvshm.core.specs import SlidingWindowSpec
from kvshm.core.state import FLAG_CACHED, FLAG_PENDING
from kvshm.ops import protocol as p
from kvshm.ops.executor import OpExecutor
from kvshm.pool.segment import PoolSegment
from kvshm.service.client import connect
from kvshm.service.process import CoordinatorProcess
from kvshm.service.resume import Reconnect

CFG = make_config(num_blocks=64, max_num_seqs=16)
BS = 4
FAST = Reconnect(initial_delay=0.01, max_delay=0.2, timeout=20)


def _mgr(**kw) -> KVCacheManager:
    return KVCacheManager(CFG, track_ready=True, **kw)


def _req(mgr, rid, prompt) -> Request:
    return Request(rid, prompt, mgr.make_hasher())


def _lookup(mgr, session, rid, prompt):
    mgr.block_pool.reader = session
    blocks, n = mgr.get_computed_blocks(_req(mgr, rid, prompt))
    return list(blocks[0]), n, mgr.num_in_flight_tokens


def _write(mgr, session, rid, prompt) -> tuple[Request, list[int]]:
    """Session `session` allocates (and so caches, pending) the whole prompt."""
    mgr.block_pool.reader = session
    req = _req(mgr, rid, prompt)
    [new] = mgr.allocate_slots(req, len(prompt))
    return req, new


def test_pending_blocks_are_hits_for_their_writer_only():
    prompt = tokens(0, 14)                       # 3 full blocks of 4
    with _mgr() as mgr:
        req, new = _write(mgr, 1, "a", prompt)
        pool = mgr.block_pool
        assert sorted(pool.pending) == new[:3] and set(pool.pending.values()) == {1}
        assert all(mgr.segment.flags[b] == FLAG_CACHED | FLAG_PENDING for b in new[:3])
        # Its own session hits them, exactly as vLLM's own manager would.
        assert _lookup(mgr, 1, "b", prompt) == (new[:3], 12, 0)
        # Another session sees them as in flight, not as hits.
        assert _lookup(mgr, 2, "c", prompt) == ([], 0, 12)
        req.num_computed_tokens = 8              # two blocks' K/V are written
        mgr.mark_computed(req)
        assert _lookup(mgr, 2, "c", prompt) == (new[:2], 8, 4)
        req.num_computed_tokens = 14
        mgr.mark_computed(req)
        assert _lookup(mgr, 2, "c", prompt) == (new[:3], 12, 0)
        assert not pool.pending and check_segment(mgr.segment, pool).clean


def test_marking_computed_what_readies_nothing_changes_no_byte():
    """An Advance of a request whose blocks are all ready, while another
    request's are pending, opens no mutation (the common case: decode)."""
    with _mgr() as mgr:
        ready, _ = _write(mgr, 1, "a", tokens(0, 14))
        ready.num_computed_tokens = 14
        mgr.mark_computed(ready)                 # all of a's blocks are ready
        writer, new = _write(mgr, 2, "b", tokens(100, 114))
        writer.num_computed_tokens = 3           # less than a block: nothing to ready
        path = Path(f"/dev/shm/{mgr.segment.name}")
        before = path.read_bytes()
        for req in (ready, writer):
            mgr.mark_computed(req)
        assert path.read_bytes() == before
        writer.num_computed_tokens = 4
        mgr.mark_computed(writer)                # its first block is ready now
        assert path.read_bytes() != before
        assert sorted(mgr.block_pool.pending) == new[1:3]
        assert check_segment(mgr.segment, mgr.block_pool).clean


def test_a_writer_that_frees_its_pending_blocks_uncaches_them():
    prompt = tokens(0, 14)
    with _mgr() as mgr:
        req, new = _write(mgr, 1, "a", prompt)
        req.num_computed_tokens = 4
        mgr.mark_computed(req)                   # block 0 is ready, 1 and 2 are not
        # A request of the same session holds the pending blocks as hits.
        mgr.block_pool.reader = 1
        other = _req(mgr, "b", prompt)
        hits, n = mgr.get_computed_blocks(other)
        mgr.allocate_slots(other, 2, n, hits)
        mgr.free(req)                            # preempted or aborted: never computed
        pool = mgr.block_pool
        assert not pool.pending and pool.num_dropped_pending == 2
        assert pool.block_hash(new[0]) is not None      # the ready block stays cached
        assert pool.block_hash(new[1]) is None and pool.block_hash(new[2]) is None
        for session in (1, 2):
            assert _lookup(mgr, session, "c", prompt)[:2] == (new[:1], 4)
        mgr.free(other)
        assert check_segment(mgr.segment, pool).clean


def test_embedded_pools_cache_as_vllm_does():
    """Without track_ready (one engine) a cached block is a hit for all."""
    prompt = tokens(0, 14)
    with KVCacheManager(CFG) as mgr:
        req, new = _write(mgr, 1, "a", prompt)
        assert not mgr.block_pool.pending
        assert _lookup(mgr, 2, "b", prompt) == (new[:3], 12, 0)
        mgr.free(req)
        assert _lookup(mgr, 2, "b", prompt)[1] == 12


def test_check_finds_bad_marks_and_adoption_repairs_them(tmp_path):
    prompt = tokens(0, 14)
    mgr = _mgr()
    try:
        _, new = _write(mgr, 7, "a", prompt)
        mgr.table.set_owner("a", 7)
        free_block = mgr.block_pool.free_queue(1)[0]
        flags = mgr.segment.flags
        flags[free_block] = FLAG_PENDING                 # pending, not cached, held by none
        problems = check_segment(mgr.segment).problems
        assert any("pending but not cached" in m for m in problems)
        assert any(f"pending block {free_block} is held by no request" in m for m in problems)
        # A restarted coordinator rebuilds the index from the writers' rows
        # (the writer's session is its row's) and uncaches what no writer
        # holds.
        seg = PoolSegment.attach(mgr.segment.name)
        flags[free_block] = FLAG_CACHED | FLAG_PENDING
        adopted = KVCacheManager(segment=seg, track_ready=True)
        try:
            assert adopted.block_pool.pending == {b: 7 for b in new[:3]}
            assert not seg.flags[free_block] & FLAG_PENDING
            assert check_segment(seg, adopted.block_pool).clean
            assert _lookup(adopted, 8, "x", prompt) == ([], 0, 12)
            assert _lookup(adopted, 7, "x", prompt)[1] == 12
        finally:
            seg.close()
    finally:
        mgr.close()


def _adopt(mgr) -> KVCacheManager:
    """The pool as a restarted coordinator takes it over."""
    return KVCacheManager(segment=PoolSegment.attach(mgr.segment.name), track_ready=True)


@pytest.mark.parametrize("first_freed", ["writer", "sharer"])
def test_adoption_gives_pending_blocks_to_the_request_that_cached_them(first_freed):
    # "b" of the writer's session hits the blocks "a" cached pending (adoption
    # visits slots last first: "b"'s first); after a restart freeing "a"
    # must still uncache them, and freeing "b" must not.
    prompt = tokens(0, 14)
    with _mgr() as mgr:
        _, new = _write(mgr, 7, "a", prompt)              # slot 0: 3 blocks pending
        mgr.block_pool.reader = 7
        sharer = _req(mgr, "b", prompt)
        hits, n = mgr.get_computed_blocks(sharer)
        assert n == 12
        mgr.allocate_slots(sharer, 2, n, hits)            # slot 1 holds them as hits
        for rid in ("a", "b"):
            mgr.table.set_owner(rid, 7)
        assert mgr.table.slot_of == {"a": 0, "b": 1}
        assert [mgr.segment.writer[b] for b in new[:3]] == [0, 0, 0]
        adopted = _adopt(mgr)
        try:
            pool = adopted.block_pool
            assert pool.pending == {b: 7 for b in new[:3]}
            assert check_segment(adopted.segment, pool).clean
            if first_freed == "writer":
                adopted.free("a")
                assert not pool.pending and pool.num_dropped_pending == 3
                assert _lookup(adopted, 8, "y", prompt) == ([], 0, 0)
            else:
                adopted.free("b")
                assert pool.pending == {b: 7 for b in new[:3]}
                assert _lookup(adopted, 8, "y", prompt) == ([], 0, 12)
            assert check_segment(adopted.segment, pool).clean
        finally:
            adopted.segment.close()


def test_check_finds_a_pending_block_its_writer_does_not_hold():
    prompt = tokens(0, 14)
    with _mgr() as mgr:
        _, new = _write(mgr, 7, "a", prompt)
        _, other = _write(mgr, 7, "b", tokens(200, 204))    # one more block pending
        mgr.segment.writer[new[0]] = mgr.table.slot_of["b"]      # not "b"'s block
        problems = check_segment(mgr.segment).problems
        assert problems == [f"pending block {new[0]}: its writer (request slot 1) does not "
                            "hold it in the cached part of its row"]
        # Adoption uncaches it: no request will ever report its K/V.
        adopted = _adopt(mgr)
        try:
            assert sorted(adopted.block_pool.pending) == new[1:3] + other
            assert adopted.block_pool.block_hash(new[0]) is None
            assert check_segment(adopted.segment, adopted.block_pool).clean
        finally:
            adopted.segment.close()


def test_a_pending_block_that_leaves_the_window_is_uncached():
    cfg = make_config(groups=(SlidingWindowSpec(4, sliding_window=8),), num_blocks=64,
                      max_num_seqs=4)
    with KVCacheManager(cfg, track_ready=True) as mgr:
        mgr.block_pool.reader = 1
        req = _req(mgr, "a", tokens(0, 40))
        [new] = mgr.allocate_slots(req, 24)               # 6 blocks, all pending
        mgr.table.set_owner("a", 1)
        assert sorted(mgr.block_pool.pending) == sorted(new)
        req.num_computed_tokens = 24
        # Computed past the window, not reported: the blocks it no longer
        # attends to will never be reported, so they are uncached (freed
        # too: nothing else holds them).
        [more] = mgr.allocate_slots(req, 4)
        gone = [b for b in new if mgr.block_pool.block_hash(b) is None]
        assert gone == new[:4] and sorted(mgr.block_pool.pending) == new[4:] + more
        assert mgr.block_pool.num_dropped_pending == 4
        assert check_segment(mgr.segment, mgr.block_pool).clean
        adopted = _adopt(mgr)
        try:
            assert adopted.block_pool.pending == mgr.block_pool.pending
            assert check_segment(adopted.segment, adopted.block_pool).clean
        finally:
            adopted.segment.close()


# -- through the op executor --------------------------------------------------------------
def test_admit_waits_for_tokens_in_flight_and_a_dead_writer_ends_the_wait():
    prompt = tokens(0, 30)                       # 7 full blocks
    with _mgr() as mgr:
        ex = OpExecutor(mgr)
        writer, reader = ex.lifecycle.open(1), ex.lifecycle.open(2)
        for owner, rid in ((writer, "w"), (reader, "r")):
            assert ex.execute(owner, p.AddRequest(rid, prompt)) == p.Done()
        # The writer admits a 16-token chunk: 4 blocks pending.
        w = ex.execute(writer, p.Admit("w", 16))
        assert w.num_computed_tokens == 0 and len(w.new_block_ids[0]) == 4
        r = ex.execute(reader, p.Admit("r", 30, wait_in_flight=8))
        assert (r.new_block_ids, r.num_computed_tokens, r.num_in_flight_tokens) == (None, 0, 16)
        assert "r" not in mgr.table.slot_of      # waiting holds nothing
        # The chunk is written (Advance), the next one allocated: the reader
        # hits the first and waits for the second.
        ex.execute(writer, p.Batch([p.Advance("w", 16), p.AllocateSlots("w", 14)]))
        r = ex.execute(reader, p.Admit("r", 30, wait_in_flight=8))
        assert (r.new_block_ids, r.num_computed_tokens, r.num_in_flight_tokens) == (None, 16, 12)
        # Below the threshold it computes instead.
        r = ex.execute(reader, p.GetComputedBlocks("r"))
        assert (r.num_computed_tokens, r.num_in_flight_tokens) == (16, 12)
        # The writer dies: its pending blocks are uncached, the wait is over.
        ex.lifecycle.close(writer)
        r = ex.execute(reader, p.Admit("r", 30, wait_in_flight=8))
        assert r.num_computed_tokens == 16 and r.num_in_flight_tokens == 0
        assert len(r.new_block_ids[0]) == 4
        assert check_segment(mgr.segment, mgr.block_pool).clean
        bad = ex.execute(reader, p.Admit("r", 30, wait_in_flight=-1))
        assert bad.__class__ is p.Error and "wait_in_flight" in bad.message


def test_a_lookup_that_holds_its_request_back_is_not_counted():
    """On a pool of 0.14's semantics every lookup counts, except one that
    holds its request back for tokens in flight (Admit's wait_in_flight,
    GetComputedBlocks' hold_at): the request is looked up again, and only
    the lookup that admits it counts."""
    prompt = tokens(0, 30)
    with _mgr() as mgr:
        ex = OpExecutor(mgr)
        writer, reader = ex.lifecycle.open(1), ex.lifecycle.open(2)
        for owner, rid in ((writer, "w"), (reader, "r")):
            assert ex.execute(owner, p.AddRequest(rid, prompt)) == p.Done()
        ex.execute(writer, p.Admit("w", 16))             # 16 tokens in flight
        start = dict(mgr.prefix_cache_stats)

        def counted():
            now = mgr.prefix_cache_stats
            return tuple(now[k] - start[k] for k in ("queries", "query_tokens", "hit_tokens"))

        for _ in range(3):
            assert ex.execute(reader, p.Admit("r", 30, wait_in_flight=8)).new_block_ids is None
            r = ex.execute(reader, p.GetComputedBlocks("r", hold_at=16))
            assert r.num_in_flight_tokens == 16
        assert counted() == (0, 0, 0)
        # Fewer in flight than hold_at: it will not wait, so it counts.
        ex.execute(reader, p.GetComputedBlocks("r", hold_at=17))
        assert counted() == (1, 30, 0)
        ex.execute(reader, p.GetComputedBlocks("r"))     # (0: every lookup counts)
        assert counted() == (2, 60, 0)
        ex.execute(writer, p.Advance("w", 16))
        r = ex.execute(reader, p.Admit("r", 30, wait_in_flight=8))
        assert r.num_computed_tokens == 16 and r.new_block_ids is not None
        assert counted() == (3, 90, 16)
        bad = ex.execute(reader, p.GetComputedBlocks("r", hold_at=-1))
        assert bad.__class__ is p.Error and "hold_at" in bad.message
        assert counted() == (3, 90, 16)


# -- processes: a SIGKILLed writer, a coordinator restart ---------------------------------
WRITER = textwrap.dedent("""
    import asyncio, sys
    from kvshm.service.client import connect

    async def main(sock, algo, seed):
        c = await connect(sock, hash_algorithm=algo, hash_seed=seed)
        await c.add_request("w", list(range(1000, 1014)))
        await c.allocate_slots("w", 14)          # cached, pending: never marked ready
        print("allocated", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
""")


async def test_a_writer_sigkilled_before_marking_ready_is_never_hit(pool_name, tmp_path):
    prompt = tokens(1000, 1014)
    with CoordinatorProcess(CFG, name=pool_name) as proc:
        script = tmp_path / "writer.py"
        script.write_text(WRITER)
        w = subprocess.Popen([sys.executable, str(script), str(proc.socket),
                              CFG.hash_algorithm, str(CFG.hash_seed)],
                             stdout=subprocess.PIPE, text=True)
        try:
            assert w.stdout.readline().strip() == "allocated"
            c = await connect(proc.socket, hash_algorithm=CFG.hash_algorithm,
                              hash_seed=CFG.hash_seed)
            await c.add_request("r", prompt)
            r = await c.call(p.GetComputedBlocks("r"))
            assert (r.num_computed_tokens, r.num_in_flight_tokens) == (0, 12)
            os.kill(w.pid, signal.SIGKILL)
            w.wait(10)

            for _ in range(400):                     # the coordinator sees the session end
                r = await c.call(p.GetComputedBlocks("r"))
                if not r.num_in_flight_tokens:
                    break
                await asyncio.sleep(0.01)
            assert (r.num_computed_tokens, r.num_in_flight_tokens) == (0, 0)
            stats = await c.stats()
            assert stats.num_cached_blocks == 0 and stats.num_free_blocks == 63   # all back
            await c.close()
        finally:
            w.kill()
            w.wait(10)
            w.stdout.close()
        await asyncio.sleep(0.1)
        rep = check_pool(pool_name)
        assert rep.clean and rep.num_requests == 0


async def test_pending_blocks_survive_a_coordinator_restart(pool_name):
    prompt = tokens(0, 14)
    with CoordinatorProcess(CFG, name=pool_name) as proc:
        writer = await connect(proc.socket, hash_algorithm=CFG.hash_algorithm,
                               hash_seed=CFG.hash_seed, reconnect=FAST)
        reader = await connect(proc.socket, hash_algorithm=CFG.hash_algorithm,
                               hash_seed=CFG.hash_seed, reconnect=FAST)
        await writer.add_request("w", prompt)
        await writer.allocate_slots("w", 14)
        proc.kill()
        proc.restart()
        await reader.add_request("r", prompt)
        r = await reader.call(p.GetComputedBlocks("r"))
        assert (r.num_computed_tokens, r.num_in_flight_tokens) == (0, 12)
        assert check_pool(pool_name).clean
        await writer.advance("w", 14, [5])       # resumed: its K/V are written
        r = await reader.call(p.GetComputedBlocks("r"))
        assert (r.num_computed_tokens, r.num_in_flight_tokens) == (12, 0)
        await writer.close()
        await reader.close()
        await asyncio.sleep(0.1)
        assert check_pool(pool_name).clean
