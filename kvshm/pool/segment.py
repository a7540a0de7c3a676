"""The pool's shared-memory segment: create / attach / close / unlink, the
consistent read over the mutation counter, and `ls` / `rm` helpers.  What
lies where in it is layout.py.

All pool state lives here in flat arrays (no Python object per block), so a
pool of millions of blocks starts in milliseconds and a restarted
coordinator, `kvshm check` or a stats reader can attach and read it.

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

import os
import struct
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from kvshm.core.errors import SegmentError
from kvshm.core.hashing import hash_fingerprint
from kvshm.core.journal import Journal
from kvshm.core.specs import PoolConfig
from kvshm.core.state import RID_BYTES, SEQ_WORD, SLOT_META_FIELDS
from kvshm.pool.layout import (ARENA_MAGIC, COUNTERS, COUNTERS_OFFSET, COUNTER_FIELDS,
    FORMATS, HEADER_FIELDS, HEADER_FIXED, LAYOUT_VERSION, MAGIC, Layout, config_fingerprint)
from kvshm.pool.shm import SHM_DIR, OwnedMapping, Shm, create_shm, open_shm, unlink_shm

T = TypeVar("T")


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
            fmt = "i" if name.startswith("table") else FORMATS[name]
            view = buf[off:off + size].cast(fmt)
            self._views.append(view)
            setattr(self, name, view)
        self.tables = [getattr(self, f"table{g}") for g in range(len(layout.widths))]
        # The request ids as 8-byte words: the journal copies a slot's id
        # into its log in one slice.
        off, size = layout.offsets["slot_rid"]
        self.slot_rid_words = buf[off:off + size].cast("q")
        self._views.append(self.slot_rid_words)
        # The fixed header as 8-byte words (fields from offset 64 on are
        # words): the writer's hot path stores through this view.
        self.words = buf[:HEADER_FIXED].cast("Q")
        self._views.append(self.words)
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
    def create(cls, config: PoolConfig, name: str | None = None, *,
               reserve: bool = False) -> "PoolSegment":
        """Create and initialise a segment for `config`, its pages allocated
        now with `reserve` (kvshm.pool.shm.reserve_pages: a coordinator's
        pool; an in-process pool touches its pages as it goes, and its 8 MiB
        of reply rings never).

        Raises ShmSpaceError when /dev/shm is too small and SegmentError when
        `name` already exists.
        """
        layout = Layout(config)
        shm = create_shm(name, layout.size, reserve=reserve)
        seg = cls(shm, layout, owner=True)
        seg._initialise()
        return seg

    @classmethod
    def attach(cls, name: str, expect_config: PoolConfig | None = None) -> "PoolSegment":
        """Attach to an existing segment; validates magic, version, and (when
        given) that the segment holds exactly `expect_config`.  Raises
        SegmentError for anything that is not such a pool (open_shm turns
        the OS's refusals into it)."""
        shm = open_shm(name, expected="kvshm pool")
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
        h[:HEADER_FIXED] = bytes(HEADER_FIXED)
        h[HEADER_FIXED:HEADER_FIXED + len(lay.config_json)] = lay.config_json
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
            lambda: COUNTERS.unpack_from(self.header, COUNTERS_OFFSET), timeout)
        return dict(zip(COUNTER_FIELDS, values))

    # -- request slots ---------------------------------------------------------
    def slot_request_id(self, slot: int) -> str:
        n = self.slot_meta[slot * SLOT_META_FIELDS]
        base = slot * RID_BYTES
        return bytes(self.slot_rid[base:base + n]).decode()


def _read_layout(shm: Shm) -> Layout:
    buf = shm.buf
    if len(buf) < HEADER_FIXED or bytes(buf[:8]) != MAGIC:
        raise SegmentError(f"segment {shm.name!r} is not a kvshm pool (bad magic)")
    version = struct.unpack_from("I", buf, HEADER_FIELDS["layout_version"][0])[0]
    if version != LAYOUT_VERSION:
        raise SegmentError(
            f"segment {shm.name!r} has layout version {version}; this kvshm "
            f"reads version {LAYOUT_VERSION}"
        )
    clen = struct.unpack_from("I", buf, HEADER_FIELDS["config_len"][0])[0]
    raw = bytes(buf[HEADER_FIXED:HEADER_FIXED + clen])
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
        if len(buf) < HEADER_FIXED or bytes(buf[:8]) not in (MAGIC, ARENA_MAGIC):
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
    import psutil   # loaded on use: `import kvshm` stays quick without it
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
