#!/usr/bin/env python3
"""Coordinator ops/s with a Prometheus exporter scraping every second vs
without (the target: within noise).

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
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from bench_common import add_json_argument, write_results
from service_load import (Workers, ab_rounds, ab_rows, ab_workload, add_ab_arguments,
    start_coordinator)


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
        # NOTE: a scraped round starts with a scrape (waiting on `on`, not
        # polling it), so even a round shorter than the interval is scraped.
        while not self.stopped.is_set():
            if self.on.wait(self.interval) and not self.stopped.is_set():
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
    add_ab_arguments(ap)
    ap.add_argument("--scrape-interval", type=float, default=1.0)
    add_json_argument(ap, "metrics")
    args = ap.parse_args()
    config, recs = ab_workload(args)
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    coord = exporter = scraper = workers = None
    try:
        coord = start_coordinator(config)
        exporter = subprocess.Popen([sys.executable, "-m", "kvshm", "metrics", coord.name,
                                     "--port", str(port), "--addr", "127.0.0.1"],
                                    stdout=subprocess.PIPE, text=True)
        exporter.stdout.readline()               # listening
        scraper = Scraper(f"http://127.0.0.1:{port}/metrics", args.scrape_interval)
        workers = Workers(recs, config)
        # One coordinator: "on" runs are scraped, "off" runs are not.
        runs = ab_rounds(args, workers, {"off": coord.socket, "on": coord.socket}, "scraped",
                         lambda mode: (scraper.on.set if mode == "on" else scraper.on.clear)())
        scraper.on.clear()
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
    rows = ab_rows(runs)
    per_scrape = scraper.seconds / scraper.scrapes if scraper.scrapes else 0.0
    print(f"\nexporter scraping every {args.scrape_interval:g}s vs not (median of "
          f"{args.rounds} rounds; {scraper.scrapes} scrapes, {per_scrape * 1e3:.1f} ms each)")
    print("  clients batch   unscraped ops/s  scraped ops/s  ratio")
    for r in rows:
        print(f"  {r['clients']:7d} {r['batch']:5d} {r['ops_per_s_off']:17,.0f} "
              f"{r['ops_per_s_on']:14,.0f}  {r['ratio']:.2f}")
    out = {"benchmark": "metrics", "rows": rows, "scrapes": scraper.scrapes,
           "scrape_seconds": per_scrape, "scrape_interval": args.scrape_interval}
    write_results(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
