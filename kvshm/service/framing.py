"""Reading frames of the coordinator protocol off a stream: a 4-byte
little-endian length, then a msgpack body (one of the Structs of
ops/protocol.py, which also encodes them: `encode_frame`).

Frames over the receiver's limit (MAX_FRAME_BYTES for the coordinator) end
the stream: it cannot be resynchronised after a bad length.
"""

from __future__ import annotations

from kvshm.ops.errors import FrameTooLarge
from kvshm.ops.protocol import LENGTH_BYTES

MAX_FRAME_BYTES = 8 * 2**20     # what the coordinator accepts
REPLY_LIMIT_BYTES = 2**30       # what a client accepts (a stats reply can be large)


class FrameReader:
    """Incremental frame splitter: feed bytes, get complete bodies.

    When a header announces a frame over `limit`, the complete frames before
    it are still returned and `broken` is set (a FrameTooLarge): the stream
    cannot be resynchronised after it.
    """

    __slots__ = ("_buf", "limit", "broken")

    def __init__(self, limit: int = MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self.limit = limit
        self.broken: FrameTooLarge | None = None

    def feed(self, data: bytes) -> list[bytes | memoryview]:
        if self.broken is not None:
            return []
        buf = self._buf
        if not buf and len(data) >= LENGTH_BYTES:
            # Fast path: exactly one whole frame arrived (the common case for
            # request/reply traffic): no copy.
            size = int.from_bytes(data[:LENGTH_BYTES], "little")
            if size + LENGTH_BYTES == len(data) and size <= self.limit:
                return [memoryview(data)[LENGTH_BYTES:]]
        buf += data
        out = []
        pos = 0
        n = len(buf)
        while n - pos >= LENGTH_BYTES:
            size = int.from_bytes(buf[pos:pos + LENGTH_BYTES], "little")
            if size > self.limit:
                self.broken = FrameTooLarge(size, self.limit)
                buf.clear()
                return out
            end = pos + LENGTH_BYTES + size
            if end > n:
                break
            out.append(bytes(buf[pos + LENGTH_BYTES:end]))
            pos = end
        if pos:
            del buf[:pos]
        return out

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held back."""
        return len(self._buf)
