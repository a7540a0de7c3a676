"""`kvshm check`: verify the invariants of a pool segment."""

from __future__ import annotations

import argparse
import dataclasses
import json

from kvshm.cli.common import add_name_argument, attach_named
from kvshm.core.check import check_segment

HELP = "verify the invariants of a pool segment"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_name_argument(p, required=True)
    p.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    with attach_named(args.name) as (name, seg):
        report = check_segment(seg)
    if args.json:
        print(json.dumps({"name": name, "clean": report.clean,
                          **dataclasses.asdict(report)}, indent=2))
    else:
        print(f"pool {name}: {report.summary()}")
    return 0 if report.clean else 1
