"""The undo log of the open frame, kept in the pool segment.

A frame is the unit a restarted coordinator either keeps whole or rolls
back whole: one core op in embedded mode, one protocol frame (an op or a
batch, and its session record) in the coordinator.  While a frame is open,
every write to an *authoritative* array (the request table's rows and slot
metadata, the lookup counters, session records) first saves what it
overwrites here; the header's `undo_len` covers an entry only once it is
complete, and `commit()` empties the log in one store.  Derived state (ref
counts, the free queue, the free count) is not journaled: repair rebuilds it
from the authoritative arrays (kvshm/core/recovery.py).  A block cached
during the frame is recognised by its cache stamp (>= `frame_cache_stamp`),
so caching needs no entries either.

Each entry is saved at most once per frame (the first touch of a row, slot,
or counter), so one frame never needs more than `frame_bound()` words (state.py, which
also holds the entry kinds and sizes below).

Entries (int64 words):

    FRAME    kind                                      first of every frame that
                                                       journals anything (undo_len > 0)
    ROW      kind, slot, group, count, num_cached      a row's counts
    PREFIX   kind, slot, group, n, id_0 ... id_n-1     a row's first n ids
    META     kind, slot, meta[4], rid bytes as 8 words a slot's metadata
    STATS    kind, queries, hits, query tokens, hit tokens
    SESSION  kind, session slot, last applied seq
"""

from __future__ import annotations

from array import array

from kvshm.core.state import (FRAME, FRAME_CACHE_STAMP_WORD, META, META_WORDS, PREFIX,
    RID_BYTES, ROW, ROW_WORDS, SESSION, SESSION_ENTRY_WORDS, SLOT_META_FIELDS, STATS,
    STATS_WORDS, UNDO_LEN_WORD)

_RID_WORDS = RID_BYTES // 8
# A META entry is stored field by field (slot_meta): it has four.
assert SLOT_META_FIELDS == 4 and META_WORDS == 2 + SLOT_META_FIELDS + _RID_WORDS


class Journal:
    """Appends undo entries for the open frame of one segment."""

    def __init__(self, seg) -> None:
        self._log = seg.undo
        self._words = seg.words
        self._len_word = UNDO_LEN_WORD
        self._stamp_word = FRAME_CACHE_STAMP_WORD
        self._counts = seg.slot_counts
        self._tables = seg.tables
        self._meta = seg.slot_meta
        self._rid_words = seg.slot_rid_words
        self._num_groups = len(seg.config.groups)
        self._widths = seg.layout.widths
        self.n = 0
        self.open = False
        self._stamp = 0
        self._rows: dict[int, int] = {}   # row key -> its count at the frame's start
        self._saved: set[int] = set()     # rows whose original ids are saved
        self._slots: set[int] = set()     # slots whose metadata is saved
        self._stats = False

    # -- frames --------------------------------------------------------------
    def begin(self, next_cache_stamp: int) -> None:
        """Open a frame; blocks cached from now on get stamps >= `next_cache_stamp`.
        Nothing is written until the frame journals its first entry (a frame
        that journals nothing changes nothing repair would need to undo)."""
        self.open = True
        if self._rows:
            self._rows.clear()
            self._saved.clear()
        if self._slots:
            self._slots.clear()
        self._stats = False
        self._stamp = next_cache_stamp

    def commit(self) -> None:
        """Close the frame: from here on its effects stand (the one store
        that commits it)."""
        if self.n:
            self._words[self._len_word] = 0
            self.n = 0
        self.open = False

    def _start(self) -> int:
        """Where the next entry goes (the log's word index): the frame's
        first entry first marks the frame open in the segment."""
        n = self.n
        if not n:
            self._words[self._stamp_word] = self._stamp
            self._log[0] = FRAME
            n = 1
        return n

    def _close(self, m: int) -> None:
        """The entry ending before word `m` is complete: it counts from here on."""
        assert m <= len(self._log), "frame_bound() sizes the log for any frame"
        self.n = m
        self._words[self._len_word] = m

    def _append(self, entry) -> None:
        """Append `entry` (an array of words) as one slice copy."""
        n = self._start()
        m = n + len(entry)
        self._log[n:m] = entry
        self._close(m)

    # -- entries (no-ops outside a frame) ------------------------------------------
    def row(self, slot: int, group: int) -> None:
        """Row (slot, group)'s counts are about to change."""
        if not self.open:
            return
        key = slot * self._num_groups + group
        if key in self._rows:
            return
        c = self._counts
        count = c[key * 2]
        self._rows[key] = count
        # The frequent entries (ROW, STATS, SESSION) are stored word by word
        # into the log: no array is made per entry.
        n = self._start()
        log = self._log
        log[n] = ROW
        log[n + 1] = slot
        log[n + 2] = group
        log[n + 3] = count
        log[n + 4] = c[key * 2 + 1]
        self._close(n + ROW_WORDS)

    def ids(self, slot: int, group: int, index: int) -> None:
        """Row (slot, group)'s ids from `index` on are about to change."""
        if not self.open:
            return
        key = slot * self._num_groups + group
        if key not in self._rows:
            self.row(slot, group)
        n = self._rows[key]
        if index >= n or key in self._saved:
            return  # beyond the frame's original ids, or already saved
        self._saved.add(key)
        w = self._widths[group]
        entry = array("q", (PREFIX, slot, group, n))
        entry.extend(self._tables[group][slot * w:slot * w + n])
        self._append(entry)

    def slot_meta(self, slot: int) -> None:
        """Slot `slot`'s metadata (and request id) are about to change."""
        if not self.open or slot in self._slots:
            return
        self._slots.add(slot)
        n = self._start()
        log = self._log
        meta = self._meta
        k = slot * SLOT_META_FIELDS
        log[n] = META
        log[n + 1] = slot
        log[n + 2] = meta[k]
        log[n + 3] = meta[k + 1]
        log[n + 4] = meta[k + 2]
        log[n + 5] = meta[k + 3]
        w = slot * _RID_WORDS
        log[n + 6:n + META_WORDS] = self._rid_words[w:w + _RID_WORDS]
        self._close(n + META_WORDS)

    def stats(self, values) -> None:
        """The lookup counters (currently `values`) are about to change."""
        if not self.open or self._stats:
            return
        self._stats = True
        n = self._start()
        log = self._log
        log[n] = STATS
        log[n + 1], log[n + 2], log[n + 3], log[n + 4] = values
        self._close(n + STATS_WORDS)

    def session(self, slot: int, last_seq: int) -> None:
        """Session record `slot`'s last applied seq (now `last_seq`) is about
        to change."""
        if self.open:
            n = self._start()
            log = self._log
            log[n] = SESSION
            log[n + 1] = slot
            log[n + 2] = last_seq
            self._close(n + SESSION_ENTRY_WORDS)
