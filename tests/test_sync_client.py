"""The synchronous client against a real coordinator process: the asyncio
client's operations and errors, batches, timeouts, and riding through a
coordinator restart."""

from __future__ import annotations

import os
import threading

import pytest

from helpers import make_config, tokens
from kvshm.core.errors import InvalidArgument, UnknownRequest
from kvshm.ops import protocol as p
from kvshm.ops.errors import (
    ConnectionClosed,
    ConnectionLost,
    HashMismatch,
    RequestTimeout,
    ResumeFailed,
)
from kvshm.pool.segment import remove_segment
from kvshm.service.process import CoordinatorProcess
from kvshm.service.resume import Reconnect
from kvshm.service.sync_client import connect_sync

CFG = make_config(num_blocks=32, max_num_seqs=16)
FAST = Reconnect(initial_delay=0.01, max_delay=0.1, timeout=20.0)


@pytest.fixture
def proc(pool_name):
    with CoordinatorProcess(CFG, name=pool_name) as proc:
        yield proc


def client(proc, **kw):
    return connect_sync(proc.socket, hash_algorithm=CFG.hash_algorithm,
                        hash_seed=CFG.hash_seed, reconnect=FAST, **kw)


def test_the_scheduler_operations(proc):
    with client(proc) as c:
        assert c.config == CFG and c.session_id > 0
        c.add_request("a", tokens(0, 10))
        hits, n = c.get_computed_blocks("a")
        assert (hits, n) == ([[]], 0)
        new = c.allocate_slots("a", 10)
        assert [len(g) for g in new] == [3]
        c.advance("a", 10)                     # computed: its 2 full blocks are ready
        c.cache_blocks("a", 8)
        assert c.get_block_ids("a") == new
        assert c.get_num_common_prefix_blocks("a") == [3]
        free = c.free("a")
        assert free == CFG.num_blocks - 1
        c.add_request("b", tokens(0, 10))
        hits, n = c.get_computed_blocks("b")
        assert n == 8 and hits[0] == new[0][:2]
        assert c.allocate_slots("b", 2, 8, use_computed_blocks=True) is not None
        assert c.stats().num_requests == 1


def test_errors_are_typed_and_change_nothing(proc):
    with client(proc) as c:
        with pytest.raises(UnknownRequest) as ei:
            c.get_block_ids("nobody")
        assert ei.value.request_id == "nobody"
        c.add_request("a", tokens(0, 10))
        with pytest.raises(InvalidArgument, match="num_new_tokens"):
            c.allocate_slots("a", 0)
        assert c.get_block_ids("a") == [[]]
        # A failing op in a batch: the ops before it applied, its error raised
        # with their replies.
        with pytest.raises(UnknownRequest) as e:
            c.batch([p.AllocateSlots("a", 10), p.GetBlockIds("nobody")])
        assert e.value.index == 1 and len(e.value.results) == 1
        assert len(c.get_block_ids("a")[0]) == 3


def test_batch_is_one_round_trip(proc):
    with client(proc) as c:
        replies = c.batch([p.AddRequest("a", tokens(0, 10)), p.GetComputedBlocks("a"),
                           p.AllocateSlots("a", 10)])
        assert [type(r).__name__ for r in replies] == ["Done", "ComputedBlocks", "Allocated"]


def test_a_second_coordinator_on_the_socket_or_the_pool_is_refused(proc, sockdir):
    import subprocess
    import sys
    cfg = sockdir / "c.json"
    cfg.write_bytes(CFG.to_json())
    for args, message in (
            (["--name", "kvshm-t-other", "--socket", str(proc.socket)],
             f"another coordinator listens on {proc.socket}"),
            (["--name", proc.name, "--socket", str(sockdir / "s.sock")],
             f"pool {proc.name!r} is served by live process {proc.proc.pid}")):
        r = subprocess.run([sys.executable, "-m", "kvshm", "serve", "--config", str(cfg), *args],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and message in r.stderr, r.stderr


def test_refused_handshakes(proc):
    with pytest.raises(HashMismatch):
        connect_sync(proc.socket, hash_algorithm="sha256", hash_seed="another seed")
    with pytest.raises(ConnectionLost, match="no coordinator listening"):
        connect_sync(proc.socket.with_name("nothing.sock"))


def test_a_client_may_take_the_pool_s_hashing(proc):
    with connect_sync(proc.socket, hash_algorithm=None) as c:
        h = c.make_hasher()
        assert (h.algorithm, h.seed) == (CFG.hash_algorithm, CFG.hash_seed)
        c.add_request("a", block_hashes=[b"\0" * 32, b"\1" * 32], num_tokens=9)
        assert c.get_computed_blocks("a")[1] == 0


def test_a_closed_client_raises(proc):
    c = client(proc)
    c.close()
    with pytest.raises(ConnectionClosed):
        c.stats()


def test_a_timeout_leaves_the_stream_in_step(proc):
    with client(proc) as c:
        c.add_request("a", tokens(0, 10))
        proc.proc.send_signal(19)                     # SIGSTOP: no replies for now
        try:
            with pytest.raises(RequestTimeout):
                c.allocate_slots("a", 10, timeout=0.2)
        finally:
            proc.proc.send_signal(18)                 # SIGCONT
        # The late reply is read and applied before the next call's.
        assert len(c.get_block_ids("a")[0]) == 3


def test_rides_through_a_coordinator_restart(proc, pool_name):
    with client(proc) as c:
        c.add_request("run", tokens(0, 10))
        held = c.allocate_slots("run", 10)
        c.advance("run", 10, [7])
        c.add_request("done", tokens(50, 62))
        c.allocate_slots("done", 12)
        c.advance("done", 12)
        c.free("done")                                # its 3 full blocks stay cached
        sid = c.session_id
        proc.kill()
        proc.restart()
        assert c.get_block_ids("run") == held         # taken back, restored
        assert c.session_id == sid and len(c.restarts) == 1 and c.resumed_requests == 1
        assert c.allocate_slots("run", 1) is not None
        c.add_request("again", tokens(50, 62))
        assert c.get_computed_blocks("again")[1] == 8   # the cache survived


# The Welcome is the session's first reply: the second frame's is the third.
@pytest.mark.parametrize("where, nth", [("Session._reply:before", 3),
                                        ("OpExecutor.execute_frame:before", 2)])
def test_the_call_in_flight_at_a_crash_is_applied_once(pool_name, where, nth):
    """The coordinator dies in the second frame: after committing it but
    before its reply (the kept reply is the answer), or before applying it
    (the frame is sent again).  Either way it takes effect once."""
    env = dict(os.environ, KVSHM_CRASH=f"point={where} nth={nth}")
    with CoordinatorProcess(CFG, name=pool_name, env=env) as proc:
        c = client(proc)
        c.add_request("a", tokens(0, 10))

        def restart():
            proc.proc.wait()
            proc.restart(env={k: v for k, v in os.environ.items() if k != "KVSHM_CRASH"})

        t = threading.Thread(target=restart)
        t.start()
        new = c.allocate_slots("a", 10)
        t.join()
        assert proc.restarts == 1 and len(c.restarts) == 1
        assert len(new[0]) == 3 and c.get_block_ids("a") == new
        assert c.stats().num_free_blocks == CFG.num_blocks - 1 - 3
        c.close()


def test_a_dropped_connection_ends_the_session(proc):
    """Only a coordinator restart is ridden through: a connection dropped
    while the coordinator lives ended the session, which freed its requests."""
    c = client(proc)
    c.add_request("a", tokens(0, 10))
    c.allocate_slots("a", 10)
    c.break_connection()
    assert c.connected                       # (it finds out at the next call)
    with pytest.raises(ResumeFailed):
        c.get_block_ids("a")
    c.close()
    with client(proc) as other:
        assert other.stats().num_requests == 0


def test_without_resume_a_restart_is_fatal(proc):
    c = client(proc, resume=False)
    c.add_request("a", tokens(0, 10))
    proc.kill()
    proc.restart()
    with pytest.raises(ConnectionLost):
        c.get_block_ids("a")
    with pytest.raises(ConnectionLost):   # and stays so
        c.stats()
    c.close()


def test_a_fresh_pool_cannot_resume_the_session(pool_name):
    with CoordinatorProcess(CFG, name=pool_name) as proc:
        c = client(proc)
        c.add_request("a", tokens(0, 10))
        proc.kill()
        remove_segment(pool_name, force=True)
        proc.restart()
        with pytest.raises(ResumeFailed):
            c.get_block_ids("a")
        c.close()


def test_connect_by_pool_name(pool_name, sockdir, monkeypatch):
    """connect_sync(name=...) reaches `kvshm serve --name NAME`'s default socket."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(sockdir))
    with CoordinatorProcess(CFG, name=pool_name, default_socket=True):
        with connect_sync(name=pool_name, admin=True) as c:
            c.reset_prefix_cache()
            assert c.pool_segment == pool_name and c.stats().num_blocks == CFG.num_blocks


def test_connect_takes_a_path_or_a_name(sockdir, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(sockdir))
    with pytest.raises(TypeError, match="not both"):
        connect_sync(sockdir / "x.sock", name="kvshm")
    with pytest.raises(TypeError, match="not neither"):
        connect_sync()
    with pytest.raises(InvalidArgument, match="bad pool name"):
        connect_sync(name="a/b")
    with pytest.raises(ConnectionLost, match=str(sockdir / "kvshm" / "kvshm-test-none.sock")):
        connect_sync(name="kvshm-test-none")
