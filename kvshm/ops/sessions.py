"""Resumable sessions: their records in the pool segment.

Each session with a record can be taken back after a coordinator restart by
a client presenting its resume token.  A record holds the session id (the
request table's owner word), the SHA-256 of its resume token, its tenant
(as a digest), rights, the seq of the last frame applied for it, and the
encoded replies of its last frames: a pipelining client may have several
frames in flight when the coordinator dies, and each gets its own reply
when it resumes.

Frames are numbered per session in the order they arrive after the
handshake, 1, 2, ...; `record_frame` writes the seq (journaled: rolled back
with the frame) and the reply inside the frame, so after a crash
`last_seq` says exactly which frames were applied.

The replies live in a byte ring per session (REPLY_RING_BYTES), each where
the last one ended (or at the ring's start when it does not fit before its
end), indexed by seq in REPLIES_KEPT entries of the record (entry seq %
REPLIES_KEPT).  A reply is kept until a later one needs its index entry or
its bytes; one larger than the ring is not kept.  NOTE: the entries a
reply's bytes will cover are invalidated before the bytes are written, and
its own entry is written after them, so a crash at any point leaves every
valid entry naming intact bytes; entries of frames after `last_seq` (a
cut-off frame's) are dropped when the record is read back.

Record words (int64):

    0 session id (0: free)    1 last applied seq    2 peer pid    3 flags
    4 NUMA node               5-8 token digest      9-10 tenant digest
    11-42 REPLIES_KEPT entries: seq (0: none), offset << 32 | length
"""

from __future__ import annotations

import hashlib
import hmac
from array import array
from collections import deque
from dataclasses import dataclass

from kvshm.pool.segment import PoolSegment

from kvshm.core.state import (REPLIES_KEPT, REPLY_RING_BYTES, SESSION_LAST_SEQ, SESSION_SLOTS,
    SESSION_WORDS)

FLAG_ADMIN = 1
# Seconds a restarted coordinator keeps the requests of sessions that have
# not resumed yet (`kvshm serve --resume-grace`).
DEFAULT_RESUME_GRACE = 30.0
_ID, _PID, _FLAGS, _NODE, _TOKEN, _TENANT, _KEPT = 0, 2, 3, 4, 5, 9, 11


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def tenant_digest(tenant: str) -> bytes:
    return hashlib.sha256(b"kvshm-tenant\0" + tenant.encode()).digest()[:16]


@dataclass
class SessionRecord:
    """A record as read back from the segment (after a restart)."""

    slot: int
    session_id: int
    last_seq: int
    pid: int
    admin: bool
    node: int
    token: bytes
    tenant: bytes


class SessionTable:
    """The session records of one pool segment (the coordinator's only)."""

    def __init__(self, seg: PoolSegment) -> None:
        self._words = seg.sessions
        self._replies = seg.replies
        self._journal = seg.journal
        self._free = [s for s in range(SESSION_SLOTS - 1, -1, -1)
                      if not self._words[s * SESSION_WORDS + _ID]]
        # Per record in use: its kept replies, oldest first, as (seq, start,
        # end) of their bytes in the ring (the index entries, in memory), and
        # where the next reply goes (after the newest one kept).
        self._heads: dict[int, int] = {}
        self._rings: dict[int, deque] = {
            s: self._read_ring(s) for s in range(SESSION_SLOTS)
            if self._words[s * SESSION_WORDS + _ID]}

    def _read_ring(self, slot: int) -> deque:
        """The kept replies of a record read back: entries of frames after
        its last applied one are dropped (a cut-off frame's)."""
        w = self._words
        base = slot * SESSION_WORDS
        last = w[base + SESSION_LAST_SEQ]
        kept = []
        for i in range(REPLIES_KEPT):
            e = base + _KEPT + 2 * i
            seq = w[e]
            if not seq:
                continue
            if seq > last:
                w[e] = 0
                continue
            start, n = w[e + 1] >> 32, w[e + 1] & 0xFFFFFFFF
            kept.append((seq, start, start + ((n + 7) & ~7)))
        kept.sort()
        return deque(kept)

    def records(self) -> list[SessionRecord]:
        """Every record in use."""
        out = []
        w = self._words
        for s in range(SESSION_SLOTS):
            base = s * SESSION_WORDS
            if w[base + _ID]:
                out.append(SessionRecord(
                    s, w[base + _ID], w[base + SESSION_LAST_SEQ], w[base + _PID],
                    bool(w[base + _FLAGS] & FLAG_ADMIN), w[base + _NODE],
                    array("q", w[base + _TOKEN:base + _TOKEN + 4]).tobytes(),
                    array("q", w[base + _TENANT:base + _TENANT + 2]).tobytes()))
        return out

    def allocate(self, session_id: int, token: str, tenant: str, *, admin: bool,
                 pid: int, node: int) -> int | None:
        """A new record (its slot), or None when every slot is taken (the
        session is served but cannot be resumed)."""
        if not self._free:
            return None
        slot = self._free.pop()
        base = slot * SESSION_WORDS
        w = self._words
        w[base:base + SESSION_WORDS] = array("q", bytes(8 * SESSION_WORDS))
        w[base + _PID] = pid
        w[base + _FLAGS] = FLAG_ADMIN if admin else 0
        w[base + _NODE] = node
        w[base + _TOKEN:base + _TOKEN + 4] = array("q", token_digest(token))
        w[base + _TENANT:base + _TENANT + 2] = array("q", tenant_digest(tenant))
        self._rings[slot] = deque()
        self._heads[slot] = 0
        w[base + _ID] = session_id   # last: a record is in use once it has an id
        return slot

    def take(self, slot: int) -> None:
        """Keep `slot` (a record read back by `records()`) in use."""
        if slot in self._free:
            self._free.remove(slot)

    def release(self, slot: int) -> None:
        """Free a record (its session ended for good)."""
        self._words[slot * SESSION_WORDS + _ID] = 0
        self._rings.pop(slot, None)
        if slot not in self._free:
            self._free.append(slot)

    @staticmethod
    def token_matches(record: SessionRecord, token: str) -> bool:
        return hmac.compare_digest(record.token, token_digest(token))

    # -- frames ----------------------------------------------------------------
    def record_frame(self, slot: int, seq: int, reply: bytes | bytearray) -> None:
        """Frame `seq` of the session is applied, with this encoded reply
        (inside the frame: the seq is journaled)."""
        w = self._words
        base = slot * SESSION_WORDS
        self._journal.session(slot, w[base + SESSION_LAST_SEQ])
        self._keep(slot, seq, reply)
        w[base + SESSION_LAST_SEQ] = seq

    def _keep(self, slot: int, seq: int, reply: bytes | bytearray) -> None:
        """Keep frame `seq`'s reply in the record's ring (see the module
        docstring for the order of the writes)."""
        w = self._words
        kept = base = slot * SESSION_WORDS + _KEPT
        ring = self._rings[slot]
        n = len(reply)
        oldest = seq - REPLIES_KEPT     # its index entry is this frame's now
        while ring and ring[0][0] <= oldest:
            ring.popleft()              # (its entry is overwritten below)
        entry = base + 2 * (seq % REPLIES_KEPT)
        if n > REPLY_RING_BYTES:        # too large to keep: a lost reply stays lost
            w[entry] = 0
            return
        head = ring[-1][2] if ring else self._heads.get(slot, 0)
        end = head + ((n + 7) & ~7)
        if end <= REPLY_RING_BYTES:     # the bytes go to [head, end)
            while ring and head <= ring[0][1] < end:
                w[kept + 2 * (ring.popleft()[0] % REPLIES_KEPT)] = 0
            start = head
        else:                           # to [0, end): [head, ring end) is left
            start, end = 0, end - head
            while ring and (ring[0][1] >= head or ring[0][1] < end):
                w[kept + 2 * (ring.popleft()[0] % REPLIES_KEPT)] = 0
        off = slot * REPLY_RING_BYTES + start
        self._replies[off:off + n] = reply
        w[entry + 1] = start << 32 | n
        w[entry] = seq
        ring.append((seq, start, end))
        self._heads[slot] = end

    def last_seq(self, slot: int) -> int:
        return self._words[slot * SESSION_WORDS + SESSION_LAST_SEQ]

    def reply(self, slot: int, seq: int) -> bytes | None:
        """The encoded reply frame of frame `seq`, if it is still kept."""
        w = self._words
        e = slot * SESSION_WORDS + _KEPT + 2 * (seq % REPLIES_KEPT)
        if seq <= 0 or w[e] != seq:
            return None
        start, n = w[e + 1] >> 32, w[e + 1] & 0xFFFFFFFF
        off = slot * REPLY_RING_BYTES + start
        return bytes(self._replies[off:off + n])
