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
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections import defaultdict

from bench_common import REPO, add_json_argument, write_results
from kvshm.replay import (EmbeddedReplayer, TraceTranslator, expand_paths,
                          load_trace, replay_ops, trace_pool_config)

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
    prebuilt = list(map(TraceTranslator().message, ops))

    def whole():
        r = EmbeddedReplayer(config)
        assert replay_ops(r, ops) is None
        r.close()

    def no_check():
        r = EmbeddedReplayer(config)
        build, execute, owner = r.translator.builders, r.executor.execute, r.owner
        for op in ops:
            execute(owner, build[op["op"]](op))
        r.close()

    def built():
        r = EmbeddedReplayer(config)
        execute, owner = r.executor.execute, r.owner
        for m in prebuilt:
            execute(owner, m)
        r.close()

    def handlers():
        r = EmbeddedReplayer(config)
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="*", help="trace files or directories")
    ap.add_argument("--runs", type=int, default=15, help="replays per timing (the fastest)")
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
        rows.append({"trace": path.name, "ops": len(ops), "us_per_op": us, "parts": parts,
                     "handlers_by_room": rooms})
        print(f"{path.name}: {len(ops):,} ops, whole {us['whole']:.2f} us/op = "
              + " + ".join(f"{k} {v:.2f}" for k, v in parts.items()))
        print("  handlers and core by room (cProfile tottime): "
              + ", ".join(f"{k} {v:.0%}" for k, v in rooms.items()), flush=True)
    write_results(args.json, {"benchmark": "profile_replay", "runs": args.runs, "traces": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
