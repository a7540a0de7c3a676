"""The replies a session record keeps for a resume (ops/sessions.py): the
last REPLIES_KEPT frames', as far as they fit in the record's ring, read
back after a restart, a cut-off frame's dropped; and the client settling
every call in flight from them (client_core.InFlight)."""

from __future__ import annotations

import random

import msgspec
import pytest

from helpers import make_config, tokens
from kvshm import KVCacheManager
from kvshm.core.recovery import needs_repair, repair
from kvshm.core.state import REPLIES_KEPT, REPLY_RING_BYTES
from kvshm.ops import protocol as p
from kvshm.ops.errors import ReplyLost
from kvshm.ops.sessions import SessionTable
from kvshm.pool.segment import PoolSegment
from kvshm.service.client_core import Call, InFlight
from kvshm.service.resume import RequestMirror

CFG = make_config(num_blocks=16, max_num_seqs=4)


@pytest.fixture
def pool(pool_name):
    mgr = KVCacheManager(CFG, name=pool_name)
    yield mgr
    mgr.close()


def record(mgr, table: SessionTable, slot: int, seq: int, reply: bytes) -> None:
    mgr.begin_frame()
    table.record_frame(slot, seq, reply)
    mgr.commit_frame()


def body(seq: int, n: int) -> bytes:
    return bytes((seq + i) % 251 for i in range(n))


def kept(table: SessionTable, slot: int, last: int) -> dict[int, bytes]:
    out = {}
    for seq in range(1, last + 1):
        r = table.reply(slot, seq)
        if r is not None:
            out[seq] = r
    return out


def test_the_last_frames_replies_are_kept_up_to_the_entry_limit(pool):
    table = SessionTable(pool.segment)
    slot = table.allocate(7, "tok", "", admin=False, pid=1, node=0)
    for seq in range(1, 41):
        record(pool, table, slot, seq, body(seq, 100))
        got = kept(table, slot, seq)
        assert sorted(got) == list(range(max(1, seq - REPLIES_KEPT + 1), seq + 1))
        assert all(r == body(s, 100) for s, r in got.items())


def test_replies_that_fill_the_ring_push_the_oldest_out(pool):
    table = SessionTable(pool.segment)
    slot = table.allocate(7, "tok", "", admin=False, pid=1, node=0)
    size = REPLY_RING_BYTES // 5            # 4 fit at once (5 would leave no room to wrap)
    for seq in range(1, 13):
        record(pool, table, slot, seq, body(seq, size))
        got = kept(table, slot, seq)
        assert seq in got and list(got) == sorted(got)    # a run of the newest
        assert len(got) >= min(seq, 4)
        assert all(r == body(s, size) for s, r in got.items())


def test_a_reply_larger_than_the_ring_is_not_kept_and_the_others_stay(pool):
    table = SessionTable(pool.segment)
    slot = table.allocate(7, "tok", "", admin=False, pid=1, node=0)
    record(pool, table, slot, 1, body(1, 50))
    record(pool, table, slot, 2, body(2, REPLY_RING_BYTES + 1))
    record(pool, table, slot, 3, body(3, 60))
    assert table.reply(slot, 2) is None
    assert table.reply(slot, 1) == body(1, 50) and table.reply(slot, 3) == body(3, 60)
    assert table.last_seq(slot) == 3


@pytest.mark.parametrize("seed", range(6))
def test_random_sizes_keep_a_run_of_the_newest_replies_intact(pool, seed):
    """Whatever the sizes: every kept reply is intact, the kept ones are the
    newest frames without a gap (but for replies too large to keep), and
    the newest frames whose replies fill at most half the ring are all kept."""
    rng = random.Random(seed)
    table = SessionTable(pool.segment)
    slot = table.allocate(7, "tok", "", admin=False, pid=1, node=0)
    sizes = {}
    for seq in range(1, 300):
        n = rng.choice((5, 17, 100, 1000, 5000, 9000, REPLY_RING_BYTES // 2))
        sizes[seq] = n
        record(pool, table, slot, seq, body(seq, n))
        got = kept(table, slot, seq)
        assert all(r == body(s, sizes[s]) for s, r in got.items())
        assert seq in got
        run, total = [], 0
        for s in range(seq, max(0, seq - REPLIES_KEPT), -1):
            total += (sizes[s] + 7) & ~7
            if total > REPLY_RING_BYTES // 2:
                break
            run.append(s)
        assert set(run) <= set(got), (seed, seq, sorted(got), run)
        oldest = min(got)
        assert set(got) == set(range(oldest, seq + 1)), (seed, seq, sorted(got))


def test_the_replies_are_read_back_by_the_next_coordinator(pool, pool_name):
    table = SessionTable(pool.segment)
    slot = table.allocate(7, "tok", "", admin=False, pid=1, node=0)
    for seq in range(1, 30):
        record(pool, table, slot, seq, body(seq, 3000))
    before = kept(table, slot, 29)
    seg = PoolSegment.attach(pool_name)
    try:
        again = SessionTable(seg)        # as a restarted coordinator reads the records
        assert kept(again, slot, 29) == before
    finally:
        seg.close()


def test_a_cut_off_frames_reply_is_dropped_and_its_seq_kept_anew(pool, pool_name):
    """The frame a crash cut off recorded its seq and reply; repair rolls the
    seq back, the next coordinator drops that reply, and the frame sent
    again gets its own."""
    table = SessionTable(pool.segment)
    slot = table.allocate(7, "tok", "", admin=False, pid=1, node=0)
    for seq in range(1, 6):
        record(pool, table, slot, seq, body(seq, 2000))
    pool.begin_frame()
    table.record_frame(slot, 6, b"cut off")     # never committed: the process died
    seg = PoolSegment.attach(pool_name)
    try:
        assert needs_repair(seg)
        repair(seg)
        again = SessionTable(seg)
        assert again.last_seq(slot) == 5 and again.reply(slot, 6) is None
        assert kept(again, slot, 5) == {s: body(s, 2000) for s in range(1, 6)}
    finally:
        seg.close()


# -- the client: every call in flight settled from the kept replies ------------------------------
DECODER = msgspec.msgpack.Decoder(p.ServerMessage)


def test_every_applied_call_in_flight_gets_its_kept_reply():
    mirror = RequestMirror()
    flight = InFlight(mirror)
    calls = []
    for i in range(8):
        call = Call(p.AddRequest(f"r{i}", tokens(0, 5)))
        flight.add(call)
        flight.number(call)
        calls.append(call)
    flight.answered(p.Done())                     # the first reply arrived
    assert flight.first_sent() == 2
    replies = [msgspec.msgpack.encode(p.Done()) for _ in range(5)]
    welcome = p.Welcome(p.PROTOCOL_VERSION, 1, b"{}", "kvshm-x", "fp", resumed=True,
                        last_seq=6, replies_from=2, replies=replies)
    settled = flight.resumed(welcome, DECODER.decode)
    assert settled == calls[1:6]
    assert all(c.error is None and c.reply == p.Done() for c in settled)
    assert flight.replies_lost == 0 and all(f"r{i}" in mirror for i in range(6))
    assert flight.to_resend() == calls[6:]        # not applied: sent again


def test_a_reply_the_record_no_longer_kept_is_reply_lost():
    flight = InFlight(RequestMirror())
    a, b = Call(p.GetStats()), Call(p.GetStats())
    for call in (a, b):
        flight.add(call)
        flight.number(call)
    stats = msgspec.msgpack.encode(p.Stats(1, 1, 0, 0.0, 0, 1, 0, 0, 0, 0))
    welcome = p.Welcome(p.PROTOCOL_VERSION, 1, b"{}", "kvshm-x", "fp", resumed=True,
                        last_seq=2, replies_from=1, replies=[b"", stats])
    flight.resumed(welcome, DECODER.decode)
    assert isinstance(a.error, ReplyLost) and b.reply.num_blocks == 1
    assert flight.replies_lost == 1
