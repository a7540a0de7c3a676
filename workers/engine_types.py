"""The CPU worker engine's options and figures (`EngineOptions`,
`EngineStats`): what the launcher sends a worker and what it reports back."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from kvshm.config import DecoderShape


class EngineOptions(msgspec.Struct, frozen=True, kw_only=True):
    # Tokens scheduled per step: 2,048, vLLM's default for a server on a CPU.
    token_budget: int = 2048
    max_running: int = 16
    verify_hits: float = 1.0          # exact model: fraction of hit blocks checked
    # transformer: full prompt blocks per request checked, hit or computed alike
    check_blocks: int = 2
    check_decode: float = 0.02        # fraction of decode steps checked against a recompute
    seed: int = 0                     # model weights (all workers of a pool must agree)
    sample_seed: int = 0              # which blocks / steps get sampled
    model: str = "exact"              # compute.MODELS: "exact" or "transformer"
    # The transformer's dimensions beyond the KV shape (a preset's; None:
    # derived from the KV shape).
    decoder: DecoderShape | None = None
    # A load generator (scripts/numa_stress.py): the scheduler's ops and the
    # arena's writer stamps, no model compute (no K/V, attention or checks).
    load_only: bool = False
    # Wait for a prefix other workers are computing when at least this many
    # of its tokens are in flight (0: never wait), until it makes no progress
    # for `in_flight_deadline` seconds (then compute the rest).
    wait_in_flight: int = 128
    in_flight_deadline: float = 2.0


class EngineStats(msgspec.Struct, kw_only=True):
    """One worker's figures.  Counters and seconds add up over workers
    (`a + b`, `EngineStats.total(many)`), the per-step samples concatenate,
    and `first_error` is the first one seen."""

    finished: int = 0
    aborted: int = 0
    rejected: int = 0                 # longer than the model or the whole pool: never admitted
    prompt_tokens: int = 0            # prompt tokens of admitted requests (first admission)
    hit_tokens: int = 0               # of those, served from the prefix cache
    cross_hit_tokens: int = 0         # of those, in blocks another worker wrote
    computed_tokens: int = 0          # tokens whose K/V this worker computed
    generated_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    hit_blocks_checked: int = 0
    hit_mismatches: int = 0           # hit blocks found wrong and not healed (must stay 0)
    # Hit blocks found wrong before any output used them: reported to the
    # pool (report_corrupt), which uncached them and the blocks computed
    # from them; the requests that read them (or this step's blocks of
    # those) started over.  Someone wrote into the arena: look at the host.
    corrupt_findings: int = 0         # a block found wrong by one request
    corrupt_blocks_found: int = 0     # ... distinct blocks (each counted once a worker)
    corrupt_blocks_evicted: int = 0   # what the pool uncached for this worker's reports
    corrupt_requeued: int = 0         # requests started over because of them
    # (block, when the batch that admitted its request was sent, when its
    # report came back; time.monotonic(), one clock for every process of the host)
    corrupt_log: list[tuple[int, float, float]] = []
    first_corruption: str = ""
    computed_blocks_checked: int = 0  # blocks this worker computed, checked (transformer)
    computed_mismatches: int = 0      # ... whose K/V differed from a recompute (must stay 0)
    decode_checks: int = 0
    decode_mismatches: int = 0        # paged attention != contiguous recompute
    batch_us: list[int] = []          # each step's batch round trip
    coord_s: float = 0.0              # waiting for the coordinator (every batch)
    # CPU seconds (not wall: on an oversubscribed host wall time counts the
    # other processes' turns too)
    kv_s: float = 0.0                 # K/V of scheduled tokens and their arena writes
    attention_s: float = 0.0          # decode attention over the arena
    check_s: float = 0.0              # integrity checks (hit blocks, decode recomputes)
    first_error: str = ""
    # Coordinator restarts this worker rode through (filled in from its client).
    coordinator_restarts: int = 0
    requests_resumed: int = 0         # requests taken back after a restart
    requests_lost: int = 0            # ... and those that could not be (recomputed)
    recomputed_tokens: int = 0        # computed tokens given up because of restarts
    stalls_ms: list[int] = []         # loss -> resumed, per restart
    ttft_ms: list[int] = []           # per request: arrival -> its first token
    queue_ms: list[int] = []          # ... of which arrival -> first admission
    in_flight_waits: int = 0          # requests that waited for a prefix in flight
    in_flight_timeouts: int = 0       # ... and computed it at their deadline instead
    ops: int = 0                      # operations sent to the coordinator (every batch's)

    @property
    def corrupt_refound(self) -> int:
        """Blocks found wrong in a request admitted after a report of them had
        come back: hits on a block the pool had uncached (0, unless the arena
        was written into again since)."""
        done: dict[int, float] = {}
        for b, _, back in self.corrupt_log:
            done[b] = min(back, done.get(b, back))
        return sum(1 for b, sent, _ in self.corrupt_log if sent > done[b])

    @property
    def integrity_failures(self) -> int:
        return self.hit_mismatches + self.computed_mismatches + self.decode_mismatches

    def __add__(self, other: "EngineStats") -> "EngineStats":
        summed = {}
        for name in self.__struct_fields__:
            a, b = getattr(self, name), getattr(other, name)
            summed[name] = (a or b) if isinstance(a, str) else a + b
        return EngineStats(**summed)

    @classmethod
    def total(cls, stats: Iterable["EngineStats"]) -> "EngineStats":
        """The figures of several workers together."""
        return sum(stats, cls())

    def without_samples(self) -> "EngineStats":
        """A copy without the per-step samples (for progress reports)."""
        return msgspec.structs.replace(self, batch_us=[], stalls_ms=[], ttft_ms=[],
                                        queue_ms=[], corrupt_log=[])

