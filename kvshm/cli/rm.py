"""`kvshm rm`: remove pools (each with its KV arena) whose owner is dead."""

from __future__ import annotations

import argparse
import sys

from kvshm.cli.common import segment_name
from kvshm.core.errors import KvshmError
from kvshm.pool.lifecycle import remove_pool
from kvshm.pool.segment import list_segments, remove_segment, segment_info

HELP = "remove pools (each with its KV arena) whose owner is dead"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", help="pool names (or /dev/shm paths)")
    p.add_argument("--stale", action="store_true",
                   help="remove every kvshm segment whose owner is dead")
    p.add_argument("--force", action="store_true", help="even if the owner is alive")


def main(args: argparse.Namespace) -> int:
    if args.stale == bool(args.names):
        print("kvshm rm: name pools to remove, or pass --stale (not both)", file=sys.stderr)
        return 2
    if args.stale:
        for info in list_segments():
            if not info["alive"]:
                remove_segment(info["name"], force=True)
                print(f"removed {info['name']} ({info['kind']} of dead process {info['pid']})")
        return 0
    names = [segment_name(a) for a in args.names]  # all valid, or remove none
    status = 0
    for name in names:
        info = segment_info(name)
        if info is not None and info["kind"] == "arena" and name.endswith(".kv"):
            name = name[:-len(".kv")]   # an arena goes with its pool
        try:
            for removed in remove_pool(name, force=args.force):
                print(f"removed {removed}")
        except KvshmError as e:   # not found, or its owner lives: the others are removed
            print(f"kvshm rm: {e}", file=sys.stderr)
            status = 2
    return status
