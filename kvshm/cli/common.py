"""What several commands share: the pool a command-line argument names."""

from __future__ import annotations

import os

from kvshm.core.errors import SegmentError
from kvshm.core.shm import SHM_DIR, valid_name


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
