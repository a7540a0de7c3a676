"""What lies where in a pool's shared-memory segment: the header's fields,
the arrays and their offsets for a config (`Layout`), the block flags, the
session records' sizes, and the format of the undo log (its entry kinds and
sizes, and the most words one frame can journal).  The segment
(segment.py) maps it, the journal (journal.py) writes the undo log, recovery
(recovery.py) reads it back; this module only describes them.

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
"""

from __future__ import annotations

import hashlib
import struct

from kvshm.core.hashing import HASH_SLOT_BYTES
from kvshm.core.metrics import METRICS_WORDS
from kvshm.core.specs import PoolConfig

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
    # Recovery: words of the open frame's undo log (0: none), the
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
HEADER_FIXED = 256
COUNTER_FIELDS = ("num_free_blocks", "queries", "hits", "query_tokens", "hit_tokens",
                  "num_requests")
COUNTERS = struct.Struct(f"{len(COUNTER_FIELDS)}Q")
COUNTERS_OFFSET = HEADER_FIELDS["num_free_blocks"][0]
FREE_WORD = COUNTERS_OFFSET // 8
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


def align(n: int, to: int = 64) -> int:
    return -(-n // to) * to


def undo_words(config: PoolConfig) -> int:
    """Capacity of the undo log: the most one frame can journal (every
    request row's counts and original ids, every slot's metadata, the
    lookup counters and one session record; see journal.py)."""
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
            off = align(off + size)
        self.size = off
        self.block_bytes = sum(self.offsets[k][1] for k in (
            "ref_cnt", "next_delta", "prev_delta", "free_stamp", "cache_stamp",
            "hash_group", "flags", "hashes"))
        self.recovery_bytes = sum(self.offsets[k][1] for k in ("undo", "sessions", "replies"))
        self.metrics_bytes = self.offsets["metrics"][1]
        self.table_bytes = (self.size - self.header_size - self.block_bytes
                            - self.recovery_bytes - self.metrics_bytes)


FORMATS = {"ref_cnt": "i", "next_delta": "i", "prev_delta": "i", "free_stamp": "q",
            "cache_stamp": "q", "hash_group": "H", "flags": "B", "hashes": "B",
            "slot_meta": "i", "slot_rid": "B", "slot_counts": "i", "undo": "q",
            "sessions": "q", "replies": "B", "metrics": "q"}


# -- the undo log's entries (journal.py writes them, recovery.py reads them) --
FRAME, ROW, PREFIX, META, STATS, SESSION = 0, 1, 2, 3, 4, 5
ROW_WORDS = 5
PREFIX_HEAD = 4
STATS_WORDS = 5
SESSION_ENTRY_WORDS = 3
# kind, slot, the metadata fields, the request-id bytes as words
META_WORDS = 2 + SLOT_META_FIELDS + RID_BYTES // 8


def frame_bound(num_slots: int, widths: list[int]) -> int:
    """Words one frame can journal at most, for a table of `num_slots` rows
    per group of the given widths."""
    rows = num_slots * sum(ROW_WORDS + PREFIX_HEAD + w for w in widths)
    return rows + num_slots * META_WORDS + STATS_WORDS + SESSION_ENTRY_WORDS + 1
