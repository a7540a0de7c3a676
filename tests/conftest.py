"""Suite-wide guard: no test may leave a kvshm segment behind in /dev/shm."""

from __future__ import annotations

import os

import pytest

from kvshm.core.segment import SHM_DIR


def _kvshm_segments() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith("kvshm")}
    except OSError:
        return set()


@pytest.fixture(autouse=True, scope="session")
def no_leaked_segments():
    before = _kvshm_segments()
    yield
    leaked = _kvshm_segments() - before
    assert not leaked, f"segments left in {SHM_DIR}: {sorted(leaked)}"
