"""What both clients share (kvshm/service/client_core.py): the frames in
flight and how a restart settles them, the reconnect schedule, and the same
behaviour in the asyncio and the synchronous client when a restarted
coordinator cannot give the session back."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from helpers import make_config, tokens
from kvshm.ops import protocol as p
from kvshm.ops.errors import ConnectionLost, ReplyLost, ResumeFailed
from kvshm.ops.protocol import encode_frame
from kvshm.pool.segment import remove_segment
from kvshm.service.client import connect
from kvshm.service.client_core import Backoff, Call, InFlight
from kvshm.service.process import CoordinatorProcess
from kvshm.service.resume import Reconnect, RequestMirror
from kvshm.service.sync_client import connect_sync

CFG = make_config(num_blocks=32, max_num_seqs=16)
FAST = Reconnect(initial_delay=0.01, max_delay=0.1, timeout=20.0)


# -- sans-IO: the frames in flight ---------------------------------------------------------------
DECODER = msgspec.msgpack.Decoder(p.ServerMessage)


def welcome(**kw) -> p.Welcome:
    return p.Welcome(p.PROTOCOL_VERSION, 1, b"{}", "kvshm-x", "fp", **kw)


def _sent(flight: InFlight, *msgs) -> list[Call]:
    calls = []
    for msg in msgs:
        call = Call(msg)
        flight.add(call)
        flight.number(call)
        calls.append(call)
    return calls


def test_replies_settle_the_oldest_call_and_reach_the_mirror():
    flight = InFlight(RequestMirror())
    add, stats = _sent(flight, p.AddRequest("a", [1, 2, 3]), p.GetStats())
    assert [add.seq, stats.seq] == [1, 2]
    assert flight.answered(p.Done()) is add and add.settled and add.reply == p.Done()
    assert "a" in flight.mirror and len(flight) == 1


def test_a_resume_delivers_the_kept_replies_loses_the_others_and_resends_the_rest():
    mirror = RequestMirror()
    flight = InFlight(mirror)
    a, b, c, d = _sent(flight, p.AddRequest("a", [1]), p.AddRequest("b", [2]),
                       p.AddRequest("c", [3]), p.GetStats())
    assert flight.first_sent() == 1
    kept = encode_frame(p.Done())[p.LENGTH_BYTES:]    # a reply's body, as the Welcome keeps it
    # (the record kept only frame 3's reply: 1 and 2 were pushed out of it)
    settled = flight.resumed(welcome(resumed=True, last_seq=3, replies_from=1,
                                     replies=[b"", b"", bytes(kept)]), DECODER.decode)
    assert settled == [a, b, c]
    assert isinstance(a.error, ReplyLost) and isinstance(b.error, ReplyLost)
    assert c.error is None and c.reply == p.Done()
    assert flight.replies_lost == 2
    # Lost replies' requests are forgotten (the restore releases them); the
    # kept one's is recorded.
    assert "a" not in mirror and "b" not in mirror and "c" in mirror
    assert flight.to_resend() == [d] and not d.settled
    assert flight.number(d) and d.seq == 4   # numbering goes on after last_seq


def test_a_session_not_given_back_fails_every_call_and_forgets_the_requests():
    mirror = RequestMirror()
    flight = InFlight(mirror)
    a, = _sent(flight, p.AddRequest("a", [1]))
    flight.answered(p.Done())
    b, c = _sent(flight, p.GetStats(), p.GetStats())
    failed = flight.fresh_session(welcome(resumed=False, resume_error="grace period is over"))
    assert failed == [b, c] and len(flight) == 0 and len(mirror) == 0
    assert all(isinstance(x.error, ResumeFailed) and "grace period is over" in str(x.error)
               for x in failed)
    assert flight.seq == 0


# -- sans-IO: the reconnect schedule ---------------------------------------------------------------
def test_backoff_doubles_up_to_its_cap_then_gives_up_at_the_deadline():
    b = Backoff(Reconnect(initial_delay=0.01, max_delay=0.04, timeout=0.5), OSError("gone"))
    assert [b.next_delay(OSError()) for _ in range(4)] == [0.01, 0.02, 0.04, 0.04]
    b.deadline = time.monotonic()             # the time is up
    with pytest.raises(ConnectionLost, match=r"did not come back within 0.5s: refused"):
        b.next_delay(OSError("refused"))


# -- both clients, against a restarted coordinator that lost the session ----------------------------
class SyncSide:
    def __init__(self, proc):
        self.c = connect_sync(proc.socket, hash_algorithm=CFG.hash_algorithm,
                              hash_seed=CFG.hash_seed, reconnect=FAST)

    def __call__(self, method, *a, **k):
        return getattr(self.c, method)(*a, **k)

    def close(self):
        self.c.close()


class AsyncSide:
    def __init__(self, proc):
        self.loop = asyncio.new_event_loop()
        self.c = self.loop.run_until_complete(connect(
            proc.socket, hash_algorithm=CFG.hash_algorithm, hash_seed=CFG.hash_seed,
            reconnect=FAST))

    def __call__(self, method, *a, **k):
        return self.loop.run_until_complete(getattr(self.c, method)(*a, **k))

    def close(self):
        self.loop.run_until_complete(self.c.close())
        self.loop.close()


@pytest.mark.parametrize("side", [SyncSide, AsyncSide], ids=["sync", "asyncio"])
def test_after_resume_failed_both_clients_go_on_as_a_fresh_session(pool_name, side):
    with CoordinatorProcess(CFG, name=pool_name) as proc:
        c = side(proc)
        try:
            c("add_request", "a", tokens(0, 10))
            c("allocate_slots", "a", 10)
            assert "a" in c.c.requests and c.c.connected
            proc.kill()
            remove_segment(pool_name, force=True)   # a new pool: nothing to resume
            proc.restart()
            with pytest.raises(ResumeFailed, match="could not be resumed"):
                c("get_block_ids", "a")
            assert len(c.c.requests) == 0 and c.c.connected
            # The session is the fresh one: later calls work; the old
            # requests are gone.
            assert c("stats").num_requests == 0
            c("add_request", "a", tokens(0, 10))
            assert [len(g) for g in c("allocate_slots", "a", 10)] == [3]
            assert c.c.restarts == []            # nothing was resumed
        finally:
            c.close()
        assert not c.c.connected
