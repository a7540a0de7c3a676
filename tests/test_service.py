"""The coordinator service: every message type through the client (checked
against an embedded KVCacheManager doing the same calls), sessions and
ownership, tenants, auth and socket permissions, `kvshm stats`, and
conformance replay through a coordinator process (`kvshm replay --ipc`).

Fault handling is in test_service_faults.py (bad input, error codes),
test_client_faults.py (killed clients, cancellation, backpressure) and
test_coordinator_faults.py (signals, `kvshm serve` refusing to start).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import stat
import sys
from pathlib import Path

import pytest

from helpers import ids, make_config, tokens, until
from kvshm import FullSpec, KVCacheManager, Request, SlidingWindowSpec
from kvshm.core.check import check_segment
from kvshm.core.errors import DuplicateRequest, InvalidArgument, UnknownRequest
from kvshm.ops import protocol as p
from kvshm.ops.errors import ConnectionLost, Forbidden, HashMismatch, NotOwner
from kvshm.ops.executor import OpExecutor
from kvshm.pool.segment import SHM_DIR
from kvshm.pool.stats import read_stats
from kvshm.replay import expand_paths, load_trace
from kvshm.service.client import connect
from kvshm.service.handshake import default_socket_path
from kvshm.service.ipc_replay import replay_trace_ipc
from kvshm.service.process import CoordinatorProcess
from kvshm.service.server import Coordinator

TRACES = Path(__file__).parent / "data" / "conformance" / "traces"
TRACES_032 = Path(__file__).parent / "data" / "conformance-0.32.0" / "traces"


# -- fixtures ------------------------------------------------------------------------------
async def client(coord: Coordinator, **kw):
    return await connect(coord.socket_path, hash_algorithm=coord.config.hash_algorithm,
                         hash_seed=coord.config.hash_seed, **kw)



def assert_pool_clean(coord: Coordinator) -> None:
    report = check_segment(coord.mgr.segment, coord.mgr.block_pool)
    assert report.clean, report.problems


# -- every message type, checked against embedded mode -----------------------------------
class Mirror:
    """The same calls run by the op executor on an embedded KVCacheManager
    (no socket, no codec), in the shapes the client returns."""

    def __init__(self, config) -> None:
        self.mgr = KVCacheManager(config)
        self.executor = OpExecutor(self.mgr)
        self.owner = self.executor.lifecycle.open(1, admin=True)

    def run(self, op):
        reply = self.executor.execute(self.owner, op)
        assert reply.__class__ is not p.Error, reply
        return reply

    def add(self, rid, prompt=None, *, block_hashes=None, num_tokens=0):
        self.run(p.AddRequest(rid, prompt, block_hashes, num_tokens))

    def advance(self, rid, n, append=(), *, append_hashes=(), num_appended=0):
        self.run(p.Advance(rid, n, list(append), list(append_hashes), num_appended))

    def get_computed_blocks(self, rid):
        r = self.run(p.GetComputedBlocks(rid))
        return ids(r.block_ids), r.num_computed_tokens

    def allocate_slots(self, rid, n, nc=0, *, use_computed_blocks=False, **kw):
        return ids(self.run(p.AllocateSlots(rid, n, nc, use_computed_blocks,
                                            **kw)).new_block_ids)

    def cache_blocks(self, rid, n):
        self.run(p.CacheBlocks(rid, n))

    def free(self, rid, *, preempted=False):
        return self.run(p.Free(rid, preempted)).num_free_blocks

    def remove_skipped_blocks(self, rid, n):
        return self.run(p.RemoveSkippedBlocks(rid, n)).num_free_blocks

    def get_block_ids(self, rid):
        return ids(self.run(p.GetBlockIds(rid)).block_ids)

    def get_num_common_prefix_blocks(self, rid):
        return self.run(p.NumCommonPrefixBlocks(rid)).num_blocks

    def reset_prefix_cache(self):
        return self.run(p.ResetPrefixCache()).ok

    def evict_blocks(self, block_ids):
        return self.run(p.EvictBlocks(list(block_ids))).num_free_blocks

    def stats(self, free_head=0) -> dict:
        return stats_dict(self.run(p.GetStats(free_head)))


def stats_dict(s: p.Stats) -> dict:
    d = {f: getattr(s, f) for f in s.__struct_fields__}
    d.pop("num_sessions")
    return d


HYBRID = make_config(groups=(FullSpec(4), SlidingWindowSpec(4, 8)), num_blocks=48,
                     max_num_seqs=8)


async def test_every_operation_matches_embedded_mode(coordinator):
    coord = await coordinator(HYBRID)
    e = Mirror(HYBRID)
    try:
        async with await client(coord, admin=True) as c:
            assert c.config == HYBRID
            assert c.pool_segment == coord.name
            assert c.session_id in coord.sessions
            assert c.hash_fingerprint == coord.fingerprint

            async def both(method, *args, **kw):
                got = await getattr(c, method)(*args, **kw)
                want = getattr(e, method)(*args, **kw)
                assert got == want, (method, args, kw)
                return got

            prompt = tokens(0, 22)  # 5 full blocks + 2 tokens
            await c.add_request("r1", prompt)
            e.add("r1", prompt)
            assert await both("get_computed_blocks", "r1") == ([[], []], 0)
            first = await both("allocate_slots", "r1", 22, 0, use_computed_blocks=True)
            assert first == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
            await c.advance("r1", 22, [500])
            e.advance("r1", 22, [500])
            await both("allocate_slots", "r1", 1)
            await both("cache_blocks", "r1", 23)
            await both("get_block_ids", "r1")
            assert await both("get_num_common_prefix_blocks", "r1") == [6, 0]
            await both("remove_skipped_blocks", "r1", 23)

            # A hash-only request: the client hashes with make_hasher().
            hasher = c.make_hasher()
            assert hasher is not None and hasher.fingerprint == coord.fingerprint
            full = prompt + [500, 501]            # 24 tokens = 6 full blocks
            hashes = Request("h", full, hasher).block_hashes
            await c.add_request("r2", block_hashes=hashes[:4], num_tokens=18)
            e.add("r2", block_hashes=hashes[:4], num_tokens=18)
            hits = await both("get_computed_blocks", "r2")
            assert hits[1] == 16                  # 4 blocks of r1's prompt
            await both("allocate_slots", "r2", 2, 16, use_computed_blocks=True)
            await c.advance("r2", 18, append_hashes=hashes[4:6], num_appended=6)
            e.advance("r2", 18, append_hashes=hashes[4:6], num_appended=6)
            await both("allocate_slots", "r2", 6)
            await both("cache_blocks", "r2", 24)
            r2_blocks = await both("get_block_ids", "r2")
            await both("get_num_common_prefix_blocks", "r2")

            # preempted: blocks freed, the request kept (it can be looked up again)
            await both("free", "r1", preempted=True)
            assert "r1" in coord.executor.requests
            assert await both("get_block_ids", "r1") == [[], []]
            await both("get_computed_blocks", "r1")
            # finished: forgotten
            await both("free", "r1")
            assert "r1" not in coord.executor.requests
            with pytest.raises(UnknownRequest):
                await c.free("r1")

            await both("evict_blocks", r2_blocks[0][:2])
            assert await both("reset_prefix_cache") is False   # r2 holds blocks
            st = await c.stats(free_head=6)
            assert stats_dict(st) == e.stats(6) and st.num_sessions == 1
            assert len(st.free_head) == 6
            await both("free", "r2")
            assert await both("reset_prefix_cache") is True
            st = await c.stats(free_head=100)
            assert stats_dict(st) == e.stats(100)
            assert st.num_cached_blocks == 0 and st.num_free_blocks == 47

            # a batch: every reply type in one frame
            bp = tokens(1000, 1013)
            ops = [p.AddRequest("r3", bp), p.GetComputedBlocks("r3"),
                   p.AllocateSlots("r3", 13, 0, True), p.Advance("r3", 13, [7, 8, 9]),
                   p.AllocateSlots("r3", 3), p.CacheBlocks("r3", 16), p.GetBlockIds("r3"),
                   p.NumCommonPrefixBlocks("r3"), p.RemoveSkippedBlocks("r3", 16),
                   p.EvictBlocks([1]), p.GetStats(3), p.Free("r3", True), p.Free("r3"),
                   p.ResetPrefixCache()]
            results = await c.batch(ops)
            e.add("r3", bp)
            hb, hn = e.get_computed_blocks("r3")
            a1 = e.allocate_slots("r3", 13, 0, use_computed_blocks=True)
            f1 = e.mgr.num_free_blocks
            e.advance("r3", 13, [7, 8, 9])
            a2 = e.allocate_slots("r3", 3)
            f2 = e.mgr.num_free_blocks
            e.cache_blocks("r3", 16)
            want = [p.Done(), p.ComputedBlocks(hb, hn), p.Allocated(a1, f1),
                    p.Done(), p.Allocated(a2, f2), p.Done(),
                    p.BlockIds(e.get_block_ids("r3")),
                    p.CommonPrefix(e.get_num_common_prefix_blocks("r3")),
                    p.FreeBlocks(e.remove_skipped_blocks("r3", 16)),
                    p.FreeBlocks(e.evict_blocks([1]))]
            st = e.stats(3)
            want.append(p.Stats(st["num_blocks"], st["num_free_blocks"],
                                st["num_cached_blocks"], st["usage"], st["num_requests"], 1,
                                st["queries"], st["hits"], st["query_tokens"],
                                st["hit_tokens"], st["free_head"]))
            want += [p.FreeBlocks(e.free("r3", preempted=True)), p.FreeBlocks(e.free("r3")),
                     p.ResetResult(e.reset_prefix_cache())]
            assert results == want
            assert await c.batch([]) == []
            assert_pool_clean(coord)
            assert check_segment(e.mgr.segment, e.mgr.block_pool).clean
    finally:
        e.mgr.close()


async def test_a_batch_stops_at_its_first_error(coordinator):
    coord = await coordinator()
    async with await client(coord) as c:
        with pytest.raises(UnknownRequest) as ei:
            await c.batch([p.AddRequest("a", tokens(0, 8)), p.AllocateSlots("a", 8),
                           p.GetBlockIds("nope"), p.Free("a")])
        assert ei.value.index == 2
        assert ei.value.results == [p.Done(), p.Allocated([[1, 2]], 61)]
        # the ops before the error ran, the ones after did not
        assert await c.get_block_ids("a") == [[1, 2]]
        with pytest.raises(DuplicateRequest):
            await c.batch([p.AddRequest("a", [1])])
        assert await c.free("a") == 63


async def test_caching_off_pool_has_no_hasher_and_no_hits(coordinator):
    cfg = make_config(num_blocks=16, enable_caching=False)
    coord = await coordinator(cfg)
    async with await client(coord) as c:
        assert c.make_hasher() is None
        await c.add_request("a", tokens(0, 12))
        assert await c.allocate_slots("a", 12) == [[1, 2, 3]]
        await c.add_request("b", tokens(0, 12))
        assert await c.get_computed_blocks("b") == ([[]], 0)
        await c.add_request("h", block_hashes=[], num_tokens=12)
        with pytest.raises(InvalidArgument):
            await c.add_request("h2", block_hashes=[b"x" * 32], num_tokens=12)


# -- sessions -----------------------------------------------------------------------------------
async def test_two_sessions_cannot_touch_each_others_requests(coordinator):
    coord = await coordinator()
    async with await client(coord) as a, await client(coord) as b:
        assert a.session_id != b.session_id
        await a.add_request("a1", tokens(0, 10))
        await a.get_computed_blocks("a1")
        assert await a.allocate_slots("a1", 10) == [[1, 2, 3]]
        before = (coord.mgr.num_free_blocks, coord.mgr.block_pool.num_cached_blocks)
        for call in (b.advance("a1", 10, [1]), b.get_computed_blocks("a1"),
                     b.allocate_slots("a1", 1), b.cache_blocks("a1", 8), b.free("a1"),
                     b.free("a1", preempted=True), b.remove_skipped_blocks("a1", 8),
                     b.get_block_ids("a1"), b.get_num_common_prefix_blocks("a1")):
            with pytest.raises(NotOwner):
                await call
        with pytest.raises(NotOwner) as ei:
            await b.batch([p.GetStats(), p.Free("a1")])
        assert ei.value.index == 1
        with pytest.raises(DuplicateRequest):
            await b.add_request("a1", tokens(0, 4))
        assert (coord.mgr.num_free_blocks, coord.mgr.block_pool.num_cached_blocks) == before
        assert coord.executor.requests["a1"].owner.id == a.session_id
        # the owner still has it, untouched
        assert await a.get_block_ids("a1") == [[1, 2, 3]]
        assert coord.executor.requests["a1"].request.num_tokens == 10
        assert await a.free("a1") == 63
        # once the owner forgot it, the id is free for anyone
        await b.add_request("a1", tokens(0, 4))
        assert coord.executor.requests["a1"].owner.id == b.session_id
        assert_pool_clean(coord)


async def test_a_clean_close_frees_the_sessions_requests(coordinator):
    coord = await coordinator()
    other = await client(coord)
    await other.add_request("keep", tokens(0, 8))
    await other.allocate_slots("keep", 8)
    c = await client(coord)
    sid = c.session_id
    for i in range(5):
        await c.add_request(f"r{i}", tokens(100 * i, 100 * i + 12))
        await c.allocate_slots(f"r{i}", 12)
        await c.advance(f"r{i}", 12)        # computed: its blocks are ready for all
    await c.add_request("never-allocated", tokens(0, 4))
    assert coord.mgr.num_free_blocks == 63 - 2 - 15
    await c.close()
    with pytest.raises(Exception) as ei:
        await c.stats()
    assert type(ei.value).__name__ == "ConnectionClosed"
    await until(lambda: sid not in coord.sessions)
    assert coord.mgr.num_free_blocks == 61
    assert set(coord.executor.requests) == {"keep"}
    assert len(coord.mgr.table) == 1
    assert_pool_clean(coord)
    # the freed requests' blocks stay cached: the other session hits them
    await other.add_request("again", tokens(100, 112))
    assert (await other.get_computed_blocks("again"))[1] == 8
    await other.close()
    await until(lambda: not coord.sessions)
    assert coord.mgr.num_free_blocks == 63 and not coord.executor.requests


async def test_connect_to_nothing_is_connection_lost(sockdir):
    with pytest.raises(ConnectionLost):
        await connect(sockdir / "nobody.sock")


# -- tenants ----------------------------------------------------------------------------------------
async def test_tenants_never_share_cached_blocks(coordinator):
    coord = await coordinator()
    prompt = tokens(0, 17)                 # 4 full blocks
    async with await client(coord, tenant="A") as a1:
        await a1.add_request("a1", prompt)
        await a1.allocate_slots("a1", 17)  # caches its 4 full blocks
        await a1.advance("a1", 17)         # ... whose K/V are written
        cached = coord.mgr.block_pool.num_cached_blocks
        assert cached == 4
        hashes = Request("x", prompt, a1.make_hasher()).block_hashes
        async with await client(coord, tenant="B") as b, \
                await client(coord, tenant="A") as a2, await client(coord) as nobody:
            # B: same prompt, same raw hashes -> no hit
            await b.add_request("b1", prompt)
            assert await b.get_computed_blocks("b1") == ([[]], 0)
            await b.add_request("b2", block_hashes=hashes, num_tokens=17)
            assert await b.get_computed_blocks("b2") == ([[]], 0)
            await nobody.add_request("n1", prompt)
            assert await nobody.get_computed_blocks("n1") == ([[]], 0)
            # B caching the same prompt makes its own blocks
            new = await b.allocate_slots("b1", 17)
            assert set(new[0]).isdisjoint((await a1.get_block_ids("a1"))[0])
            assert coord.mgr.block_pool.num_cached_blocks == 8
            # A (another session of the same tenant) hits, by prompt or by hashes
            await a2.add_request("a2", prompt)
            blocks, n = await a2.get_computed_blocks("a2")
            assert n == 16 and blocks == [(await a1.get_block_ids("a1"))[0][:4]]
            await a2.add_request("a3", block_hashes=hashes, num_tokens=17)
            assert await a2.get_computed_blocks("a3") == (blocks, 16)
            assert await a2.allocate_slots("a3", 1, 16, use_computed_blocks=True) is not None
            assert (await a2.get_block_ids("a3"))[0][:4] == blocks[0]
    await until(lambda: not coord.sessions)
    assert_pool_clean(coord)


# -- auth and socket permissions -----------------------------------------------------------------
async def test_token_is_required_when_configured(coordinator):
    coord = await coordinator(token="s3cret-token")
    with pytest.raises(Forbidden):
        await client(coord)
    with pytest.raises(Forbidden):
        await client(coord, token="wrong")
    async with await client(coord, token="s3cret-token") as c:
        assert (await c.stats()).num_blocks == 64
    await until(lambda: not coord.sessions)


async def test_hash_mismatch_is_refused_by_connect(coordinator):
    coord = await coordinator()
    with pytest.raises(HashMismatch, match="hash_seed"):
        await connect(coord.socket_path, hash_seed="another-seed")
    await until(lambda: not coord.sessions)


async def test_socket_is_0600_in_a_0700_directory(coordinator, sockdir):
    path = sockdir / "made" / "here" / "pool.sock"
    coord = await coordinator(socket_path=path)
    assert stat.S_ISSOCK(path.lstat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    async with await client(coord) as c:
        assert c.session_id >= 1


async def test_a_stale_socket_is_replaced(coordinator, sockdir):
    import socket
    stale = sockdir / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()                                  # a socket file nobody listens on
    coord = await coordinator(socket_path=stale)
    async with await client(coord) as c:
        await c.stats()


async def test_a_regular_file_at_the_socket_path_is_refused_and_kept(sockdir):
    """BUG: start() refuses a path that is not a socket, but stop() (which
    serve() always runs) unlinks socket_path unconditionally, deleting the
    user's file it just refused to touch."""
    plain = sockdir / "plain"
    plain.write_text("not a socket")
    coord = Coordinator(make_config(), name=f"kvshm-test-{secrets.token_hex(5)}",
                        socket_path=plain)
    try:
        with pytest.raises(InvalidArgument, match="not a socket"):
            await coord.start()
        assert plain.read_text() == "not a socket"
    finally:
        await coord.stop()
    assert not os.path.exists(f"{SHM_DIR}/{coord.name}")
    assert plain.exists(), "stop() deleted a file the coordinator never created"


def test_default_socket_path(monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1234")
    assert default_socket_path("pool") == Path("/run/user/1234/kvshm/pool.sock")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_socket_path("pool") == Path(f"/tmp/kvshm-{os.getuid()}/pool.sock")


def test_connect_by_pool_name(pool_name, sockdir, monkeypatch):
    """connect(name=...) reaches the coordinator of `kvshm serve --name NAME`
    started without --socket, and reads the admin token beside that socket."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(sockdir))

    async def run():
        async with await connect(name=pool_name, admin=True) as c:
            await c.reset_prefix_cache()      # admin: the token beside the socket was read
            return c.pool_segment, (await c.stats()).num_blocks

    with CoordinatorProcess(make_config(), name=pool_name, default_socket=True) as proc:
        assert proc.socket == sockdir / "kvshm" / f"{pool_name}.sock"
        assert asyncio.run(run()) == (pool_name, 10)


async def test_connect_takes_a_path_or_a_name(sockdir, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(sockdir))
    with pytest.raises(TypeError, match="not both"):
        await connect(sockdir / "x.sock", name="kvshm")
    with pytest.raises(TypeError, match="not neither"):
        await connect()
    for bad in ("a/b", "", "..", 7):
        with pytest.raises(InvalidArgument, match="bad pool name"):
            await connect(name=bad)
    with pytest.raises(ConnectionLost, match=str(sockdir / "kvshm" / "kvshm-test-none.sock")):
        await connect(name="kvshm-test-none")


def test_serve_with_a_token_file(tmp_path):
    token = tmp_path / "token"
    token.write_text("file-token\n")
    cfg = make_config()

    async def run(sock):
        with pytest.raises(Forbidden):
            await connect(sock)
        async with await connect(sock, token="file-token") as c:
            return (await c.stats()).num_blocks

    with CoordinatorProcess(cfg, extra_args=("--token-file", str(token))) as proc:
        assert asyncio.run(run(proc.socket)) == 10
        assert proc.stop() == 0


# -- kvshm stats ---------------------------------------------------------------------------------------
async def _kvshm(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvshm", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode, out.decode(), err.decode()


async def test_kvshm_stats_reads_the_segment(coordinator):
    coord = await coordinator()
    async with await client(coord) as a, await client(coord) as b:
        for i in range(3):
            await a.add_request(f"a{i}", tokens(10 * i, 10 * i + 8))
            await a.allocate_slots(f"a{i}", 8)                # 2 blocks each
            await a.advance(f"a{i}", 8)
        await b.add_request("b0", tokens(500, 513))
        await b.get_computed_blocks("b0")
        await b.allocate_slots("b0", 13)                     # 4 blocks
        await b.add_request("b1", tokens(0, 8))               # hits a0's 1 full block
        hit, n = await b.get_computed_blocks("b1")
        assert n == 4
        await b.allocate_slots("b1", 4, 4, use_computed_blocks=True)
        rc, out, err = await _kvshm("stats", coord.name, "--json")
        assert rc == 0, err
        st = json.loads(out)
        assert st["name"] == coord.name
        assert st["num_blocks"] == 64
        assert st["num_free_blocks"] == coord.mgr.num_free_blocks == 63 - 6 - 4 - 1
        assert st["num_used_blocks"] == 11
        assert st["num_cached_blocks"] == coord.mgr.block_pool.num_cached_blocks
        assert st["num_requests"] == 5
        assert st["coordinator_pid"] == os.getpid() and st["coordinator_alive"]
        assert st["consistent"]
        assert st["queries"] == 2 and st["hits"] == 1 and st["hit_tokens"] == 4
        assert st["sessions"] == [
            {"session": a.session_id, "requests": 3, "blocks": 6},
            {"session": b.session_id, "requests": 2, "blocks": 6},
        ]
        assert st == {**read_stats(coord.mgr.segment), "uptime_s": st["uptime_s"]}

        rc, out, err = await _kvshm("stats", coord.name)
        assert rc == 0, err
        assert f"pool {coord.name}: 64 blocks, 52 free" in out
        assert f"session {a.session_id}: 3 requests, 6 block references" in out
        assert f"session {b.session_id}: 2 requests, 6 block references" in out
        assert "requests 5" in out
    rc, out, err = await _kvshm("stats", "kvshm-no-such-pool-here")
    assert rc == 2 and "no shared-memory segment" in err


async def test_stats_attribute_every_request_to_its_session(coordinator):
    """BUG: get_num_common_prefix_blocks and cache_blocks on a request that
    holds no slot yet (new, or preempted) create its table slot without
    recording the owning session, so `kvshm stats` lists it under a
    non-existent "session 0"."""
    coord = await coordinator()
    async with await client(coord) as c:
        await c.add_request("probe", tokens(0, 10))
        assert await c.get_num_common_prefix_blocks("probe") == [0]
        await c.add_request("pre", tokens(100, 110))
        await c.allocate_slots("pre", 10)
        await c.free("pre", preempted=True)
        await c.cache_blocks("pre", 8)
        sessions = read_stats(coord.mgr.segment)["sessions"]
        assert [s["session"] for s in sessions] == [c.session_id], sessions


# -- conformance replay through a coordinator process ---------------------------------------------
IPC_TRACES = [
    "full16-tiny-chat-s1000", "full16-nocache-tiny-chat-s1200", "sw128-tiny-chat-s1528",
    "hyb-full-sw32-tiny-chat-s2032", "mamba16-tiny-chat-s1800",
    "eagle-full16-tiny-chat-s2500", "encdec-enc64-tiny-chat-s1964",
    "pd-full16-tiny-chat-s2900", "sink16-tiny-chat-s1716", "chunked32-tiny-chat-s1632",
    "dcp2-full16-tiny-chat-s2700", "hyb3-full-sw-mamba-tiny-chat-s2330",
    # vLLM 0.32.0's (tests/test_conformance.py replays every one embedded)
    "0.32.0/full16-tiny-chat-s1000", "0.32.0/full16-nocache-tiny-chat-s1200",
    "0.32.0/pd-full16-small-oob-s2905", "0.32.0/eagle-full16-tiny-chat-s2500",
    "0.32.0/encdec-enc64-tiny-chat-s1964", "0.32.0/hyb-full-chunked64-tiny-chat-s2400",
    "0.32.0/sw128-tiny-chat-s1528", "0.32.0/mamba16-tiny-chat-s1800",
    "0.32.0/hyb3-full-sw-mamba-tiny-chat-s2330", "0.32.0/eagle-hyb-full-sw128-tiny-chat-s2520",
]


def trace_path(name: str) -> Path:
    release, _, name = name.rpartition("/")
    return (TRACES_032 if release else TRACES) / f"{name}.jsonl.gz"


@pytest.mark.parametrize("batch", [0, 64], ids=["ipc", "ipc-batch"])
@pytest.mark.parametrize("name", IPC_TRACES)
def test_replay_ipc(name, batch):
    cfg, ops = load_trace(trace_path(name))
    mismatch, seconds, report = replay_trace_ipc(cfg, ops, batch=batch)
    assert mismatch is None, str(mismatch)
    assert seconds > 0
    assert report.clean, report.summary()


def test_replay_ipc_cli(capsys):
    from kvshm.cli import main
    one = str(TRACES / "hyb-full-sw32-tiny-chat-s2032.jsonl.gz")
    assert main(["replay", "--ipc", "--batch", "--batch-size", "17", "--json", one]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["passed"] == 1 and doc["traces"][0]["ipc_ops_per_s"] > 0


@pytest.mark.skipif(os.environ.get("KVSHM_FULL_IPC") != "1",
                    reason="set KVSHM_FULL_IPC=1 to replay every trace through IPC")
def test_replay_ipc_all_traces():
    paths = list(expand_paths([TRACES]))
    assert len(paths) == 166
    failures = []
    for path in paths + list(expand_paths([TRACES_032])):
        cfg, ops = load_trace(path)
        for batch in (0, 64):
            mismatch, _, report = replay_trace_ipc(cfg, ops, batch=batch)
            if mismatch is not None or not report.clean:
                failures.append(f"{path.name} batch={batch}: {mismatch or report.summary()}")
    assert not failures, "\n".join(failures)
