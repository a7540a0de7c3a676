"""The `kvshm` command line."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from kvshm import FullSpec, KVCacheManager, PoolConfig, Request
from kvshm.cli import main

TRACES = Path(__file__).parent / "data" / "conformance" / "traces"
ONE = TRACES / "full16-tiny-chat-s1000.jsonl.gz"


def test_replay_passes_and_ends_with_the_count(capsys):
    assert main(["replay", str(ONE), str(TRACES / "hyb-full-sw32-tiny-chat-s2032.jsonl.gz")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "2 passed, 0 failed"


def test_replay_reports_the_first_mismatch(tmp_path, capsys):
    lines = gzip.open(ONE, "rt").read().splitlines()
    # Corrupt the first allocate_slots expectation.
    for i, line in enumerate(lines):
        op = json.loads(line)
        if op.get("op") == "allocate_slots":
            op["expect"]["num_free_blocks"] += 1
            lines[i] = json.dumps(op)
            break
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    assert main(["replay", str(bad), str(ONE)]) == 1
    out = capsys.readouterr().out
    assert f"line {i + 1} (allocate_slots" in out
    assert "expected" in out and "got" in out
    assert out.splitlines()[-1] == "1 passed, 1 failed"


def test_replay_json_and_bench(capsys):
    assert main(["replay", "--bench", "--runs", "1", "--json", str(ONE)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["passed"] == 1 and doc["traces"][0]["ops_per_s"] > 0


def test_replay_of_unreadable_trace_and_empty_dir(tmp_path, capsys):
    (tmp_path / "x.jsonl").write_text('{"op": "free"}\n')
    assert main(["replay", str(tmp_path / "x.jsonl")]) == 1
    assert "cannot load" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["replay", str(empty)]) == 2


def test_replay_of_a_directory(tmp_path, capsys):
    shutil.copy(ONE, tmp_path)
    assert main(["replay", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == "1 passed, 0 failed"


def test_check_clean_and_broken(capsys):
    cfg = PoolConfig(num_blocks=8, hash_block_size=4, max_model_len=32,
                     groups=(FullSpec(4),)).validate()
    with KVCacheManager(cfg, name="kvshm-test-cli-check") as m:
        m.allocate_slots(Request("a", list(range(9)), m.make_hasher()), 9)
        assert main(["check", "kvshm-test-cli-check"]) == 0
        assert "clean" in capsys.readouterr().out
        m.segment.ref_cnt[1] += 1
        assert main(["check", "--json", "kvshm-test-cli-check"]) == 1
        doc = json.loads(capsys.readouterr().out)
        assert not doc["clean"] and any("ref count" in p for p in doc["problems"])
        m.segment.ref_cnt[1] -= 1


def test_check_of_a_missing_segment(capsys):
    assert main(["check", "kvshm-test-nope"]) == 2
    assert "no shared-memory segment" in capsys.readouterr().err


def test_demo_runs_a_workload_and_the_replay(capsys, tmp_path):
    shutil.copy(ONE, tmp_path)
    assert main(["demo", "--requests", "20", "--num-blocks", "256",
                 "--traces", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "20 requests served" in out and "pool check: clean" in out
    assert out.splitlines()[-1] == "1 passed, 0 failed"


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as e:
        main(["replay"])
    assert e.value.code == 2
