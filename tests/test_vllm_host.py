"""`vllm serve` engines on one pool behind vllm-router: `kvshm host`
(kvshm/vllm/host.py) and the serving quickstart of the README and
docs/vllm.md, on both vLLM releases, run as a user runs them: fresh
interpreters of the vLLM environments (./scripts/vllm_env.sh), HTTP to the
front door.  Without an environment these tests skip, unless
KVSHM_REQUIRE_VLLM=1 (the test command sets it): then they fail."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import kvshm_segments
from vllm_engines import PYTHONS, release  # noqa: F401 (a fixture)
from kvshm.service.handshake import default_socket_path
from kvshm.vllm.model import vocabulary, write_tiny_model
from kvshm.vllm.release import vllm_cache_root

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT = 600


def user_env(release: str) -> dict[str, str]:
    """A shell of the release's environment, as a user who activated it has."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVSHM_POOL", "PYTHONHASHSEED", "VLLM_PORT")}
    env["PATH"] = f"{PYTHONS[release].parent}:{env['PATH']}"
    env.setdefault("VLLM_CACHE_ROOT", vllm_cache_root(release))
    return env


def free_ports(n: int) -> int:
    """The first of `n` consecutive ports nobody listens on now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n >= 65535:
            continue
        ok = True
        for port in range(first, first + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return first
    raise RuntimeError("no free ports")


def post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as reply:
        return json.load(reply)


def metric(text: str, name: str) -> float:
    """The sum of a Prometheus counter's samples in `text`."""
    return sum(float(m) for m in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text,
                                              re.M))


def processes_of(pids: set[int]) -> list[str]:
    """Which of `pids` still run (a zombie has ended: whoever reaps it), with
    their command lines."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if state != "Z":
            alive.append(f"{pid} {state} {cmd[:200]}")
    return alive


def descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for k in map(int, kids):
            out.add(k)
            todo.append(k)
    return out


def test_the_host_serves_rides_through_a_coordinator_kill_and_stops_clean(release, tmp_path):
    """`kvshm host`: start, 100 requests through the front door with the
    coordinator SIGKILLed once under load (every request succeeds), the
    engines' metrics, the pool's stats and the replies' cached tokens
    (`--enable-prompt-tokens-details` passed through) telling the same hit
    tokens,
    Ctrl-C, nothing left behind (no process, no segment, no socket)."""
    model = write_tiny_model(tmp_path / "model", "tiny")
    port = free_ports(3)
    name = f"kvshm-host-{os.getpid()}-{release.replace('.', '')}"
    proc = subprocess.Popen(
        ["kvshm", "host", str(model), "--name", name, "--port", str(port), "--kv-memory",
         "64MiB", "--block-size", "32", "--max-model-len", "1024", "--", "--enforce-eager",
         "--max-num-seqs", "8", "--enable-prompt-tokens-details"],
        env=user_env(release), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not any("ready:" in ln for ln in lines):
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.5)
        url = f"http://127.0.0.1:{port}"
        words = vocabulary(1000)[3:]
        docs = [" ".join(words[(d * 97 + i) % len(words)] for i in range(160))
                for d in range(5)]
        results: dict[int, dict | Exception] = {}

        def ask(i: int) -> None:
            try:
                results[i] = post(f"{url}/v1/completions",
                                  {"model": str(model), "max_tokens": 4, "ignore_eos": True,
                                   "prompt": f"{docs[i % 5]} {words[i]} {words[i + 1]}"})
            except Exception as e:   # noqa: BLE001 - each failure is reported below
                results[i] = e

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(100)]
        for i, t in enumerate(threads):
            t.start()
            if i == 30:          # under load: kill the coordinator once
                coordinator = next(int(pid) for pid in descendants(proc.pid)
                                   if f"--name {name}" in
                                   Path(f"/proc/{pid}/cmdline").read_bytes()
                                   .replace(b"\0", b" ").decode())
                os.kill(coordinator, signal.SIGKILL)
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=600)
        failed = {i: r for i, r in results.items() if isinstance(r, Exception)}
        assert len(results) == 100 and not failed, failed
        assert all(r["usage"]["completion_tokens"] == 4 for r in results.values())
        prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in results.values())
        assert any("restarted, it adopted the pool" in ln for ln in lines), "".join(lines)
        # Each engine's counters, and the pool's: a request counted once.
        queries = hits = 0.0
        for e in (1, 2):
            with urllib.request.urlopen(f"http://127.0.0.1:{port + e}/metrics") as r:
                text = r.read().decode()
            queries += metric(text, "vllm:prefix_cache_queries_total")
            hits += metric(text, "vllm:prefix_cache_hits_total")
        assert queries == prompt_tokens
        stats = subprocess.run(["kvshm", "stats", name, "--json"], env=user_env(release),
                               capture_output=True, text=True, check=True)
        pool = json.loads(stats.stdout)
        assert pool["query_tokens"] == prompt_tokens and pool["hit_tokens"] == hits
        assert hits >= 0.5 * prompt_tokens          # five shared documents
        # The clients' view: each reply's cached tokens, hits from other
        # engines' blocks included (0.14 leaves out the details of a reply
        # with none).
        assert sum((r["usage"]["prompt_tokens_details"] or {"cached_tokens": 0})
                   ["cached_tokens"] for r in results.values()) == hits
        children = descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130
        reader.join(timeout=10)
        assert lines[-1].startswith("kvshm host: stopped"), "".join(lines)
        assert not processes_of(children), "".join(lines)
        assert not {name, f"{name}.kv"} & kvshm_segments(), "".join(lines)
        assert not default_socket_path(name).exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=10)
        proc.stdout.close()


def quickstart(path: Path) -> str:
    """The serving quickstart's shell block in README.md or docs/vllm.md."""
    text = path.read_text()
    marker = "tests/test_vllm_host.py::test_the_serving_quickstart_runs_as_written"
    start = text.index("```sh\n", text.index(marker)) + len("```sh\n")
    return text[start:text.index("```", start)]


@pytest.mark.serial   # the quickstart's ports (8000-8002) and pool name are the defaults
def test_the_serving_quickstart_runs_as_written(release, tmp_path):
    """The README's and docs/vllm.md's quickstart (the same block), in a
    shell of the release's environment: both requests answered, the second
    one's prefix a hit from the other engine's K/V in the pool and in that
    engine's own counters, everything stopped, nothing left behind."""
    commands = quickstart(REPO / "README.md")
    assert commands == quickstart(REPO / "docs" / "vllm.md")
    before = set(kvshm_segments())
    proc = subprocess.Popen(["bash", "-e", "-c", commands], cwd=tmp_path, env=user_env(release),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=START_TIMEOUT + 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    log = (tmp_path / "host.log").read_text()
    assert proc.returncode == 0, f"{err[-3000:]}\n{log[-3000:]}"
    completions = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    assert [c["usage"]["prompt_tokens"] for c in completions] == [601, 601]
    assert "512 of 1,202 tokens hit" in out, out
    queries = [float(v) for v in re.findall(r"prefix_cache_queries_total\{.*\} (\S+)", out)]
    hits = [float(v) for v in re.findall(r"prefix_cache_hits_total\{.*\} (\S+)", out)]
    assert sorted(queries) == [601, 601] and sorted(hits) == [0, 512], out
    assert "kvshm host: stopped" in log
    assert set(kvshm_segments()) <= before
    assert not default_socket_path("kvshm").exists()
