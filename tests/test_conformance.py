"""Every recorded vLLM trace replays exactly, and leaves a clean pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvshm.core.check import check_segment
from kvshm.replay import expand_paths, load_trace, replay_trace

TRACES = Path(__file__).parent / "data" / "conformance" / "traces"
ALL = list(expand_paths([TRACES]))


def test_all_public_traces_are_here():
    # The acceptance figure is 166 traces; losing files must not pass quietly.
    assert len(ALL) == 166


@pytest.mark.parametrize("path", ALL, ids=[p.name.split(".")[0] for p in ALL])
def test_trace(path):
    cfg, ops = load_trace(path)
    reports = []
    mismatch = replay_trace(cfg, ops, after=lambda mgr: reports.append(
        check_segment(mgr.segment, mgr.block_pool)))
    assert mismatch is None, str(mismatch)
    assert reports[0].clean, reports[0].summary()
