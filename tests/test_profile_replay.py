"""scripts/profile_replay.py's per-op figures (`--by-op`): every kind of op
of a trace is timed, the shares add up, and a missing reference runner is
said, not a crash.  (The reference side needs ../shared/oracle's Python,
which CI does not install: it is exercised where it is there.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO / "tests" / "data" / "conformance" / "traces" / "full16-large-short-s1015.jsonl.gz"
sys.path.insert(0, str(REPO / "scripts"))

import profile_replay  # noqa: E402
from kvshm.replay import load_trace, trace_pool_config  # noqa: E402


def test_by_op_times_every_kind_of_op():
    cfg, ops = load_trace(TRACE)
    us = profile_replay.by_op(trace_pool_config(cfg, ops), ops, runs=2)
    assert set(us) == {op["op"] for op in ops}
    assert all(v > 0 for v in us.values())


def test_by_op_refuses_a_trace_it_does_not_replay():
    cfg, ops = load_trace(TRACE)
    bad = [dict(op) for op in ops]
    i = next(i for i, op in enumerate(bad) if op["op"] == "allocate_slots")
    bad[i]["expect"] = {"new_block_ids": [[123456]], "num_free_blocks": -1}
    with pytest.raises(RuntimeError, match=f"line {i + 2}"):
        profile_replay.by_op(trace_pool_config(cfg, ops), bad, runs=1)


def test_missing_reference_is_said(monkeypatch, capsys):
    monkeypatch.setattr(profile_replay, "ORACLE_PY", Path("/nonexistent/python"))
    cfg, ops = load_trace(TRACE)
    assert profile_replay.reference_by_op(TRACE, ops, 1) is None
    assert "no reference" in capsys.readouterr().err
    profile_replay.print_by_op({"advance": 1.0, "free": 2.0},
                               None, [{"op": "advance"}, {"op": "free"}])
    out = capsys.readouterr().out
    assert "advance" in out and "67%" in out   # free: 2 us of 3


def test_cli_by_op_writes_the_figures(tmp_path):
    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "profile_replay.py"),
                           str(TRACE), "--runs", "2", "--by-op", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = json.loads(out.read_text())["traces"][0]
    assert set(row["by_op_us"]["kvshm"]) == {op["op"] for op in load_trace(TRACE)[1]}
