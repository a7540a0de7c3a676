"""Clients that misbehave: one SIGKILLed while holding requests, cancelled
and timed-out calls, and backpressure on a client that stops reading its
replies (on asyncio's loop and on uvloop).
"""

from __future__ import annotations

import asyncio
import secrets
import sys

import pytest

from helpers import make_config, tokens, until
from kvshm.core.check import check_segment
from kvshm.ops import protocol as p
from kvshm.ops.errors import RequestTimeout
from kvshm.ops.protocol import encode_frame
from kvshm.service.client import connect
from kvshm.service.server import Coordinator
from raw_wire import CONFIG, Raw, snapshot


@pytest.fixture
def coordinator_config():
    return CONFIG


# -- a client killed while holding requests ----------------------------------------------------------
KILLED_CLIENT = r"""
import asyncio, sys
from kvshm.ops import protocol as p
from kvshm.service.client import connect

async def main():
    c = await connect(sys.argv[1])
    ops = []
    for i in range(100):
        ops += [p.AddRequest(f"k{i}", list(range(1000 * i, 1000 * i + 10))),
                p.AllocateSlots(f"k{i}", 10)]
    res = await c.batch(ops)
    assert all(r.new_block_ids for r in res[1::2])
    print("ready", c.session_id, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


async def test_sigkilled_client_frees_everything_within_a_second(coordinator):
    cfg = make_config(num_blocks=512, max_num_seqs=128)
    coord = await coordinator(cfg)
    async with await connect(coord.socket_path) as other:
        await other.add_request("survivor", tokens(0, 8))
        await other.allocate_slots("survivor", 8)
        free0 = coord.mgr.num_free_blocks
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", KILLED_CLIENT, str(coord.socket_path),
            stdout=asyncio.subprocess.PIPE)
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
            assert line.startswith("ready"), line
            sid = int(line.split()[1])
            assert len(coord.sessions[sid].owner.requests) == 100
            assert coord.mgr.num_free_blocks == free0 - 300
            assert len(coord.mgr.table) == 101
            proc.kill()
            t0 = asyncio.get_running_loop().time()
            await until(lambda: coord.mgr.num_free_blocks == free0, timeout=1.0)
            elapsed = asyncio.get_running_loop().time() - t0
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
        assert elapsed < 1.0
        assert sid not in coord.sessions
        assert set(coord.executor.requests) == {"survivor"}
        assert len(coord.mgr.table) == 1
        pool = coord.mgr.block_pool
        assert len(pool.free_queue()) == free0
        report = check_segment(coord.mgr.segment, pool)
        assert report.clean, report.problems
        assert report.num_requests == 1
        assert await other.get_block_ids("survivor") == [[1, 2]]


# -- cancelled and timed-out calls ---------------------------------------------------------------------
async def test_cancelled_and_timed_out_calls_leave_the_connection_in_sync(coordinator):
    coord = await coordinator()
    async with await connect(coord.socket_path, admin=True) as c:
        await c.add_request("a", tokens(0, 10))
        await c.allocate_slots("a", 10)
        session = coord.sessions[c.session_id]

        # 1. task.cancel() after the frame went out: its reply is discarded
        session.transport.pause_reading()           # hold the coordinator's replies
        task = asyncio.create_task(c.get_block_ids("a"))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        session.transport.resume_reading()
        st = await c.stats(free_head=2)
        assert isinstance(st, p.Stats) and len(st.free_head) == 2

        # 2. the call's own timeout -> RequestTimeout
        session.transport.pause_reading()
        with pytest.raises(RequestTimeout):
            await c.get_num_common_prefix_blocks("a", timeout=0.05)
        session.transport.resume_reading()
        assert await c.get_block_ids("a") == [[1, 2, 3], [4, 5, 6]]

        # 3. asyncio.wait_for around a call
        session.transport.pause_reading()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(c.get_block_ids("a"), 0.05)
        session.transport.resume_reading()
        assert await c.free("a", preempted=True) == 63

        # 4. a cancelled mutation still ran (its frame was sent), and the
        #    connection stays in sync
        session.transport.pause_reading()
        task = asyncio.create_task(c.add_request("b", [1, 2, 3]))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        session.transport.resume_reading()
        assert (await c.stats()).num_sessions == 1
        assert "b" in coord.executor.requests

        # 5. many pipelined calls, every other one cancelled
        session.transport.pause_reading()
        tasks = [asyncio.create_task(c.stats(free_head=k)) for k in range(20)]
        await asyncio.sleep(0.02)
        for t in tasks[::2]:
            t.cancel()
        session.transport.resume_reading()
        for k, t in enumerate(tasks):
            if k % 2:
                assert len((await t).free_head) == k
            else:
                with pytest.raises(asyncio.CancelledError):
                    await t
        assert c.calls_in_flight == 0   # every reply, cancelled or not, was read
        assert await c.get_block_ids("a") == [[], []]


async def test_a_zero_timeout_never_desyncs(coordinator):
    coord = await coordinator()
    async with await connect(coord.socket_path, admin=True) as c:
        for k in range(30):
            with pytest.raises(RequestTimeout):
                await c.stats(free_head=k % 4, timeout=0)
            assert len((await c.stats(free_head=k % 5)).free_head) == k % 5


# -- backpressure (on asyncio's loop and on uvloop, the coordinator's) ------------------------------
LOOPS = {"asyncio": asyncio.run, "uvloop": lambda coro: __import__("uvloop").run(coro)}


async def _with_coordinator(sockdir, fn, config=CONFIG, **kw):
    coord = Coordinator(config, name=f"kvshm-test-{secrets.token_hex(5)}",
                        socket_path=sockdir / "bp.sock", **kw)
    try:
        await coord.start()
        return await fn(coord)
    finally:
        await coord.stop()


async def _flood_without_reading(coord, frames: list[bytes], settle: float = 0.3):
    """Send `frames` on a raw connection that does not read its replies;
    return it, its coordinator session and the peak of that session's
    write buffer."""
    raw = await Raw.open(coord.socket_path)
    welcome = await raw.hello(coord.admin_token)
    session = coord.sessions[welcome.session_id]
    raw.w.transport.pause_reading()                  # stop reading replies
    raw.send(b"".join(frames))
    peak = 0
    loop = asyncio.get_running_loop()
    end = loop.time() + settle
    while True:
        peak = max(peak, session.transport.get_write_buffer_size())
        if loop.time() >= end:
            return raw, session, peak
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("loop", list(LOOPS))
def test_backpressure_bounds_the_coordinators_write_buffer(sockdir, loop):
    n = 50_000

    async def body(coord):
        before = snapshot(coord)
        frames = [encode_frame(p.GetStats(i % 7)) for i in range(n)]
        raw, session, peak = await _flood_without_reading(coord, frames)
        try:
            assert not session.transport.is_reading()   # paused: not reading the flood
            assert 64 * 1024 < peak <= 4 * 2**20, peak
            raw.w.transport.resume_reading()
            replies = await raw.recv_many(n)            # every reply, in order
            for i, st in enumerate(replies):
                assert isinstance(st, p.Stats) and len(st.free_head) == i % 7, (i, st)
            await until(lambda: session.transport.is_reading())
            assert isinstance(await raw.call(p.GetStats()), p.Stats)
            assert snapshot(coord) == before
        finally:
            await raw.close()

    LOOPS[loop](_with_coordinator(sockdir, body, write_buffer_high=64 * 1024))


@pytest.mark.parametrize("loop", list(LOOPS))
def test_backpressure_holds_for_replies_larger_than_requests(sockdir, loop):
    """BUG: Session.pause_writing pauses reading, but data_received keeps
    executing every frame already received in the current chunk; with small
    requests and large replies (stats(free_head=4096) is 14 bytes in, ~12 kB
    out) 14 kB of input buffer ~12 MB (one 256 kB read: ~200 MB), and the
    loop is blocked for the whole chunk."""
    n = 1000

    async def body(coord):
        raw, session, peak = await _flood_without_reading(
            coord, [encode_frame(p.GetStats(4096))] * n)
        try:
            assert peak <= 8 * 2**20, f"{peak:,} bytes buffered for {n} replies"
        finally:
            raw.w.transport.resume_reading()
            assert all(isinstance(r, p.Stats) for r in await raw.recv_many(n))
            await raw.close()

    LOOPS[loop](_with_coordinator(sockdir, body, make_config(num_blocks=8192, max_num_seqs=16)))
