"""Repair of a pool segment whose writer died mid-frame (docs/recovery.md).

The request table (rows, counts, slot metadata), the cache marks (flags,
hashes, groups, stamps), the free stamps, the lookup counters and the
session records are authoritative.  Everything else is derived and rebuilt
here: ref counts (references from the table), the free queue (unreferenced
blocks in (free stamp, id) order, which is the LRU order), the free count
and the request count.  A cut-off frame is rolled back from the undo log
(kvshm/core/journal.py) and the blocks it cached are uncached (they may
hold K/V that was never written), so the pool is exactly as the last
committed frame left it, less some cache entries the cut-off frame evicted
(losing a cache entry is always safe: it only costs a future hit).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from kvshm.core.errors import SegmentError
from kvshm.core.state import (FLAG_CACHED, FLAG_NULL, FLAG_PARTIAL, FLAG_SINK, FRAME,
    FRAME_CACHE_STAMP_WORD, FREE_WORD, META, META_WORDS, NUM_REQUESTS_WORD, PREFIX,
    PREFIX_HEAD, RID_BYTES, ROW, ROW_WORDS, SEQ_WORD, SESSION, SESSION_ENTRY_WORDS,
    SESSION_LAST_SEQ, SESSION_SLOTS, SESSION_WORDS, SLOT_META_FIELDS, STATS, STATS_WORD,
    STATS_WORDS, UNDO_LEN_WORD, SegmentState)
from kvshm.core.table import NO_ENTRY


@dataclass
class RepairReport:
    """What `repair` found and did."""

    torn: bool = False              # a frame or a mutation was cut off
    undo_entries: int = 0           # entries rolled back
    uncached: int = 0               # blocks the cut-off frame had cached
    ref_counts_fixed: int = 0
    free_queue_rebuilt: bool = False
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if not self.torn:
            return "the last frame was committed: nothing to repair"
        return (f"a frame was cut off: rolled back {self.undo_entries} undo entries, "
                f"uncached {self.uncached} blocks it had cached, fixed "
                f"{self.ref_counts_fixed} ref counts, rebuilt the free queue")


def needs_repair(seg: SegmentState) -> bool:
    """Whether the segment's last writer died inside a frame or a mutation."""
    words = seg.words
    return bool(words[SEQ_WORD] & 1 or words[UNDO_LEN_WORD])


def repair(seg: SegmentState) -> RepairReport:
    """Roll back a cut-off frame and rebuild the derived arrays, in place.
    Only the process that now owns the pool may call this (no other writer
    may be running).  Raises SegmentError if the undo log is unreadable."""
    rep = RepairReport()
    if not needs_repair(seg):
        return rep
    rep.torn = True
    words = seg.words
    words[SEQ_WORD] |= 1   # readers: a mutation is in progress
    entries = _parse_undo(seg, words[UNDO_LEN_WORD])
    for kind, off, size in reversed(entries):
        _undo(seg, kind, off, size)
    rep.undo_entries = sum(1 for e in entries if e[0] != FRAME)
    if words[UNDO_LEN_WORD]:
        rep.uncached = _uncache_since(seg, words[FRAME_CACHE_STAMP_WORD])
    rep.ref_counts_fixed = _rebuild_ref_counts(seg)
    _rebuild_free_queue(seg)
    rep.free_queue_rebuilt = True
    meta = seg.slot_meta
    words[NUM_REQUESTS_WORD] = sum(1 for s in range(seg.config.max_num_seqs)
                                   if meta[s * SLOT_META_FIELDS + 2])
    words[UNDO_LEN_WORD] = 0
    words[SEQ_WORD] += 1
    return rep


# -- the undo log --------------------------------------------------------------------
def _entry_size(seg: SegmentState, log, off: int, end: int) -> int:
    kind = log[off]
    if kind == FRAME:
        return 1
    if kind == ROW:
        return ROW_WORDS
    if kind == PREFIX:
        n = log[off + 3] if off + 3 < end else -1
        if n < 0:
            raise SegmentError(f"segment {seg.name!r}: undo log entry at word {off} is cut "
                               "short or holds a negative id count")
        return PREFIX_HEAD + n
    if kind == META:
        return META_WORDS
    if kind == STATS:
        return STATS_WORDS
    if kind == SESSION:
        return SESSION_ENTRY_WORDS
    raise SegmentError(f"segment {seg.name!r}: undo log entry of unknown kind {kind} "
                       f"at word {off}")


def _parse_undo(seg: SegmentState, length: int) -> list[tuple[int, int, int]]:
    log = seg.undo
    if not 0 <= length <= len(log):
        raise SegmentError(f"segment {seg.name!r}: undo log length {length} is outside "
                           f"[0, {len(log)}]")
    out = []
    off = 0
    while off < length:
        size = _entry_size(seg, log, off, length)
        if off + size > length:
            raise SegmentError(f"segment {seg.name!r}: undo log entry at word {off} runs "
                               "past the log's end")
        _validate(seg, log, off)
        out.append((log[off], off, size))
        off += size
    return out


def _validate(seg: SegmentState, log, off: int) -> None:
    cfg = seg.config
    kind = log[off]
    bad = None
    if kind in (ROW, PREFIX, META):
        slot = log[off + 1]
        if not 0 <= slot < cfg.max_num_seqs:
            bad = f"slot {slot}"
        elif kind != META and not 0 <= log[off + 2] < len(cfg.groups):
            bad = f"group {log[off + 2]}"
        elif kind == PREFIX and not 0 <= log[off + 3] <= seg.layout.widths[log[off + 2]]:
            bad = f"{log[off + 3]} ids"
    elif kind == SESSION and not 0 <= log[off + 1] < SESSION_SLOTS:
        bad = f"session slot {log[off + 1]}"
    if bad is not None:
        raise SegmentError(f"segment {seg.name!r}: undo log entry at word {off} names "
                           f"{bad}, out of range")


def _undo(seg: SegmentState, kind: int, off: int, size: int) -> None:
    log = seg.undo
    ngroups = len(seg.config.groups)
    if kind == ROW:
        slot, g, count, cached = log[off + 1:off + 5]
        base = (slot * ngroups + g) * 2
        seg.slot_counts[base] = count
        seg.slot_counts[base + 1] = cached
    elif kind == PREFIX:
        slot, g, n = log[off + 1:off + 4]
        w = seg.layout.widths[g]
        seg.tables[g][slot * w:slot * w + n] = array("i", log[off + 4:off + 4 + n])
    elif kind == META:
        slot = log[off + 1]
        k = SLOT_META_FIELDS
        seg.slot_meta[slot * k:(slot + 1) * k] = array("i", log[off + 2:off + 2 + k])
        rid = array("q", log[off + 2 + k:off + size]).tobytes()
        seg.slot_rid[slot * RID_BYTES:(slot + 1) * RID_BYTES] = rid
    elif kind == STATS:
        seg.words[STATS_WORD:STATS_WORD + 4] = array("Q", log[off + 1:off + 5])
    elif kind == SESSION:
        seg.sessions[log[off + 1] * SESSION_WORDS + SESSION_LAST_SEQ] = log[off + 2]


# -- derived state ---------------------------------------------------------------------
def _uncache_since(seg: SegmentState, stamp: int) -> int:
    flags, stamps = seg.flags, seg.cache_stamp
    n = 0
    for b in range(seg.config.num_blocks):
        # (a partial entry carries its block's stamp: block_pool.py)
        if flags[b] & (FLAG_CACHED | FLAG_PARTIAL) and stamps[b] >= stamp:
            flags[b] = 0
            n += 1
    return n


def table_references(seg: SegmentState) -> list[int]:
    """Per block, how many request-table entries hold it."""
    cfg = seg.config
    ngroups = len(cfg.groups)
    widths = seg.layout.widths
    counted = [0] * cfg.num_blocks
    meta, counts = seg.slot_meta, seg.slot_counts
    for slot in range(cfg.max_num_seqs):
        if not meta[slot * SLOT_META_FIELDS + 2]:
            continue
        for g in range(ngroups):
            n = counts[(slot * ngroups + g) * 2]
            if n == NO_ENTRY or not 0 <= n <= widths[g]:
                continue
            base = slot * widths[g]
            for b in seg.tables[g][base:base + n]:
                if 0 < b < cfg.num_blocks:
                    counted[b] += 1
    return counted


def _rebuild_ref_counts(seg: SegmentState) -> int:
    counted = table_references(seg)
    ref, flags = seg.ref_cnt, seg.flags
    fixed = 0
    for b, c in enumerate(counted):
        if flags[b] & (FLAG_NULL | FLAG_SINK):
            c = 0
        if ref[b] != c:
            ref[b] = c
            fixed += 1
    return fixed


def _rebuild_free_queue(seg: SegmentState) -> None:
    n = seg.config.num_blocks
    ref, flags, stamp = seg.ref_cnt, seg.flags, seg.free_stamp
    free = [b for b in range(n) if not ref[b] and not flags[b] & (FLAG_NULL | FLAG_SINK)]
    free.sort(key=stamp.__getitem__)   # stable: ties stay in id order
    nxt, prv = seg.next_delta, seg.prev_delta
    last = n  # the sentinel
    for b in free:
        nxt[last] = b - last
        prv[b] = last - b
        last = b
    nxt[last] = n - last
    prv[n] = last - n
    seg.words[FREE_WORD] = len(free)
