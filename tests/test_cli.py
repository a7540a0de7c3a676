"""The `kvshm` command line."""

from __future__ import annotations

import gzip
import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_config

import kvshm
from kvshm import FullSpec, KVCacheManager, PoolConfig, Request
from kvshm.cli import main
from kvshm.core import fmt
from kvshm.pool.segment import SHM_DIR, PoolSegment

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
                     groups=(FullSpec(4),))
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


def test_demo_refuses_traces_that_are_not_there(capsys, tmp_path):
    assert main(["demo", "--requests", "5", "--num-blocks", "256",
                 "--traces", str(tmp_path / "nowhere")]) == 2
    assert _error_line(capsys) == f"kvshm demo: no such file or directory: {tmp_path}/nowhere\n"


def test_demo_finds_the_source_checkout_s_traces_and_only_those():
    from kvshm.cli import demo
    here = Path(__file__).resolve().parent
    assert demo.source_traces() == str(here / "data" / "conformance" / "traces")


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as e:
        main(["replay"])
    assert e.value.code == 2


# Above Linux's PID_MAX_LIMIT (2**22): no process can have it.
DEAD_PID = 2**22 + 1


@pytest.fixture
def stale_pool():
    """A pool segment whose recorded coordinator pid is not alive; removed at
    teardown (also if a test already removed it)."""
    seg = PoolSegment.create(make_config(), f"kvshm-test-{secrets.token_hex(5)}")
    seg.set("coordinator_pid", DEAD_PID)
    yield seg.name
    seg.close()
    seg.unlink()


@pytest.fixture
def odd_shm_entries():
    """An empty file and a directory in SHM_DIR, named like kvshm segments."""
    tag = secrets.token_hex(5)
    empty, folder = f"kvshm-test-empty-{tag}", f"kvshm-test-dir-{tag}"
    open(f"{SHM_DIR}/{empty}", "x").close()
    os.mkdir(f"{SHM_DIR}/{folder}")
    try:
        yield empty, folder
    finally:
        os.unlink(f"{SHM_DIR}/{empty}")
        os.rmdir(f"{SHM_DIR}/{folder}")


def _error_line(capsys) -> str:
    """The one line a failed command wrote to stderr (and nothing on stdout)."""
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1, err
    return err


def test_check_and_stats_accept_a_path_in_dev_shm(capsys):
    cfg = make_config()
    with KVCacheManager(cfg, name=f"kvshm-test-{secrets.token_hex(5)}") as m:
        path = f"{SHM_DIR}/{m.segment.name}"
        assert main(["check", path]) == 0
        assert capsys.readouterr().out.startswith(f"pool {m.segment.name}: clean")
        assert main(["check", "--json", path]) == 0
        assert json.loads(capsys.readouterr().out)["name"] == m.segment.name
        assert main(["stats", path]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"pool {m.segment.name}: 10 blocks, 9 free")
        assert f"coordinator pid {os.getpid()} (alive), up 0s" in out
        assert main(["stats", "--json", path]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["coordinator_alive"] is True and doc["uptime_s"] >= 0


def test_rm_accepts_a_path_in_dev_shm(stale_pool, capsys):
    assert main(["rm", f"{SHM_DIR}/{stale_pool}"]) == 0
    assert capsys.readouterr().out == f"removed {stale_pool}\n"
    assert not os.path.exists(f"{SHM_DIR}/{stale_pool}")


@pytest.mark.parametrize("command", ["check", "stats", "top", "metrics", "rm"])
@pytest.mark.parametrize("arg", ["/tmp/kvshm-x", "sub/kvshm-x", f"{SHM_DIR}/",
                                 f"{SHM_DIR}/sub/kvshm-x"])
def test_a_path_outside_dev_shm_is_refused(command, arg, capsys):
    assert main([command, arg]) == 2
    assert _error_line(capsys) == (
        f"kvshm {command}: {arg!r} is not a segment in {SHM_DIR}: expected a segment "
        f"name (see `kvshm ls`) or {SHM_DIR}/NAME\n")


@pytest.mark.parametrize("command", ["check", "stats", "top", "metrics", "rm"])
@pytest.mark.parametrize("arg", ["", "..", "kvshm x", "x" * 201, f"{SHM_DIR}/.x*"])
def test_a_bad_segment_name_is_refused(command, arg, capsys):
    name = arg.rsplit("/", 1)[-1]
    assert main([command, arg]) == 2
    assert _error_line(capsys) == (
        f"kvshm {command}: bad segment name {name!r}: expected 1-200 letters, digits, "
        "'.', '_' or '-' (see `kvshm ls`)\n")


def test_rm_removes_nothing_when_one_name_is_bad(stale_pool, capsys):
    assert main(["rm", stale_pool, "/tmp/x"]) == 2
    assert "'/tmp/x' is not a segment in" in _error_line(capsys)
    assert os.path.exists(f"{SHM_DIR}/{stale_pool}")


def test_stats_of_a_missing_segment_by_path(capsys):
    assert main(["stats", f"{SHM_DIR}/kvshm-test-nope"]) == 2
    assert _error_line(capsys) == \
        "kvshm stats: no shared-memory segment named 'kvshm-test-nope'\n"


@pytest.mark.parametrize("command", ["check", "stats"])
def test_check_and_stats_of_an_empty_file_or_a_directory(command, odd_shm_entries, capsys):
    empty, folder = odd_shm_entries
    assert main([command, empty]) == 2
    assert _error_line(capsys) == \
        f"kvshm {command}: {SHM_DIR}/{empty} is empty: not a kvshm pool\n"
    assert main([command, f"{SHM_DIR}/{folder}"]) == 2
    assert _error_line(capsys).startswith(
        f"kvshm {command}: cannot open {SHM_DIR}/{folder} as a kvshm pool: ")


def test_the_command_prints_no_traceback_for_a_foreign_path():
    proc = subprocess.run([sys.executable, "-m", "kvshm.cli", "check", "/tmp/kvshm-x"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"kvshm check: '/tmp/kvshm-x' is not a segment in {SHM_DIR}: expected a segment "
        f"name (see `kvshm ls`) or {SHM_DIR}/NAME"]


def test_stats_of_a_dead_coordinator_has_no_uptime(stale_pool, capsys):
    assert main(["stats", stale_pool]) == 0
    out = capsys.readouterr().out
    assert f"  coordinator pid {DEAD_PID} (dead: not running; remove the stale pool with " \
        f"`kvshm rm {stale_pool}`), generation 0\n" in out
    assert " up " not in out
    assert main(["stats", "--json", stale_pool]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["coordinator_pid"] == DEAD_PID
    assert doc["coordinator_alive"] is False and doc["uptime_s"] is None


# -- usage, version, exit codes ----------------------------------------------------------


def exit_status(argv: list[str]) -> int:
    """What `kvshm ARGV` exits with (argparse's own errors exit through SystemExit)."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_version(capsys):
    assert exit_status(["--version"]) == 0
    assert capsys.readouterr().out == f"kvshm {kvshm.__version__}\n"


def test_no_command_prints_the_help_and_exits_2(capsys):
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: kvshm")
    for command in ("run", "replay", "events", "serve", "stats", "check", "ls", "rm", "demo"):
        assert f"\n    {command} " in err
    assert "exit status: 0 success; 1" in err


@pytest.mark.parametrize("argv, message", [
    (["rm"], "kvshm rm: name pools to remove, or pass --stale (not both)"),
    (["rm", "--stale", "kvshm-x"], "kvshm rm: name pools to remove, or pass --stale"),
    (["events", "--from", "-1"], "kvshm events: --from must be >= 0"),
    (["events", "--endpoint", "nonsense"],
     "kvshm events: endpoint: cannot connect to nonsense: Invalid argument"),
    (["events", "--replay-endpoint", "nonsense", "--from", "0"],
     "kvshm events: replay_endpoint: cannot connect to nonsense: Invalid argument"),
    (["stats", "--bogus"], "unrecognized arguments: --bogus"),
    (["check"], "the following arguments are required: name"),
    (["replay", "--runs"], "argument --runs: expected one argument"),
    (["nope"], "invalid choice: 'nope'"),
], ids=lambda v: "-".join(v) if isinstance(v, list) else None)
def test_usage_errors_exit_2(argv, message, capsys):
    assert exit_status(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err


@pytest.mark.parametrize("argv, message", [
    (["rm", "kvshm-test-nope"], "kvshm rm: no kvshm pool or arena named 'kvshm-test-nope'"),
    (["check", "kvshm-test-nope"], "kvshm check: no shared-memory segment named"),
    (["stats", "kvshm-test-nope"], "kvshm stats: no shared-memory segment named"),
    (["replay", str(ONE), "/nonexistent/t.jsonl"],
     "kvshm replay: no such file or directory: /nonexistent/t.jsonl"),
    (["replay", "--ipc", "--connect", "/nonexistent/s.sock", str(ONE)],
     "kvshm replay: no coordinator listening at /nonexistent/s.sock (no such socket)"),
], ids=["rm", "check", "stats", "replay-file", "replay-socket"])
def test_what_is_not_found_exits_2_and_nothing_runs(argv, message, capsys):
    """Before, `rm` of an unknown pool and `replay` of a missing file or
    socket exited 1, as for a problem found; `check` and `stats` exited 2."""
    assert exit_status(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(message)


def test_replay_through_a_socket_nothing_listens_on_exits_2(sockdir, capsys):
    (sockdir / "s.sock").write_text("")       # no coordinator, no admin token beside it
    assert main(["replay", "--ipc", "--connect", str(sockdir / "s.sock"), str(ONE)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("kvshm replay: cannot read the admin token")


def test_events_whose_replay_endpoint_does_not_answer_exits_2(capsys):
    assert main(["events", "--replay-endpoint", "tcp://127.0.0.1:1", "--from", "0"]) == 2
    assert "kvshm events: no answer from the replay endpoint tcp://127.0.0.1:1" in \
        capsys.readouterr().err


def test_rm_of_a_live_pool_exits_2_and_removes_the_others(stale_pool, capsys):
    with KVCacheManager(make_config(), name=f"kvshm-test-{secrets.token_hex(5)}") as live:
        assert main(["rm", live.segment.name, stale_pool]) == 2
        out, err = capsys.readouterr()
        assert out == f"removed {stale_pool}\n"
        assert err == f"kvshm rm: {live.segment.name!r} belongs to live process " \
            f"{os.getpid()}; stop it first (or pass --force)\n"
        assert os.path.exists(f"{SHM_DIR}/{live.segment.name}")
    assert not os.path.exists(f"{SHM_DIR}/{stale_pool}")


def test_serve_refuses_a_config_with_an_unknown_key(tmp_path, sockdir):
    cfg = tmp_path / "pool.toml"
    cfg.write_text('num_blocks = 64\nhash_block_size = 16\nmax_model_len = 256\n'
                   '[[groups]]\ntype = "full"\nblocksize = 16\n')
    proc = subprocess.run([sys.executable, "-m", "kvshm", "serve", "--config", str(cfg),
                           "--socket", str(sockdir / "s.sock"), "--name", "kvshm-test-keys"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "kvshm serve: groups[0].blocksize: unknown key; did you mean `block_size`? "
        "valid keys: block_size, type"]
    assert not (sockdir / "s.sock").exists()


# -- number formatting ---------------------------------------------------------------------


def test_the_number_helpers():
    assert fmt.count(1234567) == "1,234,567" and fmt.count(2.5e3 + 0.4) == "2,500"
    assert fmt.nbytes(1048576) == "1,048,576 bytes"
    assert fmt.percent(0.1234) == "12.3%" and fmt.percent(1) == "100.0%"


def test_stats_ls_and_check_write_counts_alike(capsys):
    """Counts have thousands separators in every human-readable output (`ls`
    and `stats` printed "1500 blocks" where `demo` printed "1,500")."""
    name = f"kvshm-test-{secrets.token_hex(5)}"
    with KVCacheManager(make_config(num_blocks=1500), name=name) as m:
        m.allocate_slots(Request("a", list(range(9)), m.make_hasher()), 9)
        assert main(["stats", name]) == 0
        assert capsys.readouterr().out.startswith(
            f"pool {name}: 1,500 blocks, 1,496 free, 2 cached, 3 used (usage 0.2%)\n")
        assert main(["ls"]) == 0
        line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(name))
        assert line.startswith(f"{name}: pool, {fmt.nbytes(m.segment.layout.size)}, "
                               "1,500 blocks, owner pid")
        assert main(["check", name]) == 0
        assert capsys.readouterr().out == \
            f"pool {name}: clean: 1,500 blocks, 1,496 free, 2 cached, 1 requests\n"
