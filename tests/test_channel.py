"""The launcher <-> worker channel (workers/channel.py): the spec a worker
is started with, its typed reports, and figures that sum themselves."""

from __future__ import annotations

import asyncio
import io
import json
import re
import subprocess
import sys

import msgspec
import pytest

from kvshm.config import preset_config
from kvshm.workers.channel import Done, Failed, Progress, Ready, WorkerSpec, emit, read_report
from kvshm.workers.engine_types import EngineOptions, EngineStats
from kvshm.workload.spec import WorkloadSpec
from kvshm.workers.launcher import Launch, LaunchOptions, RunResult, WorkerResult, make_plan
from kvshm.workload.items import SyntheticSpec


def test_a_worker_spec_survives_its_encoding():
    spec = WorkerSpec(socket="/tmp/x.sock", index=1, num_workers=3, node=0, cpus=(2, 3),
                      workload=WorkloadSpec(synthetic=SyntheticSpec(seed=5).fit(1024),
                                            limit=7, assign="hash"),
                      engine=EngineOptions(token_budget=64, seed=9), hash_seed="s")
    assert WorkerSpec.decode(spec.encode()) == spec


@pytest.mark.parametrize("text, where", [
    ('{"index": 0}', "socket"),
    ('{"socket": "s", "workload": {"kind": "csv"}}', "$.workload.kind"),
    ('{"socket": "s", "engine": {"token_budget": "many"}}', "$.engine.token_budget"),
    ('{"socket": "s", "cpus": [0, "one"]}', "$.cpus[1]"),
])
def test_a_bad_worker_spec_names_the_field(text, where):
    with pytest.raises(msgspec.ValidationError, match=re.escape(where)):
        WorkerSpec.decode(text)


def test_a_worker_refuses_a_bad_spec_with_a_report():
    r = subprocess.run([sys.executable, "-m", "kvshm.workers.worker", '{"socket": 5}'],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    report = read_report(r.stdout.splitlines()[-1])
    assert isinstance(report, Failed) and "bad worker spec" in report.message
    assert "socket" in report.message


def test_reports_round_trip_and_other_lines_are_ignored():
    stats = EngineStats(finished=3, batch_us=[10, 20], first_error="x")
    out = io.StringIO()
    for report in (Ready(0, pid=9, session=2, cpus=(0, 1), model="m"),
                   Progress(0, elapsed=0.5, stats=stats.without_samples()),
                   Done(0, seconds=1.5, stats=stats), Failed(1, message="boom")):
        emit(report, out)
    lines = out.getvalue().splitlines()
    assert json.loads(lines[0])["event"] == "ready"
    got = [read_report(line) for line in lines]
    assert [type(r) for r in got] == [Ready, Progress, Done, Failed]
    assert got[1].stats.batch_us == [] and got[1].stats.finished == 3
    assert got[2].stats == stats
    assert read_report("a library printed this") is None
    with pytest.raises(msgspec.ValidationError, match="seconds"):
        read_report('{"event": "done", "index": 0, "stats": {}}')


def test_engine_stats_sum_themselves():
    a = EngineStats(finished=1, hit_tokens=10, kv_s=0.5, batch_us=[1], hit_mismatches=1)
    b = EngineStats(finished=2, hit_tokens=5, kv_s=0.25, batch_us=[2, 3],
                    decode_mismatches=2, first_error="second")
    c = EngineStats(first_error="third")
    t = EngineStats.total([a, b, c])
    assert (t.finished, t.hit_tokens, t.kv_s, t.batch_us) == (3, 15, 0.75, [1, 2, 3])
    assert t.integrity_failures == 3 and t.first_error == "second"
    assert EngineStats.total([]) == EngineStats()
    assert a.batch_us == [1]            # the operands are unchanged


def test_a_run_result_sums_its_workers():
    config = preset_config("tiny", num_blocks=64)
    workers = [WorkerResult(index=i, cpus=(i,), status="done",
                            stats=EngineStats(finished=i + 1, prompt_tokens=100,
                                              hit_tokens=25 * i, batch_us=[i]))
               for i in range(2)]
    res = RunResult(mode="shared", config=config, workers=workers, seconds=2.0)
    assert res.totals.finished == 3 and res.hit_rate == 25 / 200
    d = res.to_dict()
    assert d["requests"] == 3 and d["workers"][1]["finished"] == 2
    assert "batch_us" not in d["workers"][0] and d["workers"][0]["integrity_failures"] == 0


async def test_the_launcher_marks_a_worker_with_unreadable_reports():
    launch = Launch(LaunchOptions(num_workers=1, live=False), make_plan(1, False), "shared")
    script = ('print("not a report"); '
              'print(\'{"event": "ready", "index": 0, "pid": 1, "session": 4, '
              '"cpus": [0], "model": "m"}\'); '
              'print(\'{"event": "done", "index": 0}\'); '
              'print(\'{"event": "done", "index": 0, "seconds": 1, "stats": {}}\')')
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    await launch.watch(0, proc)
    res = launch.results[0]
    assert res.session == 4 and res.affinity == (0,)
    assert res.status == "error" and "unreadable report" in res.message


async def test_start_together_releases_every_worker_once_all_are_ready():
    """Workers wait after Ready until the launcher says start; one that dies
    before Ready does not hold the others back."""
    launch = Launch(LaunchOptions(num_workers=3, live=False, start_together=True),
                    make_plan(3, False), "shared")
    ready = ('import sys; print(\'{"event": "ready", "index": %d, "pid": 1, "session": %d, '
             '"cpus": [0], "model": "m"}\', flush=True); ')
    done = ('line = sys.stdin.readline(); '
            'print(\'{"event": "done", "index": 0, "seconds": 1, "stats": {"steps": 7}}\' '
            'if line == "start\\n" else \'{"event": "failed", "index": 0, "message": "no"}\')')
    scripts = [ready % (0, 1) + done, ready % (1, 2) + "import time; time.sleep(0.3); " + done,
               "raise SystemExit(3)"]
    launch.procs = [await asyncio.create_subprocess_exec(
        sys.executable, "-c", s, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE) for s in scripts]
    await asyncio.wait_for(asyncio.gather(*(launch.watch(i, p)
                                            for i, p in enumerate(launch.procs))), 30)
    assert launch.started_at is not None
    assert [r.status for r in launch.results] == ["done", "done", "died"]
    assert [r.stats.steps for r in launch.results[:2]] == [7, 7]
