"""scripts/bench_service.py runs end to end in a tiny configuration: every
section produces figures, replies match the recording, nothing is left
running or in /dev/shm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kvshm.pool.segment import SHM_DIR, segment_info

pytestmark = pytest.mark.serial   # a benchmark; its leftovers are read off /dev/shm

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "bench_service.py"


def _kvshm_segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("kvshm")}


def _leaked(names: set[str]) -> list[str]:
    """Segments whose owner is gone (a live owner is another program's)."""
    return sorted(n for n in names if (i := segment_info(n)) is None or not i["alive"])


def test_bench_service_tiny(tmp_path):
    out = tmp_path / "service.json"
    before = _kvshm_segments()
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--requests", "6", "--clients", "1", "2",
         "--batches", "1", "64", "--rounds", "1", "--latency-calls", "200",
         "--rss-ops", "3000", "--rss-every", "1000", "--rss-warmup", "1000",
         "--num-blocks", "4096", "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        start_new_session=True)  # its own process group: find what it leaves
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stdout + stderr
    assert stdout.rstrip().splitlines()[-1] == f"wrote {out}"
    d = json.loads(out.read_text())
    assert {"get_block_ids", "stats", "allocate_slots", "free"} <= d["latency"].keys()
    assert all(v["calls"] == 200 and v["p50_us"] > 0 for v in d["latency"].values())
    rows = {(r["clients"], r["batch"]): r for r in d["throughput"]}
    assert rows.keys() == {(1, 1), (1, 64), (2, 1), (2, 64)}
    for r in rows.values():
        assert r["ops_per_s"] > 0 and r["errors"] == 0 and r["hit_mismatches"] == 0
        assert r["failed_allocs"] == 0
    assert rows[(2, 1)]["ops"] == sum(d["workload"]["ops_per_client"][:2])
    assert d["embedded"]["ops_per_s"] > 0
    assert set(d["ratio_batch64_vs_embedded"]) == {"1", "2"}
    assert d["rss"]["ops"] >= 3000 and d["rss"]["errors"] == 0
    assert len(d["rss"]["samples"]) >= 4
    assert d["problems"] == []
    # Every coordinator and client process is gone (multiprocessing's
    # resource tracker may take a moment to see its pipe close), and so is
    # every segment.
    deadline = time.monotonic() + 5
    while (left := _group_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == []
    assert _leaked(_kvshm_segments() - before) == []


def _group_members(pgid: int) -> list[str]:
    out = []
    for p in psutil.process_iter(["pid", "status", "cmdline"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(" ".join(p.info["cmdline"] or []))
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def _run_ab_bench(tmp_path, script: str, *extra: str):
    """Run an on/off benchmark of scripts/ (service_load's A/B rounds) at its
    smallest; check its one row and that it left no segment; returns the
    finished process and the JSON it wrote."""
    out = tmp_path / "out.json"
    before = _kvshm_segments()
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / script), "--requests", "6", "--clients", "1",
         "--batches", "8", "--rounds", "2", "--num-blocks", "4096", *extra,
         "--json", str(out)], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    [row] = doc["rows"]
    assert (row["clients"], row["batch"]) == (1, 8) and len(row["rounds_on"]) == 2
    assert row["ops_per_s_on"] > 0 and row["ops_per_s_off"] > 0 and row["ratio"] > 0
    assert not _leaked(_kvshm_segments() - before)
    return proc, doc


def test_bench_events_tiny(tmp_path):
    """scripts/bench_events.py: both coordinators, both modes, a ratio per
    configuration, the subscriber saw the events; nothing left behind."""
    proc, doc = _run_ab_bench(tmp_path, "bench_events.py")
    assert doc["subscriber_events"] > 0
    assert "worst ratio" in proc.stdout


def test_bench_metrics_tiny(tmp_path):
    """scripts/bench_metrics.py: scraped and unscraped rounds, a ratio per
    configuration, the scraper really scraped; nothing left behind."""
    _, doc = _run_ab_bench(tmp_path, "bench_metrics.py", "--scrape-interval", "0.05")
    assert doc["scrapes"] > 0


def test_bench_service_takes_serve_s_pool_flags_and_refuses_bad_ones():
    for flags, message in (
            (["--preset", "tiny"], "preset: the service benchmark runs the presets"),
            (["--kv-memory", "1G"], "--kv-memory needs a KV shape"),
            (["--num-blocks", "5", "--kv-memory", "1G"], "not allowed with argument"),
            (["--hash-algorithm", "md5"], "invalid choice: 'md5'")):
        r = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True,
                           text=True, cwd=REPO, timeout=60)
        assert r.returncode == 2 and message in r.stderr, (flags, r.stderr)
        assert r.stdout == ""
