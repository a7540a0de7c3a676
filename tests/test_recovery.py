"""A pool outlives its coordinator: adoption after SIGKILL, resumed sessions,
the grace period, refusals that leave the segments untouched, the writer
lock, and the rights of ordinary and admin sessions (docs/recovery.md).

The crash-point sweep is in test_crash_points.py."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time

import msgspec
import pytest

from helpers import check_pool, make_config, tokens, until
from kvshm.core.check import check_segment
from kvshm.ops import protocol as p
from kvshm.ops.errors import ConnectionLost, Forbidden, ResumeFailed
from kvshm.pool.segment import PoolSegment, segment_info
from kvshm.pool.shm import SHM_DIR
from kvshm.service import client as client_module
from kvshm.service.client import connect, open_wire
from kvshm.service.process import CoordinatorProcess
from kvshm.service.resume import Reconnect


def segment_bytes(name: str) -> bytes:
    """The pool segment's bytes, read from /dev/shm as any process can."""
    with open(os.path.join(SHM_DIR, name), "rb") as f:
        return f.read()


CFG = make_config(num_blocks=64, max_num_seqs=16)
FAST = Reconnect(initial_delay=0.01, max_delay=0.2, timeout=20)


async def _client(proc, **kw):
    kw.setdefault("reconnect", FAST)
    return await connect(proc.socket, hash_algorithm=CFG.hash_algorithm,
                         hash_seed=CFG.hash_seed, **kw)


def _serve(config, name: str, sock, *extra, timeout=30) -> subprocess.CompletedProcess:
    path = sock.parent / f"{name}.json"
    path.write_bytes(config.to_json())
    return subprocess.run([sys.executable, "-m", "kvshm", "serve", "--config", str(path),
                           "--name", name, "--socket", str(sock), "--quiet", *extra],
                          capture_output=True, text=True, timeout=timeout)


async def test_sigkill_of_the_coordinator_is_a_pause(pool_name):
    """Requests, block tables and the prefix cache survive; the client does
    not notice beyond a delay."""
    with CoordinatorProcess(CFG, name=pool_name) as proc:
        c = await _client(proc)
        prompt = tokens(0, 14)                      # 3 full blocks + 2 tokens
        await c.add_request("done", prompt)
        await c.allocate_slots("done", 14)
        await c.advance("done", 14)                 # its K/V are written
        await c.free("done")                        # finished: its 3 full blocks stay cached
        await c.add_request("run", tokens(100, 110))
        await c.allocate_slots("run", 10)
        await c.advance("run", 10, [7])
        held = await c.get_block_ids("run")
        sid = c.session_id
        proc.kill()
        proc.restart()
        assert await c.get_block_ids("run") == held  # taken back, restored
        assert c.session_id == sid and c.generation == 1 and len(c.restarts) == 1
        await c.add_request("again", prompt)
        hits, n = await c.get_computed_blocks("again")
        assert n == 12 and len(hits[0]) == 3         # the cache survived the crash
        await c.allocate_slots("again", 2, 12, use_computed_blocks=True)
        assert await c.allocate_slots("run", 1) is not None   # "run" is whole again
        assert check_pool(pool_name).clean
        await c.close()
        await asyncio.sleep(0.1)
        st = check_pool(pool_name)
        assert st.clean and st.num_requests == 0
    assert segment_info(pool_name) is None


def lose_after_welcome(monkeypatch, lose) -> list[bool]:
    """From now on, the client's `open_wire` calls `lose(hello, n)` after
    the n-th Welcome; when it returns a reason, the connection is closed and
    lost with it before the client takes it over (as a `connection_lost`
    that came first).  Returns each Welcome's `resumed`, in order."""
    real_open_wire = client_module.open_wire
    resumed: list[bool] = []

    async def open_wire_then_lose(path, hello, timeout):
        wire, welcome = await real_open_wire(path, hello, timeout)
        resumed.append(welcome.resumed)
        why = lose(hello, len(resumed))
        if why:
            wire.transport.close()
            wire.fail(ConnectionLost(why))
        return wire, welcome

    monkeypatch.setattr(client_module, "open_wire", open_wire_then_lose)
    return resumed


async def test_a_coordinator_killed_right_after_its_welcome_is_reconnected_to(pool_name,
                                                                             monkeypatch):
    """The connection of a resume is lost after the Welcome arrived but
    before the client took it over (a coordinator SIGKILLed just then, as a
    soak that kills every 2 s on a loaded machine does): the client must
    not write to the dead connection and wait for ever; it starts over."""
    with CoordinatorProcess(CFG, name=pool_name) as proc:
        def kill_after_first(hello, n):
            if n == 1:
                proc.kill()
                proc.restart()   # (blocking: the dead connection's loss is not seen yet)
                return "killed after its Welcome"
            return None

        c = await _client(proc)
        await c.add_request("run", tokens(100, 110))
        await c.allocate_slots("run", 10)
        held = await c.get_block_ids("run")
        calls = lose_after_welcome(monkeypatch, kill_after_first)
        proc.kill()
        proc.restart()
        assert await asyncio.wait_for(c.get_block_ids("run"), 20) == held
        assert calls == [True, True] and c.generation == 2 and len(c.restarts) == 1
        assert check_pool(pool_name).clean
        await c.close()


async def test_connections_always_lost_after_their_welcome_end_the_resume_on_its_schedule(
        pool_name, monkeypatch):
    with CoordinatorProcess(CFG, name=pool_name) as proc:
        c = await _client(proc, reconnect=Reconnect(initial_delay=0.05, max_delay=0.2,
                                                    timeout=1.5))
        await c.add_request("run", tokens(100, 110))
        attempts = lose_after_welcome(monkeypatch, lambda hello, n: "lost after its Welcome")
        proc.kill()
        proc.restart()
        # The first resume takes the session back and loses it: the
        # coordinator ends a session whose connection closes, so the next
        # attempts get fresh sessions (failing the calls waiting with
        # ResumeFailed), lost in turn, until the policy's timeout.
        outcomes, deadline = set(), time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(c.stats(), 20)
            except ResumeFailed:
                outcomes.add("resume failed")
                continue
            except ConnectionLost as e:
                assert "did not come back within 1.5s" in str(e)
                outcomes.add("gave up")
                break
        assert outcomes == {"resume failed", "gave up"} and not c.connected
        assert attempts[0] and 3 <= len(attempts) <= 12   # backed off, then gave up
        await c.close()


@pytest.mark.parametrize("resume", [True, False])
async def test_a_connection_lost_right_after_the_first_welcome_is_not_waited_on(
        pool_name, monkeypatch, resume):
    with CoordinatorProcess(CFG, name=pool_name) as proc:
        lose_after_welcome(monkeypatch, lambda hello, n: None if hello.resume_token
                           else "lost after its Welcome")
        c = await _client(proc, resume=resume)
        if resume:
            # It reconnects; the coordinator ended the closed session, so the
            # call made meanwhile fails as after any lost session, and the
            # client goes on as a fresh one.
            with pytest.raises(ResumeFailed, match="could not be resumed"):
                await asyncio.wait_for(c.add_request("x", tokens(0, 9)), 20)
            await c.add_request("x", tokens(0, 9))
            assert await c.get_block_ids("x") == [[]]
        else:
            with pytest.raises(ConnectionLost, match="lost after its Welcome"):
                await asyncio.wait_for(c.add_request("x", tokens(0, 9)), 20)
        await c.close()


async def test_a_connection_accepted_then_closed_is_a_connection_error(tmp_path):
    """A coordinator killed as it comes up has accepted connections (the
    kernel queues them) that then close: connecting must say ConnectionLost,
    which a reconnecting client retries, not fail the Hello's write with
    the event loop's RuntimeError, which ended a resume for good."""
    path = tmp_path / "dies.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(64)
    stop = threading.Event()

    def accept_and_close():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            conn.close()

    closer = threading.Thread(target=accept_and_close)
    closer.start()
    hello = p.Hello(p.PROTOCOL_VERSION, os.getpid(), "0" * 16)
    try:
        for _ in range(30):
            with pytest.raises(ConnectionLost, match="closed the connection"):
                await open_wire(path, hello, 5)
    finally:
        stop.set()
        closer.join()
        listener.close()


async def test_a_resume_that_fails_unforeseen_fails_its_calls_instead_of_hanging(
        pool_name, monkeypatch):
    async def broken(path, hello, timeout):
        raise RuntimeError("an error nobody foresaw")

    with CoordinatorProcess(CFG, name=pool_name) as proc:
        c = await _client(proc)
        await c.add_request("run", tokens(100, 110))
        monkeypatch.setattr(client_module, "open_wire", broken)
        proc.kill()
        with pytest.raises(ConnectionLost, match="RuntimeError: an error nobody foresaw"):
            await asyncio.wait_for(c.get_block_ids("run"), 20)
        assert not c.connected
        with pytest.raises(ConnectionLost):          # and every later call
            await asyncio.wait_for(c.get_block_ids("run"), 20)
        await c.close()


async def test_a_session_that_does_not_come_back_is_freed_after_the_grace_period(pool_name):
    with CoordinatorProcess(CFG, name=pool_name, extra_args=("--resume-grace", "0.5")) as proc:
        gone = await _client(proc, resume=False)
        await gone.add_request("lost", tokens(0, 9))
        await gone.allocate_slots("lost", 9)
        await gone.advance("lost", 9)               # its 2 full blocks are ready
        proc.kill()
        proc.restart()
        with pytest.raises(ConnectionLost):
            await gone.get_block_ids("lost")
        seg = PoolSegment.attach(pool_name)
        try:
            assert seg.get("num_requests") == 1      # held for a resume...
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while seg.get("num_requests") and loop.time() < deadline:
                await asyncio.sleep(0.05)
            assert seg.get("num_requests") == 0      # ... then freed
            report = check_segment(seg)
            assert report.clean and report.num_cached_blocks == 2   # the cache stays
        finally:
            seg.close()
        # Its token is no good any more: a fresh session, and it says why.
        hello = p.Hello(p.PROTOCOL_VERSION, os.getpid(), gone.hash_fingerprint,
                        resume_token=gone.resume_token)
        wire, welcome = await open_wire(proc.socket, hello, 5)
        wire.transport.close()
        assert not welcome.resumed and "grace period is over" in welcome.resume_error
        c = await _client(proc)
        await c.add_request("x", tokens(0, 9))
        assert (await c.get_computed_blocks("x"))[1] == 8
        await c.close()


@pytest.mark.parametrize("token", ["wrong", "", "reused"])
async def test_a_bad_resume_token_starts_a_fresh_session(pool_name, token):
    with CoordinatorProcess(CFG, name=pool_name) as proc:
        a = await _client(proc)
        await a.add_request("a1", tokens(0, 9))
        await a.allocate_slots("a1", 9)
        before = await a.get_block_ids("a1")
        hello = p.Hello(p.PROTOCOL_VERSION, os.getpid(), a.hash_fingerprint,
                        resume_token=a.resume_token if token == "reused" else token or "x" * 32)
        wire, welcome = await open_wire(proc.socket, hello, 5)
        try:
            assert not welcome.resumed and welcome.requests == []
            assert welcome.session_id != a.session_id and welcome.resume_token
            assert ("connected already" if token == "reused" else "no session to resume") \
                in welcome.resume_error
        finally:
            wire.transport.close()
        assert await a.get_block_ids("a1") == before   # nothing of A was touched
        await a.close()


def test_a_config_mismatch_at_adoption_is_refused_and_names_the_fields(pool_name, sockdir):
    with CoordinatorProcess(CFG, name=pool_name) as proc:
        proc.kill()
        before = segment_bytes(pool_name)
        other = CFG.replace(num_blocks=128, max_model_len=32)
        res = _serve(other, pool_name, sockdir / "s.sock")
        assert res.returncode == 2, res.stderr
        assert "num_blocks: 64 -> 128" in res.stderr and "max_model_len" in res.stderr
        assert "--fresh" in res.stderr and "Traceback" not in res.stderr
        assert segment_bytes(pool_name) == before   # untouched
        fresh = subprocess.Popen(
            [sys.executable, "-m", "kvshm", "serve", "--config",
             str(sockdir / f"{pool_name}.json"), "--name", pool_name, "--socket",
             str(sockdir / "s.sock"), "--quiet", "--fresh"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert fresh.stdout.readline().startswith("ready"), fresh.stderr.read()
            assert PoolSegment.attach(pool_name).config.num_blocks == 128
        finally:
            fresh.terminate()
            assert fresh.wait(10) == 0
            fresh.stdout.close()
            fresh.stderr.close()
    assert segment_info(pool_name) is None


def test_a_corrupted_pool_is_refused_with_its_problems_and_left_untouched(pool_name, sockdir):
    with CoordinatorProcess(CFG, name=pool_name) as proc:
        async def work():
            c = await _client(proc, resume=False)
            await c.add_request("r", tokens(0, 9))
            await c.allocate_slots("r", 9)
            proc.kill()
            await c.close()
        asyncio.run(work())
        seg = PoolSegment.attach(pool_name)
        seg.ref_cnt[1] += 5                         # derived: repair could fix this ...
        seg.tables[0][0] = 9999                     # ... not a row naming no block
        seg.close()
        before = segment_bytes(pool_name)
        res = _serve(CFG, pool_name, sockdir / "s.sock")
        after = segment_bytes(pool_name)
    assert res.returncode == 2, res.stderr
    assert "cannot be repaired" in res.stderr and "--fresh" in res.stderr
    assert after == before


def test_two_coordinators_racing_to_adopt_a_pool_one_wins(pool_name, sockdir):
    with CoordinatorProcess(CFG, name=pool_name) as proc:
        proc.kill()
        path = sockdir / "race.json"
        path.write_bytes(CFG.to_json())
        procs = [subprocess.Popen(
            [sys.executable, "-m", "kvshm", "serve", "--config", str(path), "--name",
             pool_name, "--socket", str(sockdir / f"r{i}.sock"), "--quiet"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
        try:
            lines = []
            for q in procs:
                line = q.stdout.readline()
                lines.append(line)
            winners = [q for q, line in zip(procs, lines) if line.startswith("ready")]
            assert len(winners) == 1, lines
            loser = next(q for q in procs if q is not winners[0])
            assert loser.wait(10) == 2
            assert "Traceback" not in loser.stderr.read()
            assert check_pool(pool_name).clean
        finally:
            for q in procs:
                if q.poll() is None:
                    q.terminate()
                q.wait(10)
                q.stdout.close()
                q.stderr.close()
    assert segment_info(pool_name) is None


async def test_tenants_cannot_reset_or_evict_each_others_blocks(coordinator):
    coord = await coordinator()
    kw = dict(hash_algorithm=coord.config.hash_algorithm, hash_seed=coord.config.hash_seed)
    a = await connect(coord.socket_path, tenant="team-a", **kw)
    b = await connect(coord.socket_path, tenant="team-b", **kw)
    prompt = tokens(0, 37)
    await a.add_request("a1", prompt)
    blocks = await a.allocate_slots("a1", 37)
    await a.advance("a1", 37)
    await a.free("a1")
    free0 = coord.mgr.num_free_blocks
    with pytest.raises(Forbidden, match="admin"):
        await b.reset_prefix_cache()
    with pytest.raises(Forbidden, match="admin"):
        await b.evict_blocks(blocks[0])
    with pytest.raises(Forbidden, match="admin"):
        await b.stats(free_head=8)
    with pytest.raises(Forbidden):
        await b.batch([p.GetStats(), p.EvictBlocks(blocks[0])])
    await b.add_request("b1", prompt)
    assert (await b.get_computed_blocks("b1"))[1] == 0   # never another tenant's hits
    await a.add_request("a2", prompt)
    assert (await a.get_computed_blocks("a2"))[1] == 36  # A's whole cached prefix
    assert coord.mgr.num_free_blocks == free0
    admin = await connect(coord.socket_path, admin=True, **kw)
    assert admin.admin and not a.admin
    await admin.evict_blocks(blocks[0][:1])
    assert (await a.get_computed_blocks("a2"))[1] == 0
    for c in (a, b, admin):
        await c.close()
    with pytest.raises(Forbidden, match="admin token"):
        await connect(coord.socket_path, admin_token="guess", **kw)


async def test_restoring_a_request_with_other_tokens_is_refused(pool_name):
    with CoordinatorProcess(CFG, name=pool_name) as proc:
        c = await _client(proc)
        await c.add_request("r", tokens(0, 9))
        await c.allocate_slots("r", 9)
        await c.cache_blocks("r", 8)
        token, fp = c.resume_token, c.hash_fingerprint
        c.reconnect = None            # this test resumes by hand
        proc.kill()
        proc.restart()
        hello = p.Hello(p.PROTOCOL_VERSION, os.getpid(), fp, resume_token=token)
        wire, welcome = await open_wire(proc.socket, hello, 5)
        try:
            assert welcome.resumed and welcome.requests == ["r"]
            enc = msgspec.msgpack.Encoder()
            reply = asyncio.get_running_loop().create_future()
            wire.on_reply = reply.set_result
            body = enc.encode(p.AddRequest("r", tokens(50, 59)))
            wire.transport.write(len(body).to_bytes(4, "little") + body)
            err = await asyncio.wait_for(reply, 5)
            assert err.__class__ is p.Error and "other tokens" in err.message
        finally:
            wire.transport.close()
        await c.close()
        await until(lambda: check_pool(pool_name).num_requests == 0, timeout=5)


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2, 0.4, 0.7])
def test_sigterm_while_adopting_still_stops_cleanly(pool_name, delay):
    """A coordinator told to stop while it starts (from Python's start-up,
    delay 0, to adopting a dead coordinator's pool) finishes starting, then
    stops cleanly: exit 0, its segments removed.  (kvshm run stops a
    coordinator it may have just restarted.)"""
    import signal
    import time
    with CoordinatorProcess(CFG, name=pool_name) as proc:
        proc.kill()
        proc.restart(wait=False)
        time.sleep(delay)
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(20) == 0, proc.stderr
    assert segment_info(pool_name) is None and segment_info(f"{pool_name}.kv") is None


def test_stopping_a_dead_coordinator_keeps_its_pool_unless_the_caller_owns_it(pool_name):
    """`stop()` of a coordinator that died leaves its pool for adoption; with
    `owns_pool` (kvshm run, which made the pool and is done with it) it
    removes both segments, so a run that ends while its coordinator is down
    leaves nothing in /dev/shm."""
    first = CoordinatorProcess(CFG, name=pool_name)
    first.wait_ready()
    first.kill()
    first.proc.wait(10)
    assert first.stop() == -9
    assert segment_info(pool_name) is not None           # kept: a new one may adopt it
    second = CoordinatorProcess(CFG, name=pool_name)     # adopts it
    second.wait_ready()
    second.kill()
    second.proc.wait(10)
    assert second.stop(owns_pool=True) == -9
    assert segment_info(pool_name) is None and segment_info(f"{pool_name}.kv") is None
