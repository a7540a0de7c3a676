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
from kvshm.replay import Mismatch, TraceTranslator, check_reply, trace_pool_config
from kvshm.service import protocol as p
from kvshm.service.client import Client, connect
from kvshm.service.loop import run_async
from kvshm.service.process import CoordinatorProcess

async def replay_through(client: Client, ops: list[dict[str, Any]],
                         batch: int = 0) -> Mismatch | None:
    """Replay `ops` on the coordinator behind `client`: one op per round trip,
    or (batch > 0) up to `batch` ops per frame."""
    tr = TraceTranslator()
    if batch <= 0:
        for i, op in enumerate(ops):
            reply = await client.request(tr.message(op), None)
            if (m := check_reply(op, tr.got(op, reply), i + 2)) is not None:
                return m
        return None
    for start in range(0, len(ops), batch):
        chunk = ops[start:start + batch]
        reply = await client.request(p.Batch([tr.message(op) for op in chunk]), None)
        if reply.__class__ is p.Error:
            return Mismatch(start + 2, "batch", "", None, f"error {reply.code}: {reply.message}")
        for j, (op, r) in enumerate(zip(chunk, reply.results)):
            if (m := check_reply(op, tr.got(op, r), start + j + 2)) is not None:
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
                                 hash_seed=config.hash_seed, admin=True) as client:
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
