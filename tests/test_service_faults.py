"""Coordinator faults on the wire: bad input (each answered with a typed
error and no change to the pool), error codes and the exception classes and
fields clients get for them, and connections that send truncated or oversized
frames or ask for oversized replies.

Clients that die, cancel calls or stop reading are in test_client_faults.py;
signals to a coordinator process and `kvshm serve` refusing to start, in
test_coordinator_faults.py.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from helpers import make_config, tokens, until
from kvshm.core.errors import KvshmError
from kvshm.core.hashing import hash_fingerprint
from kvshm.ops import protocol as p
from kvshm.ops.protocol import encode_frame
from kvshm.service.client import connect
from kvshm.service.framing import MAX_FRAME_BYTES
from raw_wire import CONFIG, FP, HELLO, Raw, frame, snapshot

_pack = msgspec.msgpack.encode


# -- fixtures and helpers ---------------------------------------------------------------------
@pytest.fixture
def coordinator_config():
    return CONFIG


@pytest.fixture
async def populated(coordinator):
    """A coordinator (batch limit 8) where another session holds request
    'held' with cached blocks."""
    coord = await coordinator(max_batch_ops=8)
    holder = await connect(coord.socket_path)
    await holder.add_request("held", tokens(0, 14))
    await holder.allocate_slots("held", 14)
    await holder.advance("held", 14)         # computed: its blocks are ready
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
    from kvshm.ops import errors as e
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
    from kvshm.ops import errors as e
    from kvshm.ops.executor import error_reply
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
    from kvshm.ops import errors
    from kvshm.service import framing
    assert framing.FrameTooLarge is errors.FrameTooLarge


async def test_clients_get_the_fields_of_a_coordinator_s_errors(populated):
    from kvshm.core.errors import DuplicateRequest, UnknownRequest
    from kvshm.ops.errors import NotOwner
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
    from kvshm.ops.errors import BatchTooLarge, NotOwner, ProtocolError
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
            assert c.connected, repr(e)
        assert await c.get_block_ids("kept") == [[1, 2]]
        assert "kept" in coord.executor.requests
