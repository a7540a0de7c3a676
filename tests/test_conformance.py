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


# vLLM 0.32.0's own manager (scripts/record_vllm_traces.py): every trace
# replays exactly on a pool of its semantics (vllm_version = "0.32.0").
TRACES_032 = Path(__file__).parent / "data" / "conformance-0.32.0" / "traces"
ALL_032 = list(expand_paths([TRACES_032]))


def test_the_0_32_set_is_here():
    # 0.14's shapes but sink (0.32 cannot build it), and 0.32's own (shapes-0.32.json)
    assert len(ALL_032) == 166
    assert {g["type"] for p in ALL_032 for g in load_trace(p)[0]["groups"]} == {
        "full", "mla", "chunked_local", "cross_attention", "sliding_window", "mamba"}


@pytest.mark.parametrize("path", ALL_032, ids=[p.name.split(".")[0] for p in ALL_032])
def test_trace_of_vllm_0_32(path):
    cfg, ops = load_trace(path)
    assert cfg["vllm_version"] == "0.32.0"
    reports = []
    mismatch = replay_trace(cfg, ops, after=lambda mgr: reports.append(
        check_segment(mgr.segment, mgr.block_pool)))
    assert mismatch is None, str(mismatch)
    assert reports[0].clean, reports[0].summary()
