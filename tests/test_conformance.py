"""Every recorded vLLM trace replays exactly, and leaves a clean pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvshm.core.check import check_segment
from kvshm.core.errors import ConfigError
from kvshm.core.semantics import semantics
from kvshm.replay import expand_paths, load_trace, replay_trace, trace_pool_config

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


# vLLM 0.32.0's own manager (scripts/record_vllm_traces.py): the traces
# whose groups a 0.32 pool takes replay exactly; the others are refused
# at the pool's creation, saying why (core/semantics.py).
TRACES_032 = Path(__file__).parent / "data" / "conformance-0.32.0" / "traces"
ALL_032 = list(expand_paths([TRACES_032]))
SEM_032 = semantics("0.32.0")


def _takes(path: Path) -> bool:
    cfg, ops = load_trace(path)
    try:
        trace_pool_config(cfg, ops)
    except ConfigError:
        return False
    return True


TAKEN_032 = [p for p in ALL_032 if _takes(p)]
REFUSED_032 = [p for p in ALL_032 if not _takes(p)]


def test_the_0_32_set_is_here():
    assert len(ALL_032) == 160
    # every type but sink (0.32 cannot build it); no EAGLE on a hybrid pool yet
    assert len(TAKEN_032) == 157
    assert {g["type"] for p in TAKEN_032 for g in load_trace(p)[0]["groups"]} == {
        "full", "mla", "chunked_local", "cross_attention", "sliding_window", "mamba"}


@pytest.mark.parametrize("path", TAKEN_032, ids=[p.name.split(".")[0] for p in TAKEN_032])
def test_trace_of_vllm_0_32(path):
    cfg, ops = load_trace(path)
    assert cfg["vllm_version"] == "0.32.0"
    reports = []
    mismatch = replay_trace(cfg, ops, after=lambda mgr: reports.append(
        check_segment(mgr.segment, mgr.block_pool)))
    assert mismatch is None, str(mismatch)
    assert reports[0].clean, reports[0].summary()


@pytest.mark.parametrize("path", REFUSED_032, ids=[p.name.split(".")[0] for p in REFUSED_032])
def test_a_0_32_pool_refuses_the_groups_it_does_not_reproduce(path):
    cfg, ops = load_trace(path)
    assert cfg["use_eagle"] and len(cfg["groups"]) > 1
    with pytest.raises(ConfigError, match=r"use_eagle: a pool of vLLM 0\.32\.0's semantics "
                                          r"with several groups and caching on takes no EAGLE: "
                                          r"kvshm does not reproduce how 0\.32's hybrid lookups"):
        trace_pool_config(cfg, ops)
