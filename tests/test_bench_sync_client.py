"""scripts/bench_sync_client.py runs end to end in a tiny form: every frame
is measured in each placement the host allows, with the processes pinned as
the placement says, and its JSON keeps the figures the issue tracker and
docs quote (`sync_vs_echo_p50` per frame)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.serial   # pins client and server to CPUs

REPO = Path(__file__).resolve().parent.parent


def test_bench_sync_client_tiny(tmp_path):
    out = tmp_path / "sync.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_sync_client.py"),
                           "--rounds", "60", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    cpus = sorted(os.sched_getaffinity(0))
    want = {"same_cpu"} | ({"separate_cpus"} if len(cpus) > 1 else set())
    assert set(doc["frames"]) == {"get_block_ids", "alloc_step"}
    for frame in doc["frames"].values():
        assert set(frame["placements"]) == want
        assert frame["sync_vs_echo_p50"] > 0
        for where, row in frame["placements"].items():
            assert row["client_cpus"] == [cpus[0]]
            assert row["server_cpus"] == [cpus[1] if where == "separate_cpus" else cpus[0]]
            assert row["sync"]["p50_us"] > 0 and row["coordinator_cpu_us_per_sync_call"] >= 0
            assert row["shm_echo"]["p50_us"] > 0 and row["shm_vs_echo_p50"] > 0
    assert os.sched_getaffinity(0) == set(cpus)   # (the test process was not pinned)
