"""Invariant checker for a pool segment (`kvshm check`).

Works from the segment alone, so any process can check a live pool: it
copies the arrays between two reads of the mutation counter (retrying a torn
copy) and verifies them.  Given the owning `BlockPool` too, it also checks
the in-memory hash index against the segment.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from kvshm.core import fmt
from kvshm.core.hashing import HASH_SLOT_BYTES
from kvshm.core.state import (FLAG_CACHED, FLAG_NULL, FLAG_PARTIAL, FLAG_PENDING, FLAG_SINK,
    RID_BYTES, SLOT_META_FIELDS, SegmentState)
from kvshm.core.table import NO_ENTRY

MAX_PROBLEMS = 50


@dataclass
class CheckReport:
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    num_requests: int = 0
    num_partial_entries: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.problems

    def add(self, problem: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(problem)
        elif len(self.problems) == MAX_PROBLEMS:
            self.problems.append("... (more problems not listed)")

    def summary(self) -> str:
        head = (f"{fmt.count(self.num_blocks)} blocks, {fmt.count(self.num_free_blocks)} "
                f"free, {fmt.count(self.num_cached_blocks)} cached, "
                f"{fmt.count(self.num_requests)} requests")
        if self.num_partial_entries:
            head += f", {fmt.count(self.num_partial_entries)} partial entries"
        if self.clean:
            return f"clean: {head}"
        return f"BROKEN ({len(self.problems)} problems): {head}\n" + "\n".join(
            f"  - {p}" for p in self.problems)


class _Snapshot:
    """Private copies of the segment's arrays, taken between two equal, even
    reads of the mutation counter."""

    NAMES = ("ref_cnt", "next_delta", "prev_delta", "free_stamp", "cache_stamp",
             "hash_group", "flags", "writer", "hashes", "partial_hashes", "partial_tokens",
             "slot_meta", "slot_rid", "slot_counts")

    def __init__(self, seg: SegmentState, timeout: float) -> None:
        # A copy still torn after `timeout` s (a writer died mid-mutation, or
        # is very busy) is checked as it is.
        _, consistent = seg.read_consistent(lambda: self._copy(seg), timeout,
                                            pause=0.001, torn_ok=True)
        self.torn = not consistent

    def _copy(self, seg: SegmentState) -> None:
        for name in self.NAMES:
            view = getattr(seg, name)
            copy = array(view.format)
            copy.frombytes(view.cast("B"))
            setattr(self, name, copy)
        self.tables = []
        for t in seg.tables:
            copy = array("i")
            copy.frombytes(t.cast("B"))
            self.tables.append(copy)
        self.counters = {f: seg.get(f) for f in ("num_free_blocks", "num_requests")}


def check_segment(seg: SegmentState, pool=None, timeout: float = 2.0) -> CheckReport:
    """Verify every invariant of the pool in `seg`; with `pool` (the owning
    BlockPool), also its hash index.  A copy torn by concurrent mutations is
    retried for up to `timeout` seconds, then checked as it is (and reported
    as possibly torn)."""
    cfg = seg.config
    n = cfg.num_blocks
    snap = _Snapshot(seg, timeout)
    rep = CheckReport(num_blocks=n)
    if snap.torn:
        rep.add("a mutation is in progress or was interrupted (odd mutation counter)")
    flags, ref = snap.flags, snap.ref_cnt
    header_free = snap.counters["num_free_blocks"]
    rep.num_free_blocks = header_free

    # -- free queue ---------------------------------------------------------------
    s = n
    nxt, prv, stamp = snap.next_delta, snap.prev_delta, snap.free_stamp
    in_free = bytearray(n)
    length = 0
    cur = s
    last_key = None
    while True:
        nb = cur + nxt[cur]
        if not 0 <= nb <= n:
            rep.add(f"free queue: block {cur} links to {nb}, outside [0, {n}]")
            break
        if nb + prv[nb] != cur:
            rep.add(f"free queue: next of {cur} is {nb}, but prev of {nb} is {nb + prv[nb]}")
        if nb == s:
            break
        if in_free[nb]:
            rep.add(f"free queue: block {nb} appears twice (cycle)")
            break
        in_free[nb] = 1
        length += 1
        key = (stamp[nb], nb)
        if last_key is not None and key <= last_key:
            rep.add(f"free queue: block {nb} (stamp {stamp[nb]}) is out of LRU order")
        last_key = key
        cur = nb
        if length > n:
            rep.add("free queue: longer than the pool")
            break
    if length != header_free:
        rep.add(f"free queue holds {length} blocks, the header says {header_free}")

    # -- references from the request table ------------------------------------------
    num_groups = len(cfg.groups)
    widths = seg.layout.widths
    counted = [0] * n
    owner_group = [-1] * n  # a block holds one group's KV: it is in one group only
    # A pending block is held by requests of its writer's session only.
    pending_owner: dict[int, int] = {}
    # Pending blocks their writer (the request in their `writer` slot) holds
    # in the cached part of its row, as it must (core/state.py).
    written: set[int] = set()
    in_use = 0
    for slot in range(cfg.max_num_seqs):
        meta = snap.slot_meta[slot * SLOT_META_FIELDS:(slot + 1) * SLOT_META_FIELDS]
        rows = [(snap.slot_counts[(slot * num_groups + g) * 2],
                 snap.slot_counts[(slot * num_groups + g) * 2 + 1]) for g in range(num_groups)]
        if not meta[2]:
            if any(c != NO_ENTRY or k != NO_ENTRY for c, k in rows):
                rep.add(f"slot {slot} is free but has block rows")
            continue
        in_use += 1
        rid_len = meta[0]
        if not 0 < rid_len <= RID_BYTES:
            rep.add(f"slot {slot}: request id length {rid_len} out of range")
        for g, (count, num_cached) in enumerate(rows):
            if count == NO_ENTRY:
                continue
            if not 0 <= count <= widths[g]:
                rep.add(f"slot {slot} group {g}: {count} blocks, row holds {widths[g]}")
                continue
            base = slot * widths[g]
            for i, b in enumerate(snap.tables[g][base:base + count]):
                if not 0 <= b < n:
                    rep.add(f"slot {slot} group {g}: block id {b} out of range")
                elif b:
                    counted[b] += 1
                    if flags[b] & FLAG_PENDING:
                        if pending_owner.setdefault(b, meta[1]) != meta[1]:
                            rep.add(f"pending block {b} is held by sessions {pending_owner[b]} "
                                    f"and {meta[1]}: only its writer's session may hold it")
                        if snap.writer[b] == slot and i < num_cached:
                            written.add(b)
                    if owner_group[b] == -1:
                        owner_group[b] = g
                    elif owner_group[b] != g:
                        rep.add(f"block {b} is held in group {owner_group[b]} and group {g}")
                        owner_group[b] = g
    rep.num_requests = in_use
    if snap.counters.get("num_requests", in_use) != in_use:
        rep.add(f"{in_use} request slots in use, the header says "
                f"{snap.counters['num_requests']}")

    # -- per block ------------------------------------------------------------------
    num_sink = 0
    cached = partial = 0
    partial_groups = cfg.partial_entry_groups
    for b in range(n):
        f = flags[b]
        if f & FLAG_NULL:
            if b != 0:
                rep.add(f"block {b} is marked null; only block 0 is")
            if in_free[b] or counted[b]:
                rep.add("the null block is free or held by a request table row")
            continue
        if b == 0:
            rep.add("block 0 is not marked as the null block")
        if f & FLAG_SINK:
            num_sink += 1
            if in_free[b] or counted[b] or ref[b]:
                rep.add(f"sink block {b} is free, referenced, or held by a request")
            if f & (FLAG_CACHED | FLAG_PARTIAL):
                rep.add(f"sink block {b} is cached")
            continue
        if ref[b] != counted[b]:
            rep.add(f"block {b}: ref count {ref[b]}, but {counted[b]} request-table "
                    "references")
        if ref[b] < 0:
            rep.add(f"block {b}: negative ref count {ref[b]}")
        if in_free[b] and ref[b]:
            rep.add(f"block {b} is both free and referenced (ref count {ref[b]})")
        if not in_free[b] and ref[b] == 0:
            rep.add(f"block {b} has ref count 0 but is not in the free queue (leaked)")
        if f & FLAG_PENDING:
            if not f & FLAG_CACHED:
                rep.add(f"block {b} is marked pending but not cached")
            if not counted[b]:
                rep.add(f"pending block {b} is held by no request (its K/V will never be "
                        "written: it must be uncached)")
            elif b not in written:
                rep.add(f"pending block {b}: its writer (request slot {snap.writer[b]}) does "
                        "not hold it in the cached part of its row")
        if f & FLAG_CACHED:
            cached += 1
            if snap.hash_group[b] >= num_groups:
                rep.add(f"block {b} is cached for group {snap.hash_group[b]} (no such group)")
            if snap.cache_stamp[b] <= 0:
                rep.add(f"block {b} is cached without a cache stamp")
        if f & FLAG_PARTIAL:
            partial += 1
            _check_partial(b, f, snap, cfg, partial_groups, rep)
    rep.num_cached_blocks = cached
    rep.num_partial_entries = partial
    if num_sink != cfg.num_sink_blocks:
        rep.add(f"{num_sink} sink blocks, the config reserves {cfg.num_sink_blocks}")

    if pool is not None:
        _check_index(pool, snap, rep)
    return rep


def _check_partial(b: int, f: int, snap: _Snapshot, cfg, partial_groups: tuple[int, ...],
                   rep: CheckReport) -> None:
    """A partial entry (kvshm/core/block_pool.py): of a group that takes
    them (`partial_groups`), for a prefix a whole number of hash blocks
    long; alone, with a cache stamp."""
    g = snap.hash_group[b]
    if g not in partial_groups:
        rep.add(f"block {b} has a partial entry for group {g}, which takes none")
        return
    t = snap.partial_tokens[b]
    if t <= 0 or t % cfg.hash_block_size or not t % cfg.effective_block_size(g):
        rep.add(f"block {b}: its partial entry covers {t} tokens, not a prefix ending "
                f"inside a block on a hash block boundary")
    if not f & FLAG_CACHED and snap.cache_stamp[b] <= 0:
        rep.add(f"block {b} has a partial entry without a cache stamp")


def _check_index(pool, snap: _Snapshot, rep: CheckReport) -> None:
    """The owner's hash -> block index agrees with the segment both ways."""
    dsz = pool.digest_size
    seen = 0
    for g in range(len(pool.segment.config.groups)):
        for key, blocks in pool.hash_to_block(g).entries():
            partial_key = False
            for b in blocks:
                seen += 1
                off = b * HASH_SLOT_BYTES
                f = snap.flags[b]
                if (f & FLAG_PARTIAL and bytes(snap.partial_hashes[off:off + dsz]) == key
                        and snap.hash_group[b] == g):
                    partial_key = True
                elif not f & FLAG_CACHED:
                    rep.add(f"index: hash {key.hex()[:12]} (group {g}) maps to block {b}, "
                            "which is not cached (stale entry)")
                elif bytes(snap.hashes[off:off + dsz]) != key or snap.hash_group[b] != g:
                    rep.add(f"index: hash {key.hex()[:12]} (group {g}) maps to block {b}, "
                            "which is cached under another hash or group")
            # (a partial key's blocks may come in any order: no lookup asks for it)
            if len(blocks) > 1 and not partial_key:
                stamps = [snap.cache_stamp[b] for b in blocks]
                if stamps != sorted(stamps):
                    rep.add(f"index: blocks under hash {key.hex()[:12]} are not in "
                            "caching order")
    entries = rep.num_cached_blocks + rep.num_partial_entries
    if seen != entries:
        rep.add(f"index holds {seen} entries, the segment {entries} (cached blocks and "
                "partial entries)")
    marked = {b for b in range(len(snap.flags)) if snap.flags[b] & FLAG_PENDING}
    if marked != set(pool.pending):
        rep.add(f"readiness index: {len(set(pool.pending) - marked)} blocks pending in the "
                f"index only, {len(marked - set(pool.pending))} in the segment only")
