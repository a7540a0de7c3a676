"""`kvshm run`: the main job (kvshm/workers/run.py): a coordinator and N
pinned CPU workers sharing one KV pool on a workload, with a summary."""

from __future__ import annotations

import argparse

from kvshm.workers.run import add_arguments as add_run_arguments
from kvshm.workers.run import run

HELP = ("the main job: a coordinator and N pinned CPU workers sharing one KV pool on a "
        "workload, with a summary")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p)


def main(args: argparse.Namespace) -> int:
    return run(args)
