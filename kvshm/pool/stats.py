"""Pool statistics read straight from a segment (no socket, any process)."""

from __future__ import annotations

import time
from collections import defaultdict

from kvshm.core.metrics import read_metrics
from kvshm.core.state import FLAG_CACHED, FLAG_PARTIAL, FLAG_PENDING, SLOT_META_FIELDS
from kvshm.core.table import NO_ENTRY
from kvshm.pool.layout import COUNTER_FIELDS
from kvshm.pool.segment import PoolSegment, segment_info

_CHURN_FIELDS = ("blocks_allocated", "blocks_evicted")
# The flags a cached block may have beside FLAG_CACHED (the segment's flags are
# counted with bytes.count, fast at a million blocks).
_CACHED_WITH = (0, FLAG_PENDING, FLAG_PARTIAL, FLAG_PENDING | FLAG_PARTIAL)


def read_stats(seg: PoolSegment, timeout: float = 1.0) -> dict:
    """Blocks total/free/cached/used, usage, requests and blocks per owning
    session, prefix-cache lookups and hits, blocks allocated and evicted
    since the pool was created, coordinator pid, liveness,
    uptime (None when the coordinator is not alive), preemptions, KV events
    published and dropped, and per tenant its blocks, quota and hits
    (kvshm/core/metrics.py).  Retries until it
    copies a state no mutation overlapped; after `timeout` seconds it
    reports what it saw, with "consistent": False."""
    cfg = seg.config
    groups = len(cfg.groups)
    widths = seg.layout.widths

    def read():
        counters = {f: seg.get(f) for f in COUNTER_FIELDS + _CHURN_FIELDS}
        flags = bytes(seg.flags)
        cached = sum(flags.count(FLAG_CACHED | extra) for extra in _CACHED_WITH)
        sessions: dict[int, dict] = defaultdict(lambda: {"requests": 0, "blocks": 0})
        meta, counts = seg.slot_meta, seg.slot_counts
        for slot in range(cfg.max_num_seqs):
            base = slot * SLOT_META_FIELDS
            if not meta[base + 2]:
                continue
            row = sessions[meta[base + 1]]
            row["requests"] += 1
            for g in range(groups):
                n = counts[(slot * groups + g) * 2]
                if n != NO_ENTRY:
                    base = slot * widths[g]
                    row["blocks"] += sum(1 for b in seg.tables[g][base:base + n] if b)
        return counters, cached, sessions

    (counters, cached, sessions), consistent = seg.read_consistent(read, timeout,
                                                                   torn_ok=True)
    metrics = read_metrics(seg.metrics)
    n = cfg.num_blocks
    free = counters["num_free_blocks"]
    info = segment_info(seg.name) or {"pid": seg.get("coordinator_pid"), "alive": False}
    return {
        "name": seg.name,
        "num_blocks": n,
        "num_free_blocks": free,
        "num_cached_blocks": cached,
        "num_used_blocks": n - 1 - free,
        "usage": 1.0 - free / (n - 1),
        "num_requests": counters["num_requests"],
        "queries": counters["queries"],
        "hits": counters["hits"],
        "query_tokens": counters["query_tokens"],
        "hit_tokens": counters["hit_tokens"],
        "blocks_allocated": counters["blocks_allocated"],
        "blocks_evicted": counters["blocks_evicted"],
        "coordinator_pid": info["pid"],
        "coordinator_alive": info["alive"],
        # A dead coordinator has no uptime: the clock would tick on regardless.
        "uptime_s": (time.time_ns() - seg.get("started_ns")) / 1e9 if info["alive"] else None,
        "generation": seg.get("generation"),   # = coordinator restarts (adoptions)
        "preemptions": metrics["preemptions"],
        "quota_refusals": metrics["quota_refusals"],
        "corrupt_blocks_reported": metrics["corrupt_reported"],
        "corrupt_blocks_evicted": metrics["corrupt_evicted"],
        "events_published": metrics["events_published"],
        "events_dropped": metrics["events_dropped"],
        "tenants": metrics["tenants"],
        "consistent": consistent,
        "sessions": [{"session": k, **v} for k, v in sorted(sessions.items())],
    }
