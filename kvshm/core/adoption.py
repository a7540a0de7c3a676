"""The in-process indexes of an adopted pool, rebuilt from its segment.

A pool another process wrote (a coordinator that died, once
`core/recovery.py` has repaired it) keeps all its state in the segment; the
adopting process rebuilds what it keeps beside it: the request index and
the managers' per-request block lists (`RequestTable` rows), and the
readiness index (which session writes each pending block).  The block
pool rebuilds its own hash maps (`BlockPool.rebuild`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvshm.core.attention_managers import SingleTypeManager
from kvshm.core.block_pool import BlockPool
from kvshm.core.state import FLAG_PENDING, SegmentState
from kvshm.core.table import RequestTable


def adopt_indexes(segment: SegmentState, pool: BlockPool, table: RequestTable,
                  managers: Sequence[SingleTypeManager]) -> None:
    """Rebuild the request index, the managers' lists and the readiness
    index of an adopted pool."""
    adopt_table(table, managers)
    adopt_pending(segment, pool, table, managers)


def adopt_table(table: RequestTable, managers: Sequence[SingleTypeManager]) -> None:
    """Rebuild the request index and per-group lists from the segment."""
    table.adopt()
    for rid, slot in table.slot_of.items():
        for g, m in enumerate(managers):
            blocks, cached = table.read_row(slot, g)
            if blocks is not None:
                m.req_to_blocks[rid] = blocks
            if cached >= 0:
                m.num_cached_block[rid] = cached


def adopt_pending(segment: SegmentState, pool: BlockPool, table: RequestTable,
                  managers: Sequence[SingleTypeManager]) -> None:
    """Rebuild the readiness index from the segment: a pending block's
    writer is the request in its `writer` slot, which holds it in the
    cached part of its row (core/state.py), and the writer's session is
    that request's.  A pending block whose writer does not hold it so (its
    writer's frame was cut off) is uncached, in block order."""
    rid_of = {slot: rid for rid, slot in table.slot_of.items()}
    orphans = []
    found: dict[tuple[int, str], list[int]] = {}
    flags = segment.flags
    for b in range(segment.config.num_blocks):
        if not flags[b] & FLAG_PENDING:
            continue
        slot, g = segment.writer[b], segment.hash_group[b]
        rid = rid_of.get(slot)
        i = -1
        if rid is not None and g < len(managers):
            m = managers[g]
            cached = m.req_to_blocks.get(rid, [])[:m.num_cached_block.get(rid, 0)]
            i = cached.index(b) if b in cached else -1
        if i < 0:
            orphans.append(b)
            continue
        pool.pending[b] = table.owner(slot)
        found.setdefault((g, rid), []).append(i)
    for (g, rid), idx in found.items():
        managers[g].pending_of[rid] = sorted(idx)
    for b in orphans:
        pool.drop_pending(b)
