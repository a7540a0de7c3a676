#!/usr/bin/env python3
"""Pool start-up cost: creation time, bytes of state per block, Python objects.

For 1M and 4M blocks (full attention, 16-token blocks, max_model_len 4096):
- time to create a KVCacheManager (segment created and initialised, null
  block taken, indexes ready), median of --runs;
- bytes of per-block state in the segment (ref count, links, stamps, flags,
  cached hash key) per block, and the request table's bytes separately;
- Python objects alive after creation minus before (must not grow with the
  block count);
- the same creation time and traced Python memory for vLLM's reference
  BlockPool-backed manager, when the reference runner is installed
  (../shared/oracle/get_vllm.sh).

Prints a table and writes JSON (bench-results/pool.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time

from bench_common import ORACLE, ORACLE_PY, add_json_argument, write_results
from kvshm import FullSpec, KVCacheManager, PoolConfig

_REFERENCE = r"""
import sys, time, tracemalloc, json
sys.path.insert(0, sys.argv[1])
import kvops
n = int(sys.argv[2])
cfg = {"kind": "config", "num_blocks": n, "hash_block_size": 16, "max_model_len": 4096,
       "enable_caching": True, "use_eagle": False, "dcp_world_size": 1,
       "groups": [{"type": "full", "block_size": 16}]}
t0 = time.perf_counter(); m = kvops.make_manager(cfg); t = time.perf_counter() - t0
del m
tracemalloc.start(); m = kvops.make_manager(cfg)
size, _ = tracemalloc.get_traced_memory()
print(json.dumps({"seconds": t, "bytes_per_block": size / n}))
"""


def config(n: int) -> PoolConfig:
    return PoolConfig(num_blocks=n, hash_block_size=16, max_model_len=4096,
                      groups=(FullSpec(16),), max_num_seqs=256)


def measure(n: int, runs: int) -> dict:
    cfg = config(n)
    times = []
    objects = None
    for i in range(runs):
        gc.collect()
        before = len(gc.get_objects())
        t0 = time.perf_counter()
        mgr = KVCacheManager(cfg)
        times.append(time.perf_counter() - t0)
        if i == 0:
            objects = len(gc.get_objects()) - before
            layout = mgr.segment.layout
        mgr.close()
    return {
        "num_blocks": n,
        "create_ms_median": statistics.median(times) * 1e3,
        "create_ms_runs": [round(t * 1e3, 3) for t in times],
        "block_state_bytes_per_block": layout.block_bytes / n,
        "request_table_bytes": layout.table_bytes,
        "segment_bytes": layout.size,
        "python_objects_created": objects,
    }


def reference(n: int) -> dict | None:
    if not (ORACLE_PY.exists() and (ORACLE / "kvops.py").exists()):
        return None
    proc = subprocess.run([str(ORACLE_PY), "-c", _REFERENCE, str(ORACLE), str(n)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        return None
    return json.loads(proc.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1_000_000, 4_000_000])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-reference", action="store_true")
    add_json_argument(ap, "pool")
    args = ap.parse_args()
    rows = []
    for n in args.blocks:
        row = measure(n, args.runs)
        line = (f"{n:>10,} blocks: create {row['create_ms_median']:7.2f} ms (median of "
                f"{args.runs}), {row['block_state_bytes_per_block']:.1f} B/block of block "
                f"state (+ {row['request_table_bytes'] / 2**20:.1f} MiB request table, "
                f"{row['request_table_bytes'] / n:.1f} B/block), "
                f"{row['python_objects_created']} Python objects")
        if not args.no_reference:
            ref = reference(n)
            if ref:
                row["reference"] = ref
                line += (f" | vLLM: {ref['seconds'] * 1e3:7.1f} ms, "
                         f"{ref['bytes_per_block']:.0f} B/block traced")
        print(line, flush=True)
        rows.append(row)
    write_results(args.json, {"benchmark": "pool", "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
