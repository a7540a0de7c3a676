#!/usr/bin/env python3
"""Coordinator ops/s with KV events published vs not (the target: at least 0.9x).

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
import sys
import tempfile
import time

from bench_common import add_json_argument, write_results
from kvshm.service.events import EventCollector
from service_load import (Workers, ab_rounds, ab_rows, ab_workload, add_ab_arguments,
    start_coordinator)

TARGET = 0.9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_ab_arguments(ap)
    ap.add_argument("--no-subscriber", action="store_true",
                    help="publish to nobody (the events are recorded, encoded and handed "
                    "to ZMQ, which drops them): the coordinator's own cost without a "
                    "subscriber's CPU on this host")
    add_json_argument(ap, "events")
    args = ap.parse_args()
    config, recs = ab_workload(args)
    d = tempfile.mkdtemp(prefix="kvshm-bench-events-")
    kv = {"enable_kv_cache_events": True, "endpoint": f"ipc://{d}/pub"}
    coords = {}
    workers = drain = None
    try:
        coords["off"] = start_coordinator(config)
        coords["on"] = start_coordinator(config, ("--kv-events-config", json.dumps(kv)))
        drain = None if args.no_subscriber else EventCollector(kv["endpoint"], keep=False)
        workers = Workers(recs, config)
        runs = ab_rounds(args, workers, {m: c.socket for m, c in coords.items()}, "events")
        time.sleep(0.5)                      # the last batches reach the drain
    finally:
        if workers is not None:
            workers.stop()
        if drain is not None:
            drain.stop()
        for coord in coords.values():
            coord.stop()
    rows = ab_rows(runs)
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
    write_results(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
