"""Suite-wide guard: no test may leave a kvshm segment behind in /dev/shm."""

from __future__ import annotations

import os

import pytest

from kvshm.core.segment import SHM_DIR, segment_info


def _kvshm_segments() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith("kvshm")}
    except OSError:
        return set()


def _ours_or_orphaned(name: str) -> bool:
    """Left by this run: owned by this process or by a process that died.
    (A live segment of another program on the host is not ours to judge.)"""
    info = segment_info(name)
    return info is None or info["pid"] == os.getpid() or not info["alive"]


@pytest.fixture(autouse=True, scope="session")
def no_leaked_segments():
    before = _kvshm_segments()
    yield
    leaked = sorted(n for n in _kvshm_segments() - before if _ours_or_orphaned(n))
    assert not leaked, f"segments left in {SHM_DIR}: {leaked}"
