"""Operational counters in the pool segment, readable by any process.

The coordinator (the segment's one writer) counts here what operators watch:
frames, sessions, preemptions, per-op counts, errors and latency
histograms, errors by code, KV events published and dropped, and per-tenant
blocks, quotas and prefix-cache hits.  `kvshm metrics` (Prometheus) and
`kvshm top` read them straight from shared memory: no socket, no cost to the
coordinator.

Region `metrics` of the segment, int64 words:

    GLOBALS                       one word each (names below)
    errors[len(ERROR_CODES)]      replies by error code (last: any other code)
    ops[len(OP_NAMES)]            per op: errors, total ns of the ops that
                                  succeeded, then their count per latency
                                  bucket (LATENCY_BOUNDS_NS, and one past the
                                  last bound); calls = buckets + errors
    tenants[TENANT_SLOTS]         per tenant: TENANT_FIELDS, then its name
                                  (TENANT_NAME_BYTES, utf-8, zero padded)

The words are not journaled: counters are monotonic (a frame that a crash
cut off still counts), gauges are set again by a restarted coordinator.
Each store is one aligned 8-byte word, so a reader never sees a torn value;
it may see one frame's counters half updated, which rates tolerate.
"""

from __future__ import annotations

# Counters and gauges of the whole pool.
GLOBALS = ("frames", "sessions_open", "sessions_total", "sessions_resumed",
           "handshakes_refused", "preemptions", "events_published", "events_dropped",
           "quota_refusals", "corrupt_reported", "corrupt_evicted")
# The op tags of the wire protocol (kvshm/ops/protocol.py), in a fixed
# order: the index is part of the layout.
OP_NAMES = ("add", "advance", "hits", "alloc", "admit", "cache", "free", "skip", "ids",
            "common", "reset", "evict", "stats", "take_events", "corrupt", "restore_hits",
            "step", "cached_tokens")
# Every code a coordinator replies with; a code not listed counts as "other".
ERROR_CODES = ("BAD_CONFIG", "BAD_ARGUMENT", "BAD_MM_INPUT", "UNKNOWN_REQUEST",
               "DUPLICATE_REQUEST", "STALE_HITS", "TABLE_FULL", "REQUEST_TOO_LONG",
               "BAD_SEGMENT", "NO_SHM_SPACE", "NO_FREE_BLOCKS", "POOL_REFUSED", "BAD_MESSAGE",
               "FRAME_TOO_LARGE", "BATCH_TOO_LARGE", "HANDSHAKE_REQUIRED", "HANDSHAKE_FAILED",
               "VERSION_MISMATCH", "HASH_MISMATCH", "FORBIDDEN", "RESUME_FAILED", "NOT_OWNER",
               "INTERNAL", "other")
# Latency buckets of one op's execution in the coordinator (socket
# excluded): powers of two, so that the hot path finds an op's bucket with
# int.bit_length: 1.024 us, 2.048 us, ... 33.6 ms, and one past the last.
FIRST_BOUND_BITS = 10
LATENCY_BOUNDS_NS = tuple(1 << b for b in range(FIRST_BOUND_BITS, FIRST_BOUND_BITS + 16))
LAST_BUCKET = len(LATENCY_BOUNDS_NS)
OP_ERRORS, OP_NS, OP_BUCKETS = 0, 1, 2     # words of an op's counters
OP_WORDS = OP_BUCKETS + LAST_BUCKET + 1
TENANT_SLOTS = 64
TENANT_NAME_BYTES = 64
# blocks: held now (gauge); quota: blocks it may hold (-1: unlimited);
# the rest count since the pool was created.
TENANT_FIELDS = ("used", "blocks", "quota", "queries", "hits", "query_tokens", "hit_tokens",
                 "quota_refusals", "preemptions")
TENANT_WORDS = len(TENANT_FIELDS) + TENANT_NAME_BYTES // 8

_G = {name: i for i, name in enumerate(GLOBALS)}
ERRORS_BASE = len(GLOBALS)
OPS_BASE = ERRORS_BASE + len(ERROR_CODES)
TENANTS_BASE = OPS_BASE + len(OP_NAMES) * OP_WORDS
METRICS_WORDS = TENANTS_BASE + TENANT_SLOTS * TENANT_WORDS
_T = TENANT_OFFSETS = {name: i for i, name in enumerate(TENANT_FIELDS)}
_ERR = {code: i for i, code in enumerate(ERROR_CODES)}
_NAME_AT = len(TENANT_FIELDS)


def global_word(name: str) -> int:
    """The index of global counter `name` in the region."""
    return _G[name]


def op_base(name: str) -> int:
    """The first word of op `name`'s counters (OP_ERRORS, OP_NS, OP_BUCKETS)."""
    return OPS_BASE + OP_NAMES.index(name) * OP_WORDS


def latency_bucket(ns: int) -> int:
    """The bucket of a latency of `ns` nanoseconds (ns < its bound)."""
    b = ns.bit_length() - FIRST_BOUND_BITS
    return 0 if b < 0 else b if b < LAST_BUCKET else LAST_BUCKET


def tenant_word(slot: int, field: str) -> int:
    return TENANTS_BASE + slot * TENANT_WORDS + _T[field]


def tenant_base(slot: int) -> int:
    """The first word of tenant slot `slot` (its fields at TENANT_OFFSETS)."""
    return TENANTS_BASE + slot * TENANT_WORDS


class MetricsWriter:
    """The coordinator's side: stores into the region `words` (the
    segment's `metrics` view).  An op's time is counted inline by the op
    executor (OpExecutor._run: `words[base + OP_NS] += ns` and one count in
    bucket `latency_bucket(ns)`), the hot path."""

    __slots__ = ("words",)

    def __init__(self, words) -> None:
        self.words = words

    def add(self, name: str, n: int = 1) -> None:
        self.words[_G[name]] += n

    def set(self, name: str, value: int) -> None:
        self.words[_G[name]] = value

    def error(self, base: int | None, code: str) -> None:
        """An op (`base`, or None for a frame that is no op) failed with `code`."""
        w = self.words
        if base is not None:
            w[base + OP_ERRORS] += 1
        w[ERRORS_BASE + _ERR.get(code, len(ERROR_CODES) - 1)] += 1

    # -- tenants -------------------------------------------------------------
    def tenant_slot(self, name: str) -> int | None:
        """The slot of tenant `name`, taken on first use (None: all taken)."""
        raw = name.encode()
        free = None
        for slot in range(TENANT_SLOTS):
            if not self.words[tenant_word(slot, "used")]:
                if free is None:
                    free = slot
                continue
            if tenant_name(self.words, slot) == raw:
                return slot
        if free is None:
            return None
        w = self.words
        base = TENANTS_BASE + free * TENANT_WORDS
        for i in range(TENANT_WORDS):
            w[base + i] = 0
        padded = raw.ljust(TENANT_NAME_BYTES, b"\0")
        for i in range(TENANT_NAME_BYTES // 8):
            w[base + _NAME_AT + i] = int.from_bytes(padded[8 * i:8 * i + 8], "little",
                                                    signed=True)
        w[base + _T["quota"]] = -1
        w[base + _T["used"]] = 1
        return free

    def tenant_add(self, slot: int, field: str, n: int) -> None:
        self.words[tenant_word(slot, field)] += n

    def tenant_set(self, slot: int, field: str, value: int) -> None:
        self.words[tenant_word(slot, field)] = value


def tenant_name(words, slot: int) -> bytes:
    base = TENANTS_BASE + slot * TENANT_WORDS + _NAME_AT
    raw = b"".join(int(words[base + i]).to_bytes(8, "little", signed=True)
                   for i in range(TENANT_NAME_BYTES // 8))
    return raw.rstrip(b"\0")


def read_metrics(words) -> dict:
    """A copy of the region as plain values: globals, errors by code,
    per-op counts/errors/total seconds/bucket counts, and tenants by name."""
    w = list(words)
    out: dict = {name: w[i] for name, i in _G.items()}
    out["errors"] = {code: w[ERRORS_BASE + i] for i, code in enumerate(ERROR_CODES)}
    ops = {}
    for i, name in enumerate(OP_NAMES):
        b = OPS_BASE + i * OP_WORDS
        buckets = w[b + OP_BUCKETS:b + OP_WORDS]
        ops[name] = {"count": sum(buckets) + w[b + OP_ERRORS], "errors": w[b + OP_ERRORS],
                     "seconds": w[b + OP_NS] / 1e9, "buckets": buckets}
    out["ops"] = ops
    tenants = {}
    for slot in range(TENANT_SLOTS):
        base = TENANTS_BASE + slot * TENANT_WORDS
        if not w[base]:
            continue
        name = tenant_name(w, slot).decode(errors="replace")
        tenants[name] = {f: w[base + i] for f, i in _T.items() if f != "used"}
    out["tenants"] = tenants
    return out


def percentile(values, q: float):
    """The q-th percentile (0..100) of `values`, by the one rule every
    figure of kvshm uses: the sample at rank round(q/100 * (n - 1)) of the
    sorted values (a sample, never an interpolation; None for no values)."""
    s = sorted(values)
    if not s:
        return None
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def quantile(buckets: list[int], q: float) -> float | None:
    """The q-quantile (0..1) of a latency histogram, in seconds: the upper
    bound of the bucket it falls in (None: no samples; the last bucket
    reports the last bound)."""
    total = sum(buckets)
    if not total:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(buckets):
        seen += n
        if seen >= rank and n:
            return LATENCY_BOUNDS_NS[min(i, len(LATENCY_BOUNDS_NS) - 1)] / 1e9
    return LATENCY_BOUNDS_NS[-1] / 1e9
