"""`kvshm check`: verify the invariants of a pool segment."""

from __future__ import annotations

import argparse
import json

from kvshm.cli.common import segment_name
from kvshm.core.check import check_segment
from kvshm.core.segment import PoolSegment

HELP = "verify the invariants of a pool segment"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="segment name (see `kvshm ls`)")
    p.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    name = segment_name(args.name)
    with PoolSegment.attach(name) as seg:
        report = check_segment(seg)
    if args.json:
        print(json.dumps({"name": name, "clean": report.clean,
                          "num_blocks": report.num_blocks,
                          "num_free_blocks": report.num_free_blocks,
                          "num_cached_blocks": report.num_cached_blocks,
                          "num_requests": report.num_requests,
                          "problems": report.problems}, indent=2))
    else:
        print(f"pool {name}: {report.summary()}")
    return 0 if report.clean else 1
