"""scripts/numa_stress.py end to end in a few seconds (the CI smoke test): a
two-step ramp writes its JSON, report and plots and leaves nothing behind;
a soak, and one whose coordinator is SIGKILLed twice; the arena policy on a
one-node host; bad arguments; Ctrl-C.  Also the script's own arithmetic
(stress_measure.py, stress_soak.py)."""

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

from helpers import cmdline, descendants_when, kill_all, kvshm_segments, leftovers
from kvshm.pool.segment import remove_segment
from kvshm.workers.topology import discover

# pins its clients to CPUs and times a soak; leftovers are read off /dev/shm
pytestmark = pytest.mark.serial

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "numa_stress.py"
SINGLE_NODE = len(discover()) == 1
NODE_KEYS = {"node", "cpus", "clients", "ops_per_s", "p50_us", "p99_us", "p999_us"}


def stress(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the script to its end.  If it has not ended after `timeout` s, it
    prints its Python stacks (faulthandler, on SIGABRT; its processes get the
    signal too) and the test fails with them and its processes' command
    lines: a hang once seen on a loaded CI machine left nothing to go on."""
    before = kvshm_segments()
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        children = psutil.Process(proc.pid).children(recursive=True)
        who = [cmdline(c) for c in children]
        proc.send_signal(signal.SIGABRT)   # its stack where it waits (the children's
        for child in children:             # go to their own stderr, or nowhere)
            try:
                child.send_signal(signal.SIGABRT)
            except psutil.Error:
                pass
        try:
            stdout, stderr = proc.communicate(timeout=30)
        finally:
            kill_all(proc, children)
            for name in leftovers(before):   # the aborted coordinator's pool
                remove_segment(name, force=True)
        pytest.fail(f"numa_stress {' '.join(args)} did not end within {timeout:g} s; "
                    f"it and its processes {who} printed:\n{stderr[-12000:]}\n"
                    f"{stdout[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_short_ramp_writes_its_figures_and_leaves_nothing(tmp_path):
    before = kvshm_segments()
    out = tmp_path / "out"
    proc = stress("--clients-per-node", "1", "2", "--duration", "1.5", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    doc = json.loads((out / "numa_stress.json").read_text())
    assert {"nodes", "fairness", "steps", "host", "coordinator"} <= set(doc)
    num_nodes = len({row["node"] for row in doc["nodes"]})
    assert num_nodes == (2 if SINGLE_NODE else len(discover()))
    assert len(doc["nodes"]) == 2 * num_nodes            # a row per node and step
    assert [row["clients"] for row in doc["nodes"]] == [1] * num_nodes + [2] * num_nodes
    for row in doc["nodes"]:
        assert NODE_KEYS <= set(row)
        assert row["ops_per_s"] > 0 and row["cpus"]
        assert 0 < row["p50_us"] <= row["p99_us"] <= row["p999_us"]
        assert row["op_p50_us"] > 0 and row["cross_hit_tokens"] <= row["hit_tokens"]
    assert [f["clients"] for f in doc["fairness"]] == [1, 2]
    assert all(1 / num_nodes <= f["jain"] <= 1.0 + 1e-9 for f in doc["fairness"])
    for step in doc["steps"]:
        c = step["coordinator"]
        assert c["cpu_us_per_op"] > 0 and c["allocated_per_s"] > 0
        # A client's step is one frame of several ops (a probe's: one op).
        assert c["frames_per_s"] > 0 and c["ops_per_frame"] > 1
        assert c["cpu_us_per_frame"] == pytest.approx(
            c["cpu_us_per_op"] * c["ops_per_frame"], rel=0.02)
        assert step["ops_per_s"] == pytest.approx(
            sum(r["ops_per_s"] for r in doc["nodes"]
                if r["clients"] == step["clients_per_node"]), rel=1e-3)
        assert step["seconds"] < 1.5 + 1.0   # bounded by --duration (+ a last step)
    assert doc["host"]["virtual_nodes"] is SINGLE_NODE
    assert not doc["problems"] and not doc["interrupted"]
    report = (out / "numa_stress.md").read_text()
    assert "| first-touch | 2 |" in report
    for name in ("throughput.png", "p99.png", "latency_cdf.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not leftovers(before)
    assert not [n for n in out.iterdir() if n.name.endswith(".tmp")]


def test_a_soak_is_one_step_with_rss_and_latency_drift(tmp_path):
    before = kvshm_segments()
    proc = stress("--clients-per-node", "1", "2", "--soak", "2", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "numa_stress.json").read_text())
    [step] = doc["steps"]
    assert doc["soak"] and step["clients_per_node"] == 2   # the ramp's largest
    soak = step["soak"]
    for key in ("step_us_first_tenth", "step_us_last_tenth", "op_us_first_tenth",
                "op_us_last_tenth"):
        assert soak[key]["p50"] > 0 and soak[key]["p99"] >= soak[key]["p50"]
    assert soak["rss_end"] > 0 and soak["rss_max"] >= soak["rss_end"]
    assert soak["rss_series"] and "## Soak" in (tmp_path / "numa_stress.md").read_text()
    assert soak["samples"] and soak["end"]["whole"] and "restarts" not in soak
    assert not leftovers(before)


def test_a_soak_whose_coordinator_is_killed_rides_through_and_leaves_nothing(tmp_path):
    before = kvshm_segments()
    proc = stress("--clients-per-node", "1", "--soak", "6", "--kill-coordinator-every", "2",
                  "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    doc = json.loads((tmp_path / "numa_stress.json").read_text())
    assert doc["kill_coordinator_every"] == 2 and not doc["problems"]
    soak = doc["steps"][0]["soak"]
    restarts = soak["restarts"]
    # Kills due at 2 s and 4 s (none in the last second); one due while the
    # last restart was still under way would be skipped, and said.
    assert len(restarts) + soak["kills_skipped"] == 2 and restarts
    pids = [restarts[0]["killed_pid"]] + [r["pid"] for r in restarts]
    assert len(set(pids)) == len(pids)                    # each restart is a new process
    assert [r["killed_pid"] for r in restarts[1:]] == pids[1:-1]
    for i, r in enumerate(restarts, 1):
        assert r["cause"] == "killed" and r["check_clean"] and r["generation"] == i
        # (a probe's reply gap may start up to 20 ms after the kill: an old reply)
        assert 0 < r["ready_ms"] and 0 < r["stall_ms"] <= r["reply_gap_ms"] + 20
        assert r["stall_ms"] == max(r["stall_ms_by_node"])   # every node's probe came back
    assert soak["stall_ms"]["count"] == len(restarts)
    assert soak["stall_ms"]["median"] <= soak["stall_ms"]["max"]
    assert [x["pid"] for x in soak["incarnations"]] == pids
    samples = soak["samples"]
    assert len(samples) >= 5 and sum(r["restart"] for r in samples) == len(restarts)
    assert [r["t_s"] for r in samples] == sorted(r["t_s"] for r in samples)
    for r in samples:
        assert 0 <= r["free_blocks"] <= 8191 and r["requests"] >= 0
        assert len(r["ops_per_s_by_node"]) == 2
        assert r["rss"] is None or r["rss"] > r["private_rss"] > 0   # None: between two
    clients = soak["clients"]
    assert clients["coordinator_restarts"] == [len(restarts)] * 2
    assert clients["requests_lost"] == 0 and clients["requests_resumed"] > 0
    end = soak["end"]
    assert end["whole"] and end["num_free_blocks"] == end["num_free_whole"] == 8191
    assert end["num_requests"] == 0 and end["check_clean"]
    assert end["segments_left"] == [] and end["processes_left"] == []
    report = (tmp_path / "numa_stress.md").read_text()
    assert "### Restarts (SIGKILL every 2 s)" in report and "| killed |" in report
    assert (tmp_path / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "restarts: " in proc.stdout and "end: pool whole" in proc.stdout
    assert not leftovers(before)


@pytest.mark.skipif(not SINGLE_NODE, reason="this host has several NUMA nodes")
@pytest.mark.parametrize("policy", ["bind", "interleave"])
def test_an_arena_policy_on_one_node_says_there_is_nothing_to_place(policy):
    proc = stress("--arena-policy", policy, "--plan-only")
    assert proc.returncode == 0, proc.stderr
    assert (f"arena policy {policy}: this host has one NUMA node (node 0), so there is "
            "nothing to place") in proc.stdout
    assert "virtual node" in proc.stdout      # and it says the nodes are carved


@pytest.mark.parametrize("args, message", [
    (["--clients-per-node", "1", "0"], "--clients-per-node values must be at least 1"),
    (["--duration", "0"], "--duration must be positive"),
    (["--soak", "-5"], "--soak must be positive"),
    (["--kill-coordinator-every", "2"], "--kill-coordinator-every needs --soak"),
    (["--soak", "10", "--kill-coordinator-every", "0"],
     "--kill-coordinator-every must be positive"),
    (["--soak", "5", "--kill-coordinator-every", "5"],
     "--kill-coordinator-every must be shorter than the soak, by 1s at least (its last "
     "second has no kill): got 5s for a 5s soak"),
    (["--soak", "5", "--kill-coordinator-every", "4.5"], "got 4.5s for a 5s soak"),
    (["--nodes", "0"], "--nodes must be at least 1"),
    (["--verify-hits", "0.5"], "--verify-hits needs --compute"),
    (["--shared-prefix", "1.5"], "share_system must be in [0, 1]"),
    (["--system-len", "900", "100"], "system_len must be ints"),
    (["--probe-rate", "0"], "--probe-rate must be in (0, 10000]"),
    (["--arena-policy", "spread"], "invalid choice: 'spread'"),
    (["--clients-per-node", "two"], "invalid int value: 'two'"),
])
def test_bad_arguments_exit_2_with_a_message(args, message):
    proc = stress(*args, "--plan-only")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_ctrl_c_stops_everything_and_writes_what_finished(tmp_path):
    before = kvshm_segments()
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--clients-per-node", "1", "--duration",
                             "30", "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    children: list[psutil.Process] = []
    try:
        line = ""
        while not line.startswith("step 1/"):
            line = proc.stdout.readline()
            assert line, f"exited early: {proc.wait()} {proc.stderr.read()}"
        children = descendants_when(   # coordinator, probes and clients are up
            proc, lambda cmds: (sum("workers.worker" in c for c in cmds) >= 2
                                and any(" serve " in c for c in cmds)
                                and any("stress_probe" in c for c in cmds)))
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 130, stdout + stderr
        assert "Traceback" not in stderr, stderr
        _, still = psutil.wait_procs(children, timeout=5)
        assert not alive(still), still
        doc = json.loads((out / "numa_stress.json").read_text())
        assert doc["interrupted"] and doc["nodes"] == [] and doc["steps"] == []
        assert not leftovers(before)
    finally:   # only if something above failed: stop what this test started
        kill_all(proc, children)
        proc.stdout.close()
        proc.stderr.close()


# -- the script's arithmetic ---------------------------------------------------------------------
@pytest.fixture
def measure(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import stress_measure
    return stress_measure


def test_jain_index_and_quantiles(measure):
    assert measure.jain([5, 5, 5]) == pytest.approx(1.0)
    assert measure.jain([9, 0, 0]) == pytest.approx(1 / 3)
    assert measure.jain([3, 1]) == pytest.approx(16 / 20)
    assert measure.jain([]) is None and measure.jain([0, 0]) is None
    q = measure.quantiles(range(1, 1001))
    assert (q["p50"], q["p99"], q["p999"]) == (501, 990, 999)
    assert measure.quantiles([]) == {"p50": None, "p99": None, "p999": None}


def test_probe_windows_keep_the_calls_sent_inside(measure):
    probe = measure.Probe(node=None, proc=None, samples=[(1.0, 10.0), (2.0, 20.0), (3.0, 30.0)])
    assert probe.window(1.5, 3.0) == [20.0]
    assert probe.window(0.0, 9.0) == [10.0, 20.0, 30.0]


@pytest.fixture
def soak(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import stress_soak
    return stress_soak


def test_a_stall_runs_from_the_kill_to_the_first_reply_served_after_it(soak, measure):
    # (sent at, round trip us): a call cut off by the kill at 1.1 s, answered at 1.52 s
    cut = measure.Probe(node=None, proc=None, samples=[
        (1.0, 1000.0), (1.01, 1000.0), (1.02, 500_000.0), (1.53, 1000.0)])
    # a reply the killed coordinator wrote, read 5 ms after the kill: not the new one's
    late = measure.Probe(node=None, proc=None, samples=[(1.095, 10_000.0), (1.6, 1000.0)])
    probes = measure.Probes("sock", [], rate=1, seconds=1, hash_algorithm="", hash_seed="")
    probes.probes = [cut, late]
    assert soak.stalls(probes, 1.1) == {"stall_ms": 501.0, "stall_ms_by_node": [420.0, 501.0],
                                        "reply_gap_ms": 509.0}
    gone = measure.Probe(node=None, proc=None, samples=[(1.0, 1000.0)])   # none after it
    probes.probes = [cut, gone]
    assert soak.stalls(probes, 1.1) == {"stall_ms": None, "stall_ms_by_node": [420.0, None],
                                        "reply_gap_ms": 509.0}


def test_op_counts_between_progress_reports(soak):
    seen = [(0.0, 0), (0.5, 100), (1.0, 200), (3.0, 300)]
    assert soak.ops_at(seen, 0.25) == 50
    assert soak.ops_at(seen, 2.0) == 200      # a stall: its ops come in the last 0.5 s
    assert soak.ops_at(seen, 2.75) == 250
    assert soak.ops_at(seen, 9.0) == 300 and soak.ops_at(seen, -1.0) == 0
    assert soak.window_period(6) == 0.5 and soak.window_period(1800) == 5.0
