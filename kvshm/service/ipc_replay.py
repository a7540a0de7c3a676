"""Conformance-trace replay through a coordinator process (`kvshm replay --ipc`).

For each trace a coordinator is started with the trace's config; the trace's
ops go through the asyncio client, one per round trip or grouped into
batches, and every reply is compared with the recorded expectation exactly as
in embedded replay.
"""

from __future__ import annotations

import time
from typing import Any

from kvshm.core.check import CheckReport, check_segment
from kvshm.core.segment import PoolSegment
from kvshm.replay import FREE_HEAD_LEN, Mismatch, differs, trace_pool_config
from kvshm.service import protocol as p
from kvshm.service.client import Client, connect
from kvshm.service.process import CoordinatorProcess
from kvshm.service.server import run_async

# Frees after which the scheduler reschedules the request (it keeps its state).
_RESCHEDULED = ("preempt", "kv_load_failed")


class _Translator:
    """Trace op -> protocol message, and reply -> the trace's `expect` shape.
    Keeps each request's token list (a trace prompt may copy another's)."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def message(self, op: dict[str, Any]):
        name = op["op"]
        get = op.get
        if name == "add_request":
            prompt = list(op["prompt"])
            if "prefix" in op:
                prompt = self.tokens[op["prefix"]["req"]][:op["prefix"]["len"]] + prompt
            self.tokens[op["req"]] = list(prompt)  # grows with advances; the message must not
            return p.AddRequest(op["req"], prompt, None, 0, get("lora_name"),
                                get("cache_salt"), bool(get("skip_prefix_cache_read")))
        if name == "advance":
            append = get("append") or []
            self.tokens[op["req"]].extend(append)
            return p.Advance(op["req"], op["num_computed_tokens"], append)
        if name == "get_computed_blocks":
            return p.GetComputedBlocks(op["req"])
        if name == "allocate_slots":
            return p.AllocateSlots(
                op["req"], op["num_new_tokens"], get("num_new_computed_tokens", 0),
                bool(get("use_computed_blocks")), get("num_lookahead_tokens", 0),
                get("num_external_computed_tokens", 0), bool(get("delay_cache_blocks")),
                get("num_encoder_tokens", 0))
        if name == "cache_blocks":
            return p.CacheBlocks(op["req"], op["num_computed_tokens"])
        if name == "remove_skipped_blocks":
            return p.RemoveSkippedBlocks(op["req"], op["total_computed_tokens"])
        if name == "free":
            return p.Free(op["req"], get("reason") in _RESCHEDULED)
        if name == "get_block_ids":
            return p.GetBlockIds(op["req"])
        if name == "num_common_prefix_blocks":
            return p.NumCommonPrefixBlocks(op["req"])
        if name == "reset_prefix_cache":
            return p.ResetPrefixCache()
        if name == "evict_blocks":
            return p.EvictBlocks(op["block_ids"])
        if name == "usage":
            return p.GetStats()
        if name == "check":
            return p.GetStats(FREE_HEAD_LEN)
        raise ValueError(f"unknown op {name!r}")

    @staticmethod
    def got(op: dict[str, Any], reply) -> dict[str, Any] | None:
        cls = reply.__class__
        if cls is p.Error:
            return {"error": reply.code, "message": reply.message}
        name = op["op"]
        if cls is p.Done:
            return None
        if cls is p.ComputedBlocks:
            return {"block_ids": reply.block_ids, "num_computed_tokens": reply.num_computed_tokens}
        if cls is p.Allocated:
            return {"new_block_ids": reply.new_block_ids, "num_free_blocks": reply.num_free_blocks}
        if cls is p.FreeBlocks:
            return {"num_free_blocks": reply.num_free_blocks}
        if cls is p.BlockIds:
            return {"block_ids": reply.block_ids}
        if cls is p.CommonPrefix:
            return {"num_blocks": reply.num_blocks}
        if cls is p.ResetResult:
            return {"ok": reply.ok}
        if cls is p.Stats:
            if name == "usage":
                return {"usage": reply.usage}
            return {"num_free_blocks": reply.num_free_blocks, "free_head": reply.free_head}
        raise ValueError(f"unexpected reply {reply!r} to {name}")


def _check(op, got, line: int) -> Mismatch | None:
    if got is not None and "error" in got:
        return Mismatch(line, op["op"], op.get("req", ""), op.get("expect"),
                        f"error {got['error']}: {got['message']}")
    if differs(op, got):
        return Mismatch(line, op["op"], op.get("req", ""), op.get("expect"), got)
    return None


async def replay_through(client: Client, ops: list[dict[str, Any]],
                         batch: int = 0) -> Mismatch | None:
    """Replay `ops` on the coordinator behind `client`: one op per round trip,
    or (batch > 0) up to `batch` ops per frame."""
    tr = _Translator()
    if batch <= 0:
        for i, op in enumerate(ops):
            reply = await client._send(tr.message(op), None)
            if (m := _check(op, tr.got(op, reply), i + 2)) is not None:
                return m
        return None
    for start in range(0, len(ops), batch):
        chunk = ops[start:start + batch]
        reply = await client._send(p.Batch([tr.message(op) for op in chunk]), None)
        if reply.__class__ is p.Error:
            return Mismatch(start + 2, "batch", "", None, f"error {reply.code}: {reply.message}")
        for j, (op, r) in enumerate(zip(chunk, reply.results)):
            if (m := _check(op, tr.got(op, r), start + j + 2)) is not None:
                return m
        if len(reply.results) < len(chunk):
            op = chunk[len(reply.results)]
            return Mismatch(start + len(reply.results) + 2, op["op"], op.get("req", ""),
                            op.get("expect"), "not run (an earlier op of its batch failed)")
    return None


def replay_trace_ipc(cfg: dict, ops: list[dict],
                     batch: int = 0) -> tuple[Mismatch | None, float, CheckReport]:
    """Replay one trace through a fresh coordinator process; returns the
    first mismatch (or None), the seconds the ops took, and a check of the
    coordinator's pool segment (read from this process) after the replay."""
    config = trace_pool_config(cfg, ops)

    async def run() -> tuple[Mismatch | None, float]:
        async with await connect(proc.socket, hash_algorithm=config.hash_algorithm,
                                 hash_seed=config.hash_seed) as client:
            t0 = time.perf_counter()
            m = await replay_through(client, ops, batch)
            return m, time.perf_counter() - t0

    with CoordinatorProcess(config) as proc:
        mismatch, seconds = run_async(run())
        seg = PoolSegment.attach(proc.name)
        try:
            report = check_segment(seg)
        finally:
            seg.close()
        return mismatch, seconds, report
