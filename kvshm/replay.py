"""Conformance-trace replay in embedded mode (the core, in-process).

Trace ops become protocol messages (`TraceTranslator`, shared with the
replay through a coordinator) run by the coordinator's op executor.

A trace (tests/data/conformance/FORMAT.md) is a config line followed by ops
recorded from vLLM's own KVCacheManager; replaying it executes every op on a
fresh kvshm pool and compares each recorded `expect` with what kvshm returned.
"""

from __future__ import annotations

import gzip
import json
import statistics
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from kvshm.core.specs import CrossAttentionSpec, PoolConfig
from kvshm.ops import protocol as p
from kvshm.ops.executor import DONE, OpExecutor
from kvshm.pool.kv_cache_manager import KVCacheManager

FREE_HEAD_LEN = 64


def expand_paths(paths: Iterable[str | Path]) -> Iterator[Path]:
    """Files as given; directories searched for *.jsonl.gz and *.jsonl (not
    the event streams recorded beside traces, *.events.jsonl*)."""
    for path in map(Path, paths):
        if path.is_dir():
            yield from sorted(p for p in [*path.rglob("*.jsonl.gz"), *path.rglob("*.jsonl")]
                              if ".events.jsonl" not in p.name)
        else:
            yield path


def load_trace(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or lines[0].get("kind") != "config":
        raise ValueError(f"{path}: line 1 is not a config line")
    return lines[0], lines[1:]


def trace_pool_config(cfg: dict[str, Any], ops: list[dict[str, Any]]) -> PoolConfig:
    """The pool config for a trace: its config line, with a request table
    sized for its requests and its encoder lengths."""
    num_requests = sum(1 for op in ops if op["op"] == "add_request")
    config = PoolConfig.from_dict(cfg, max_num_seqs=max(1, num_requests))
    if any(isinstance(g, CrossAttentionSpec) for g in config.groups):
        enc = max((op.get("num_encoder_tokens", 0) for op in ops), default=0)
        config = config.replace(max_encoder_len=max(enc, config.max_model_len))
    return config


# Frees after which the scheduler reschedules the request (it keeps its state).
_RESCHEDULED = ("preempt", "kv_load_failed")


def prefix_sources(ops: Iterable[dict[str, Any]]) -> set[str]:
    """The requests whose tokens a later `add_request` copies (its `prefix`)."""
    return {op["prefix"]["req"] for op in ops if "prefix" in op}


class TraceTranslator:
    """Trace op -> protocol message, and reply -> the trace's `expect` shape.
    Keeps the token lists of the requests in `sources` (a trace prompt may
    copy another's: `prefix_sources`), or of every request if None."""

    def __init__(self, sources: set[str] | None = None) -> None:
        self.sources = sources
        self.tokens: dict[str, list[int]] = {}
        # trace op name -> its message builder (`message`, inlined by replay_ops)
        self.builders = {
            "advance": self._advance, "allocate_slots": _allocate_slots,
            "add_request": self._add_request,
            "get_computed_blocks": lambda op: p.GetComputedBlocks(op["req"]),
            "cache_blocks": lambda op: p.CacheBlocks(op["req"], op["num_computed_tokens"]),
            "remove_skipped_blocks": lambda op: p.RemoveSkippedBlocks(
                op["req"], op["total_computed_tokens"]),
            "free": lambda op: p.Free(op["req"], op.get("reason") in _RESCHEDULED),
            "get_block_ids": lambda op: p.GetBlockIds(op["req"]),
            "num_common_prefix_blocks": lambda op: p.NumCommonPrefixBlocks(op["req"]),
            "new_step_starts": lambda op: p.NewStepStarts(),
            "estimate_cached_tokens": lambda op: p.EstimateCachedTokens(op["req"]),
            "reset_prefix_cache": lambda op: p.ResetPrefixCache(),
            "evict_blocks": lambda op: p.EvictBlocks(op["block_ids"]),
            "usage": lambda op: p.GetStats(),
            "check": lambda op: p.GetStats(FREE_HEAD_LEN),
        }

    def message(self, op: dict[str, Any]):
        """The protocol message for trace op `op`."""
        build = self.builders.get(op["op"])
        if build is None:
            raise ValueError(f"unknown op {op['op']!r}")
        return build(op)

    def _add_request(self, op):
        get = op.get
        prompt = op["prompt"]
        if "prefix" in op:
            prompt = self.tokens[op["prefix"]["req"]][:op["prefix"]["len"]] + prompt
        sources = self.sources
        if sources is None or op["req"] in sources:
            self.tokens[op["req"]] = list(prompt)  # grows with advances; the message must not
        return p.AddRequest(op["req"], prompt, None, 0, get("lora_name"),
                            get("cache_salt"), bool(get("skip_prefix_cache_read")),
                            lora_path=get("lora_path"))

    def _advance(self, op):
        append = op.get("append")
        if append:
            tokens = self.tokens.get(op["req"])
            if tokens is not None:
                tokens.extend(append)
            return p.Advance(op["req"], op["num_computed_tokens"], append)
        return p.Advance(op["req"], op["num_computed_tokens"])

    @staticmethod
    def matches(op: dict[str, Any], reply) -> bool:
        """True when `reply` certainly is what `op` expects (decided for the
        frequent replies without building the expect shape); False sends
        the caller to `got` and `check_reply`, which decide."""
        cls = reply.__class__
        want = op.get("expect")
        if cls is p.Done:
            return want is None
        if want is None:
            return False
        # (each expect shape has exactly the keys `got` builds)
        if cls is p.Allocated:
            new = reply.new_block_ids
            return (len(want) == 2 and want.get("num_free_blocks") == reply.num_free_blocks
                    # (the core's allocations are tuples of lists)
                    and want.get("new_block_ids") == (new if new is None or new.__class__ is list
                                                      else list(new)))
        if cls is p.FreeBlocks:
            return len(want) == 1 and want.get("num_free_blocks") == reply.num_free_blocks
        if cls is p.ComputedBlocks:   # (a version 2 trace also expects the boundary)
            return (len(want) == 2 + ("shared_prefix_boundary" in want)
                    and want.get("shared_prefix_boundary", 0) == reply.shared_prefix_boundary
                    and want.get("num_computed_tokens") == reply.num_computed_tokens
                    and want.get("block_ids") == _lists(reply.block_ids))
        if cls is p.Stats and op["op"] == "check":
            return (len(want) == 2 and want.get("num_free_blocks") == reply.num_free_blocks
                    and want.get("free_head") == reply.free_head)
        return False

    @staticmethod
    def got(op: dict[str, Any], reply) -> dict[str, Any] | None:
        """Reply `reply` to `op` in the trace's `expect` shape (an error as
        {"error": code, "message": ...})."""
        cls = reply.__class__
        if cls is p.Done:
            return None
        if cls is p.Allocated:
            new = reply.new_block_ids
            return {"new_block_ids": None if new is None else _lists(new),
                    "num_free_blocks": reply.num_free_blocks}
        if cls is p.Error:
            return {"error": reply.code, "message": reply.message}
        if cls is p.ComputedBlocks:
            out = {"block_ids": _lists(reply.block_ids),
                   "num_computed_tokens": reply.num_computed_tokens}
            if "shared_prefix_boundary" in (op.get("expect") or {}):
                out["shared_prefix_boundary"] = reply.shared_prefix_boundary
            return out
        if cls is p.CachedTokens:
            return {"num_tokens": reply.num_tokens}
        if cls is p.FreeBlocks:
            return {"num_free_blocks": reply.num_free_blocks}
        if cls is p.BlockIds:
            return {"block_ids": _lists(reply.block_ids)}
        if cls is p.CommonPrefix:
            return {"num_blocks": reply.num_blocks}
        if cls is p.ResetResult:
            return {"ok": reply.ok}
        if cls is p.Stats:
            if op["op"] == "usage":
                return {"usage": reply.usage}
            return {"num_free_blocks": reply.num_free_blocks, "free_head": reply.free_head}
        raise ValueError(f"unexpected reply {reply!r} to {op['op']}")


def _allocate_slots(op):
    get = op.get   # (the trace's flags are JSON booleans)
    msg = p.AllocateSlots(
        op["req"], op["num_new_tokens"], get("num_new_computed_tokens", 0),
        get("use_computed_blocks", False), get("num_lookahead_tokens", 0),
        get("num_external_computed_tokens", 0), get("delay_cache_blocks", False),
        get("num_encoder_tokens", 0))
    if ("waiting" in op or "full_sequence_must_fit" in op or "has_scheduled_reqs" in op
            or "reserved_blocks" in op):
        # vLLM 0.32's admission (format version 2; not looked up for the rest)
        msg = msgspec.structs.replace(
            msg, full_sequence_must_fit=get("full_sequence_must_fit", False),
            waiting=get("waiting", False), has_scheduled_reqs=get("has_scheduled_reqs", True),
            reserved_blocks=get("reserved_blocks", 0))
    return msg


def _lists(groups) -> list[list[int]]:
    """Block ids per group as lists (the executor's replies may hold the
    core's tuples; decoded replies hold lists)."""
    return [g if g.__class__ is list else list(g) for g in groups]


class EmbeddedReplayer:
    """Executes trace ops on an in-process pool through the op executor (the
    coordinator's own request upkeep), as one admin session."""

    def __init__(self, config: PoolConfig, *, kv_events: bool = False,
                 sources: set[str] | None = None) -> None:
        self.mgr = KVCacheManager(config, kv_events=kv_events)
        # Op latency histograms off, as the reference runs vLLM's manager
        # with log_stats off (nobody watches a replay's pool).
        self.executor = OpExecutor(self.mgr, time_ops=False)
        self.owner = self.executor.lifecycle.open(1, admin=True)
        self.translator = TraceTranslator(sources)

    def close(self) -> None:
        self.mgr.close()

    def apply(self, op: dict[str, Any]) -> dict[str, Any] | None:
        """Run one trace op; its result in the trace's `expect` shape (an
        error reply as {"error": code, "message": ...})."""
        tr = self.translator
        return tr.got(op, self.executor.execute(self.owner, tr.message(op)))


@dataclass
class Mismatch:
    line: int
    op: str
    request: str
    expected: Any
    got: Any

    def __str__(self) -> str:
        who = f" {self.request}" if self.request else ""
        return (f"line {self.line} ({self.op}{who}): expected {self.expected!r}, "
                f"got {self.got!r}")


def differs(op: dict[str, Any], got: dict[str, Any] | None) -> bool:
    want = op.get("expect")
    if want is None:
        return False
    if op["op"] == "usage":
        return got is None or abs(want["usage"] - got["usage"]) > 1e-9
    return want != got


def check_reply(op, got, line: int) -> Mismatch | None:
    """The mismatch of reply  (the trace shape) to  at , or None."""
    if got is not None and "error" in got:
        return Mismatch(line, op["op"], op.get("req", ""), op.get("expect"),
                        f"error {got['error']}: {got['message']}")
    if differs(op, got):
        return Mismatch(line, op["op"], op.get("req", ""), op.get("expect"), got)
    return None


def replay_ops(replayer: EmbeddedReplayer, ops: list[dict[str, Any]]) -> Mismatch | None:
    """Run every op; the first mismatch (line numbers count the config line
    as line 1), or None.  An error reply, or an exception from kvshm, counts
    as a mismatch."""
    tr = replayer.translator
    build, matches, got = tr.builders, tr.matches, tr.got
    execute, owner = replayer.executor.execute, replayer.owner
    for i, op in enumerate(ops):
        try:
            reply = execute(owner, build[op["op"]](op))
        except Exception as e:  # noqa: BLE001 - reported as the mismatch
            if op["op"] not in build:
                e = ValueError(f"unknown op {op['op']!r}")
            return Mismatch(i + 2, op["op"], op.get("req", ""), op.get("expect"),
                            f"raised {type(e).__name__}: {e}")
        if reply is DONE:   # (most ops: the executor's one Done)
            if "expect" not in op:
                continue
        elif matches(op, reply):
            continue
        if (m := check_reply(op, got(op, reply), i + 2)) is not None:
            return m
    return None


def replay_trace(cfg: dict[str, Any], ops: list[dict[str, Any]],
                 after=None) -> Mismatch | None:
    """Replay on a fresh pool; `after(manager)` runs before the pool closes
    (e.g. an invariant check)."""
    r = EmbeddedReplayer(trace_pool_config(cfg, ops), sources=prefix_sources(ops))
    try:
        mismatch = replay_ops(r, ops)
        if after is not None:
            after(r.mgr)
        return mismatch
    finally:
        r.close()


def bench_trace(cfg: dict[str, Any], ops: list[dict[str, Any]],
                runs: int = 3) -> tuple[Mismatch | None, list[float]]:
    """Time full replays (a fresh pool each, parsing excluded, every expect
    checked), as the reference runner does.  Returns (mismatch, seconds)."""
    config = trace_pool_config(cfg, ops)
    sources = prefix_sources(ops)   # (read with the trace: its tokens are the only copies kept)
    times = []
    mismatch = None
    for _ in range(runs):
        t0 = time.perf_counter()
        r = EmbeddedReplayer(config, sources=sources)
        mismatch = replay_ops(r, ops)
        times.append(time.perf_counter() - t0)
        r.close()
        if mismatch:
            break
    return mismatch, times


def median_ops_per_second(num_ops: int, times: list[float]) -> float:
    return num_ops / statistics.median(times)


# -- KV-cache event streams (tests/data/conformance/EVENTS.md) -------------------------------
def load_events(path: Path) -> tuple[dict[str, Any], list[tuple[int, list]]]:
    """An event-stream file: its header line and [(trace line, events)], each
    event the positional array of the wire form."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or lines[0].get("kind") != "events":
        raise ValueError(f"{path}: line 1 is not an events header")
    return lines[0], [(row["line"], row["events"]) for row in lines[1:]]


def events_trace(events_path: Path, traces: Path) -> Path:
    """The trace an event-stream file was recorded from, in `traces`."""
    name = events_path.name.split(".")[0]
    for suffix in (".jsonl.gz", ".jsonl"):
        if (traces / (name + suffix)).exists():
            return traces / (name + suffix)
    raise FileNotFoundError(f"no trace {name} in {traces} for {events_path.name}")


def replay_events(config: PoolConfig, ops: list[dict[str, Any]]
                  ) -> tuple[Mismatch | None, list[tuple[int, list]]]:
    """Replay `ops` on a fresh pool of `config` recording KV-cache events:
    (the first reply mismatch or None, [(trace line, events)] for the ops
    that produced any, each event the positional array of the wire form)."""
    r = EmbeddedReplayer(config, kv_events=True)
    tr, mgr = r.translator, r.mgr
    execute, owner = r.executor.execute, r.owner
    out: list[tuple[int, list]] = []
    mismatch = None
    try:
        for i, op in enumerate(ops):
            try:
                res = tr.got(op, execute(owner, tr.message(op)))
            except Exception as e:  # noqa: BLE001 - reported as the mismatch
                mismatch = Mismatch(i + 2, op["op"], op.get("req", ""), op.get("expect"),
                                    f"raised {type(e).__name__}: {e}")
                break
            if mismatch is None and (res is not None or "expect" in op):
                mismatch = check_reply(op, res, i + 2)
            events = mgr.take_events()
            if events:
                # As a subscriber decodes the wire form (msgpack: trailing
                # default fields left out).
                out.append((i + 2, msgspec.msgpack.decode(msgspec.msgpack.encode(events))))
    finally:
        r.close()
    return mismatch, out


def hash_pattern(stream: list[tuple[int, list]]) -> list[tuple[int, list]]:
    """`stream` with each distinct block hash (block_hashes and the parent)
    replaced by the index of its first appearance: what two streams hashed
    by different functions must share."""
    index: dict[int, int] = {}

    def idx(h):
        return None if h is None else index.setdefault(h, len(index))

    out = []
    for line, events in stream:
        mapped = []
        for ev in events:
            ev = list(ev)
            if ev[0] == "BlockStored":
                ev[1] = [idx(h) for h in ev[1]]
                ev[2] = idx(ev[2])
            elif ev[0] == "BlockRemoved":
                ev[1] = [idx(h) for h in ev[1]]
            mapped.append(ev)
        out.append((line, mapped))
    return out


def first_event_difference(got: list[tuple[int, list]], want: list[tuple[int, list]]
                           ) -> str | None:
    """Where two event streams first differ (by trace line, then event), or None."""
    for (gl, ge), (wl, we) in zip(got, want):
        if gl != wl:
            return f"events at trace line {gl}, expected the next ones at line {wl}"
        if ge != we:
            k = next((j for j, (a, b) in enumerate(zip(ge, we)) if a != b), min(len(ge), len(we)))
            return (f"line {wl}, event {k}: expected {we[k] if k < len(we) else 'none'}, "
                    f"got {ge[k] if k < len(ge) else 'none'}")
    if len(got) != len(want):
        extra = got[len(want)] if len(got) > len(want) else want[len(got)]
        return (f"{len(got)} lines with events, expected {len(want)} (first unmatched: "
                f"line {extra[0]})")
    return None
