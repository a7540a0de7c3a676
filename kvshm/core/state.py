"""What the allocator's shared state means, apart from where it lies: the
block flags, the shape of a request slot's record, the header words the
allocator keeps (its counters and the mutation and undo words), the size of
the coordinator's session records, and the format of the undo log (its
entry kinds and sizes, and the most words one frame can journal).

The core reads and writes this state through the segment it is given
(`SegmentState`); the pool layer (kvshm/pool/layout.py) lays it out in
bytes, with the header words at 8 x the indices named here
(tests/test_segment.py checks that the two agree).
"""

from __future__ import annotations

from typing import Protocol

from kvshm.core.specs import PoolConfig

# -- a block's flags -------------------------------------------------------------------
FLAG_NULL = 1
FLAG_CACHED = 2
FLAG_SINK = 4
# A cached block whose K/V its writer has not reported written yet
# (block_pool.py, "readiness"); always together with FLAG_CACHED.  The
# segment's `writer` array holds, for such a block, the request slot whose
# request cached it: its writer, the one request whose free or K/V report
# settles the block (a restarted coordinator rebuilds the readiness index
# from it).  The request that wrote `writer[b]` holds b in the cached part
# of its row for as long as b is pending, so the entry needs no undo: a
# frame a crash cut off wrote it only for blocks repair uncaches.
FLAG_PENDING = 8
# The block also carries a partial prefix entry (vLLM 0.32, a pool with
# `PoolConfig.partial_entry_groups`): a key for a prefix that ends inside
# the block, in the segment's `partial_hashes`, with its length in tokens in
# `partial_tokens`.  With FLAG_CACHED beside it the block has a full entry
# too; alone, the partial entry is the block's only one (it still counts as
# hashed where the free order asks, and carries the block's cache stamp).
# A lookup never takes a partial entry: only KV events and the free order
# see it (block_pool.py, "Partial entries").
FLAG_PARTIAL = 16

# -- a request slot: its metadata words and its request id's bytes ---------------------
RID_BYTES = 64
SLOT_META_FIELDS = 4  # rid_len, owner session, in_use, reserved

# -- the header words the allocator keeps (8-byte words of the fixed header) -----------
HEADER_WORDS = {
    "mutation_seq": 11,        # odd while a mutation is in progress
    "num_free_blocks": 13,     # the counters, in COUNTER order from here
    "queries": 14,
    "hits": 15,
    "query_tokens": 16,
    "hit_tokens": 17,
    "num_requests": 18,
    "undo_len": 21,            # words of the open frame's undo log (0: none)
    "frame_cache_stamp": 22,   # the cache stamp at the open frame's start
    # Pool churn since the pool was created (BlockPool): blocks handed out by
    # allocations, and cached blocks whose hash was dropped (evicted to reuse
    # the block, or by evict_blocks).  Not journaled: a frame a crash cut off
    # and repair rolled back stays counted.
    "blocks_allocated": 24,
    "blocks_evicted": 25,
}
SEQ_WORD = HEADER_WORDS["mutation_seq"]
FREE_WORD = HEADER_WORDS["num_free_blocks"]
STATS_WORD = HEADER_WORDS["queries"]          # queries, hits, query_tokens, hit_tokens
NUM_REQUESTS_WORD = HEADER_WORDS["num_requests"]
UNDO_LEN_WORD = HEADER_WORDS["undo_len"]
FRAME_CACHE_STAMP_WORD = HEADER_WORDS["frame_cache_stamp"]
ALLOCATED_WORD = HEADER_WORDS["blocks_allocated"]
EVICTED_WORD = HEADER_WORDS["blocks_evicted"]

# -- the coordinator's session records (kvshm/ops/sessions.py gives the words
# their meaning); each keeps the replies of its last REPLIES_KEPT frames, as
# far as they fit in its ring of REPLY_RING_BYTES -----------------------------------------
SESSION_SLOTS = 256
SESSION_WORDS = 48
SESSION_LAST_SEQ = 1   # the word of a record the undo log restores
REPLIES_KEPT = 16
REPLY_RING_BYTES = 32768

# -- the undo log's entries (journal.py writes them, recovery.py reads them) -----------
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


def undo_words(config: PoolConfig) -> int:
    """Capacity of the undo log: the most one frame can journal (every
    request row's counts and original ids, every slot's metadata, the
    lookup counters and one session record; see journal.py)."""
    return frame_bound(config.max_num_seqs,
                       [config.row_capacity(g) for g in range(len(config.groups))])


class SegmentState(Protocol):
    """The segment the core is given (kvshm.pool.segment.PoolSegment maps
    one): the pool's config, its arrays as typed memoryviews (`ref_cnt`,
    `next_delta`, `prev_delta`, `free_stamp`, `cache_stamp`, `hash_group`,
    `flags`, `writer`, `parent`, `hashes`, `partial_hashes`, `partial_tokens` (empty
    unless the config has partial entries), `slot_meta`, `slot_rid`, `slot_counts`, `tables`,
    `undo`, `sessions`, `replies`, `metrics`), the fixed header as 8-byte
    `words`, header fields by name, the mutation bracket, and the
    `journal` (a core.journal.Journal) that writes its undo log."""

    name: str
    config: PoolConfig
    owner: bool
    closed: bool
    words: memoryview
    header: memoryview
    tables: list[memoryview]
    journal: object

    def read_consistent(self, read, timeout: float = ..., *, pause: float = ...,
                        torn_ok: bool = False): ...
    def get(self, field: str): ...
    def set(self, field: str, value) -> None: ...
    def begin_mutation(self) -> None: ...
    def slot_request_id(self, slot: int) -> str: ...
    def private_copy(self) -> "SegmentState": ...
    def close(self) -> None: ...
    def unlink(self) -> None: ...
