"""`kvshm ls`: the kvshm segments in /dev/shm."""

from __future__ import annotations

import argparse
import json

from kvshm.core import fmt
from kvshm.pool.segment import list_segments

HELP = "list kvshm pool segments in /dev/shm"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    rows = list_segments()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no kvshm segments")
    for r in rows:
        state = "live" if r["alive"] else "STALE (owner dead: remove with `kvshm rm " \
            + r["name"] + "`)"
        kind = "KV arena" if r["kind"] == "arena" else "pool"
        print(f"{r['name']}: {kind}, {fmt.nbytes(r['bytes'])}, {fmt.count(r['num_blocks'])} "
              f"blocks, owner pid {r['pid']} {state}")
    return 0
