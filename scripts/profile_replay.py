#!/usr/bin/env python3
"""Where an embedded replay's time goes, per op: the parts of
`kvshm replay --bench`'s loop measured by taking them away one by one, and
a cProfile of the rest by room.  docs/hot-path.md quotes its figures.

    python scripts/profile_replay.py                 # bench_replay.py's traces
    python scripts/profile_replay.py TRACE... --runs 15

The loop does, per trace op: build the protocol message (translation),
`OpExecutor.execute` (dispatch), the op's handler (request upkeep) and the
core under it (managers, block pool, request table, journal), then compare
the reply with the trace's expect (check).  Four timings, each the fastest
of --runs full replays on a fresh pool:

    whole      the loop as bench_trace runs it
    no check   replies not compared
    prebuilt   messages built before the clock starts, no check
    handlers   prebuilt, each handler called without execute()

so translation = no check - prebuilt, check = whole - no check, dispatch =
prebuilt - handlers.  The cProfile splits `handlers` by where the functions
live.  Figures are microseconds per trace op; the machine's noise moves
them by 10-20 %, so compare parts within one run.

`--by-op` adds, per kind of trace op, the microseconds one op of that kind
takes in the whole loop, beside the same figure of vLLM 0.14.0's manager
under the reference runner's loop (`../shared/oracle`, run with its own
Python): which ops lose to the reference, and by how much.  Each side's
figure is the fastest of --runs replays of its per-kind total (two clock
reads an op on both sides).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import subprocess
import sys
import time
from collections import defaultdict

from bench_common import ORACLE, ORACLE_PY, REPO, add_json_argument, write_results
from kvshm.replay import (EmbeddedReplayer, TraceTranslator, check_reply, expand_paths,
                          load_trace, prefix_sources, replay_ops, trace_pool_config)

TRACES = REPO / "tests" / "data" / "conformance" / "traces"
DEFAULT = ["spec-full16-large-short-s2603.jsonl.gz", "hyb3-full-sw-sw-tiny-chat-s2300.jsonl.gz",
           "eagle-full16-large-short-s2503.jsonl.gz"]
# Where a profiled function lives -> the part of the work it is.
ROOMS = (("kvshm/ops/", "executor handlers"), ("kvshm/core/journal.py", "journal"),
         ("kvshm/core/table.py", "request table"), ("kvshm/core/block_pool.py", "block pool"),
         ("kvshm/core/hash_map.py", "block pool"), ("kvshm/core/request.py", "request + hashing"),
         ("kvshm/core/hashing.py", "request + hashing"),
         ("kvshm/core/extra_keys.py", "request + hashing"), ("kvshm/core/", "managers"))


def loops(config, ops):
    """The four loops (name -> a function replaying `ops` once)."""
    sources = prefix_sources(ops)
    prebuilt = list(map(TraceTranslator(sources).message, ops))

    def whole():
        r = EmbeddedReplayer(config, sources=sources)
        assert replay_ops(r, ops) is None
        r.close()

    def no_check():
        r = EmbeddedReplayer(config, sources=sources)
        build, execute, owner = r.translator.builders, r.executor.execute, r.owner
        for op in ops:
            execute(owner, build[op["op"]](op))
        r.close()

    def built():
        r = EmbeddedReplayer(config, sources=sources)
        execute, owner = r.executor.execute, r.owner
        for m in prebuilt:
            execute(owner, m)
        r.close()

    def handlers():
        r = EmbeddedReplayer(config, sources=sources)
        handler_of, owner = r.executor.handlers, r.owner
        for m in prebuilt:
            handler_of[m.__class__](owner, m)
        r.close()

    return {"whole": whole, "no check": no_check, "prebuilt": built, "handlers": handlers}


def fastest(fns: dict, runs: int) -> dict[str, float]:
    """The fastest of `runs` calls of each function, in seconds, the calls
    interleaved so that the machine's drift hits all alike."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(runs):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def by_room(fn, runs: int) -> dict[str, float]:
    """Share of profiled time (tottime) per room, over `runs` calls of `fn`."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(runs):
        fn()
    prof.disable()
    shares: dict[str, float] = defaultdict(float)
    stats = pstats.Stats(prof).stats
    total = sum(v[2] for v in stats.values())
    for (path, _, _), v in stats.items():
        room = next((name for prefix, name in ROOMS if prefix in path), "loop, interpreter")
        shares[room] += v[2] / total
    return dict(sorted(shares.items(), key=lambda kv: -kv[1]))


def _per_kind(replay_once, ops, runs: int) -> dict[str, float]:
    """Trace op kind -> microseconds an op of it takes: `replay_once()`
    returns the nanoseconds per kind of one replay; the fastest of `runs`."""
    best: dict[str, int] = {}
    for _ in range(runs):
        for kind, ns in replay_once().items():
            best[kind] = min(best.get(kind, ns), ns)
    counts: dict[str, int] = defaultdict(int)
    for op in ops:
        counts[op["op"]] += 1
    return {kind: ns / counts[kind] / 1e3 for kind, ns in best.items()}


def by_op(config, ops, runs: int) -> dict[str, float]:
    """kvshm's figure for `--by-op`: replay_ops's loop, each op timed."""
    clock = time.perf_counter_ns
    sources = prefix_sources(ops)

    def once() -> dict[str, int]:
        r = EmbeddedReplayer(config, sources=sources)
        tr = r.translator
        build, matches, got, execute, owner = (tr.builders, tr.matches, tr.got,
                                               r.executor.execute, r.owner)
        acc: dict[str, int] = defaultdict(int)
        try:
            for i, op in enumerate(ops):
                t = clock()
                reply = execute(owner, build[op["op"]](op))
                if not matches(op, reply) and check_reply(op, got(op, reply), i + 2):
                    raise RuntimeError(f"line {i + 2}: kvshm does not replay this trace")
                acc[op["op"]] += clock() - t
        finally:
            r.close()
        return acc

    return _per_kind(once, ops, runs)


# The reference side of `--by-op`, run by the oracle's Python: its runner's
# loop (kvops.VllmState.apply, then expect_equal), each op timed.
_REFERENCE_BY_OP = """import json, sys, time
from collections import defaultdict
sys.path.insert(0, sys.argv[2])
import kvops, replay_vllm
from pathlib import Path
cfg, ops = replay_vllm.load(Path(sys.argv[1]))
clock = time.perf_counter_ns
out = []
for _ in range(int(sys.argv[3])):
    st = kvops.VllmState(cfg)
    acc = defaultdict(int)
    for op in ops:
        t = clock()
        err = kvops.expect_equal(op, st.apply(op))
        acc[op["op"]] += clock() - t
        assert not err, err
    out.append(acc)
print(json.dumps(out))
"""


def reference_by_op(path, ops, runs: int) -> dict[str, float] | None:
    """The reference's figure for `--by-op` (None, said why, when it cannot run)."""
    if not ORACLE_PY.exists():
        print(f"  (no reference: {ORACLE_PY} is missing; ../shared/oracle/get_vllm.sh "
              "installs it)", file=sys.stderr)
        return None
    proc = subprocess.run([str(ORACLE_PY), "-c", _REFERENCE_BY_OP, str(path), str(ORACLE),
                           str(runs)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(f"  (reference runner failed: {proc.stderr.strip()[-400:]})", file=sys.stderr)
        return None
    runs_ns = iter(json.loads(proc.stdout))
    return _per_kind(lambda: next(runs_ns), ops, runs)


def print_by_op(ours: dict[str, float], ref: dict[str, float] | None, ops) -> None:
    counts: dict[str, int] = defaultdict(int)
    for op in ops:
        counts[op["op"]] += 1
    total = sum(ours[k] * counts[k] for k in ours)
    print(f"  {'op':26s} {'count':>6s} {'kvshm us':>9s} {'vLLM us':>8s} {'vLLM/kvshm':>10s} "
          f"{'share of kvshm':>14s}")
    for kind in sorted(ours, key=lambda k: -ours[k] * counts[k]):
        theirs = ref.get(kind) if ref else None
        cmp = f"{theirs:8.2f} {theirs / ours[kind]:9.2f}x" if theirs else f"{'':8s} {'':10s}"
        print(f"  {kind:26s} {counts[kind]:6d} {ours[kind]:9.2f} {cmp} "
              f"{ours[kind] * counts[kind] / total:13.0%}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="*", help="trace files or directories")
    ap.add_argument("--runs", type=int, default=15, help="replays per timing (the fastest)")
    ap.add_argument("--by-op", action="store_true",
                    help="also time each kind of trace op, beside vLLM's reference runner")
    add_json_argument(ap, "profile_replay")
    args = ap.parse_args()
    paths = list(expand_paths(args.traces)) if args.traces else [TRACES / t for t in DEFAULT]
    rows = []
    for path in paths:
        cfg, ops = load_trace(path)
        config = trace_pool_config(cfg, ops)
        fns = loops(config, ops)
        us = {name: t * 1e6 / len(ops) for name, t in fastest(fns, args.runs).items()}
        parts = {"translation": us["no check"] - us["prebuilt"],
                 "check": us["whole"] - us["no check"],
                 "dispatch": us["prebuilt"] - us["handlers"],
                 "handlers and core": us["handlers"]}
        rooms = by_room(fns["handlers"], 3)
        row = {"trace": path.name, "ops": len(ops), "us_per_op": us, "parts": parts,
               "handlers_by_room": rooms}
        rows.append(row)
        print(f"{path.name}: {len(ops):,} ops, whole {us['whole']:.2f} us/op = "
              + " + ".join(f"{k} {v:.2f}" for k, v in parts.items()))
        print("  handlers and core by room (cProfile tottime): "
              + ", ".join(f"{k} {v:.0%}" for k, v in rooms.items()), flush=True)
        if args.by_op:
            ours = by_op(config, ops, args.runs)
            ref = reference_by_op(path, ops, args.runs)
            row["by_op_us"] = {"kvshm": ours, "vllm": ref}
            print_by_op(ours, ref, ops)
    write_results(args.json, {"benchmark": "profile_replay", "runs": args.runs, "traces": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
