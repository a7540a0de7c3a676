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
    python scripts/bench_replay.py --instructions       # + instructions per op
    python scripts/bench_replay.py --instructions --against main~3

`--instructions` also counts the instructions one op takes (valgrind's
callgrind: the difference between 3 replays and 1 in a fresh interpreter,
trace parsing excluded, over the ops), for kvshm and the reference; with
`--against`, for each tree.  Unlike seconds, the count is the same from run
to run whatever else the machine does (to within 0.5 %), so it shows a
change of a few per cent that the noise of a shared machine hides; time
per instruction differs between the two codes, so quote ratios of seconds
as the speed figure and counts as the evidence for a change.

The reference needs `../shared/oracle/get_vllm.sh` run once (it downloads
the vLLM wheel into /tmp/kvshm-oracle); without it, kvshm's figures alone
are printed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from bench_common import ORACLE, ORACLE_PY, REPO, add_json_argument, write_results
from bench_guard import GuardError, alternate, compare, revision_tree
from kvshm.replay import bench_trace, expand_paths, load_trace

TRACES = REPO / "tests" / "data" / "conformance" / "traces"
DEFAULT = [
    # full attention, hybrid full + sliding window, EAGLE: the largest of each
    "spec-full16-large-short-s2603.jsonl.gz",
    "hyb3-full-sw-sw-tiny-chat-s2300.jsonl.gz",
    "eagle-full16-large-short-s2503.jsonl.gz",
]
_OPS = re.compile(r"-> ([\d,]+) ops/s")
_COLLECTED = re.compile(r"Collected : (\d+)")
# What valgrind runs: K replays of a trace after loading it, with kvshm's
# embedded replay (the API every revision since 0b3bf97 has) or the
# reference runner's.
_KVSHM_LOOP = """import sys
from pathlib import Path
from kvshm.replay import EmbeddedReplayer, load_trace, replay_ops, trace_pool_config
cfg, ops = load_trace(Path(sys.argv[1]))
config = trace_pool_config(cfg, ops)
try:   # (since 2026-12-07: only the prefix sources' tokens are kept, as bench_trace does)
    from kvshm.replay import prefix_sources
    kw = {"sources": prefix_sources(ops)}
except ImportError:
    kw = {}
for _ in range(int(sys.argv[2])):
    r = EmbeddedReplayer(config, **kw)
    assert replay_ops(r, ops) is None
    r.close()
"""
_REFERENCE_LOOP = """import sys
sys.path.insert(0, sys.argv[3])
import replay_vllm
from pathlib import Path
cfg, ops = replay_vllm.load(Path(sys.argv[1]))
for _ in range(int(sys.argv[2])):
    ok, msg = replay_vllm.replay(cfg, ops)
    assert ok, msg
"""


def instructions_per_op(path: Path, num_ops: int, *, tree: Path = REPO,
                        reference: bool = False) -> float:
    """Instructions one trace op takes (see the module doc).  Raises
    RuntimeError when valgrind is missing or the replay fails."""
    if shutil.which("valgrind") is None:
        raise RuntimeError("--instructions needs valgrind (the Debian package valgrind)")
    counts = []
    for k in (1, 3):
        py, loop = (ORACLE_PY, _REFERENCE_LOOP) if reference else (sys.executable, _KVSHM_LOOP)
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", str(py), "-c",
             loop, str(path), str(k), str(ORACLE)],
            # (cwd: `python -c` puts it first on sys.path; one hash seed for every
            # count: with random ones, dicts and sets differ from run to run, and
            # so did the counts, by up to 1 %)
            capture_output=True, text=True, cwd=tree,
            env={**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"})
        m = _COLLECTED.search(proc.stderr)
        if proc.returncode != 0 or not m:
            raise RuntimeError(f"counting {path.name} failed:\n{proc.stderr[-2000:]}")
        counts.append(int(m.group(1)))
    return (counts[1] - counts[0]) / 2 / num_ops


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
    ap.add_argument("--instructions", action="store_true",
                    help="also count instructions per op under valgrind (deterministic)")
    ap.add_argument("--cpu", type=int,
                    help="the CPU this benchmark and the reference runner are pinned to "
                    "(default: the first this process may use)")
    add_json_argument(ap, "replay")
    args = ap.parse_args()
    paths = list(expand_paths(args.traces)) if args.traces else [TRACES / t for t in DEFAULT]
    # Both sides on one CPU: on a shared VM one vCPU can run 40 % slower
    # than the other for seconds at a time, and an unpinned reference run
    # may land on the other one (the subprocesses inherit the pinning).
    cpu = min(os.sched_getaffinity(0)) if args.cpu is None else args.cpu
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError as e:
        ap.error(f"--cpu {cpu}: {e.strerror}")
    print(f"pinned to CPU {cpu}, with the reference runner", flush=True)
    if args.against:
        return against(args.against, args.rounds, paths, args.json, args.instructions)
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
            # Each round's pair was measured back to back: the median of their
            # ratios is the figure least moved by the machine's slow spells.
            row["ratio_rounds"] = [a / b for a, b in zip(ours, ref)]
            row["ratio_of_rounds"] = statistics.median(row["ratio_rounds"])
            line += (f"   vLLM {row['reference_ops_per_s']:>10,.0f} ops/s"
                     f"   ratio {row['ratio']:.2f}x (per round {row['ratio_of_rounds']:.2f}x)")
        if args.instructions:
            try:
                row["kvshm_instructions_per_op"] = instructions_per_op(path, len(ops))
                line += f"   {row['kvshm_instructions_per_op']:,.0f} instr/op"
                if use_ref:
                    row["reference_instructions_per_op"] = instructions_per_op(
                        path, len(ops), reference=True)
                    row["instructions_ratio"] = (row["reference_instructions_per_op"]
                                                 / row["kvshm_instructions_per_op"])
                    line += (f" (vLLM {row['reference_instructions_per_op']:,.0f}, "
                             f"{row['instructions_ratio']:.2f}x fewer)")
            except RuntimeError as e:
                print(f"bench_replay: {e}", file=sys.stderr)
                return 2
        print(line, flush=True)
        results.append(row)
    write_results(args.json, {"benchmark": "replay", "rounds": args.rounds, "cpu": cpu,
                              "results": results})
    return 0


def against(rev: str, rounds: int, paths: list[Path], json_path: str,
            instructions: bool) -> int:
    """This checkout vs `rev` on the same trace files (bench_guard.py); with
    `instructions`, also each tree's instructions per op (counted once:
    they do not vary)."""
    args = ["--no-reference", "--rounds", "1", *(str(p.resolve()) for p in paths)]
    try:
        ours, theirs = alternate(rev, rounds, "bench_replay.py", args, lambda doc: {
            f"{r['trace']} ops/s": r["kvshm_ops_per_s"] for r in doc["results"]})
        if instructions:
            with revision_tree(rev) as tree:
                for path in paths:
                    n = len(load_trace(path)[1])
                    key = f"{path.name} instructions/op"
                    for side, where in ((ours, REPO), (theirs, tree)):
                        count = instructions_per_op(path, n, tree=where)
                        for rnd in side:
                            rnd[key] = count
    except (GuardError, RuntimeError) as e:
        print(f"bench_replay: {e}", file=sys.stderr)
        return 2
    write_results(json_path, {"benchmark": "replay", **compare(
        rev, ours, theirs, lambda name: name.endswith("instructions/op"))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
