"""Hand-driving a coordinator's wire, shared by the fault tests
(test_service_faults.py, test_client_faults.py, test_coordinator_faults.py);
imported as `raw_wire`.

CONFIG is the two-group pool their coordinators serve and HELLO the
handshake that fits it; `Raw` is a connection that writes any bytes and reads
reply frames; `snapshot` is everything a bad message must leave alone.
"""

from __future__ import annotations

import asyncio
import os

import msgspec

from helpers import make_config
from kvshm import FullSpec, SlidingWindowSpec
from kvshm.core.check import check_segment
from kvshm.core.hashing import hash_fingerprint
from kvshm.ops import protocol as p
from kvshm.ops.protocol import encode_frame
from kvshm.service.framing import FrameReader
from kvshm.service.server import Coordinator

CONFIG = make_config(groups=(FullSpec(4), SlidingWindowSpec(4, 8)), num_blocks=64,
                     max_num_seqs=32)
FP = hash_fingerprint(CONFIG.hash_algorithm, CONFIG.hash_seed)
HELLO = p.Hello(p.PROTOCOL_VERSION, os.getpid(), FP)
_decode = msgspec.msgpack.Decoder(p.ServerMessage).decode


def frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "little") + body


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
