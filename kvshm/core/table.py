"""The request table: each live request's block ids per group, in the segment.

The managers keep Python lists as their working copy and write every change
through to the request's slot, so the segment alone describes who holds which
block (for `kvshm check`, stats readers and a restarted coordinator).  The
table is authoritative: every write journals what it overwrites first
(kvshm/core/journal.py).
"""

from __future__ import annotations

from array import array

from kvshm.core.errors import InvalidArgument, RequestTableFull
from kvshm.core.state import NUM_REQUESTS_WORD, RID_BYTES, SLOT_META_FIELDS, SegmentState

NO_ENTRY = -1
# A released slot's metadata (rid_len, owner, in_use, reserved).
_EMPTY_META = array("i", bytes(4 * SLOT_META_FIELDS))


class RequestTable:
    """Slot assignment and write-through of per-group block lists."""

    def __init__(self, segment: SegmentState) -> None:
        cfg = segment.config
        self.segment = segment
        self.capacity = cfg.max_num_seqs
        self.num_groups = len(cfg.groups)
        self.widths = segment.layout.widths
        self._meta = segment.slot_meta
        self._rid = segment.slot_rid
        self._counts = segment.slot_counts
        self._tables = segment.tables
        self._words = segment.words
        self._journal = segment.journal
        self.slot_of: dict[str, int] = {}
        self._free_slots = list(range(self.capacity - 1, -1, -1))

    def __len__(self) -> int:
        """Live requests (those holding a slot)."""
        return len(self.slot_of)

    def check_room(self, request_id: str) -> None:
        """Raise RequestTableFull / InvalidArgument if `request_id` could not
        get a slot."""
        if request_id in self.slot_of:
            return
        if not self._free_slots:
            raise RequestTableFull(self.capacity)
        if len(request_id.encode()) > RID_BYTES:
            raise InvalidArgument(
                f"request id is {len(request_id.encode())} bytes long, at most {RID_BYTES}"
            )

    def slot(self, request_id: str) -> int:
        """The request's slot, assigned on first use."""
        slot = self.slot_of.get(request_id)
        if slot is None:
            self.check_room(request_id)
            slot = self._free_slots.pop()
            self._journal.slot_meta(slot)
            self.slot_of[request_id] = slot
            raw = request_id.encode()
            base = slot * SLOT_META_FIELDS
            self._meta[base] = len(raw)
            self._meta[base + 1] = 0
            self._meta[base + 2] = 1
            self._rid[slot * RID_BYTES:slot * RID_BYTES + len(raw)] = raw
            self._words[NUM_REQUESTS_WORD] = len(self.slot_of)
        return slot

    def set_owner(self, request_id: str, owner: int) -> None:
        """Record `owner` (a session id) in the request's slot, if it has one."""
        slot = self.slot_of.get(request_id)
        if slot is not None and self._meta[slot * SLOT_META_FIELDS + 1] != owner:
            self._journal.slot_meta(slot)
            self._meta[slot * SLOT_META_FIELDS + 1] = owner

    def owner(self, slot: int) -> int:
        return self._meta[slot * SLOT_META_FIELDS + 1]

    def release(self, request_id: str) -> None:
        """Give the slot back once the request holds no entry in any group."""
        slot = self.slot_of.pop(request_id, None)
        if slot is None:
            return
        journal = self._journal
        journal.slot_meta(slot)
        base = slot * SLOT_META_FIELDS
        self._meta[base:base + SLOT_META_FIELDS] = _EMPTY_META
        c = self._counts
        for g in range(self.num_groups):   # (the managers' free dropped them, as a rule)
            base = (slot * self.num_groups + g) * 2
            if c[base] != NO_ENTRY or c[base + 1] != NO_ENTRY:
                journal.row(slot, g)
                c[base] = c[base + 1] = NO_ENTRY
        self._free_slots.append(slot)
        self._words[NUM_REQUESTS_WORD] = len(self.slot_of)

    # -- per-group rows ------------------------------------------------------
    def write_blocks(self, request_id: str, group: int, start: int, ids: list[int]) -> None:
        """Row `group` of the request becomes its first `start` ids + `ids`."""
        slot = self.slot(request_id)
        w = self.widths[group]
        end = start + len(ids)
        assert end <= w, "row capacity is checked before mutating"
        journal = self._journal
        journal.row(slot, group)
        if ids:
            journal.ids(slot, group, start)
            base = slot * w
            self._tables[group][base + start:base + end] = array("i", ids)
        self._counts[(slot * self.num_groups + group) * 2] = end

    def write_null(self, request_id: str, group: int, index: int) -> None:
        slot = self.slot_of[request_id]
        self._journal.ids(slot, group, index)
        self._tables[group][slot * self.widths[group] + index] = 0

    def write_num_cached(self, request_id: str, group: int, n: int) -> None:
        slot = self.slot(request_id)
        self._journal.row(slot, group)
        self._counts[(slot * self.num_groups + group) * 2 + 1] = n

    def drop(self, request_id: str, group: int) -> None:
        slot = self.slot_of.get(request_id)
        if slot is not None:
            self._journal.row(slot, group)
            base = (slot * self.num_groups + group) * 2
            self._counts[base] = NO_ENTRY
            self._counts[base + 1] = NO_ENTRY

    # -- reading (check, stats, rebuild) -------------------------------------
    def adopt(self) -> None:
        """Rebuild the request-id index and free slots from the segment."""
        self.slot_of.clear()
        self._free_slots.clear()
        for slot in range(self.capacity - 1, -1, -1):
            if self._meta[slot * SLOT_META_FIELDS + 2]:
                self.slot_of[self.segment.slot_request_id(slot)] = slot
            else:
                self._free_slots.append(slot)

    def read_row(self, slot: int, group: int) -> tuple[list[int] | None, int]:
        """(block ids or None if no entry, num cached or -1)."""
        base = (slot * self.num_groups + group) * 2
        n, cached = self._counts[base], self._counts[base + 1]
        if n == NO_ENTRY:
            return None, cached
        w = self.widths[group]
        return list(self._tables[group][slot * w:slot * w + n]), cached
