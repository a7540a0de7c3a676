"""The regression guard (scripts/bench_guard.py, `--against REV`): both
trees measured in alternating rounds, the comparison written as JSON, the
temporary work tree removed, a bad revision refused with a clear error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SCRIPTS, import_script

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO / "tests" / "data" / "conformance" / "traces" / "eagle-full16-tiny-chat-s2500.jsonl.gz"

pytestmark = pytest.mark.skipif(not (REPO / ".git").exists(),
                                reason="the guard checks out revisions of a git checkout")


def _worktrees() -> list[str]:
    out = subprocess.run(["git", "-C", str(REPO), "worktree", "list", "--porcelain"],
                         capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line.startswith("worktree ")]


def _guard():
    return import_script("bench_guard")


def test_replay_against_head(tmp_path):
    before = _worktrees()
    out = tmp_path / "against.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_replay.py"), "--against",
                           "HEAD", "--rounds", "2", str(TRACE), "--json", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "round 2/2" in proc.stdout and "this checkout vs HEAD" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["against"] == "HEAD" and doc["rounds"] == 2
    [row] = doc["figures"]
    assert row["figure"] == f"{TRACE.name} ops/s"
    assert len(row["rounds_this"]) == len(row["rounds_against"]) == 2
    assert row["this"] > 0 and row["against"] > 0 and row["ratio"] > 0
    assert _worktrees() == before   # the temporary tree is gone


def test_against_a_bad_revision_is_refused(tmp_path):
    before = _worktrees()
    out = tmp_path / "against.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_replay.py"), "--against",
                           "no-such-revision", str(TRACE), "--json", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "--against no-such-revision: not a revision of this checkout" in proc.stderr
    assert not out.exists() and _worktrees() == before


def test_forwarded_args_drop_the_guard_options():
    g = _guard()
    argv = ["--rounds", "1", "--against", "main~2", "--json=x.json", "--against-rounds", "5",
            "--clients", "1", "2"]
    assert g.forwarded_args(argv, ("--against", "--against-rounds", "--json")) == [
        "--rounds", "1", "--clients", "1", "2"]


def test_compare_orients_ratios_and_flags_slowdowns(capsys):
    g = _guard()
    ours = [{"ops/s": 90.0, "cpu us/op": 2.0}, {"ops/s": 80.0, "cpu us/op": 2.0}]
    theirs = [{"ops/s": 100.0, "cpu us/op": 4.0, "old only": 1.0},
              {"ops/s": 100.0, "cpu us/op": 4.0, "old only": 1.0}]
    doc = g.compare("REV", ours, theirs, lambda name: "us/op" in name)
    rows = {r["figure"]: r for r in doc["figures"]}
    assert rows["ops/s"]["ratio"] == pytest.approx(0.85)      # median of 0.9 and 0.8
    assert rows["cpu us/op"]["ratio"] == pytest.approx(2.0)   # half the CPU: better
    assert rows["old only"]["missing"] == "this checkout"
    assert doc["slower"] == ["ops/s"]
    assert "SLOWER" in capsys.readouterr().out
