"""What several commands share: the pool a command-line argument names."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager

from kvshm.core.errors import SegmentError
from kvshm.pool.segment import PoolSegment
from kvshm.pool.shm import SHM_DIR, valid_name

DEFAULT_POOL = "kvshm"


def add_name_argument(p: argparse.ArgumentParser, *, required: bool = False) -> None:
    """The positional pool NAME of the commands that read a pool's segment;
    `kvshm` unless `required`."""
    if required:
        p.add_argument("name", help="segment name (see `kvshm ls`)")
    else:
        p.add_argument("name", nargs="?", default=DEFAULT_POOL,
                       help=f"pool name (default {DEFAULT_POOL})")


@contextmanager
def attach_named(arg: str) -> Iterator[tuple[str, PoolSegment]]:
    """The bare name `arg` stands for (`segment_name`) and its segment,
    attached for the `with` block."""
    name = segment_name(arg)
    with PoolSegment.attach(name) as seg:
        yield name, seg


def segment_name(arg: str) -> str:
    """The segment name that a command-line argument stands for.

    Args:
        arg: a segment name as `kvshm ls` prints it, or its path in SHM_DIR
            (`/dev/shm/NAME`; a relative path is taken from the cwd).

    Returns:
        The bare name.

    Raises:
        SegmentError: `arg` is a path outside SHM_DIR or not a valid name.
    """
    name = arg
    if "/" in arg:
        directory, name = os.path.split(os.path.abspath(arg))
        if arg.endswith("/") or os.path.realpath(directory) != os.path.realpath(SHM_DIR):
            raise SegmentError(f"{arg!r} is not a segment in {SHM_DIR}: expected a segment "
                               f"name (see `kvshm ls`) or {SHM_DIR}/NAME")
    if not valid_name(name):
        raise SegmentError(f"bad segment name {name!r}: expected 1-200 letters, digits, "
                           "'.', '_' or '-' (see `kvshm ls`)")
    return name
