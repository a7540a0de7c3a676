"""The engine's backend on a shared pool: vLLM's manager calls become frames
of the synchronous client, one round trip per call.

vLLM requests go to the coordinator by their block hashes (the ones vLLM
computed: the pool hashes with the same `vllm-sha256`), and are brought up
to date (new tokens, hashes, computed count) in the frame of the next op
that needs them.  Full blocks are cached when they are allocated, as by
vLLM's own manager, so this engine hits them in the same step; the pool
keeps them pending (invisible to other engines) until this engine says
their K/V are in the arena: `step_computed` queues that word for the
request when its step completed a block, and the next frame this engine
sends carries it (no round trip of its own).

Calls the backend can answer from what it holds cost no round trip: a
running request's allocation that needs no new block and caches no new
block (most decode steps; its new tokens travel with its next frame), and
the scheduler's per-step `get_num_common_prefix_blocks` (from the block
ids the backend keeps), and `remove_skipped_blocks` where no group ever
skips a block.

A waiting request whose lookup stops where another engine is writing at
least `wait_in_flight` more of its tokens waits for them (`waits`), for at
most as long as computing them itself would take: their count times this
engine's own cost per token, measured on its steps (`token_cost`), and
never more than `in_flight_deadline` seconds (the whole wait until a step
has been measured).  So a request that waits in vain is at worst twice as
late as one that never waited, however busy the writer is.  With the
plugin's KV connector installed (`gate.py`, `skips_waiting`), the
scheduler skips the request this step and schedules the ones behind it;
without (the engine has a connector of its own), its allocation answers
None, which vLLM's scheduler takes as a full pool (the request stays first
in line and the waiting requests behind it wait too, as they would for
free blocks).  While it
waits it is looked up again at most every `in_flight_poll` seconds, and a
step that schedules nothing else sleeps until then (vLLM's engine loop
would otherwise spin through empty steps, each with a round trip).

What the coordinator holds of each request (its hashes, token count and
computed count) is the sync client's `RequestMirror`, kept from the
replies; the backend only queues the computed counts it has not sent yet.
A restart is ridden through by the client; one the session does not
survive (ResumeFailed) or one that lost a reply (ReplyLost) leaves the
scheduler's block tables out of step with the pool, so the backend stops:
that call and every later one raise `PoolSessionLost` and the engine must
be restarted.  Runs inside vLLM processes only (no vLLM import here,
though).
"""

from __future__ import annotations

import time

from kvshm.core.block_pool import hashed_tokens
from kvshm.core.errors import StaleHits
from kvshm.core.events import decode_events
from kvshm.core.group_logic import cached_tokens
from kvshm.core.hashing import HASH_SLOT_BYTES
from kvshm.core.specs import CrossAttentionSpec, FullSpec, MambaSpec, MLASpec, PoolConfig
from kvshm.core.state import FLAG_CACHED
from kvshm.ops import protocol as p
from kvshm.ops.errors import Forbidden, ReplyLost, ResumeFailed
from kvshm.pool.segment import PoolSegment
from kvshm.service.sync_client import SyncClient
from kvshm.vllm.release import log

# Groups whose block list is exactly the hits plus what each allocation
# added (no window drops blocks, no sink blocks): the backend keeps a
# request's block ids itself instead of asking for them.
_GROWING = (FullSpec, MLASpec, CrossAttentionSpec)
# Steps of at least this many tokens measure the engine's cost per token
# (decode steps are mostly the step's fixed cost), and the weight of each
# new step in the running sums.
_MEASURED_STEP = 32
_COST_WEIGHT = 0.2
# Groups where an allocation that needs no new block and caches no new block
# changes nothing in the pool (cross-attention allocates for encoder tokens).
_LOCAL = (FullSpec, MLASpec)


class PoolSessionLost(ResumeFailed):
    """The engine's session with the pool ended with its block tables in it
    (a restart it did not survive, or a lost reply): restart the engine."""


class RemoteBackend:
    """A vLLM engine's session with a coordinator (see the module doc)."""

    def __init__(self, client: SyncClient, *, wait_in_flight: int = 128,
                 in_flight_deadline: float = 2.0, in_flight_poll: float = 0.002) -> None:
        self.client = client
        self.wait_in_flight = wait_in_flight
        self.in_flight_deadline = in_flight_deadline
        self.in_flight_poll = in_flight_poll
        # Per waiting request: the tokens in flight of its last lookup when
        # that lookup holds it back, until when it may wait for them, and its
        # last lookup (when, and its answer).
        self._holds: dict[str, int] = {}
        self._wait_until: dict[str, float] = {}
        self._looked_up: dict[str, tuple[float, list[list[int]], int, int, int]] = {}
        self.in_flight_waits = 0     # requests that waited for tokens in flight
        # This engine's measured steps of at least _MEASURED_STEP tokens
        # (from the end of their scheduling to the end of their forward
        # pass: vLLM's CPU platform turns asynchronous scheduling off, so a
        # step's forward pass runs between the two): their tokens and
        # seconds, summed with weights that decay by _COST_WEIGHT a step
        # (`token_cost`).
        self._measured_tokens = 0.0
        self._measured_seconds = 0.0
        self._scheduled_at = 0.0
        # The scheduler skips a waiting request (the plugin's connector asks
        # `waits`) rather than taking a None allocation as a full pool.
        self.skips_waiting = False
        self.in_flight_skips = 0     # steps that skipped a waiting request (the gate counts)
        self.config: PoolConfig = client.config
        self.num_blocks = self.config.num_blocks
        self.segment = PoolSegment.attach(client.pool_segment)
        self._flags = self.segment.flags
        self._hashes = self.segment.hashes
        # What the coordinator holds of each request (from the replies).
        self._held = client.requests
        # Per request: the most tokens an allocation (or cache_blocks) asked
        # the pool to cache (it holds the request's full blocks up to here).
        self._cached: dict[str, int] = {}
        # Per request allocated this step: its computed tokens before the
        # step's; and the computed counts to report in the next frame.
        self._step_start: dict[str, int] = {}
        self._report: dict[str, int] = {}
        self._lost: PoolSessionLost | None = None
        self._mirror: dict[str, list[list[int]]] | None = (
            {} if all(isinstance(g, _GROWING) for g in self.config.groups) else None)
        self._block_sizes = [self.config.effective_block_size(g)
                             for g in range(len(self.config.groups))]
        self._local = self._mirror is not None and all(
            isinstance(g, _LOCAL) for g in self.config.groups)
        self._cross = [isinstance(g, CrossAttentionSpec) for g in self.config.groups]
        # vLLM 0.32's step hook matters to Mamba groups only (their same-step
        # deferral): on such a pool it travels with the step's first frame.
        self._marks_steps = any(isinstance(g, MambaSpec) for g in self.config.groups)
        self._step_began = False
        self.local_allocations = 0   # allocations answered without a round trip
        self.stale_hits = 0          # allocations retried because another engine took the hit
        self._warned: set[str] = set()

    # -- reading the pool without a round trip ------------------------------------------
    def usage(self) -> float:
        free = self.segment.get("num_free_blocks")
        return 1.0 - free / (self.num_blocks - 1)

    def block_hash(self, block_id: int) -> bytes | None:
        if not self._flags[block_id] & FLAG_CACHED:
            return None
        off = block_id * HASH_SLOT_BYTES
        return bytes(self._hashes[off:off + HASH_SLOT_BYTES])

    # -- bringing a request up to date --------------------------------------------------
    def _sync(self, request) -> list:
        """The ops that give the coordinator this request's current state."""
        rid = request.request_id
        held = self._held.get(rid)
        hashes = request.block_hashes
        if held is None:
            lora = request.lora_request.lora_name if request.lora_request else None
            ops = [p.AddRequest(rid, None, list(hashes), request.num_tokens, lora,
                                request.cache_salt, request.skip_reading_prefix_cache)]
            if request.num_computed_tokens:
                ops.append(p.Advance(rid, request.num_computed_tokens))
            return ops
        n, c = request.num_tokens, request.num_computed_tokens
        if n == held.num_tokens and c == self._report.get(rid, held.computed):
            return []
        return [p.Advance(rid, c, [], list(hashes[len(held.hashes):]), n - held.num_tokens)]

    def _run(self, ops: list):
        """Run ops in one frame, after the computed counts `step_computed`
        queued; the last op's reply."""
        if self._lost is not None:
            raise self._lost
        if self._step_began:
            ops = [p.NewStepStarts()] + ops
            self._step_began = False
        if self._report:
            ops = [p.Advance(rid, c) for rid, c in self._report.items()] + ops
            self._report = {}
        try:
            return self.client.batch(ops)[-1] if len(ops) > 1 else self.client.call(ops[0])
        except (ResumeFailed, ReplyLost) as e:
            self._lost = PoolSessionLost(
                f"kvshm: this engine's session with the pool is gone with its block tables "
                f"({e}); restart the engine")
            raise self._lost from e

    # -- the manager's calls ---------------------------------------------------------------
    def get_computed_blocks(self, request) -> tuple[list[list[int]], int, int]:
        rid = request.request_id
        now = time.monotonic()
        last = self._looked_up.get(rid) if rid in self._wait_until else None
        if last is not None:
            when, ids, n, boundary, in_flight = last
            if now < when + self.in_flight_poll:
                # Skipped (the step's end sleeps if nothing ran), or other
                # requests run this step: the last answer stands.
                if self.skips_waiting or self._step_start:
                    self._decide(rid, self.wait_in_flight if self._may_hold(rid, now) else 0,
                                 in_flight)
                    return ids, n, boundary
                if not self._report:             # else this step would be empty
                    time.sleep(when + self.in_flight_poll - now)
                    now = time.monotonic()
        # A lookup that holds the request back is not counted in the pool's
        # prefix-cache stats (nor in the engine's: `holds`); the one that
        # admits it is, so each request counts once, as on the engine's own
        # cache.
        hold_at = self.wait_in_flight if self._may_hold(rid, now) else 0
        r = self._run(self._sync(request) + [p.GetComputedBlocks(rid, hold_at)])
        in_flight = r.num_in_flight_tokens
        self._decide(rid, hold_at, in_flight)
        if in_flight:
            self._looked_up[rid] = (time.monotonic(), r.block_ids, r.num_computed_tokens,
                                    r.shared_prefix_boundary, in_flight)
        else:
            self._looked_up.pop(rid, None)
        return r.block_ids, r.num_computed_tokens, r.shared_prefix_boundary

    def _may_hold(self, rid: str, now: float) -> bool:
        """Whether a lookup of `rid` now may hold it back: waits are on and
        its wait (if it has begun one) is not past its budget."""
        if not self.wait_in_flight:
            return False
        until = self._wait_until.get(rid)
        return until is None or now < until

    def _decide(self, rid: str, hold_at: int, in_flight: int) -> None:
        """Record whether the lookup just made holds `rid` back (`waits`
        answers it): at least `hold_at` (> 0) tokens are in flight."""
        if hold_at and in_flight >= hold_at:
            self._holds[rid] = in_flight
        else:
            self._holds.pop(rid, None)

    def holds(self, rid: str) -> bool:
        """Whether the last lookup of `rid` holds it back to wait for tokens
        in flight (such a lookup is not counted in the prefix-cache stats)."""
        return rid in self._holds

    def waits(self, rid: str) -> bool:
        """Whether the waiting request `rid`, just looked up, waits for its
        tokens in flight (until its deadline) instead of being allocated now:
        its lookup's decision (`holds`); the first one starts the wait's
        budget."""
        n = self._holds.pop(rid, 0)
        if not n:
            self._wait_until.pop(rid, None)
            self._looked_up.pop(rid, None)
            return False
        if rid not in self._wait_until:
            self._wait_until[rid] = time.monotonic() + self.wait_budget(n)
            self.in_flight_waits += 1
        return True

    @property
    def token_cost(self) -> float | None:
        """Seconds per token of this engine's recent steps of at least
        _MEASURED_STEP tokens (their seconds over their tokens, so long
        prefills weigh most and the small steps' fixed cost errs towards
        waiting longer); None until a step is measured."""
        if not self._measured_tokens:
            return None
        return self._measured_seconds / self._measured_tokens

    def wait_budget(self, num_tokens: int) -> float:
        """Seconds a request may wait for `num_tokens` tokens in flight: what
        this engine would take to compute them, up to `in_flight_deadline`."""
        cost = self.token_cost
        if cost is None:
            return self.in_flight_deadline
        return min(self.in_flight_deadline, num_tokens * cost)

    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens, hits,
                       num_lookahead_tokens, num_external_computed_tokens,
                       delay_cache_blocks, num_encoder_tokens,
                       full_sequence_must_fit: bool = False, waiting: bool = False,
                       has_scheduled_reqs: bool = True,
                       reserved_blocks: int = 0) -> list[list[int]] | None:
        if self._lost is not None:
            raise self._lost
        rid = request.request_id
        # The last allocation of a step is the end of its scheduling.
        self._scheduled_at = time.monotonic()
        if (not self.skips_waiting and (self._holds or self._wait_until)
                and self.waits(rid)):
            return None
        total = request.num_computed_tokens + num_new_computed_tokens
        if (hits is None and not num_external_computed_tokens and not num_encoder_tokens
                and not waiting and not reserved_blocks
                and self._unchanged(request, total, num_new_tokens + num_lookahead_tokens,
                                    delay_cache_blocks)):
            self.local_allocations += 1
            self._step_start[rid] = total
            return [[] for _ in self._block_sizes]
        ops = self._sync(request) + [p.AllocateSlots(
            rid, num_new_tokens, num_new_computed_tokens, hits is not None,
            num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
            num_encoder_tokens, full_sequence_must_fit, waiting, has_scheduled_reqs,
            reserved_blocks)]
        try:
            new = self._run(ops).new_block_ids
        except StaleHits:
            # Another engine reused a hit block between this engine's lookup
            # and its allocation: as if the pool were full, so the scheduler
            # looks the request up again next step.
            self.stale_hits += 1
            return None
        if new is None:
            return None
        if not delay_cache_blocks:
            self._cached[rid] = max(self._cached.get(rid, 0),
                                    min(total + num_external_computed_tokens + num_new_tokens,
                                        request.num_tokens))
        if self._mirror is not None:
            held = self._mirror.get(rid)
            if held is None:
                self._mirror[rid] = [list(h) + n for h, n in zip(hits or [[]] * len(new), new)]
            else:
                for h, n in zip(held, new):
                    h.extend(n)
        self._step_start[rid] = total + num_external_computed_tokens
        return new

    def idle(self, num_scheduled_tokens: int) -> None:
        """The scheduler built a step of `num_scheduled_tokens`: if it is
        empty while requests wait for tokens in flight, sleep until the
        first of their next lookups is due."""
        if num_scheduled_tokens or not self._looked_up or self._report:
            return
        due = min(when for when, *_ in self._looked_up.values()) + self.in_flight_poll
        pause = due - time.monotonic()
        if pause > 0:
            time.sleep(min(pause, self.in_flight_poll))

    def _unchanged(self, request, total: int, num_slots: int, delay_cache_blocks: bool) -> bool:
        """Whether allocating `num_slots` more slots to a running request
        with `total` computed tokens would change nothing in the pool: it
        holds the blocks already, and caches no block it has not cached.
        Only with nothing queued for the pool (so that computed counts
        reach it in the step after their step)."""
        if not self._local or self._report:
            return False
        rid = request.request_id
        held = self._mirror.get(rid)
        if held is None or rid not in self._held:
            return False
        cached = self._cached.get(rid, 0)
        max_len = self.config.max_model_len
        total = min(total, max_len)
        need = min(total + num_slots, max_len)
        cache = min(total + num_slots, request.num_tokens)
        for bs, blocks in zip(self._block_sizes, held):
            if -(-need // bs) > len(blocks):
                return False
            if not delay_cache_blocks and cache // bs > cached // bs:
                return False
        return True

    def step_computed(self, num_scheduled_tokens: dict[str, int]) -> None:
        """The forward pass of a step wrote the K/V of its requests' scheduled
        tokens (`num_scheduled_tokens`: request id -> tokens): their blocks
        become hits for every engine once the next frame says so."""
        start = self._step_start
        if start and self._scheduled_at:
            n = sum(num_scheduled_tokens.values())
            if n >= _MEASURED_STEP:
                keep = 1.0 - _COST_WEIGHT
                self._measured_tokens = keep * self._measured_tokens + n
                self._measured_seconds = (keep * self._measured_seconds
                                          + time.monotonic() - self._scheduled_at)
        sizes = self._block_sizes
        report = self._report
        for rid, n in num_scheduled_tokens.items():
            c = start.pop(rid, None)
            held = self._held.get(rid)
            if c is None or held is None:
                continue
            # Only a step that completed a block has news for other engines
            # (the pool's count of the request's tokens must cover it; it
            # does whenever the step cached that block); any other count
            # travels with the request's next op.
            computed = report.get(rid, held.computed)
            if (computed < c + n <= held.num_tokens
                    and any((c + n) // bs > computed // bs for bs in sizes)):
                report[rid] = c + n
        start.clear()

    def new_step_starts(self) -> None:
        """vLLM 0.32's scheduler begins a step: the pool hears of it with
        this engine's next frame (only where a group needs it)."""
        if self._marks_steps:
            self._step_began = True

    def estimate_cached_tokens(self, request_id: str) -> int:
        """The core's `estimate_cached_tokens`, from the block ids this
        backend keeps and the pool's cached flags where it keeps them (no
        round trip: vLLM 0.32 asks it at every request's first output)."""
        held = None if self._mirror is None else self._mirror.get(request_id)
        if held is None:
            if request_id not in self._held:
                return 0
            return self._run([p.EstimateCachedTokens(request_id)]).num_tokens
        flags, partial = self._flags, self.segment.partial_tokens
        return cached_tokens(held, self._block_sizes, self._cross,
                             lambda b, end: hashed_tokens(flags, partial, b, end))

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        rid = request.request_id
        self._run(self._sync(request) + [p.CacheBlocks(rid, num_computed_tokens)])
        self._cached[rid] = max(self._cached.get(rid, 0), num_computed_tokens)

    def free(self, request) -> None:
        if self._lost is not None:
            raise self._lost
        rid = request.request_id
        self._step_start.pop(rid, None)
        self._holds.pop(rid, None)
        self._wait_until.pop(rid, None)
        self._looked_up.pop(rid, None)
        if self._mirror is not None:
            self._mirror.pop(rid, None)
        if rid not in self._held:
            self._report.pop(rid, None)
            return                   # never reached the pool
        # A running request freed is being preempted: the coordinator keeps
        # its hashes for the lookup that re-admits it.
        preempted = getattr(request.status, "name", "") == "RUNNING"
        ops = self._sync(request) if not preempted else []
        if not preempted:
            self._cached.pop(rid, None)
        self._run(ops + [p.Free(rid, preempted)])

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        # Full attention, MLA and cross-attention never skip a block (the
        # scheduler asks anyway, before a connector's request_finished).
        if self._mirror is None and request_id in self._held:
            self._run([p.RemoveSkippedBlocks(request_id, total_computed_tokens)])

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        if self._lost is not None:
            raise self._lost
        if self._mirror is not None:
            held = self._mirror.get(request_id)
            return held if held is not None else [[] for _ in self.config.groups]
        if request_id not in self._held:
            return [[] for _ in self.config.groups]
        return self._run([p.GetBlockIds(request_id)]).block_ids

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        """Per group, the leading blocks of the request that every request of
        this engine holding blocks holds too (vLLM's count, over this
        engine's requests; only cascade attention reads it)."""
        if self._lost is not None:
            raise self._lost
        held = None if self._mirror is None else self._mirror.get(request_id)
        if held is None:
            return self._run([p.NumCommonPrefixBlocks(request_id)]).num_blocks
        counts = [len(h) for h in held]
        for other in self._mirror.values():
            if other is held:
                continue
            for g, (mine, theirs) in enumerate(zip(held, other)):
                n = min(counts[g], len(theirs))
                i = 0
                while i < n and mine[i] == theirs[i]:
                    i += 1
                counts[g] = i
            if not any(counts):
                break
        return counts

    def evict_blocks(self, block_ids: list[int]) -> None:
        try:
            self._run([p.EvictBlocks(list(block_ids))])
        except Forbidden as e:
            self._warn_once("evict", f"kvshm: not evicting {len(block_ids)} blocks of the "
                            f"shared pool: {e} (KVSHM_ADMIN=1 connects as admin)")

    def reset_prefix_cache(self) -> bool:
        try:
            return self._run([p.ResetPrefixCache()]).ok
        except Forbidden as e:
            self._warn_once("reset", f"kvshm: not resetting the shared pool's prefix cache: "
                            f"{e} (KVSHM_ADMIN=1 connects as admin)")
            return False

    def start_events(self) -> None:
        self.take_events()                 # the coordinator keeps ours from now on

    def take_events(self) -> list:
        return decode_events(self._run([p.TakeEvents()]).payload)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def close(self) -> None:
        self.client.close()
        self._flags = self._hashes = None
        self.segment.close()
