#!/usr/bin/env python3
"""Coordinator ops/s with a Prometheus exporter scraping every second vs
without (issue 13: within noise).

One `kvshm serve` child and one `kvshm metrics` process on its pool; the
service benchmark's recorded scheduler workload (scripts/service_load.py)
is replayed against the coordinator in rounds, alternately with a scraper
in this process fetching /metrics every --scrape-interval seconds (each
scrape makes the exporter copy the pool's counters and state out of shared
memory) and without; per round and configuration the ratio scraped /
unscraped, then its median.

    python scripts/bench_metrics.py                      # ~1 min on 2 cores
    python scripts/bench_metrics.py --clients 1 2 --batches 1 64 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvshm.core.specs import FullSpec, PoolConfig  # noqa: E402
from kvshm.workload import WorkloadSpec  # noqa: E402
from service_load import (  # noqa: E402
    Workers,
    record_workload,
    reset_pool,
    start_coordinator,
    summarize_run,
)


class Scraper:
    """Fetches a metrics URL every `interval` seconds while `on` is set."""

    def __init__(self, url: str, interval: float) -> None:
        self.url = url
        self.interval = interval
        self.on = threading.Event()
        self.stopped = threading.Event()
        self.scrapes = 0
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            if self.on.is_set():
                t = time.perf_counter()
                with urllib.request.urlopen(self.url, timeout=10) as r:
                    r.read()
                self.seconds += time.perf_counter() - t
                self.scrapes += 1
            self.stopped.wait(self.interval)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-blocks", type=int, default=65536)
    ap.add_argument("--requests", type=int, default=200, help="workload requests per client")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scrape-interval", type=float, default=1.0)
    ap.add_argument("--json", default=str(REPO / "bench-results" / "metrics.json"))
    args = ap.parse_args()
    config = PoolConfig(num_blocks=args.num_blocks, hash_block_size=16, max_model_len=4096,
                        groups=(FullSpec(16),), max_num_seqs=1024)
    recs = [record_workload(config, WorkloadSpec(num_requests=args.requests,
                                                 seed=args.seed + k))
            for k in range(max(args.clients))]
    print(f"workload: {args.requests} requests/client, {recs[0].num_ops:,} ops a client",
          flush=True)
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    coord = exporter = scraper = workers = None
    configs = [(n, b) for n in sorted(set(args.clients)) for b in args.batches]
    runs: dict = {(mode, n, b): [] for mode in ("off", "on") for n, b in configs}
    try:
        coord = start_coordinator(config)
        exporter = subprocess.Popen([sys.executable, "-m", "kvshm", "metrics", coord.name,
                                     "--port", str(port), "--addr", "127.0.0.1"],
                                    stdout=subprocess.PIPE, text=True)
        exporter.stdout.readline()               # listening
        scraper = Scraper(f"http://127.0.0.1:{port}/metrics", args.scrape_interval)
        workers = Workers(recs, config)
        for rnd in range(args.rounds):
            order = ("off", "on") if rnd % 2 == 0 else ("on", "off")
            for n, b in configs:
                for mode in order:
                    reset_pool(coord.socket)
                    (scraper.on.set if mode == "on" else scraper.on.clear)()
                    row = summarize_run(n, b, workers.run(n, coord.socket, b,
                                                          f"{mode}{rnd}"), 0.0)
                    scraper.on.clear()
                    if row["errors"] or row["hit_mismatches"]:
                        raise RuntimeError(f"{mode}: {row['errors']} errors, "
                                           f"{row['hit_mismatches']} hit mismatches")
                    runs[(mode, n, b)].append(row["ops_per_s"])
                    print(f"  round {rnd + 1}/{args.rounds}: scraped {mode:3s} {n} client(s), "
                          f"batch {b:>2}: {row['ops_per_s']:>9,.0f} ops/s", flush=True)
    finally:
        if scraper is not None:
            scraper.stop()
        if workers is not None:
            workers.stop()
        if exporter is not None:
            exporter.terminate()
            exporter.wait(10)
            exporter.stdout.close()
        if coord is not None:
            coord.stop()
    rows = []
    for n, b in configs:
        on, off = runs[("on", n, b)], runs[("off", n, b)]
        rows.append({"clients": n, "batch": b, "ops_per_s_off": statistics.median(off),
                     "ops_per_s_on": statistics.median(on),
                     "ratio": statistics.median(a / c for a, c in zip(on, off)),
                     "rounds_off": off, "rounds_on": on})
    per_scrape = scraper.seconds / scraper.scrapes if scraper.scrapes else 0.0
    print(f"\nexporter scraping every {args.scrape_interval:g}s vs not (median of "
          f"{args.rounds} rounds; {scraper.scrapes} scrapes, {per_scrape * 1e3:.1f} ms each)")
    print("  clients batch   unscraped ops/s  scraped ops/s  ratio")
    for r in rows:
        print(f"  {r['clients']:7d} {r['batch']:5d} {r['ops_per_s_off']:17,.0f} "
              f"{r['ops_per_s_on']:14,.0f}  {r['ratio']:.2f}")
    out = {"benchmark": "metrics", "rows": rows, "scrapes": scraper.scrapes,
           "scrape_seconds": per_scrape, "scrape_interval": args.scrape_interval}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
