"""`kvshm run` end to end, as subprocesses: a shared run, a killed worker,
shared vs isolated, a JSONL workload, joining a running coordinator, bad
arguments, Ctrl-C, and `python -m kvshm.workers`."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers import descendants_when, kill_all, kvshm_segments, leftovers

from kvshm.config import preset_config
from kvshm.service.process import CoordinatorProcess

# pins its workers to CPUs; a run's leftovers are read off /dev/shm
pytestmark = pytest.mark.serial

RUN = [sys.executable, "-m", "kvshm", "run"]
# The shared run: 12 requests in CI, however long a slow or loaded machine
# takes to serve them; KVSHM_RUN_SECONDS=300 (with KVSHM_RUN_WORKERS=4) makes
# it a soak test of the same assertions (that long, no request cap).
RUN_SECONDS = os.environ.get("KVSHM_RUN_SECONDS")
RUN_LENGTH = (["--duration", RUN_SECONDS] if RUN_SECONDS
              else ["--requests", "12", "--duration", "100"])
RUN_WORKERS = os.environ.get("KVSHM_RUN_WORKERS", "2")
LIGHT = ["--preset", "tiny", "--kv-memory", "64M", "--quiet"]     # 1,024 blocks
TIMEOUT = 120


def run(*args: str, cmd=RUN, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout)


def results(path: Path) -> list[dict]:
    return json.loads(path.read_text())["runs"]


def worker_alive(pid: int) -> bool:
    """Whether `pid` is still one of our worker processes (not a reused pid)."""
    try:
        return "workers.worker" in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def assert_pool_whole(pool: dict) -> None:
    assert pool["check_clean"], pool["problems"]
    assert pool["num_requests"] == 0
    assert pool["num_free_blocks"] == pool["num_blocks"] - 1


def assert_ran_cleanly(proc: subprocess.CompletedProcess, before: set[str], runs) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not leftovers(before)
    for r in runs:
        for pool in r["pools"]:   # the coordinator's private socket directory is gone
            assert not Path(pool["socket"]).parent.exists()
        for w in r["workers"]:
            assert not worker_alive(w["pid"])


# -- runs -----------------------------------------------------------------------------------------
def test_a_fixed_number_of_requests_is_served_to_the_end(tmp_path):
    before = kvshm_segments()
    out = tmp_path / "out.json"
    proc = run("--requests", "12", "--duration", "100", "--json", str(out), *LIGHT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (shared,) = results(out)
    served = shared["requests"] + shared["rejected"]
    assert served == 12 and shared["aborted"] == 0
    assert sum(w["finished"] for w in shared["workers"]) == shared["requests"]
    assert shared["seconds"] < 100      # ended when the work was done, not at the cap
    assert_ran_cleanly(proc, before, [shared])


def test_shared_run(tmp_path):
    before = kvshm_segments()
    out = tmp_path / "out.json"
    proc = run("--workers", RUN_WORKERS, *RUN_LENGTH, "--grace", "2", "--json", str(out),
               *LIGHT, timeout=TIMEOUT + float(RUN_SECONDS or 0))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in ("prefix cache", "integrity", "pool after run"):
        assert line in proc.stdout
    assert proc.stdout.rstrip().endswith("result: OK (0 integrity mismatches, every worker "
                                         "finished, pools whole)")
    [res] = results(out)
    assert res["mode"] == "shared" and not res["interrupted"]
    assert res["num_blocks"] == 1024
    assert res["requests"] > 0 and res["prompt_tokens"] > 0
    assert res["hit_mismatches"] == 0 and res["decode_mismatches"] == 0
    assert res["hit_blocks_checked"] > 0
    assert res["cross_hit_tokens"] > 0
    [pool] = res["pools"]
    assert pool["num_blocks"] == 1024
    assert_pool_whole(pool)

    allowed = os.sched_getaffinity(0)
    workers = res["workers"]
    assert [w["index"] for w in workers] == list(range(int(RUN_WORKERS)))
    for w in workers:
        assert w["status"] == "done", w
        assert w["integrity_failures"] == 0
        assert w["cpus"] and set(w["cpus"]) <= allowed
        assert w["affinity"] == w["cpus"]          # each worker really is pinned there
    assert len({w["pid"] for w in workers}) == len({w["session"] for w in workers}) \
        == len(workers)
    if len(allowed) >= len(workers):     # one CPU set per worker, no overlap
        cpus = [c for w in workers for c in w["cpus"]]
        assert len(cpus) == len(set(cpus))
    assert_ran_cleanly(proc, before, [res])


def test_a_killed_worker_gives_every_block_back(tmp_path):
    before = kvshm_segments()
    out = tmp_path / "out.json"
    proc = run("--kill-worker", "1", "--kill-after", "1.5", "--duration", "6", "--grace", "2",
               "--json", str(out), *LIGHT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [res] = results(out)
    assert [w["status"] for w in res["workers"]] == ["done", "killed"]
    assert "SIGKILL" in res["workers"][1]["message"]
    [pool] = res["pools"]
    assert_pool_whole(pool)
    assert pool["num_sessions"] == 1      # only the client that took this report
    assert "every block is back in the pool" in proc.stdout
    assert proc.stdout.rstrip().endswith(
        "result: OK (0 integrity mismatches, 1 of 2 worker runs finished, worker 1 killed "
        "as asked, pools whole)")
    assert_ran_cleanly(proc, before, [res])


def test_arena_pages_overwritten_during_a_run_are_found_and_healed(tmp_path):
    """--corrupt-pages writes random bytes over 64 pages of the KV arena
    mid-run: the exact model's hit and decode checks find the bad blocks,
    the pool uncaches them (and everything computed from them), their
    requests compute them again; no checked output is wrong, no request
    hits a block after it was uncached, every request finishes, and the run
    says it was healed, with exit status 1 (someone must look at the host)."""
    before = kvshm_segments()
    out = tmp_path / "out.json"
    # (a fixed number of requests, every one of which must finish, however
    # long a slow machine takes with every decode step checked)
    proc = run("--model", "exact", "--check-decode", "1.0", "--corrupt-pages", "64",
               "--corrupt-after", "1.5", "--requests", "8", "--duration", "100",
               "--json", str(out), *LIGHT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    [res] = results(out)
    assert res["corrupted_pages"] == 64
    assert res["corrupt_blocks_found"] > 0 and res["corrupt_findings"] >= res["corrupt_blocks_found"]
    assert res["corrupt_blocks_evicted"] > 0 and res["corrupt_requeued"] > 0
    assert res["corrupt_refound"] == 0
    assert res["hit_mismatches"] == res["decode_mismatches"] == res["computed_mismatches"] == 0
    assert res["aborted"] == 0 and res["requests"] > 0
    assert [w["status"] for w in res["workers"]] == ["done", "done"]
    [pool] = res["pools"]
    assert_pool_whole(pool)
    assert "result: CORRUPTION FOUND AND HEALED" in proc.stdout
    assert "0 later hits on uncached blocks" in proc.stdout
    assert_ran_cleanly(proc, before, [res])


def test_bad_corruption_arguments_are_refused():
    proc = run("--corrupt-pages", "-1", *LIGHT)
    assert proc.returncode == 2 and "--corrupt-pages and --corrupt-after" in proc.stderr


def test_a_run_that_rejects_most_of_its_workload_is_failed():
    """Most requests need more blocks than the pool has: they are rejected,
    and the run says so (exit 1), rather than OK."""
    # A fixed amount of work: the few requests that fit finish however
    # loaded the machine is (a 2 s run on a busy CI host finished none).
    proc = run("--num-blocks", "40", "--requests", "60", "--duration", "120", "--grace", "10",
               "--workers", "1", "--quiet")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stdout.rstrip().splitlines()[-1]
    assert re.fullmatch(r"result: FAILED: shared: [\d,]+ of [\d,]+ requests rejected "
                        r"\(longer than the model or the pool: give the pool more memory\)",
                        last), last


def test_a_run_that_finishes_nothing_is_failed():
    from kvshm.config import preset_config
    from kvshm.workers.engine_types import EngineStats
    from kvshm.workers.launcher import LaunchOptions, RunResult, WorkerResult
    from kvshm.workers.run import _problems
    workers = [WorkerResult(index=0, cpus=(0,), status="done",
                            stats=EngineStats(aborted=3, rejected=1))]
    res = RunResult(mode="shared", config=preset_config("tiny", num_blocks=64),
                    workers=workers)
    assert _problems(res, LaunchOptions()) == ["shared: no request finished"]


def test_compare_shared_and_isolated(tmp_path):
    before = kvshm_segments()
    out = tmp_path / "out.json"
    proc = run("--compare", "--duration", "4", "--grace", "2", "--json", str(out), *LIGHT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "shared vs isolated" in proc.stdout
    # the shared pool's line, then one line per isolated pool naming its worker
    assert re.search(r"^  pool after run    0 requests, ", proc.stdout, re.M)
    for i in range(2):
        assert re.search(rf"^  worker {i}'s pool +0 requests, ", proc.stdout, re.M)
    shared, isolated = results(out)
    assert (shared["mode"], isolated["mode"]) == ("shared", "isolated")
    assert len(shared["pools"]) == 1 and len(isolated["pools"]) == 2
    assert isolated["cross_hit_tokens"] == 0
    assert shared["cross_hit_tokens"] > 0
    # The same total: each isolated pool has half the usable blocks.
    assert [p["num_blocks"] for p in isolated["pools"]] == [512, 512]
    assert len({p["socket"] for p in isolated["pools"]}) == 2
    for r in (shared, isolated):
        assert r["requests"] > 0
        assert r["hit_mismatches"] == 0 and r["decode_mismatches"] == 0
        for pool in r["pools"]:
            assert_pool_whole(pool)
    assert_ran_cleanly(proc, before, [shared, isolated])


def test_a_fixed_amount_of_work_gives_a_speedup_ttft_and_a_plot(tmp_path):
    out, png = tmp_path / "out.json", tmp_path / "run.png"
    proc = run("--compare", "--requests", "8", "--duration", "120", "--json", str(out),
               "--plot", str(png), *LIGHT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    shared, isolated = doc["runs"]
    assert shared["requests"] == isolated["requests"] == 8
    # Serving time: from the workers' start together to the last one's end,
    # their start-up (the coordinator, processes, model weights) excluded.
    assert doc["speedup"] == pytest.approx(isolated["serving_seconds"]
                                           / shared["serving_seconds"])
    for r in (shared, isolated):
        assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"] and r["requests_per_s"] > 0
        assert 0 <= r["queue_ms_p50"] <= r["ttft_ms_p50"]
        assert 0 < r["serving_seconds"] < r["seconds"]
        assert r["serving_seconds"] == max(w["seconds"] for w in r["workers"])
        assert r["timeline"] and r["timeline"][-1][1] == r["prompt_tokens"]
    assert re.search(r"speedup \d+\.\d\dx \(isolated [\d.]+ s / shared [\d.]+ s serving, "
                     r"same work\): shared computed", proc.stdout), proc.stdout
    assert re.search(r"== shared pool: [\d.]+s serving after [\d.]+s of start-up", proc.stdout)
    assert "time to first token p50 ms" in proc.stdout
    assert re.search(r"the same decode work in both\); time to first token p50 [\d,]+ vs "
                     r"[\d,]+ ms \(", proc.stdout), proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_refused_up_front(tmp_path):
    blocker = tmp_path / "block"
    (blocker / "matplotlib").mkdir(parents=True)
    (blocker / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib')\n")
    env = dict(os.environ, PYTHONPATH=str(blocker))
    proc = subprocess.run([*RUN, "--plot", str(tmp_path / "x.png"), *LIGHT],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--plot needs matplotlib: pip install 'kvshm[plot]'" in proc.stderr
    assert "== shared pool" not in proc.stdout


def test_jsonl_workload(tmp_path):
    rng = random.Random(5)
    ids = [rng.randrange(32000) for _ in range(64)]
    words = [f"word{i}" for i in range(40)]
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt_ids": ids + [rng.randrange(32000) for _ in range(20 + i)],
              "output_len": 4} for i in range(4)]
    lines += [{"prompt": " ".join(words + [f"tail{i}-{j}" for j in range(10)]),
               "output_len": 4} for i in range(4)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    before = kvshm_segments()
    out = tmp_path / "out.json"
    # One request at a time per worker: the later lines hit the earlier ones'
    # prefixes (the finite-workload bug of test_workers does not bite either).
    proc = run("--workload", str(path), "--max-running", "1", "--duration", "20",
               "--grace", "2", "--check-blocks", "1000", "--json", str(out), *LIGHT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [res] = results(out)
    assert res["requests"] == len(lines)
    assert res["hit_tokens"] > 0 and res["hit_blocks_checked"] > 0
    assert res["hit_mismatches"] == 0 and res["decode_mismatches"] == 0
    assert all(w["status"] == "done" for w in res["workers"])
    assert_pool_whole(res["pools"][0])
    assert_ran_cleanly(proc, before, [res])


def test_connect_to_a_running_coordinator(tmp_path):
    before = kvshm_segments()
    out = tmp_path / "out.json"
    with CoordinatorProcess(preset_config("tiny", num_blocks=2048)) as coord:
        proc = run("--connect", str(coord.socket), "--duration", "4", "--grace", "2",
                   "--quiet", "--json", str(out))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert coord.proc.poll() is None        # a joined coordinator is left running
        [res] = results(out)
        assert res["num_blocks"] == 2048 and res["requests"] > 0
        [pool] = res["pools"]
        assert pool["socket"] == str(coord.socket)
        assert_pool_whole(pool)
        assert res["hit_mismatches"] == 0 and res["decode_mismatches"] == 0
        assert "Traceback" not in proc.stderr
        assert all(not worker_alive(w["pid"]) for w in res["workers"])
    assert not leftovers(before)


def test_connect_to_a_pool_workers_cannot_use_is_refused():
    from kvshm.core.specs import FullSpec, PoolConfig
    no_arena = PoolConfig(num_blocks=64, hash_block_size=16, max_model_len=4096,
                          groups=(FullSpec(16),))
    before = kvshm_segments()
    with CoordinatorProcess(no_arena) as coord:
        proc = run("--connect", str(coord.socket), "--duration", "2", "--quiet")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert re.search(r"kvshm run: cannot run workers on the pool at .*: the pool has no "
                         r"kv shape", proc.stderr), proc.stderr
        assert "== shared pool" not in proc.stdout
        assert coord.proc.poll() is None
    assert not leftovers(before)


def test_a_coordinator_that_dies_mid_run_and_stays_dead_is_reported(tmp_path):
    """Nobody restarts it: the workers give up after --reconnect-timeout."""
    from kvshm.pool.arena import arena_name
    from kvshm.pool.segment import remove_segment
    before = kvshm_segments()
    out = tmp_path / "out.json"
    with CoordinatorProcess(preset_config("tiny", num_blocks=2048)) as coord:
        proc = subprocess.Popen([*RUN, "--connect", str(coord.socket), "--duration", "20",
                                 "--grace", "1", "--reconnect-timeout", "2", "--quiet",
                                 "--json", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(3)
        coord.proc.kill()                       # the coordinator crashes
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    try:
        assert proc.returncode == 1, stdout + stderr
        assert "Traceback" not in stderr
        assert "pool after run    UNAVAILABLE: no coordinator listening" in stdout
        assert "result: FAILED: shared: worker 0 error; shared: worker 1 error; shared: " \
            "pool check failed" in stdout
        [res] = results(out)
        assert {w["status"] for w in res["workers"]} == {"error"}
        assert all("ConnectionLost" in w["message"] for w in res["workers"])
        assert all(not worker_alive(w["pid"]) for w in res["workers"])
    finally:   # a SIGKILLed coordinator leaves its segments: `kvshm rm` territory
        for name in (coord.name, arena_name(coord.name)):
            remove_segment(name)
    assert not leftovers(before)


# -- refusals -------------------------------------------------------------------------------------
NO_KV_CONFIG = ('num_blocks = 64\nhash_block_size = 16\nmax_model_len = 4096\n'
                'groups = [{type = "full", block_size = 16}]\n')


@pytest.mark.parametrize("args,message", [
    (["--workers", "0"], r"--workers must be at least 1"),
    (["--workers", "2", "--kill-worker", "5"], r"--kill-worker must be .* in \[0, 2\)"),
    (["--model", "exact", "--verify-hits", "2"], r"--verify-hits must be within \[0, 1\]"),
    (["--verify-hits", "0.5"], r"--verify-hits is a knob of --model exact; --model "
                               r"transformer checks with --check-blocks, --check-decode"),
    (["--check-blocks", "-1"], r"--check-blocks must not be negative"),
    (["--workload", "/nonexistent"], r"/nonexistent is not a file"),
    (["--workload", "{bad_jsonl}"], r"bad\.jsonl:2: invalid JSON"),
    (["--config", "{no_kv}"], r"no_kv\.toml has no \[kv\] shape"),
    (["--connect", "{sockdir}/pool.sock", "--isolated"], r"not with --connect"),
    (["--connect", "{sockdir}/nobody.sock"], r"no coordinator listening at .*nobody\.sock"),
    (["--preset", "jamba-hybrid"], r"group 1 is MambaSpec"),
    (["--preset", "whisper-encdec"], r"group 1 is CrossAttentionSpec"),
    (["--kv-memory", "1K"], r"at least 2 are needed"),
    (["--requests", "0"], r"--requests must be at least 1"),
    (["--kv-memory", "200T"], r"num_blocks: must be at most 2,147,483,646"),
    (["--num-blocks", "2000000000"], r"needs [\d,]+ bytes but /dev/shm has only"),
    (["--json", "/nonexistent/dir/out.json"], r"--json: the directory of .* does not exist"),
], ids=["workers-0", "kill-worker", "verify-hits", "verify-hits-transformer",
        "check-blocks", "no-workload", "bad-jsonl", "no-kv",
        "connect-isolated", "connect-nobody", "mamba", "encoder-decoder", "tiny-memory",
        "requests-0", "too-many-blocks", "no-shm-space", "json-dir"])
def test_bad_arguments_exit_2(tmp_path, sockdir, args, message):
    (tmp_path / "no_kv.toml").write_text(NO_KV_CONFIG)
    (tmp_path / "bad.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n{"prompt_ids": [1,\n')
    args = [a.format(no_kv=tmp_path / "no_kv.toml", bad_jsonl=tmp_path / "bad.jsonl",
                     sockdir=sockdir) for a in args]
    before = kvshm_segments()
    proc = run(*args, "--duration", "2", "--quiet", timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(message, proc.stderr), proc.stderr
    assert proc.stderr.startswith("kvshm run: ") and "Traceback" not in proc.stderr
    assert "== shared pool" not in proc.stdout       # nothing ran
    assert not leftovers(before)


def test_python_m_workers_reports_a_dead_socket_like_kvshm_run(sockdir):
    proc = run("--connect", str(sockdir / "nobody.sock"), "--duration", "2", "--quiet",
               cmd=[sys.executable, "-m", "kvshm.workers"], timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2
    assert re.search(r"no coordinator listening at .*nobody\.sock", proc.stderr)


def test_synthetic_workload_on_a_short_context_pool(tmp_path):
    path = tmp_path / "short.toml"
    path.write_text(NO_KV_CONFIG.replace("4096", "2048")
                    + '[kv]\nnum_layers = 2\nnum_kv_heads = 2\nhead_size = 16\n')
    before = kvshm_segments()
    proc = run("--config", str(path), "--num-blocks", "512", "--duration", "1", "--grace",
               "1", "--quiet")
    # The synthetic workload is scaled down to fit the model (and 512 blocks
    # hold its requests: a run that rejects most of them is FAILED).
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "== shared pool" in proc.stdout
    assert not leftovers(before)


# -- Ctrl-C ---------------------------------------------------------------------------------------
def test_a_sigkilled_launcher_leaves_nothing_behind():
    """The coordinator and the workers die with the launcher (PDEATHSIG),
    the coordinator removes its segments, and the run's turn board lost its
    name as soon as every worker had attached it."""
    before = kvshm_segments()
    proc = subprocess.Popen([*RUN, "--duration", "30", "--grace", "2", *LIGHT],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: list[psutil.Process] = []
    try:
        children = descendants_when(
            proc, lambda cmds: (sum("workers.worker" in c for c in cmds) == 2
                                and any(" serve " in c for c in cmds)))
        time.sleep(1.5)
        proc.kill()
        proc.wait()
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, alive
        assert kvshm_segments() == before
    finally:
        kill_all(proc, children)


def test_ctrl_c_stops_everything(tmp_path):
    before = kvshm_segments()
    out = tmp_path / "out.json"
    proc = subprocess.Popen([*RUN, "--duration", "30", "--grace", "2", "--json", str(out), *LIGHT],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children: list[psutil.Process] = []
    try:
        header = []
        while "placement:" not in header:
            line = proc.stdout.readline()
            assert line, f"exited before the header: {proc.wait()} {proc.stderr.read()}"
            header.append(line.strip())
        children = descendants_when(   # the coordinator and both workers are up
            proc, lambda cmds: (sum("workers.worker" in c for c in cmds) == 2
                                and any(" serve " in c for c in cmds)))
        time.sleep(1.5)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=20)
        assert proc.returncode == 130, stdout + stderr
        _, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, alive
        assert "Traceback" not in stderr, stderr
        [res] = results(out)
        assert res["interrupted"]
        assert {w["status"] for w in res["workers"]} <= {"interrupted", "done"}
        # What was done before Ctrl-C is reported, per-step samples included.
        assert res["computed_tokens"] > 0 and res["step_batch_us_p50"], res
        assert re.search(r"over [1-9][\d,]* steps", stdout), stdout
        assert {w["pid"] for w in res["workers"]} <= {c.pid for c in children}
        assert not leftovers(before)
    finally:   # only if something above failed: stop what this test started
        kill_all(proc, children)
        proc.stdout.close()
        proc.stderr.close()


def test_python_m_workers_help():
    proc = run("--help", cmd=[sys.executable, "-m", "kvshm.workers"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    for option in ("--isolated", "--compare", "--kill-worker", "--workload", "--connect"):
        assert option in proc.stdout


def test_a_bfloat16_pool_without_ml_dtypes_is_refused_up_front(tmp_path):
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "ml_dtypes.py").write_text("raise ImportError('ml_dtypes is not installed')\n")
    env = dict(os.environ, PYTHONPATH=str(blocker))
    before = kvshm_segments()
    proc = subprocess.run([*RUN, "--preset", "llama-8b", "--num-blocks", "64", "--quiet"],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "bfloat16 KV arena needs the ml_dtypes package" in proc.stderr
    assert "== shared pool" not in proc.stdout
    assert not leftovers(before)


# -- coordinator restarts ---------------------------------------------------------------------------
def test_workers_ride_through_coordinator_kills(tmp_path):
    """--kill-coordinator-every: kvshm run restarts its coordinator, which
    adopts the pool; the workers resume, nothing is recomputed, OK."""
    before = kvshm_segments()
    out = tmp_path / "out.json"
    proc = subprocess.run([*RUN, "--workers", "2", "--duration", "6", "--grace", "3",
                           "--kill-coordinator-every", "1.2", *LIGHT, "--json", str(out)],
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [res] = results(out)
    assert res["coordinator_restarts"] >= 3
    assert all(r["check_clean"] for r in res["restarts"])
    assert res["requests_resumed"] > 0 and res["requests_lost"] == 0
    assert res["hit_mismatches"] == 0 and res["decode_mismatches"] == 0
    assert res["stall_ms_max"] is not None
    assert "restarts          coordinator restarted" in proc.stdout
    assert not leftovers(before)


def _wait_for_work(pool: str, resumed: int = 0, timeout: float = 60.0) -> None:
    """Until both workers run requests on the pool and, after a restart,
    `resumed` sessions in all have resumed on it (an adopted pool holds the
    requests of sessions still to resume, so its request count alone does
    not show that they came back)."""
    from kvshm.core.metrics import read_metrics
    from kvshm.pool.segment import PoolSegment
    deadline = time.monotonic() + timeout
    with PoolSegment.attach(pool) as seg:
        while (seg.get("num_requests") < 2
               or read_metrics(seg.metrics)["sessions_resumed"] < resumed):
            assert time.monotonic() < deadline, "the workers never started or resumed"
            time.sleep(0.05)
    time.sleep(0.5)


def test_connected_workers_ride_through_an_external_restart(tmp_path):
    """`kvshm serve` SIGKILLed and started again with the same command line
    while `kvshm run --connect` workers run: they finish, 0 mismatches."""
    out = tmp_path / "out.json"
    with CoordinatorProcess(preset_config("tiny", num_blocks=2048)) as coord:
        proc = subprocess.Popen([*RUN, "--connect", str(coord.socket), "--duration", "4",
                                 "--grace", "3", "--workers", "2", "--quiet", "--json",
                                 str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for restarts in range(2):
            # Both workers connected and running (after a restart: resumed).
            _wait_for_work(coord.name, resumed=2 * restarts)
            coord.kill()
            coord.restart()
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, stdout + stderr
    [res] = results(out)
    assert res["hit_mismatches"] == 0 and res["requests_lost"] == 0
    assert all(w["coordinator_restarts"] == 2 for w in res["workers"])
    assert "the coordinator restarted 2 time(s)" in stdout
