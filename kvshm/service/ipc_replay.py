"""Conformance-trace replay through a coordinator process (`kvshm replay --ipc`).

For each trace a coordinator is started with the trace's config; the trace's
ops go through the asyncio client, one per round trip or grouped into
batches, and every reply is compared with the recorded expectation exactly as
in embedded replay.

`--connect SOCKET` replays against a coordinator that is already running
instead (so a deployed pool's event stream and metrics can be checked
against the traces).  A trace's replies hold the block ids of a fresh pool,
so the pool must be one nobody has allocated from yet, with the trace's
config (`max_num_seqs` at least the trace's requests; the hashing may
differ: it changes hashes, not replies): `connected_problem` says why not.
"""

from __future__ import annotations

import time
from typing import Any

from kvshm.core.check import CheckReport, check_segment
from kvshm.core.specs import PoolConfig
from kvshm.ops import protocol as p
from kvshm.pool.segment import PoolSegment
from kvshm.pool.stats import read_stats
from kvshm.replay import Mismatch, TraceTranslator, check_reply, trace_pool_config
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


# Fields a connected pool may have that the trace's config does not.
_FREE_FIELDS = ("max_num_seqs", "hash_algorithm", "hash_seed", "kv")


def connected_problem(pool: PoolConfig, want: PoolConfig, stats: dict) -> str | None:
    """Why a running pool cannot replay a trace of config `want` (None: it can)."""
    diff = [f"{name}: pool {getattr(pool, name)!r}, trace {getattr(want, name)!r}"
            for name in want.__struct_fields__
            if name not in _FREE_FIELDS and getattr(pool, name) != getattr(want, name)]
    if pool.max_num_seqs < want.max_num_seqs:
        diff.append(f"max_num_seqs: pool {pool.max_num_seqs}, the trace needs "
                    f"{want.max_num_seqs}")
    if diff:
        return "the pool's config is not the trace's (" + "; ".join(diff) + ")"
    if stats["blocks_allocated"] or stats["num_requests"] or stats["num_cached_blocks"]:
        return (f"the pool is not fresh ({stats['blocks_allocated']:,} blocks allocated "
                f"since it started, {stats['num_requests']} request(s)): a trace's replies "
                "are those of a new pool; restart the coordinator with --fresh")
    return None


def replay_trace_connected(socket: str, cfg: dict, ops: list[dict], batch: int = 0
                           ) -> tuple[Mismatch | str | None, float, CheckReport | None]:
    """Replay one trace through the coordinator listening at `socket`, as an
    admin session with the pool's hashing: (the first mismatch, or a
    refusal as a string, or None; the seconds the ops took; a check of the
    pool segment after the replay, None when refused)."""
    want = trace_pool_config(cfg, ops)

    async def run():
        async with await connect(socket, hash_algorithm=None, admin=True) as client:
            seg = PoolSegment.attach(client.pool_segment)
            try:
                problem = connected_problem(client.config, want, read_stats(seg))
                if problem is not None:
                    return problem, 0.0, None
                t0 = time.perf_counter()
                m = await replay_through(client, ops, batch)
                seconds = time.perf_counter() - t0
                return m, seconds, check_segment(seg)
            finally:
                seg.close()

    return run_async(run())
