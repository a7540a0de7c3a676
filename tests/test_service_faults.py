"""Coordinator faults: bad input (each answered with a typed error and no
change to the pool), clients that die or stop reading, cancelled calls,
SIGTERM of the coordinator, and `kvshm serve` refusing to start."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from helpers import make_config, tokens, until
from kvshm import FullSpec, SlidingWindowSpec
from kvshm.core.check import check_segment
from kvshm.core.errors import KvshmError
from kvshm.core.hashing import hash_fingerprint
from kvshm.core.segment import SHM_DIR, remove_segment, segment_info
from kvshm.service import protocol as p
from kvshm.service.framing import MAX_FRAME_BYTES, FrameReader, encode_frame
from kvshm.service.client import connect
from kvshm.service.errors import ConnectionLost, RequestTimeout
from kvshm.service.process import CoordinatorProcess
from kvshm.service.server import Coordinator

CONFIG = make_config(groups=(FullSpec(4), SlidingWindowSpec(4, 8)), num_blocks=64,
                     max_num_seqs=32)
FP = hash_fingerprint(CONFIG.hash_algorithm, CONFIG.hash_seed)
HELLO = p.Hello(p.PROTOCOL_VERSION, os.getpid(), FP)
_decode = msgspec.msgpack.Decoder(p.ServerMessage).decode
_pack = msgspec.msgpack.encode


def frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "little") + body


# -- fixtures and helpers ---------------------------------------------------------------------
@pytest.fixture
def coordinator_config():
    return CONFIG


class Raw:
    """A hand-driven connection: write any bytes, read reply frames."""

    def __init__(self, reader, writer) -> None:
        self.r, self.w = reader, writer

    @classmethod
    async def open(cls, path) -> "Raw":
        return cls(*await asyncio.open_unix_connection(str(path), limit=2**26))

    def send(self, data: bytes) -> None:
        self.w.write(data)

    def send_msgs(self, *msgs) -> None:
        self.w.write(b"".join(encode_frame(m) for m in msgs))

    async def recv(self, timeout: float = 5.0):
        """The next reply, or None at EOF."""
        try:
            head = await asyncio.wait_for(self.r.readexactly(4), timeout)
            return _decode(await asyncio.wait_for(
                self.r.readexactly(int.from_bytes(head, "little")), timeout))
        except asyncio.IncompleteReadError as e:
            assert not e.partial, f"connection closed mid-frame ({len(e.partial)} bytes)"
            return None

    async def recv_many(self, n: int, timeout: float = 20.0) -> list:
        """The next n replies (read in bulk)."""
        reader = FrameReader(2**31)
        out: list = []

        async def read():
            while len(out) < n:
                data = await self.r.read(2**20)
                assert data, f"EOF after {len(out)} of {n} replies"
                out.extend(_decode(b) for b in reader.feed(data))

        await asyncio.wait_for(read(), timeout)
        assert len(out) == n and not reader.pending, "more replies than requests"
        return out

    async def call(self, msg):
        self.send_msgs(msg)
        return await self.recv()

    async def hello(self, admin_token: str = "") -> p.Welcome:
        w = await self.call(msgspec.structs.replace(HELLO, admin_token=admin_token)
                            if admin_token else HELLO)
        assert isinstance(w, p.Welcome), w
        return w

    async def expect_eof(self) -> None:
        assert await asyncio.wait_for(self.r.read(), 5) == b""

    async def close(self) -> None:
        self.w.close()
        try:
            await self.w.wait_closed()
        except OSError:
            pass



def snapshot(coord: Coordinator) -> dict:
    """Everything a bad message must leave alone."""
    mgr = coord.mgr
    report = check_segment(mgr.segment, mgr.block_pool)
    assert report.clean, report.problems
    return {
        "free": mgr.num_free_blocks,
        "cached": mgr.block_pool.num_cached_blocks,
        "free_queue": mgr.block_pool.free_queue(),
        "table": dict(mgr.table.slot_of),
        "blocks": {rid: [list(g) for g in mgr.get_block_ids(rid)] for rid in mgr.table.slot_of},
        "stats": mgr.prefix_cache_stats,
        "requests": {rid: (st.owner.id, st.request.num_tokens, st.request.num_computed_tokens,
                           len(st.request.block_hashes)) for rid, st in coord.executor.requests.items()},
    }


@pytest.fixture
async def populated(coordinator):
    """A coordinator (batch limit 8) where another session holds request
    'held' with cached blocks."""
    coord = await coordinator(max_batch_ops=8)
    holder = await connect(coord.socket_path)
    await holder.add_request("held", tokens(0, 14))
    await holder.allocate_slots("held", 14)
    yield coord, holder
    await holder.close()


# -- the bad-input table ------------------------------------------------------------------------------
def m(*fields) -> bytes:
    """A frame of an arbitrary msgpack array."""
    return frame(_pack(list(fields)))


def f(msg) -> bytes:
    return encode_frame(msg)


MINE = [f(p.AddRequest("mine", tokens(100, 130))), f(p.AllocateSlots("mine", 30))]
BIG = 2**40

# id: (handshake first, setup frames (must succeed), bad bytes, error code,
#      substring of the message, whether the connection is closed after the reply)
CASES = {
    # framing
    "garbage-bytes": (False, [], b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                      "FRAME_TOO_LARGE", "exceeds the limit", True),
    "garbage-after-handshake": (True, [], b"\xde\xad\xbe\xef" * 8,
                                "FRAME_TOO_LARGE", "exceeds the limit", True),
    "frame-over-limit": (True, [], (MAX_FRAME_BYTES + 1).to_bytes(4, "little") + b"\x90" * 64,
                         "FRAME_TOO_LARGE", str(MAX_FRAME_BYTES), True),
    "not-msgpack": (True, [], frame(b"\xc1\xc1\xc1"), "BAD_MESSAGE", "malformed", False),
    "empty-body": (True, [], frame(b""), "BAD_MESSAGE", "truncated", False),
    "truncated-msgpack": (True, [], frame(b"\x92\xa5sta"), "BAD_MESSAGE", "truncated", False),
    "not-an-array": (True, [], frame(_pack({"op": "stats"})), "BAD_MESSAGE", "array", False),
    # decoding
    "unknown-op": (True, [], m("explode", "held"), "BAD_MESSAGE", "$[0]", False),
    "reply-tag-as-op": (True, [], m("welcome", 1), "BAD_MESSAGE", "$[0]", False),
    "op-tag-not-str": (True, [], m(7, "x"), "BAD_MESSAGE", "$[0]", False),
    "wrong-type-req": (True, [], m("add", 123, [1, 2]), "BAD_MESSAGE", "$[1]", False),
    "wrong-type-count": (True, MINE, m("alloc", "mine", "ten"), "BAD_MESSAGE", "$[2]", False),
    "wrong-type-token": (True, [], m("add", "x", [1, "two"]), "BAD_MESSAGE", "$[2][1]", False),
    "wrong-type-hash": (True, [], m("add", "x", None, [7], 4), "BAD_MESSAGE", "$[3][0]", False),
    "wrong-type-in-batch": (True, [], m("batch", [["stats"], ["free", "x", "yes"]]),
                            "BAD_MESSAGE", "$[1][1][2]", False),
    "missing-field": (True, [], m("alloc", "held"), "BAD_MESSAGE", "length", False),
    "nested-batch": (True, [], m("batch", [["batch", []]]), "BAD_MESSAGE", "$[1][0][0]", False),
    "hello-in-batch": (True, [], m("batch", [["hello", 1, 1, FP]]), "BAD_MESSAGE", "$[1][0]",
                       False),
    "second-hello": (True, [], f(HELLO), "BAD_MESSAGE", "already", False),
    # arguments
    "alloc-negative": (True, MINE, f(p.AllocateSlots("mine", -1)), "BAD_ARGUMENT", "num_new_tokens",
                       False),
    "alloc-huge": (True, MINE, f(p.AllocateSlots("mine", BIG)), "BAD_ARGUMENT", "num_new_tokens",
                   False),
    "alloc-huge-uint64": (True, MINE, f(p.AllocateSlots("mine", 2**64 - 1)), "BAD_ARGUMENT", "", False),
    "alloc-lookahead-huge": (True, MINE, f(p.AllocateSlots("mine", 1, 0, False, 2**63)),
                             "BAD_ARGUMENT", "num_lookahead_tokens", False),
    "alloc-external-negative": (True, MINE, f(p.AllocateSlots("mine", 1, 0, False, 0, -4)),
                                "BAD_ARGUMENT", "num_external_computed_tokens", False),
    "alloc-encoder-huge": (True, MINE, f(p.AllocateSlots("mine", 1, 0, False, 0, 0, False, BIG)),
                           "BAD_ARGUMENT", "num_encoder_tokens", False),
    "alloc-zero-tokens": (True, MINE, f(p.AllocateSlots("mine", 0)), "BAD_ARGUMENT",
                          "num_new_tokens must be > 0", False),
    "add-num-tokens-negative": (True, [], f(p.AddRequest("h", None, [], -1)), "BAD_ARGUMENT",
                                "num_tokens", False),
    "add-num-tokens-huge": (True, [], f(p.AddRequest("h", None, [], BIG)), "BAD_ARGUMENT",
                            "num_tokens", False),
    "add-token-negative": (True, [], f(p.AddRequest("t", [1, -1])), "BAD_ARGUMENT", "token ids",
                           False),
    "add-token-huge": (True, [], f(p.AddRequest("t", [2**32])), "BAD_ARGUMENT", "token ids", False),
    "add-prompt-too-long": (True, [], f(p.AddRequest("t", tokens(0, 65))), "BAD_ARGUMENT",
                            "max_model_len", False),
    "add-hash-count-wrong": (True, [], f(p.AddRequest("h", None, [b"\0" * 32], 3)),
                             "BAD_ARGUMENT", "block hashes", False),
    "add-hash-size-wrong": (True, [], f(p.AddRequest("h", None, [b"\0" * 5], 4)),
                            "BAD_ARGUMENT", "32-byte", False),
    "add-neither": (True, [], f(p.AddRequest("h")), "BAD_ARGUMENT", "prompt or block_hashes",
                    False),
    "add-empty-id": (True, [], f(p.AddRequest("", [1])), "BAD_ARGUMENT", "request_id", False),
    "advance-negative": (True, MINE, f(p.Advance("mine", -1)), "BAD_ARGUMENT",
                         "num_computed_tokens", False),
    "advance-huge": (True, MINE, f(p.Advance("mine", BIG)), "BAD_ARGUMENT",
                     "num_computed_tokens", False),
    "advance-bad-token": (True, MINE, f(p.Advance("mine", 30, [5, -5])), "BAD_ARGUMENT",
                          "token ids", False),
    "advance-hashes-on-token-request": (True, MINE, f(p.Advance("mine", 30, [], [], 4)),
                                        "BAD_ARGUMENT", "append tokens", False),
    "cache-negative": (True, MINE, f(p.CacheBlocks("mine", -1)), "BAD_ARGUMENT",
                       "num_computed_tokens", False),
    "cache-huge": (True, MINE, f(p.CacheBlocks("mine", BIG)), "BAD_ARGUMENT",
                   "num_computed_tokens", False),
    "skip-negative": (True, MINE, f(p.RemoveSkippedBlocks("mine", -1)), "BAD_ARGUMENT",
                      "total_computed_tokens", False),
    # BUG: not range-checked; frees the sliding-window blocks of 'mine'
    "skip-huge": (True, MINE, f(p.RemoveSkippedBlocks("mine", BIG)), "BAD_ARGUMENT",
                  "total_computed_tokens", False),
    "evict-negative": (True, [], f(p.EvictBlocks([1, -1])), "BAD_ARGUMENT", "block id", False),
    "evict-huge": (True, [], f(p.EvictBlocks([1, BIG])), "BAD_ARGUMENT", "block id", False),
    # requests
    "unknown-request-hits": (True, [], f(p.GetComputedBlocks("ghost")), "UNKNOWN_REQUEST",
                             "'ghost'", False),
    "unknown-request-alloc": (True, [], f(p.AllocateSlots("ghost", 4)), "UNKNOWN_REQUEST",
                              "'ghost'", False),
    "unknown-request-free": (True, [], f(p.Free("ghost")), "UNKNOWN_REQUEST", "'ghost'", False),
    "unknown-request-in-batch": (True, [], f(p.Batch([p.GetBlockIds("ghost")])),
                                 "UNKNOWN_REQUEST", "'ghost'", False),
    "duplicate-add-own": (True, MINE, f(p.AddRequest("mine", [1, 2])), "DUPLICATE_REQUEST",
                          "'mine'", False),
    "duplicate-add-other-session": (True, [], f(p.AddRequest("held", [1, 2])),
                                    "DUPLICATE_REQUEST", "'held'", False),
    "double-free": (True, MINE + [f(p.Free("mine"))], f(p.Free("mine")), "UNKNOWN_REQUEST",
                    "'mine'", False),
    "stale-hits": (True, [f(p.AddRequest("late", tokens(0, 14))), f(p.GetComputedBlocks("late")),
                          f(p.EvictBlocks(list(range(1, 64))))],
                   f(p.AllocateSlots("late", 2, 12, True)), "STALE_HITS", "stale",
                   False),
    "batch-too-large": (True, [], f(p.Batch([p.GetStats()] * 9)), "BATCH_TOO_LARGE", "at most 8",
                        False),
    # pool-wide destructive ops and the free queue need an admin session
    "reset-not-admin": ("plain", [], f(p.ResetPrefixCache()), "FORBIDDEN", "admin", False),
    "evict-not-admin": ("plain", [], f(p.EvictBlocks([1, 2])), "FORBIDDEN", "admin", False),
    "evict-not-admin-in-batch": ("plain", [], f(p.Batch([p.GetStats(), p.EvictBlocks([1])])),
                                 "FORBIDDEN", "admin", False),
    "free-queue-not-admin": ("plain", [], f(p.GetStats(4)), "FORBIDDEN", "admin", False),
    "wrong-admin-token": (False, [], f(msgspec.structs.replace(HELLO, admin_token="guess")),
                          "FORBIDDEN", "wrong admin token", True),
    # handshake
    "op-before-hello": (False, [], f(p.GetStats()), "HANDSHAKE_REQUIRED", "Hello", False),
    "add-before-hello": (False, [], f(p.AddRequest("x", [1])), "HANDSHAKE_REQUIRED", "Hello",
                         False),
    "batch-before-hello": (False, [], f(p.Batch([p.Free("held")])), "HANDSHAKE_REQUIRED", "Hello",
                           False),
    # A refused handshake closes the connection: no second guess on it.
    "wrong-version": (False, [], f(p.Hello(p.PROTOCOL_VERSION + 1, 1, FP)), "VERSION_MISMATCH",
                      f"version {p.PROTOCOL_VERSION + 1} is not", True),
    "wrong-hash": (False, [], f(p.Hello(p.PROTOCOL_VERSION, 1, hash_fingerprint("sha256", "x"))),
                   "HASH_MISMATCH", FP, True),
    "bad-hello-types": (False, [], m("hello", "one", 1, FP), "BAD_MESSAGE", "$[1]", False),
}
NOT_OWNER_OPS = {
    "advance": p.Advance("held", 14, [1]), "hits": p.GetComputedBlocks("held"),
    "alloc": p.AllocateSlots("held", 1), "cache": p.CacheBlocks("held", 12),
    "free": p.Free("held"), "preempt": p.Free("held", True),
    "skip": p.RemoveSkippedBlocks("held", 14), "ids": p.GetBlockIds("held"),
    "common": p.NumCommonPrefixBlocks("held"),
}
for _op, _msg in NOT_OWNER_OPS.items():
    CASES[f"not-owner-{_op}"] = (True, [], f(_msg), "NOT_OWNER", "another session", False)
    CASES[f"not-owner-{_op}-in-batch"] = (True, [], f(p.Batch([p.GetStats(), _msg])),
                                          "NOT_OWNER", "another session", False)


@pytest.mark.parametrize("case", list(CASES))
async def test_bad_input_gets_a_typed_error_and_changes_nothing(populated, case):
    coord, holder = populated
    handshake, setup, bad, code, text, closes = CASES[case]
    n0 = len(coord.sessions)
    raw = await Raw.open(coord.socket_path)
    try:
        await until(lambda: len(coord.sessions) == n0 + 1)
        if handshake:   # "plain": an ordinary session; True: an admin one
            await raw.hello(coord.admin_token if handshake is True else "")
        for fr in setup:
            raw.send(fr)
            reply = await raw.recv()
            assert reply is not None and not isinstance(reply, p.Error), reply
        sessions = set(coord.sessions)
        before = snapshot(coord)
        raw.send(bad)
        reply = await raw.recv()
        if isinstance(reply, p.BatchReply):   # per-op error of a batch
            assert all(not isinstance(r, p.Error) for r in reply.results[:-1])
            reply = reply.results[-1]
        assert isinstance(reply, p.Error), reply
        assert reply.code == code, reply
        assert text in reply.message, reply.message
        assert snapshot(coord) == before
        if closes:
            await raw.expect_eof()
            await until(lambda: len(coord.sessions) == n0)
        else:
            # still open and in sync: the next op gets its own reply
            if not handshake:
                await raw.hello()
            assert isinstance(await raw.call(p.GetStats()), p.Stats)
            assert set(coord.sessions) == sessions
        # the other session is unaffected
        assert await holder.get_block_ids("held") == before["blocks"]["held"]
    finally:
        await raw.close()


def test_error_codes_map_to_exception_classes():
    from kvshm.core.errors import (DuplicateRequest, InvalidArgument, KvshmError, StaleHits,
                                   UnknownRequest)
    from kvshm.service import errors as e
    for code, cls in [("BAD_MESSAGE", e.ProtocolError), ("FRAME_TOO_LARGE", e.FrameTooLarge),
                      ("BATCH_TOO_LARGE", e.BatchTooLarge),
                      ("HANDSHAKE_REQUIRED", e.HandshakeRequired),
                      ("VERSION_MISMATCH", e.VersionMismatch),
                      ("HASH_MISMATCH", e.HashMismatch), ("FORBIDDEN", e.Forbidden),
                      ("NOT_OWNER", e.NotOwner), ("INTERNAL", e.InternalError),
                      ("UNKNOWN_REQUEST", UnknownRequest),
                      ("DUPLICATE_REQUEST", DuplicateRequest),
                      ("BAD_ARGUMENT", InvalidArgument), ("STALE_HITS", StaleHits)]:
        err = e.error_from_wire(code, "why")
        assert type(err) is cls and str(err) == "why" and err.code == code
    err = e.error_from_wire("SOMETHING_NEW", "later version")
    assert type(err) is KvshmError and err.code == "SOMETHING_NEW"


def test_error_fields_survive_the_wire_format():
    from kvshm.core.errors import (ConfigError, DuplicateRequest, NoFreeBlocks,
                                   RequestTableFull, RequestTooLong, ShmSpaceError,
                                   UnknownRequest)
    from kvshm.service import errors as e
    from kvshm.service.ops import error_reply
    decoder = msgspec.msgpack.Decoder(p.ServerMessage)
    for err, want in [
            (UnknownRequest("r1"), {"request_id": "r1"}),
            (DuplicateRequest("r2"), {"request_id": "r2"}),
            (RequestTooLong(1, 40, 32), {"group": 1, "needed": 40, "capacity": 32}),
            (RequestTableFull(16), {"capacity": 16}),
            (NoFreeBlocks(12, 3), {"requested": 12, "available": 3}),
            (ShmSpaceError(10, 5, "/dev/shm"), {"needed": 10, "available": 5,
                                                "path": "/dev/shm"}),
            (ConfigError("num_blocks", "must be positive"),
             {"field": "num_blocks", "rule": "must be positive"}),
            (e.FrameTooLarge(9000, 8192), {"size": 9000, "limit": 8192}),
            (e.SocketInUse("/tmp/s.sock"), {"path": "/tmp/s.sock"}),
            (e.PoolInUse("pool", 42), {"name": "pool", "pid": 42})]:
        reply = decoder.decode(encode_frame(error_reply(None, err))[4:])
        got = e.error_from_wire(reply.code, reply.message, reply.fields)
        assert type(got) is type(err) and str(got) == str(err)
        assert {f: getattr(got, f) for f in type(err).fields} == want
    # An older peer that sends no fields: the attributes exist, as None.
    got = e.error_from_wire("UNKNOWN_REQUEST", "unknown request 'x'")
    assert got.request_id is None


def test_no_free_blocks_is_not_a_bad_argument():
    from kvshm.core.errors import InvalidArgument, NoFreeBlocks
    assert not issubclass(NoFreeBlocks, InvalidArgument)
    from kvshm.service import errors, framing
    assert framing.FrameTooLarge is errors.FrameTooLarge


async def test_clients_get_the_fields_of_a_coordinator_s_errors(populated):
    from kvshm.core.errors import DuplicateRequest, UnknownRequest
    from kvshm.service.errors import NotOwner
    coord, holder = populated
    async with await connect(coord.socket_path) as c:
        with pytest.raises(UnknownRequest) as ei:
            await c.get_block_ids("nobody")
        assert ei.value.request_id == "nobody"
        with pytest.raises(DuplicateRequest) as ei:
            await c.add_request("held", tokens(0, 4))
        assert ei.value.request_id == "held"
        with pytest.raises(NotOwner):
            await c.free("held")


async def test_client_raises_typed_errors_and_stays_usable(populated):
    from kvshm.core.errors import InvalidArgument, UnknownRequest
    from kvshm.service.errors import BatchTooLarge, NotOwner, ProtocolError
    coord, holder = populated
    before = snapshot(coord)
    async with await connect(coord.socket_path) as c:
        with pytest.raises(NotOwner):
            await c.free("held")
        with pytest.raises(UnknownRequest):
            await c.get_block_ids("ghost")
        with pytest.raises(BatchTooLarge):
            await c.batch([p.GetStats()] * 9)
        with pytest.raises(InvalidArgument):
            await _alloc_zero(c)
        with pytest.raises(ProtocolError):
            await c.call(p.Hello(1, 1, FP))
        assert (await c.stats()).num_sessions == 2
    assert snapshot(coord) == before


async def _alloc_zero(c):
    await c.add_request("z", [1, 2, 3])
    try:
        await c.allocate_slots("z", 0)
    finally:
        await c.free("z")


async def test_a_truncated_frame_then_close_releases_the_session(populated):
    coord, holder = populated
    before = snapshot(coord)
    raw = await Raw.open(coord.socket_path)
    welcome = await raw.hello()
    for msg in (p.AddRequest("t1", tokens(200, 220)), p.AllocateSlots("t1", 20)):
        assert not isinstance(await raw.call(msg), p.Error)
    assert coord.mgr.num_free_blocks < before["free"]
    body = encode_frame(p.GetStats())
    raw.send((100).to_bytes(4, "little") + body[:10])   # announces 100 bytes, sends 10
    await asyncio.sleep(0.05)
    assert welcome.session_id in coord.sessions          # still waiting for the rest
    await raw.close()
    await until(lambda: welcome.session_id not in coord.sessions)
    after = snapshot(coord)
    assert after["free"] == before["free"] and "t1" not in coord.executor.requests
    assert after["table"] == before["table"]
    # the coordinator keeps serving others
    assert await holder.get_block_ids("held") == before["blocks"]["held"]
    async with await connect(coord.socket_path) as c:
        assert (await c.stats()).num_free_blocks == before["free"]


async def test_oversized_frame_with_a_small_limit_closes_only_that_connection(coordinator):
    coord = await coordinator(max_frame_bytes=256)
    async with await connect(coord.socket_path) as ok:
        raw = await Raw.open(coord.socket_path)
        await raw.hello()
        assert isinstance(await raw.call(p.AddRequest("fits", tokens(0, 40))), p.Done)
        before = snapshot(coord)
        reply = await raw.call(p.AddRequest("big", tokens(1000, 1100)))   # > 256 bytes
        assert reply.code == "FRAME_TOO_LARGE" and "limit of 256" in reply.message
        await raw.expect_eof()
        await raw.close()
        await until(lambda: len(coord.sessions) == 1)
        assert "big" not in coord.executor.requests and "fits" not in coord.executor.requests
        assert snapshot(coord)["free"] == before["free"]
        assert (await ok.stats()).num_sessions == 1


async def test_frames_before_an_oversized_header_are_still_answered(populated):
    """BUG: replies are 1:1 and in order, but when one read holds complete
    frames followed by an oversized header, FrameReader.feed raises before
    returning the complete frames: they are never executed and the first
    reply the client gets (FRAME_TOO_LARGE) is matched to the wrong call."""
    coord, holder = populated
    raw = await Raw.open(coord.socket_path)
    try:
        await raw.hello()
        raw.send(encode_frame(p.GetStats()) + (MAX_FRAME_BYTES + 1).to_bytes(4, "little"))
        first = await raw.recv()
        assert isinstance(first, p.Stats), first
        second = await raw.recv()
        assert isinstance(second, p.Error) and second.code == "FRAME_TOO_LARGE"
        await raw.expect_eof()
    finally:
        await raw.close()


async def test_a_large_batch_reply_does_not_kill_the_session(coordinator):
    """BUG: a batch within every limit (800 ops <= MAX_BATCH_OPS, a 14 kB
    frame) can produce a reply over the client's 8 MiB frame limit; the
    client then fails with ProtocolError and closes the connection, and the
    coordinator frees every request of the session."""
    coord = await coordinator(make_config(num_blocks=8192, max_num_seqs=16))
    async with await connect(coord.socket_path) as c:
        await c.add_request("kept", tokens(0, 8))
        await c.allocate_slots("kept", 8)
        try:
            results = await c.batch([p.GetStats(4096)] * 800)
            assert len(results) == 800
        except KvshmError as e:  # a typed refusal would do; losing the session does not
            assert c._wire.lost is None, repr(e)
        assert await c.get_block_ids("kept") == [[1, 2]]
        assert "kept" in coord.executor.requests


# -- a client killed while holding requests ----------------------------------------------------------
KILLED_CLIENT = r"""
import asyncio, sys
from kvshm.service import protocol as p
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
        assert not c._pending   # every reply, cancelled or not, was read
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


# -- SIGTERM of a coordinator process under load ---------------------------------------------------
def test_sigterm_mid_load_closes_clients_and_removes_the_segment():
    cfg = make_config(num_blocks=256, max_num_seqs=64)

    async def run(proc):
        started = asyncio.Event()
        counts = [0] * 4

        async def worker(i):
            async with await connect(proc.socket) as c:
                n = 0
                try:
                    while True:
                        rid = f"w{i}-{n}"
                        await c.add_request(rid, tokens(i * 100, i * 100 + 9 + n % 5))
                        await c.get_computed_blocks(rid)
                        await c.allocate_slots(rid, 9 + n % 5, use_computed_blocks=False)
                        if n >= 5:                  # keep 5 requests, free the rest
                            await c.free(rid)
                        n += 1
                        counts[i] = n
                        if min(counts) >= 10:
                            started.set()
                except ConnectionLost as e:
                    return e

        tasks = [asyncio.create_task(worker(i)) for i in range(4)]
        await asyncio.wait_for(started.wait(), 20)
        proc.proc.send_signal(signal.SIGTERM)
        errors = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert all(isinstance(e, ConnectionLost) for e in errors), errors
        assert all("shut down" in str(e) for e in errors), errors
        with pytest.raises(ConnectionLost):
            await connect(proc.socket, timeout=2)

    with CoordinatorProcess(cfg) as proc:
        name, sock = proc.name, proc.socket
        assert os.path.exists(f"{SHM_DIR}/{name}")
        asyncio.run(run(proc))
        assert proc.proc.wait(10) == 0
        err = proc.stderr
        assert proc.stop() == 0
    assert not os.path.exists(f"{SHM_DIR}/{name}"), "segment left behind"
    assert not sock.exists()
    assert "Traceback" not in err, err


def test_a_coordinator_that_must_be_killed_leaves_no_segments():
    """CoordinatorProcess.stop(): a coordinator that does not stop within the
    timeout (here: stopped with SIGSTOP) is SIGKILLed and its pool and arena
    are removed for it; one that was already dead keeps them for adoption."""
    from kvshm.config import preset_config
    cfg = preset_config("tiny", num_blocks=64)
    with CoordinatorProcess(cfg) as proc:
        name = proc.name
        assert os.path.exists(f"{SHM_DIR}/{name}") and os.path.exists(f"{SHM_DIR}/{name}.kv")
        proc.proc.send_signal(signal.SIGSTOP)
        assert proc.stop(timeout=0.5) == -signal.SIGKILL
    assert not os.path.exists(f"{SHM_DIR}/{name}")
    assert not os.path.exists(f"{SHM_DIR}/{name}.kv")
    with CoordinatorProcess(cfg) as dead:
        dead.kill()
        assert dead.stop() == -signal.SIGKILL
    assert os.path.exists(f"{SHM_DIR}/{dead.name}")     # adoptable
    from kvshm.service.adoption import remove_pool
    remove_pool(dead.name)


def test_sigterm_with_a_client_that_stopped_reading():
    cfg = make_config(num_blocks=256)

    async def run(proc):
        raw = await Raw.open(proc.socket)
        await raw.hello()
        raw.w.transport.pause_reading()
        raw.send(encode_frame(p.GetStats(100)) * 20_000)
        await asyncio.sleep(0.3)
        proc.proc.send_signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        rc = await loop.run_in_executor(None, proc.proc.wait, 10)
        await raw.close()
        return rc

    with CoordinatorProcess(cfg) as proc:
        name = proc.name
        assert asyncio.run(run(proc)) == 0
    assert not os.path.exists(f"{SHM_DIR}/{name}")


# -- `kvshm serve` refusing to start ----------------------------------------------------------------
def _serve(config_path: Path, name: str, sock: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvshm", "serve", "--config", str(config_path), "--name", name,
         "--socket", str(sock), "--quiet"], capture_output=True, text=True, timeout=30)


def test_serve_refuses_a_name_owned_by_a_live_coordinator(tmp_path, sockdir):
    cfg = make_config()
    cfg_path = tmp_path / "pool.json"
    cfg_path.write_bytes(cfg.to_json())
    with CoordinatorProcess(cfg) as live:
        for sock in (sockdir / "other.sock", live.socket):   # even on the live one's socket
            res = _serve(cfg_path, live.name, sock)
            assert res.returncode == 2, res
            assert "ready" not in res.stdout
            assert f"pool {live.name!r} is served by live process {live.proc.pid}" in res.stderr
        assert not (sockdir / "other.sock").exists()

        async def still_serving():
            async with await connect(live.socket) as c:
                return (await c.stats()).num_blocks
        assert asyncio.run(still_serving()) == 10
        assert segment_info(live.name)["pid"] == live.proc.pid


async def test_a_live_coordinators_socket_is_not_taken_over(coordinator, sockdir):
    """BUG: start() unlinks whatever socket is at socket_path ("a stale
    socket: the pool segment name is the lock"), but two pools of different
    names can be given the same --socket: the second silently takes the
    socket over and the first, still running, becomes unreachable (and
    stays so after the second stops and unlinks it)."""
    shared = sockdir / "shared.sock"
    first = await coordinator(socket_path=shared)
    with pytest.raises(KvshmError):
        await coordinator(make_config(num_blocks=20), socket_path=shared)
    async with await connect(shared) as c:
        assert c.pool_segment == first.name


def test_serve_adopts_the_pool_of_a_dead_coordinator(tmp_path):
    """`kvshm serve` with the same name takes over a SIGKILLed coordinator's
    pool instead of refusing; its clean shutdown then removes it."""
    cfg = make_config()
    name = f"kvshm-test-{secrets.token_hex(5)}"
    try:
        with CoordinatorProcess(cfg, name=name) as dead:
            dead.proc.kill()
            dead.proc.wait()
        info = segment_info(name)
        assert info is not None and not info["alive"]
        with CoordinatorProcess(cfg, name=name) as again:
            info = segment_info(name)
            assert info["alive"] and info["pid"] == again.proc.pid
            assert "adopted the pool" in again.stderr
        assert again.proc.returncode == 0
        assert segment_info(name) is None
    finally:
        if segment_info(name) is not None:
            remove_segment(name, force=True)


def test_serve_refuses_a_socket_path_that_is_a_regular_file(tmp_path, sockdir):
    """BUG: `kvshm serve --socket FILE` says FILE "exists and is not a
    socket", exits 2 ... and deletes FILE (serve() runs Coordinator.stop(),
    which unlinks socket_path unconditionally)."""
    cfg_path = tmp_path / "pool.json"
    cfg_path.write_bytes(make_config().to_json())
    victim = sockdir / "notes.txt"
    victim.write_text("precious")
    name = f"kvshm-test-{secrets.token_hex(5)}"
    res = _serve(cfg_path, name, victim)
    assert res.returncode == 2, res
    assert "exists and is not a socket" in res.stderr
    assert segment_info(name) is None
    assert victim.exists() and victim.read_text() == "precious", "kvshm serve deleted it"
