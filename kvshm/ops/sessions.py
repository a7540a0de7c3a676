"""Resumable sessions: their records in the pool segment.

Each session with a record can be taken back after a coordinator restart by
a client presenting its resume token.  A record holds the session id (the
request table's owner word), the SHA-256 of its resume token, its tenant
(as a digest), rights, the seq of the last frame applied for it, and the
encoded replies of its last two frames (by seq parity, so the reply of the
last applied frame survives a cut-off frame that overwrote the other one).

Frames are numbered per session in the order they arrive after the
handshake, 1, 2, ...; `record_frame` writes the seq (journaled: rolled back
with the frame) and the reply inside the frame, so after a crash
`last_seq` says exactly which frames were applied.

Record words (int64):

    0 session id (0: free)    1 last applied seq    2 peer pid    3 flags
    4 NUMA node               5-8 token digest      9-10 tenant digest
    11/12 seq and length of reply buffer 0          13/14 of buffer 1
"""

from __future__ import annotations

import hashlib
import hmac
from array import array
from dataclasses import dataclass

from kvshm.pool.segment import PoolSegment

from kvshm.core.state import REPLY_BYTES, SESSION_LAST_SEQ, SESSION_SLOTS, SESSION_WORDS

FLAG_ADMIN = 1
# Seconds a restarted coordinator keeps the requests of sessions that have
# not resumed yet (`kvshm serve --resume-grace`).
DEFAULT_RESUME_GRACE = 30.0
_ID, _PID, _FLAGS, _NODE, _TOKEN, _TENANT, _REPLY = 0, 2, 3, 4, 5, 9, 11


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
        w[base + _ID] = session_id   # last: a record is in use once it has an id
        return slot

    def take(self, slot: int) -> None:
        """Keep `slot` (a record read back by `records()`) in use."""
        if slot in self._free:
            self._free.remove(slot)

    def release(self, slot: int) -> None:
        """Free a record (its session ended for good)."""
        self._words[slot * SESSION_WORDS + _ID] = 0
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
        half = seq & 1
        rb = base + _REPLY + 2 * half
        if len(reply) <= REPLY_BYTES:
            off = (slot * 2 + half) * REPLY_BYTES
            self._replies[off:off + len(reply)] = reply
            w[rb + 1] = len(reply)
        else:
            w[rb + 1] = -1   # too large to keep: a lost reply stays lost
        w[rb] = seq
        w[base + SESSION_LAST_SEQ] = seq

    def last_seq(self, slot: int) -> int:
        return self._words[slot * SESSION_WORDS + SESSION_LAST_SEQ]

    def reply(self, slot: int, seq: int) -> bytes | None:
        """The encoded reply frame of frame `seq`, if it is still kept."""
        w = self._words
        half = seq & 1
        rb = slot * SESSION_WORDS + _REPLY + 2 * half
        if w[rb] != seq or w[rb + 1] < 0:
            return None
        off = (slot * 2 + half) * REPLY_BYTES
        return bytes(self._replies[off:off + w[rb + 1]])
