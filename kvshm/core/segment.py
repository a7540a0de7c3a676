"""The pool's shared-memory segment: layout, create / attach / close / unlink,
the consistent read over the mutation counter, and `ls` / `rm` helpers.

All pool state lives here in flat arrays (no Python object per block), so a
pool of millions of blocks starts in milliseconds and a restarted
coordinator, `kvshm check` or a stats reader can attach and read it.

Layout (every array 64-byte aligned, native byte order):

    header            fixed fields (HEADER_FIELDS) + the config as JSON
    ref_cnt           int32[num_blocks]
    next_delta        int32[num_blocks + 1]  free-queue links, stored relative
    prev_delta        int32[num_blocks + 1]  to the block's own id; slot
                                             `num_blocks` is the queue sentinel
    free_stamp        int64[num_blocks]   order in which blocks joined the free
                                          queue (0 = initial order by id)
    cache_stamp       int64[num_blocks]   order in which blocks were cached
    hash_group        uint16[num_blocks]  group the cached hash belongs to
    flags             uint8[num_blocks]   FLAG_NULL | FLAG_CACHED | FLAG_SINK
                                          | FLAG_PENDING
    hashes            uint8[num_blocks * 32] cached block hash (zero padded)
    slot_meta         int32[max_num_seqs * 4]  rid length, owner, in use, -
    slot_rid          uint8[max_num_seqs * 64] request id (utf-8)
    slot_counts       int32[max_num_seqs * groups * 2]  per group: number of
                                          blocks (-1: no entry), number of
                                          cached blocks (-1: not tracked)
    table[g]          int32[max_num_seqs * row_capacity(g)] block ids
    undo              int64[undo_words(config)]  the open frame's undo log
                                          (kvshm/core/journal.py)
    sessions          int64[SESSION_SLOTS * SESSION_WORDS]  resumable
                                          coordinator sessions (service layer)
    replies           uint8[SESSION_SLOTS * 2 * REPLY_BYTES]  each session's
                                          last two frame replies
    metrics           int64[METRICS_WORDS]  operators' counters
                                          (kvshm/core/metrics.py)

Links are relative (next = id + next_delta[id]) so that a fresh queue
[0, 1, ..., n-1] is a constant byte pattern: filling 1M links is a memset,
not a million Python stores.

Writers bracket every mutation with `begin_mutation()` / `BlockPool.publish()`:
`mutation_seq` is odd while a mutation is in progress, so a reader that sees
the same even value before and after its read got a consistent snapshot
(`PoolSegment.read_consistent`).
A frame (one op, or a coordinator frame of many) is also journaled: the
undo log holds what it overwrote in the authoritative arrays until it
commits, so a restarted coordinator can roll a cut-off frame back
(docs/recovery.md, kvshm/core/recovery.py).
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from kvshm.core.errors import SegmentError
from kvshm.core.hashing import HASH_SLOT_BYTES
from kvshm.core.metrics import METRICS_WORDS
from kvshm.core.shm import SHM_DIR, OwnedMapping, Shm, create_shm, open_shm, unlink_shm
from kvshm.core.specs import PoolConfig

T = TypeVar("T")

MAGIC = b"KVSHMPL\0"
# The KV data arena (kvshm/arena.py) shares the pool header's first fields
# (magic, layout version, header size, config fingerprint, num_blocks,
# creator pid at the same offsets), so `segment_info` reads both kinds.
ARENA_MAGIC = b"KVSHMKV\0"
LAYOUT_VERSION = 4
RID_BYTES = 64
SLOT_META_FIELDS = 4  # rid_len, owner session, in_use, reserved

FLAG_NULL = 1
FLAG_CACHED = 2
FLAG_SINK = 4
# A cached block whose K/V its writer has not reported written yet
# (core/block_pool.py, "readiness"); always together with FLAG_CACHED.
FLAG_PENDING = 8

# The pool header's fixed fields: name -> (offset, struct format).  The KV
# arena writes the leading ones (up to coordinator_pid) at the same offsets.
HEADER_FIELDS = {
    "magic": (0, "8s"),
    "layout_version": (8, "I"),
    "header_size": (12, "I"),
    "config_fingerprint": (16, "32s"),
    "hash_fingerprint": (48, "16s"),
    "num_blocks": (64, "Q"),
    "num_groups": (72, "I"),
    "num_slots": (76, "I"),
    "generation": (80, "Q"),
    "mutation_seq": (88, "Q"),
    "coordinator_pid": (96, "Q"),
    # Written by the owner as they change (see BlockPool).
    "num_free_blocks": (104, "Q"),
    "queries": (112, "Q"),
    "hits": (120, "Q"),
    "query_tokens": (128, "Q"),
    "hit_tokens": (136, "Q"),
    "num_requests": (144, "Q"),
    "created_ns": (152, "Q"),
    "config_len": (160, "I"),
    # Recovery (layout 2): words of the open frame's undo log (0: none), the
    # cache stamp at its start, and when the current coordinator took the
    # pool over (its uptime).
    "undo_len": (168, "Q"),
    "frame_cache_stamp": (176, "Q"),
    "started_ns": (184, "Q"),
    # Pool churn since the pool was created (BlockPool): blocks handed out by
    # allocations, and cached blocks whose hash was dropped (evicted to reuse
    # the block, or by evict_blocks).  Not journaled: a frame a crash cut
    # off and repair rolled back stays counted.
    "blocks_allocated": (192, "Q"),
    "blocks_evicted": (200, "Q"),
}
_HEADER_FIXED = 256
COUNTER_FIELDS = ("num_free_blocks", "queries", "hits", "query_tokens", "hit_tokens",
                  "num_requests")
_COUNTERS = struct.Struct(f"{len(COUNTER_FIELDS)}Q")
_COUNTERS_OFFSET = HEADER_FIELDS["num_free_blocks"][0]
FREE_WORD = _COUNTERS_OFFSET // 8
STATS_WORD = FREE_WORD + 1
NUM_REQUESTS_WORD = FREE_WORD + 5
SEQ_WORD = HEADER_FIELDS["mutation_seq"][0] // 8
UNDO_LEN_WORD = HEADER_FIELDS["undo_len"][0] // 8
FRAME_CACHE_STAMP_WORD = HEADER_FIELDS["frame_cache_stamp"][0] // 8
ALLOCATED_WORD = HEADER_FIELDS["blocks_allocated"][0] // 8
EVICTED_WORD = HEADER_FIELDS["blocks_evicted"][0] // 8

# Session records of the coordinator (kvshm/ops/sessions.py gives the
# words their meaning); each has room for its last two frame replies.
SESSION_SLOTS = 256
SESSION_WORDS = 16
SESSION_LAST_SEQ = 1   # the word of a record the undo log restores
REPLY_BYTES = 16384


def _align(n: int, to: int = 64) -> int:
    return -(-n // to) * to


def undo_words(config: PoolConfig) -> int:
    """Capacity of the undo log: the most one frame can journal (every
    request row's counts and original ids, every slot's metadata, the
    lookup counters and one session record; see journal.py)."""
    from kvshm.core.journal import frame_bound
    return frame_bound(config.max_num_seqs,
                       [config.row_capacity(g) for g in range(len(config.groups))])


def config_fingerprint(config: PoolConfig) -> bytes:
    return hashlib.sha256(config.to_json()).digest()


class Layout:
    """Byte offsets of every array for one config."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        n = config.num_blocks
        slots = config.max_num_seqs
        ngroups = len(config.groups)
        self.config_json = config.to_json()
        self.header_size = _align(_HEADER_FIXED + len(self.config_json))
        self.widths = [config.row_capacity(g) for g in range(ngroups)]
        arrays: list[tuple[str, int]] = [
            ("ref_cnt", 4 * n),
            ("next_delta", 4 * (n + 1)),
            ("prev_delta", 4 * (n + 1)),
            ("free_stamp", 8 * n),
            ("cache_stamp", 8 * n),
            ("hash_group", 2 * n),
            ("flags", n),
            ("hashes", HASH_SLOT_BYTES * n),
            ("slot_meta", 4 * SLOT_META_FIELDS * slots),
            ("slot_rid", RID_BYTES * slots),
            ("slot_counts", 4 * 2 * ngroups * slots),
        ]
        arrays += [(f"table{g}", 4 * slots * w) for g, w in enumerate(self.widths)]
        arrays += [("undo", 8 * undo_words(config)),
                   ("sessions", 8 * SESSION_SLOTS * SESSION_WORDS),
                   ("replies", SESSION_SLOTS * 2 * REPLY_BYTES),
                   ("metrics", 8 * METRICS_WORDS)]
        self.offsets: dict[str, tuple[int, int]] = {}
        off = self.header_size
        for name, size in arrays:
            self.offsets[name] = (off, size)
            off = _align(off + size)
        self.size = off
        self.block_bytes = sum(self.offsets[k][1] for k in (
            "ref_cnt", "next_delta", "prev_delta", "free_stamp", "cache_stamp",
            "hash_group", "flags", "hashes"))
        self.recovery_bytes = sum(self.offsets[k][1] for k in ("undo", "sessions", "replies"))
        self.metrics_bytes = self.offsets["metrics"][1]
        self.table_bytes = (self.size - self.header_size - self.block_bytes
                            - self.recovery_bytes - self.metrics_bytes)


_FORMATS = {"ref_cnt": "i", "next_delta": "i", "prev_delta": "i", "free_stamp": "q",
            "cache_stamp": "q", "hash_group": "H", "flags": "B", "hashes": "B",
            "slot_meta": "i", "slot_rid": "B", "slot_counts": "i", "undo": "q",
            "sessions": "q", "replies": "B", "metrics": "q"}


class PoolSegment(OwnedMapping):
    """An open pool segment and typed memoryviews over its arrays.

    Use `PoolSegment.create(config, name)` in the owning process and
    `PoolSegment.attach(name)` everywhere else.  Only the creator unlinks.
    """

    def __init__(self, shm: Shm, layout: Layout, owner: bool) -> None:
        self._shm = shm
        self.layout = layout
        self.config = layout.config
        self.owner = owner
        self.name = shm.name
        buf = shm.buf
        self._views: list[memoryview] = []
        self.header = buf[:layout.header_size]
        self._views.append(self.header)
        for name, (off, size) in layout.offsets.items():
            fmt = "i" if name.startswith("table") else _FORMATS[name]
            view = buf[off:off + size].cast(fmt)
            self._views.append(view)
            setattr(self, name, view)
        self.tables = [getattr(self, f"table{g}") for g in range(len(layout.widths))]
        # The fixed header as 8-byte words (fields from offset 64 on are
        # words): the writer's hot path stores through this view.
        self.words = buf[:_HEADER_FIXED].cast("Q")
        self._views.append(self.words)
        from kvshm.core.journal import Journal
        self.journal = Journal(self)
        self.closed = False

    # -- header --------------------------------------------------------------
    def get(self, field: str):
        off, fmt = HEADER_FIELDS[field]
        value = struct.unpack_from(fmt, self.header, off)[0]
        return value

    def set(self, field: str, value) -> None:
        off, fmt = HEADER_FIELDS[field]
        struct.pack_into(fmt, self.header, off, value)

    # -- lifecycle -------------------------------------------------------------
    @classmethod
    def create(cls, config: PoolConfig, name: str | None = None) -> "PoolSegment":
        """Create and initialise a segment for `config`.

        Raises ShmSpaceError when /dev/shm is too small and SegmentError when
        `name` already exists.
        """
        layout = Layout(config)
        shm = create_shm(name, layout.size)
        seg = cls(shm, layout, owner=True)
        seg._initialise()
        return seg

    @classmethod
    def attach(cls, name: str, expect_config: PoolConfig | None = None) -> "PoolSegment":
        """Attach to an existing segment; validates magic, version, and (when
        given) that the segment holds exactly `expect_config`."""
        shm = open_shm(name)
        try:
            layout = _read_layout(shm)
            if expect_config is not None and layout.config != expect_config:
                raise SegmentError(
                    f"segment {name!r} holds another pool config "
                    f"({layout.config.to_json().decode()})"
                )
        except BaseException:
            shm.close()
            raise
        return cls(shm, layout, owner=False)

    def close(self) -> None:
        """Release this process's mapping (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for v in self._views:
            v.release()
        self._views.clear()
        self._shm.close()

    def private_copy(self) -> "PoolSegment":
        """A segment over a private copy of this one's bytes (a dry run of
        repair or a check that must leave the original untouched)."""
        return PoolSegment(_Copy(self.name, self._shm.buf), self.layout, owner=False)

    # -- initial state ---------------------------------------------------------
    def _initialise(self) -> None:
        lay = self.layout
        cfg = self.config
        n = cfg.num_blocks
        h = self.header
        h[:_HEADER_FIXED] = bytes(_HEADER_FIXED)
        h[_HEADER_FIXED:_HEADER_FIXED + len(lay.config_json)] = lay.config_json
        # The free queue [0, 1, ..., n-1]: every next link is +1, every prev
        # link -1; only the ends point at the sentinel (id n).
        nxt, prv = self.next_delta, self.prev_delta
        nxt.cast("B")[:] = b"\x01\x00\x00\x00" * (n + 1) if sys.byteorder == "little" \
            else b"\x00\x00\x00\x01" * (n + 1)
        prv.cast("B")[:] = b"\xff" * (4 * (n + 1))
        nxt[n] = -n          # sentinel -> block 0 (head)
        prv[0] = n           # block 0 -> sentinel
        # next[n-1] == +1 -> sentinel, prev[sentinel] == -1 -> n-1: already set.
        counts = self.slot_counts
        counts.cast("B")[:] = b"\xff" * (4 * len(counts))
        for field, value in (
            ("layout_version", LAYOUT_VERSION),
            ("header_size", lay.header_size),
            ("config_fingerprint", config_fingerprint(cfg)),
            ("num_blocks", n),
            ("num_groups", len(cfg.groups)),
            ("num_slots", cfg.max_num_seqs),
            ("num_free_blocks", n),
            ("created_ns", time.time_ns()),
            ("started_ns", time.time_ns()),
            ("config_len", len(lay.config_json)),
            ("coordinator_pid", os.getpid()),
        ):
            self.set(field, value)
        from kvshm.core.hashing import hash_fingerprint
        self.set("hash_fingerprint", hash_fingerprint(cfg.hash_algorithm, cfg.hash_seed).encode())
        self.set("magic", MAGIC)  # last: a reader never sees a half-made header

    # -- mutation bracket ----------------------------------------------------
    def begin_mutation(self) -> None:
        words = self.words
        words[SEQ_WORD] |= 1

    def read_consistent(self, read: Callable[[], T], timeout: float = 1.0, *,
                        pause: float = 0.0005, torn_ok: bool = False) -> tuple[T, bool]:
        """Call `read()` (which copies what it needs out of the segment) until
        no mutation overlapped it: the mutation counter was even and the same
        before and after the call.  Between attempts it sleeps `pause` s.

        Returns `(result, consistent)`.  After `timeout` seconds without a
        mutation-free moment (a writer that died mid-mutation leaves the
        counter odd) it returns the last, possibly torn result and False if
        `torn_ok`, and raises SegmentError otherwise.
        """
        words = self.words
        deadline = time.monotonic() + timeout
        while True:
            before = words[SEQ_WORD]
            result = read()
            after = words[SEQ_WORD]
            if before == after and not before & 1:
                return result, True
            if time.monotonic() > deadline:
                if torn_ok:
                    return result, False
                raise SegmentError(
                    f"segment {self.name!r}: a mutation has been in progress for "
                    f"{timeout}s (its writer may have died mid-operation)")
            time.sleep(pause)

    def read_counters(self, timeout: float = 1.0) -> dict[str, int]:
        """A consistent snapshot of the header counters (COUNTER_FIELDS).
        Raises SegmentError as `read_consistent` does."""
        values, _ = self.read_consistent(
            lambda: _COUNTERS.unpack_from(self.header, _COUNTERS_OFFSET), timeout)
        return dict(zip(COUNTER_FIELDS, values))

    # -- request slots ---------------------------------------------------------
    def slot_request_id(self, slot: int) -> str:
        n = self.slot_meta[slot * SLOT_META_FIELDS]
        base = slot * RID_BYTES
        return bytes(self.slot_rid[base:base + n]).decode()


def _read_layout(shm: Shm) -> Layout:
    buf = shm.buf
    if len(buf) < _HEADER_FIXED or bytes(buf[:8]) != MAGIC:
        raise SegmentError(f"segment {shm.name!r} is not a kvshm pool (bad magic)")
    version = struct.unpack_from("I", buf, HEADER_FIELDS["layout_version"][0])[0]
    if version != LAYOUT_VERSION:
        raise SegmentError(
            f"segment {shm.name!r} has layout version {version}; this kvshm "
            f"reads version {LAYOUT_VERSION}"
        )
    clen = struct.unpack_from("I", buf, HEADER_FIELDS["config_len"][0])[0]
    raw = bytes(buf[_HEADER_FIXED:_HEADER_FIXED + clen])
    try:
        config = PoolConfig.from_json(raw)
    except Exception as e:
        raise SegmentError(f"segment {shm.name!r} has an unreadable config: {e}") from None
    fp = bytes(buf[HEADER_FIELDS["config_fingerprint"][0]:][:32])
    if fp != config_fingerprint(config):
        raise SegmentError(f"segment {shm.name!r}: config fingerprint mismatch")
    layout = Layout(config)
    if len(buf) < layout.size:
        raise SegmentError(
            f"segment {shm.name!r} is {len(buf)} bytes, its config needs {layout.size}"
        )
    return layout


class _Copy:
    """Private bytes standing in for a mapped segment (see private_copy)."""

    def __init__(self, name: str, buf: memoryview) -> None:
        self.name = name
        self.buf = memoryview(bytearray(buf))

    def close(self) -> None:
        self.buf.release()

    def unlink(self) -> None:
        raise SegmentError("a private copy has no name to unlink")


def segment_info(name: str) -> dict | None:
    """Summary of segment `name` if it is a kvshm pool or KV arena, else None."""
    try:
        shm = Shm.open(name)
    except (OSError, ValueError):  # not ours to open, or empty (being created)
        return None
    try:
        buf = shm.buf
        if len(buf) < _HEADER_FIXED or bytes(buf[:8]) not in (MAGIC, ARENA_MAGIC):
            return None
        pid = struct.unpack_from("Q", buf, HEADER_FIELDS["coordinator_pid"][0])[0]
        return {
            "name": name,
            "kind": "pool" if bytes(buf[:8]) == MAGIC else "arena",
            "bytes": len(buf),
            "num_blocks": struct.unpack_from("Q", buf, HEADER_FIELDS["num_blocks"][0])[0],
            "layout_version": struct.unpack_from("I", buf, HEADER_FIELDS["layout_version"][0])[0],
            "pid": pid,
            "alive": _pid_alive(pid),
        }
    finally:
        shm.close()


def _pid_alive(pid: int) -> bool:
    import psutil
    return pid > 0 and psutil.pid_exists(pid)


def list_segments() -> list[dict]:
    """Every kvshm segment (pools and KV arenas) in /dev/shm, with its owner
    and liveness."""
    try:
        names = sorted(os.listdir(SHM_DIR))
    except OSError:
        return []
    return [info for n in names if (info := segment_info(n)) is not None]


def remove_segment(name: str, force: bool = False) -> None:
    """Unlink the kvshm segment `name`; refuses while its owner lives unless
    `force`.  Raises SegmentError."""
    info = segment_info(name)
    if info is None:
        raise SegmentError(f"{name!r} is not a kvshm segment")
    if info["alive"] and not force:
        raise SegmentError(
            f"{name!r} belongs to live process {info['pid']}; stop it first "
            "(or pass --force)")
    unlink_shm(name)
