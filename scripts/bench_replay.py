#!/usr/bin/env python3
"""Replay speed of kvshm's core against vLLM's own KVCacheManager.

For each trace, alternates rounds of kvshm's embedded replay (in this
process) and the reference runner (vLLM 0.14.0's pure-Python manager, in its
own interpreter via ../shared/oracle/replay_vllm.py --bench), so both see the
same machine load.  Each round is a median of 3 timed replays (parsing
excluded, a fresh pool per replay, request upkeep with sha256 hashing, every
expect checked).  Prints ops/s and the ratio of medians; writes JSON.

    python scripts/bench_replay.py                      # the default trio
    python scripts/bench_replay.py --rounds 5 TRACE...  # any traces
    python scripts/bench_replay.py --no-reference       # kvshm only
    python scripts/bench_replay.py --against main~3     # this tree vs a revision

The reference needs `../shared/oracle/get_vllm.sh` run once (it downloads
the vLLM wheel into /tmp/kvshm-oracle); without it, kvshm's figures alone
are printed.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

from bench_common import ORACLE, ORACLE_PY, REPO, add_json_argument, write_results
from bench_guard import GuardError, alternate, compare
from kvshm.replay import bench_trace, expand_paths, load_trace

TRACES = REPO / "tests" / "data" / "conformance" / "traces"
DEFAULT = [
    # full attention, hybrid full + sliding window, EAGLE: the largest of each
    "spec-full16-large-short-s2603.jsonl.gz",
    "hyb3-full-sw-sw-tiny-chat-s2300.jsonl.gz",
    "eagle-full16-large-short-s2503.jsonl.gz",
]
_OPS = re.compile(r"-> ([\d,]+) ops/s")


def reference_ops_per_second(path: Path) -> float | None:
    proc = subprocess.run(
        [str(ORACLE_PY), str(ORACLE / "replay_vllm.py"), "--bench", str(path)],
        capture_output=True, text=True, check=False)
    m = _OPS.search(proc.stdout)
    if proc.returncode != 0 or not m:
        sys.stderr.write(f"reference runner failed on {path.name}:\n{proc.stdout}{proc.stderr}")
        return None
    return float(m.group(1).replace(",", ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="*", help="trace files or directories")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per trace")
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--against", metavar="REV",
                    help="compare this checkout with git revision REV instead (kvshm only, "
                    "each side in its own process, --rounds alternating rounds)")
    add_json_argument(ap, "replay")
    args = ap.parse_args()
    paths = list(expand_paths(args.traces)) if args.traces else [TRACES / t for t in DEFAULT]
    if args.against:
        return against(args.against, args.rounds, paths, args.json)
    use_ref = not args.no_reference and ORACLE_PY.exists() and (ORACLE / "replay_vllm.py").exists()
    if not use_ref and not args.no_reference:
        print(f"(reference runner not found: run {ORACLE}/get_vllm.sh; kvshm only)")
    results = []
    for path in paths:
        cfg, ops = load_trace(path)
        ours, ref = [], []
        for _ in range(args.rounds):
            mismatch, times = bench_trace(cfg, ops)
            if mismatch:
                print(f"{path.name}: FAIL {mismatch}")
                return 1
            ours.append(len(ops) / statistics.median(times))
            if use_ref:
                r = reference_ops_per_second(path)
                if r is not None:
                    ref.append(r)
        row = {"trace": path.name, "ops": len(ops),
               "kvshm_ops_per_s": statistics.median(ours), "kvshm_rounds": ours}
        line = f"{path.name:45s} kvshm {row['kvshm_ops_per_s']:>10,.0f} ops/s"
        if ref:
            row["reference_ops_per_s"] = statistics.median(ref)
            row["reference_rounds"] = ref
            row["ratio"] = row["kvshm_ops_per_s"] / row["reference_ops_per_s"]
            line += (f"   vLLM {row['reference_ops_per_s']:>10,.0f} ops/s"
                     f"   ratio {row['ratio']:.2f}x")
        print(line, flush=True)
        results.append(row)
    write_results(args.json, {"benchmark": "replay", "rounds": args.rounds, "results": results})
    return 0


def against(rev: str, rounds: int, paths: list[Path], json_path: str) -> int:
    """This checkout vs `rev` on the same trace files (bench_guard.py)."""
    args = ["--no-reference", "--rounds", "1", *(str(p.resolve()) for p in paths)]
    try:
        ours, theirs = alternate(rev, rounds, "bench_replay.py", args, lambda doc: {
            f"{r['trace']} ops/s": r["kvshm_ops_per_s"] for r in doc["results"]})
    except GuardError as e:
        print(f"bench_replay: {e}", file=sys.stderr)
        return 2
    write_results(json_path, {"benchmark": "replay", **compare(rev, ours, theirs)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
