"""Corrupted blocks are healed, not only counted: `report_corrupt` uncaches
the reported blocks and every cached block whose chain runs through them
(whichever request cached it), so no later lookup hits them; only blocks a
request holds may be reported, so a session can never uncache another
tenant's blocks; bad ids change nothing; the counters, the log line and a
coordinator restart."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from kvshm import InvalidArgument, KVCacheManager, Request, UnknownRequest
from kvshm.core.metrics import read_metrics
from kvshm.service.client import connect
from kvshm.service.process import CoordinatorProcess
from kvshm.service.resume import Reconnect
from kvshm.service.sync_client import connect_sync

import helpers
from helpers import assert_clean, lookup, step, tokens

CFG = helpers.make_config(num_blocks=32, max_num_seqs=8)    # 4-token blocks


def computed(m, rid, prompt):
    """A request that computed `prompt` and cached its full blocks (its hits
    adopted first): its block ids."""
    r = Request(rid, prompt, m.make_hasher())
    hits, n = m.get_computed_blocks(r)
    m.allocate_slots(r, len(prompt) - n, n, hits)
    step(r, len(prompt))
    m.cache_blocks(r, len(prompt))
    return r, m.get_block_ids(rid)[0]


def test_a_report_uncaches_the_block_and_every_chain_through_it():
    with KVCacheManager(CFG) as m:
        shared = tokens(0, 8)
        a, blocks_a = computed(m, "a", shared + tokens(100, 108))     # 4 blocks
        b, blocks_b = computed(m, "b", shared + tokens(200, 212))     # 2 hits + 3 of its own
        assert blocks_b[:2] == blocks_a[:2]
        c, blocks_c = computed(m, "c", tokens(300, 312))              # another prefix
        bad = blocks_a[1]
        gone = m.report_corrupt([bad])
        assert gone[0] == bad
        assert sorted(gone) == sorted([bad] + blocks_a[2:] + blocks_b[2:])
        for blk in gone:
            assert m.block_pool.block_hash(blk) is None
        for rid, prompt in (("a2", shared + tokens(100, 108)), ("b2", shared + tokens(200, 212))):
            hits, n = lookup(m, Request(rid, prompt + [1], m.make_hasher()))
            assert hits == [[blocks_a[0]]] and n == 4   # up to the bad block only
        hits, n = lookup(m, Request("c2", tokens(300, 312) + [1], m.make_hasher()))
        assert n == 12                                   # untouched
        assert m.report_corrupt([bad]) == []             # already uncached: nothing
        assert a.num_tokens and b.num_tokens and c.num_tokens
        for rid in ("a", "b", "c"):
            m.free(rid)
        assert_clean(m)


def test_a_parent_block_reused_since_does_not_take_its_old_children():
    with KVCacheManager(helpers.make_config(num_blocks=8, max_num_seqs=4)) as m:
        _, chain = computed(m, "a", tokens(0, 12))        # blocks 1, 2, 3
        m.free("a")                                      # free, still cached
        m.evict_blocks([chain[0]])
        # Block 1 cached again, for other tokens (as when a later request
        # takes it from the free queue): its old children are not its.
        m.block_pool.cache_block(chain[0], bytes(range(32)), 0)
        assert m.report_corrupt([chain[0]]) == [chain[0]]
        assert all(m.block_pool.block_hash(b) is not None for b in chain[1:])


@pytest.mark.parametrize("bad", [[0], [32], [-1], ["3"], [1.0]])
def test_bad_ids_are_refused_and_change_nothing(bad):
    with KVCacheManager(CFG) as m:
        computed(m, "a", tokens(0, 8))
        before = [m.block_pool.block_hash(b) for b in range(32)]
        with pytest.raises(InvalidArgument, match="is not in"):
            m.report_corrupt([1, *bad])
        assert [m.block_pool.block_hash(b) for b in range(32)] == before
        m.free("a")


# -- through the coordinator ----------------------------------------------------------------
def kw(tenant=""):
    return dict(hash_algorithm=CFG.hash_algorithm, hash_seed=CFG.hash_seed, tenant=tenant,
                resume=False)


async def test_a_session_reports_only_blocks_its_request_holds(coordinator, caplog):
    coord = await coordinator(CFG)
    async with await connect(coord.socket_path, **kw("t1")) as a, \
            await connect(coord.socket_path, **kw("t1")) as a2, \
            await connect(coord.socket_path, **kw("t2")) as other:
        prompt = tokens(0, 12)
        await a.add_request("r", prompt)
        blocks = (await a.allocate_slots("r", 12))[0]
        await a.advance("r", 12)
        await a.cache_blocks("r", 12)
        await other.add_request("o", tokens(50, 58))
        theirs = (await other.allocate_slots("o", 8))[0]
        # another tenant's block, one the request does not hold, a block of
        # another session's request: refused, nothing uncached
        with pytest.raises(InvalidArgument, match="report only the blocks a request read"):
            await a.report_corrupt("r", [theirs[0]])
        with pytest.raises(InvalidArgument, match="not one of the blocks of request 'o'"):
            await other.report_corrupt("o", [blocks[0]])
        with pytest.raises(UnknownRequest):
            await other.report_corrupt("r", [blocks[0]])   # t2 cannot even see it
        await a2.add_request("r2", prompt + [1])
        hits, n = await a2.get_computed_blocks("r2")
        assert n == 12
        with pytest.raises(Exception, match="belongs to another session"):
            await a2.report_corrupt("r", [blocks[1]])
        with caplog.at_level(logging.WARNING, logger="kvshm.coordinator"):
            gone = await a.report_corrupt("r", [blocks[1]])
        assert gone == blocks[1:]
        assert any("reported 1 block(s) of request 'r' with wrong K/V" in r.message
                   and "uncached 2 block(s)" in r.message for r in caplog.records)
        m = read_metrics(coord.metrics.words)
        assert m["corrupt_reported"] == 1 and m["corrupt_evicted"] == 2
        await a2.add_request("r3", prompt + [2])
        assert (await a2.get_computed_blocks("r3"))[1] == 4     # up to the bad block


def test_the_report_survives_a_coordinator_restart(pool_name):
    """The chains are in the segment: a restarted coordinator still finds
    the blocks computed from a bad one (blocks no request holds any more
    among them)."""
    with CoordinatorProcess(CFG, name=pool_name) as proc:
        with connect_sync(proc.socket, hash_algorithm=CFG.hash_algorithm,
                          hash_seed=CFG.hash_seed,
                          reconnect=Reconnect(initial_delay=0.01, max_delay=0.1,
                                              timeout=20)) as c:
            prompt = tokens(0, 16)
            c.add_request("w", prompt)
            blocks = c.allocate_slots("w", 16)[0]
            c.advance("w", 16)
            c.cache_blocks("w", 16)
            c.free("w")                                   # cached, held by nobody
            proc.kill()
            proc.restart()
            c.add_request("r", tokens(0, 9))
            hits, n = c.get_computed_blocks("r")
            assert hits[0] == blocks[:2] and n == 8
            c.allocate_slots("r", 1, n, use_computed_blocks=True)
            assert c.report_corrupt("r", [blocks[0]]) == blocks   # its whole chain
            c.add_request("q", prompt + [1])
            assert c.get_computed_blocks("q")[1] == 0


def test_stats_top_and_metrics_show_the_corrupt_blocks(pool_name):
    with CoordinatorProcess(CFG, name=pool_name) as proc:
        with connect_sync(proc.socket, **kw()) as c:
            c.add_request("r", tokens(0, 8))
            blocks = c.allocate_slots("r", 8)[0]
            c.advance("r", 8)
            c.cache_blocks("r", 8)
            assert c.report_corrupt("r", [blocks[0]]) == blocks
            outs = {}
            for cmd in (["stats", pool_name], ["stats", pool_name, "--json"],
                        ["top", pool_name, "--once", "--interval", "0.1"]):
                out = subprocess.run([sys.executable, "-m", "kvshm", *cmd], capture_output=True,
                                     text=True, timeout=30)
                assert out.returncode == 0, out.stderr
                outs[" ".join(cmd[:1] + cmd[2:])] = out.stdout
    assert "CORRUPT blocks: 1 reported by engines, 2 uncached" in outs["stats"]
    st = json.loads(outs["stats --json"])
    assert (st["corrupt_blocks_reported"], st["corrupt_blocks_evicted"]) == (1, 2)
    assert "CORRUPT blocks 1 reported, 2 uncached" in outs["top --once --interval 0.1"]
