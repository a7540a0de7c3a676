"""`kvshm replay`: conformance traces replayed in embedded mode, through a
coordinator process (`--ipc`) or one already listening (`--connect`), and
optionally timed (`--bench`)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvshm.core import fmt
from kvshm.core.check import check_segment
from kvshm.core.errors import KvshmError
from kvshm.ops.errors import ConnectionLost, HandshakeError
from kvshm.replay import bench_trace, expand_paths, load_trace, replay_trace
from kvshm.service.ipc_replay import replay_trace_connected, replay_trace_ipc

HELP = "replay conformance traces in embedded mode"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", help=".jsonl/.jsonl.gz files or directories")
    p.add_argument("--bench", action="store_true", help="also time each trace (median of --runs)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--ipc", action="store_true",
                   help="replay through a coordinator process and the client")
    p.add_argument("--batch", action="store_true",
                   help="with --ipc: send ops in batches (scheduler-step frames)")
    p.add_argument("--batch-size", type=int, default=64, help="ops per batch (64)")
    p.add_argument("--connect", metavar="SOCKET",
                   help="with --ipc: replay through the coordinator already listening at "
                   "SOCKET (a fresh pool of the trace's config), e.g. to check its KV-event "
                   "stream")


def main(args: argparse.Namespace) -> int:
    if args.connect and not args.ipc:
        print("kvshm replay: --connect goes with --ipc", file=sys.stderr)
        return 2
    if args.connect and not os.path.exists(args.connect):
        print(f"kvshm replay: no coordinator listening at {args.connect} (no such socket)",
              file=sys.stderr)
        return 2
    missing = [a for a in args.paths if not os.path.exists(a)]
    if missing:
        print(f"kvshm replay: no such file or directory: {', '.join(missing)}",
              file=sys.stderr)
        return 2
    paths = list(expand_paths(args.paths))
    if not paths:
        print("no traces found in " + " ".join(args.paths), file=sys.stderr)
        return 2
    results = []
    passed = failed = 0
    for path in paths:
        row: dict = {"trace": path.name}
        try:
            cfg, ops = load_trace(path)
        except (OSError, ValueError, KvshmError) as e:
            row.update(passed=False, error=f"cannot load: {e}")
            failed += 1
            results.append(row)
            if not args.json:
                print(f"FAIL {path}: cannot load: {e}")
            continue
        row["ops"] = len(ops)
        reports = []
        try:
            if args.connect:
                try:
                    mismatch, seconds, report = replay_trace_connected(
                        args.connect, cfg, ops, batch=args.batch_size if args.batch else 0)
                except (ConnectionLost, HandshakeError) as e:   # no coordinator to use
                    print(f"kvshm replay: {e}", file=sys.stderr)
                    return 2
                if report is not None:
                    reports.append(report)
                    row["ipc_ops_per_s"] = len(ops) / seconds if seconds else None
            elif args.ipc:
                mismatch, seconds, report = replay_trace_ipc(
                    cfg, ops, batch=args.batch_size if args.batch else 0)
                reports.append(report)
                row["ipc_ops_per_s"] = len(ops) / seconds if seconds else None
            else:
                mismatch = replay_trace(
                    cfg, ops, after=lambda mgr: reports.append(
                        check_segment(mgr.segment, mgr.block_pool)))
        except KvshmError as e:  # a config kvshm refuses
            mismatch = f"pool not created: {e}"
        problem = str(mismatch) if mismatch else None
        if problem is None and reports and not reports[0].clean:
            problem = "pool check after replay: " + "; ".join(reports[0].problems)
        if problem is None and args.bench and not args.ipc:
            bench_mismatch, times = bench_trace(cfg, ops, runs=args.runs)
            if bench_mismatch:
                problem = str(bench_mismatch)
            else:
                times.sort()
                med = times[len(times) // 2]
                row.update(runs=[round(t, 6) for t in times], median_s=med,
                           ops_per_s=len(ops) / med)
                if not args.json:
                    print(f"{path.name}: PASS ops={fmt.count(len(ops))} median={med:.4f}s "
                          f"-> {fmt.count(len(ops) / med)} ops/s", flush=True)
        row["passed"] = problem is None
        if problem is None:
            passed += 1
        else:
            failed += 1
            row["mismatch"] = problem
            if not args.json:
                print(f"FAIL {path}: {problem}", flush=True)
        results.append(row)
    if args.json:
        print(json.dumps({"passed": passed, "failed": failed, "traces": results}, indent=2))
    else:
        print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1
