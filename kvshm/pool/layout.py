"""What lies where in a pool's shared-memory segment: the header's fields
and the arrays and their offsets for a config (`Layout`).  What the state
means (block flags, the header words the allocator keeps, the session
records' sizes, the undo log's format) is kvshm/core/state.py; the segment
(segment.py) maps this layout.

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
                                          | FLAG_PENDING | FLAG_PARTIAL
    writer            int32[num_blocks]   the request slot whose request cached
                                          a pending block (read only with
                                          FLAG_PENDING)
    parent            int32[num_blocks]   the block before a cached block in the
                                          chain of the request that cached it
                                          (0: none; for healing descendants)
    hashes            uint8[num_blocks * 32] cached block hash (zero padded)
    partial_hashes    uint8[num_blocks * 32] a block's partial prefix entry
                                          (FLAG_PARTIAL; empty unless the
                                          config has partial_entry_groups)
    partial_tokens    int32[num_blocks]   the tokens its prefix ends at (idem)
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
    replies           uint8[SESSION_SLOTS * REPLY_RING_BYTES]  each session's
                                          ring of its last frames' replies
    metrics           int64[METRICS_WORDS]  operators' counters
                                          (kvshm/core/metrics.py)

Links are relative (next = id + next_delta[id]) so that a fresh queue
[0, 1, ..., n-1] is a constant byte pattern: filling 1M links is a memset,
not a million Python stores.
"""

from __future__ import annotations

import hashlib
import struct

from kvshm.core.hashing import HASH_SLOT_BYTES
from kvshm.core.metrics import METRICS_WORDS
from kvshm.core.specs import PoolConfig
from kvshm.core.state import (HEADER_WORDS, REPLY_RING_BYTES, RID_BYTES, SESSION_SLOTS,
    SESSION_WORDS, SLOT_META_FIELDS, undo_words)

MAGIC = b"KVSHMPL\0"
# The KV data arena (arena.py) shares the pool header's first fields
# (magic, layout version, header size, config fingerprint, num_blocks,
# creator pid at the same offsets), so `segment_info` reads both kinds.
ARENA_MAGIC = b"KVSHMKV\0"
LAYOUT_VERSION = 9
# The pool header's fixed fields: name -> (offset, struct format).  The KV
# arena writes the leading ones (up to coordinator_pid) at the same offsets.
# The words the allocator keeps (the mutation counter, the counters, the
# undo words, pool churn) lie where core/state.py's HEADER_WORDS says.
HEADER_FIELDS = {**{field: (8 * word, "Q") for field, word in HEADER_WORDS.items()},
    "magic": (0, "8s"),
    "layout_version": (8, "I"),
    "header_size": (12, "I"),
    "config_fingerprint": (16, "32s"),
    "hash_fingerprint": (48, "16s"),
    "num_blocks": (64, "Q"),
    "num_groups": (72, "I"),
    "num_slots": (76, "I"),
    "generation": (80, "Q"),
    "coordinator_pid": (96, "Q"),
    "created_ns": (152, "Q"),
    "config_len": (160, "I"),
    # When the current coordinator took the pool over (its uptime).
    "started_ns": (184, "Q"),
}
HEADER_FIXED = 256
COUNTER_FIELDS = ("num_free_blocks", "queries", "hits", "query_tokens", "hit_tokens",
                  "num_requests")
COUNTERS = struct.Struct(f"{len(COUNTER_FIELDS)}Q")
COUNTERS_OFFSET = HEADER_FIELDS["num_free_blocks"][0]


def align(n: int, to: int = 64) -> int:
    return -(-n // to) * to


def config_fingerprint(config: PoolConfig) -> bytes:
    return hashlib.sha256(config.to_json()).digest()


class Layout:
    """Byte offsets of every array for one config."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        n = config.num_blocks
        slots = config.max_num_seqs
        ngroups = len(config.groups)
        partial = n if config.partial_entry_groups else 0
        self.config_json = config.to_json()
        self.header_size = align(HEADER_FIXED + len(self.config_json))
        self.widths = [config.row_capacity(g) for g in range(ngroups)]
        arrays: list[tuple[str, int]] = [
            ("ref_cnt", 4 * n),
            ("next_delta", 4 * (n + 1)),
            ("prev_delta", 4 * (n + 1)),
            ("free_stamp", 8 * n),
            ("cache_stamp", 8 * n),
            ("hash_group", 2 * n),
            ("flags", n),
            ("writer", 4 * n),
            ("parent", 4 * n),
            ("hashes", HASH_SLOT_BYTES * n),
            ("partial_hashes", HASH_SLOT_BYTES * partial),
            ("partial_tokens", 4 * partial),
            ("slot_meta", 4 * SLOT_META_FIELDS * slots),
            ("slot_rid", RID_BYTES * slots),
            ("slot_counts", 4 * 2 * ngroups * slots),
        ]
        arrays += [(f"table{g}", 4 * slots * w) for g, w in enumerate(self.widths)]
        arrays += [("undo", 8 * undo_words(config)),
                   ("sessions", 8 * SESSION_SLOTS * SESSION_WORDS),
                   ("replies", SESSION_SLOTS * REPLY_RING_BYTES),
                   ("metrics", 8 * METRICS_WORDS)]
        self.offsets: dict[str, tuple[int, int]] = {}
        off = self.header_size
        for name, size in arrays:
            self.offsets[name] = (off, size)
            off = align(off + size)
        self.size = off
        self.block_bytes = sum(self.offsets[k][1] for k in (
            "ref_cnt", "next_delta", "prev_delta", "free_stamp", "cache_stamp",
            "hash_group", "flags", "writer", "parent", "hashes", "partial_hashes",
            "partial_tokens"))
        self.recovery_bytes = sum(self.offsets[k][1] for k in ("undo", "sessions", "replies"))
        self.metrics_bytes = self.offsets["metrics"][1]
        self.table_bytes = (self.size - self.header_size - self.block_bytes
                            - self.recovery_bytes - self.metrics_bytes)


FORMATS = {"ref_cnt": "i", "next_delta": "i", "prev_delta": "i", "free_stamp": "q",
            "cache_stamp": "q", "hash_group": "H", "flags": "B", "writer": "i", "parent": "i",
            "hashes": "B", "partial_hashes": "B", "partial_tokens": "i",
            "slot_meta": "i", "slot_rid": "B", "slot_counts": "i", "undo": "q",
            "sessions": "q", "replies": "B", "metrics": "q"}
