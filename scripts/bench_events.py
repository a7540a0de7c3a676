#!/usr/bin/env python3
"""Coordinator ops/s with KV events published vs not (issue 12's 0.9x target).

Two `kvshm serve` children on the same pool config, one with
`--kv-events-config` (publishing to an ipc endpoint that a subscriber in
this process drains, so every batch is really sent), one without; the
service benchmark's recorded scheduler workload (scripts/service_load.py:
per client its own prompts, every step's ops in frames of at most --batches
ops) is replayed against each in turn, the order alternating per round, and
the ratio events-on / events-off is taken per round and configuration, then
its median.  The events each run produced are counted (the stream is live:
every cached block is a BlockStored, every reset an AllBlocksCleared).

    python scripts/bench_events.py                       # ~1 min on 2 cores
    python scripts/bench_events.py --clients 1 2 --batches 1 64 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvshm.core.specs import FullSpec, PoolConfig  # noqa: E402
from kvshm.service.events import EventCollector  # noqa: E402
from kvshm.workload import WorkloadSpec  # noqa: E402
from service_load import (  # noqa: E402
    Workers,
    record_workload,
    reset_pool,
    start_coordinator,
    summarize_run,
)

TARGET = 0.9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-blocks", type=int, default=65536)
    ap.add_argument("--requests", type=int, default=200, help="workload requests per client")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-subscriber", action="store_true",
                    help="publish to nobody (the events are recorded, encoded and handed "
                    "to ZMQ, which drops them): the coordinator's own cost without a "
                    "subscriber's CPU on this host")
    ap.add_argument("--json", default=str(REPO / "bench-results" / "events.json"))
    args = ap.parse_args()
    config = PoolConfig(num_blocks=args.num_blocks, hash_block_size=16, max_model_len=4096,
                        groups=(FullSpec(16),), max_num_seqs=1024)
    recs = [record_workload(config, WorkloadSpec(num_requests=args.requests,
                                                 seed=args.seed + k))
            for k in range(max(args.clients))]
    print(f"workload: {args.requests} requests/client, {recs[0].num_ops:,} ops a client",
          flush=True)
    d = tempfile.mkdtemp(prefix="kvshm-bench-events-")
    kv = {"enable_kv_cache_events": True, "endpoint": f"ipc://{d}/pub"}
    coords = {}
    workers = drain = None
    configs = [(n, b) for n in sorted(set(args.clients)) for b in args.batches]
    runs: dict = {(mode, n, b): [] for mode in ("off", "on") for n, b in configs}
    try:
        coords["off"] = start_coordinator(config)
        coords["on"] = start_coordinator(config, ("--kv-events-config", json.dumps(kv)))
        drain = None if args.no_subscriber else EventCollector(kv["endpoint"], keep=False)
        workers = Workers(recs, config)
        for rnd in range(args.rounds):
            order = ("off", "on") if rnd % 2 == 0 else ("on", "off")
            for n, b in configs:
                for mode in order:
                    coord = coords[mode]
                    reset_pool(coord.socket)
                    row = summarize_run(n, b, workers.run(n, coord.socket, b,
                                                          f"{mode}{rnd}"), 0.0)
                    if row["errors"] or row["hit_mismatches"]:
                        raise RuntimeError(f"{mode}: {row['errors']} errors, "
                                           f"{row['hit_mismatches']} hit mismatches")
                    runs[(mode, n, b)].append(row["ops_per_s"])
                    print(f"  round {rnd + 1}/{args.rounds}: events {mode:3s} {n} client(s), "
                          f"batch {b:>2}: {row['ops_per_s']:>9,.0f} ops/s", flush=True)
        time.sleep(0.5)                      # the last batches reach the drain
    finally:
        if workers is not None:
            workers.stop()
        if drain is not None:
            drain.stop()
        for coord in coords.values():
            coord.stop()
    rows = []
    for n, b in configs:
        on, off = runs[("on", n, b)], runs[("off", n, b)]
        ratio = statistics.median(a / c for a, c in zip(on, off))
        rows.append({"clients": n, "batch": b, "ops_per_s_off": statistics.median(off),
                     "ops_per_s_on": statistics.median(on), "ratio": ratio,
                     "rounds_off": off, "rounds_on": on})
    got = (f"the events subscriber got {drain.num_batches:,} batches, "
           f"{drain.num_events:,} events" if drain is not None else "no subscriber")
    print(f"\nKV events on vs off (median of {args.rounds} rounds; {got})")
    print("  clients batch    off ops/s     on ops/s  ratio")
    for r in rows:
        print(f"  {r['clients']:7d} {r['batch']:5d} {r['ops_per_s_off']:12,.0f} "
              f"{r['ops_per_s_on']:12,.0f}  {r['ratio']:.2f}")
    worst = min(r["ratio"] for r in rows)
    print(f"  {'PASS' if worst >= TARGET else 'MISS'}  worst ratio {worst:.2f} (target >= "
          f"{TARGET})")
    out = {"benchmark": "events", "rows": rows, "worst_ratio": worst, "target": TARGET,
           "subscriber": drain is not None,
           "subscriber_batches": drain.num_batches if drain else 0,
           "subscriber_events": drain.num_events if drain else 0}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
