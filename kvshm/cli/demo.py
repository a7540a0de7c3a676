"""`kvshm demo`: a synthetic workload on an embedded pool, then a conformance
replay."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvshm.cli import replay
from kvshm.core import fmt
from kvshm.core.check import check_segment
from kvshm.core.specs import FullSpec, PoolConfig
from kvshm.pool.kv_cache_manager import KVCacheManager
from kvshm.workload.scheduler import Scheduler, run_workload, system_workload

HELP = "run a synthetic workload on an embedded pool"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--traces", default=os.environ.get("KVSHM_TRACES") or source_traces(),
                   help="conformance traces to replay afterwards (default: $KVSHM_TRACES, "
                   "else the source checkout's tests/data; none in an installed package)")


def main(args: argparse.Namespace) -> int:
    if args.traces is not None and not Path(args.traces).exists():
        print(f"kvshm demo: no such file or directory: {args.traces}", file=sys.stderr)
        return 2
    config = PoolConfig(num_blocks=args.num_blocks, hash_block_size=16, max_model_len=4096,
                        groups=(FullSpec(16),), max_num_seqs=256)
    scheduler = Scheduler(system_workload(args.requests, args.seed, config.max_model_len))
    print(f"kvshm demo (embedded mode): one pool of {fmt.count(config.num_blocks)} blocks x "
          f"16 tokens, full attention, max_model_len {fmt.count(config.max_model_len)}")
    with KVCacheManager(config) as mgr:
        print(f"  segment /dev/shm/{mgr.segment.name}: {fmt.nbytes(mgr.segment.layout.size)}")
        res = run_workload(mgr, scheduler)
        report = check_segment(mgr.segment, mgr.block_pool)
        print(f"  {fmt.count(res.finished)} requests served in {fmt.count(res.steps)} "
              f"scheduler steps, {fmt.count(res.preemptions)} preemptions")
        print(f"  prefix-cache hit rate {fmt.percent(res.hit_rate)} of prompt tokens "
              f"({fmt.count(res.hit_tokens)} of {fmt.count(res.prompt_tokens)})")
        print(f"  peak usage {fmt.percent(res.peak_usage)}; {fmt.count(res.manager_calls)} "
              f"ops in {fmt.count(res.frames)} frames, {fmt.count(res.calls_per_second)} "
              "ops/s")
        print(f"  pool check: {report.summary()}")
    status = 0 if report.clean else 1
    if args.traces is None:
        print("no conformance traces to replay: this kvshm is installed, not a source "
              "checkout (give --traces DIR, or set KVSHM_TRACES)")
        return status
    traces = Path(args.traces)
    print(f"conformance replay of {traces}:")
    ns = argparse.Namespace(paths=[str(traces)], bench=False, runs=1, json=False,
                            ipc=False, batch=False, batch_size=0, connect=None)
    return replay.main(ns) or status


def source_traces() -> str | None:
    """The conformance traces of the source checkout this kvshm runs from
    (tests/data beside the package), or None for an installed package."""
    root = Path(__file__).resolve().parents[2]
    traces = root / "tests" / "data" / "conformance" / "traces"
    return str(traces) if (root / "pyproject.toml").is_file() and traces.is_dir() else None
