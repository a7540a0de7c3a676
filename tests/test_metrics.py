"""Prometheus metrics read from the pool segment (`kvshm metrics`, `kvshm
serve --metrics-port`), the counters behind them, and the logs."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from helpers import make_config, tokens
from kvshm.core import metrics as m
from kvshm.ops import protocol as p
from kvshm.ops.errors import ERROR_CLASSES
from kvshm.pool.shm import SHM_DIR
from kvshm.service.process import CoordinatorProcess
from kvshm.service.resume import Reconnect
from kvshm.service.sync_client import connect_sync

parser = pytest.importorskip("prometheus_client.parser")

CFG = make_config(num_blocks=64, max_num_seqs=16)
KVSHM = [sys.executable, "-m", "kvshm"]
EXPECTED = {
    "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
    "vllm:num_preemptions", "kvshm_pool_up", "kvshm_blocks", "kvshm_requests",
    "kvshm_sessions", "kvshm_sessions_started", "kvshm_sessions_resumed",
    "kvshm_handshakes_refused", "kvshm_frames", "kvshm_prefix_cache_lookups",
    "kvshm_prefix_cache_lookup_hits", "kvshm_blocks_allocated", "kvshm_evictions",
    "kvshm_coordinator_restarts", "kvshm_coordinator_up", "kvshm_events_published",
    "kvshm_events_dropped", "kvshm_quota_refusals", "kvshm_errors", "kvshm_ops",
    "kvshm_op_errors", "kvshm_op_latency_seconds", "kvshm_tenant_blocks",
    "kvshm_tenant_quota_blocks", "kvshm_tenant_prefix_cache_queries",
    "kvshm_tenant_prefix_cache_hits", "kvshm_tenant_quota_refusals",
    "kvshm_tenant_preemptions",
}


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read()
    return {f.name: f for f in parser.text_string_to_metric_families(text.decode())}


def scrape_when_up(port: int, timeout: float = 10.0) -> dict:
    """A scrape, once the exporter listens."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return scrape(port)
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def value(fams, name, **labels):
    """The sample of family `name` (its `_total` for counters) with `labels`."""
    for s in fams[name].samples:
        if s.name in (name, name + "_total") and all(s.labels.get(k) == v
                                                    for k, v in labels.items()):
            return s.value
    raise KeyError((name, labels))


def client(proc, **kw):
    return connect_sync(proc.socket, hash_algorithm=CFG.hash_algorithm,
                        hash_seed=CFG.hash_seed,
                        reconnect=Reconnect(initial_delay=0.01, max_delay=0.1, timeout=20),
                        **kw)


def stats_json(name):
    out = subprocess.run([*KVSHM, "stats", name, "--json"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def workload(c, prefix: str, n: int = 4):
    for i in range(n):
        rid = f"{prefix}{i}"
        c.add_request(rid, tokens(0, 24) + [i] * 4)
        hits, num = c.get_computed_blocks(rid)
        c.allocate_slots(rid, 28 - num, num, use_computed_blocks=True)
        c.advance(rid, 28)                 # computed: its blocks are ready
        c.free(rid, preempted=(i == 0))


def test_the_layout_names_every_op_and_code():
    assert m.OP_NAMES == tuple(op.__struct_config__.tag for op in p.OPS)
    client_side = {"CLOSED", "CONNECTION_LOST", "TIMEOUT", "REPLY_LOST", "SOCKET_IN_USE",
                   "POOL_IN_USE"}
    assert set(ERROR_CLASSES) - client_side <= set(m.ERROR_CODES)
    assert m.quantile([0] * (len(m.LATENCY_BOUNDS_NS) + 1), 0.5) is None
    assert m.quantile([0, 3, 1] + [0] * (len(m.LATENCY_BOUNDS_NS) - 2), 0.5) == 2.048e-6
    bounds = (0, *m.LATENCY_BOUNDS_NS)
    for ns in (0, 1, 1023, 1024, 1025, 5000, 2**25 - 1, 2**25, 2**26, 10**12):
        i = m.latency_bucket(ns)      # the first bucket whose bound exceeds ns
        assert bounds[i] <= ns and (i == m.LAST_BUCKET or ns < m.LATENCY_BOUNDS_NS[i])


def test_scraped_metrics_are_all_there_and_agree_with_kvshm_stats(pool_name):
    port = free_port()
    with CoordinatorProcess(CFG, name=pool_name) as proc:
        exporter = subprocess.Popen([*KVSHM, "metrics", pool_name, "--port", str(port),
                                     "--addr", "127.0.0.1"], stdout=subprocess.PIPE, text=True)
        try:
            assert "/metrics" in exporter.stdout.readline()
            with client(proc, tenant="team-a") as a, client(proc) as b:
                workload(a, "a")
                workload(b, "b")
                with pytest.raises(Exception):
                    a.get_block_ids("nobody")
                a.add_request("held", tokens(0, 9))
                a.allocate_slots("held", 9)
                fams = scrape(port)
                st = stats_json(pool_name)
            assert EXPECTED <= set(fams), EXPECTED - set(fams)
            assert value(fams, "kvshm_pool_up", pool=pool_name) == 1
            assert value(fams, "vllm:kv_cache_usage_perc", model_name=pool_name) == st["usage"]
            assert value(fams, "vllm:prefix_cache_hits", model_name=pool_name) \
                == st["hit_tokens"] > 0
            assert value(fams, "vllm:prefix_cache_queries", model_name=pool_name) \
                == st["query_tokens"]
            assert value(fams, "vllm:num_preemptions", model_name=pool_name) == 2
            assert value(fams, "kvshm_blocks", pool=pool_name, state="cached") \
                == st["num_cached_blocks"]
            assert value(fams, "kvshm_blocks", pool=pool_name, state="free") \
                == st["num_free_blocks"]
            assert value(fams, "kvshm_sessions", pool=pool_name) == 2
            assert value(fams, "kvshm_ops", pool=pool_name, op="alloc") == 9
            assert value(fams, "kvshm_op_errors", pool=pool_name, op="ids") == 1
            assert value(fams, "kvshm_errors", pool=pool_name, code="UNKNOWN_REQUEST") == 1
            hist = {(s.name, s.labels.get("le")): s.value
                    for s in fams["kvshm_op_latency_seconds"].samples if s.labels["op"] == "alloc"}
            count = hist["kvshm_op_latency_seconds_count", None]
            assert count == hist["kvshm_op_latency_seconds_bucket", "+Inf"] == 9
            assert 0 < hist["kvshm_op_latency_seconds_sum", None] < 1
            assert value(fams, "kvshm_tenant_blocks", pool=pool_name, tenant="team-a") \
                == st["tenants"]["team-a"]["blocks"] == 3
            assert value(fams, "kvshm_tenant_prefix_cache_hits", pool=pool_name,
                         tenant="") == st["tenants"][""]["hit_tokens"] > 0
        finally:
            exporter.terminate()
            assert exporter.wait(10) == 0
            exporter.stdout.close()


def test_serve_metrics_port_and_restarts(pool_name, sockdir):
    port = free_port()
    with CoordinatorProcess(CFG, name=pool_name,
                            extra_args=("--metrics-port", str(port))) as proc:
        with client(proc) as c:
            workload(c, "r")
            fams = scrape_when_up(port)
            assert value(fams, "kvshm_coordinator_restarts", pool=pool_name) == 0
            proc.kill()
            proc.restart()
            c.add_request("after", tokens(0, 8))
            fams = scrape_when_up(port)       # the new coordinator's exporter
            assert value(fams, "kvshm_coordinator_restarts", pool=pool_name) == 1
            assert value(fams, "kvshm_sessions_resumed", pool=pool_name) == 1
            assert value(fams, "kvshm_ops", pool=pool_name, op="alloc") >= 4   # kept
    with pytest.raises(OSError):   # the exporter went with its coordinator
        scrape(port)


def test_metrics_of_a_missing_pool_and_a_busy_port(pool_name):
    out = subprocess.run([*KVSHM, "metrics", "--once", "kvshm-no-such-pool"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "no pool 'kvshm-no-such-pool'" in out.stderr
    assert 'kvshm_pool_up{pool="kvshm-no-such-pool"} 0.0' in out.stdout
    busy = socket.socket()
    busy.bind(("", 0))
    busy.listen()
    try:
        out = subprocess.run([*KVSHM, "serve", "--preset", "tiny", "--num-blocks", "64",
                              "--name", pool_name, "--metrics-port",
                              str(busy.getsockname()[1])],
                             capture_output=True, text=True, timeout=60)
    finally:
        busy.close()
    assert out.returncode == 2 and "cannot listen on" in out.stderr
    assert "ready" not in out.stdout


def test_metrics_once_prints_a_parsable_scrape(pool_name):
    with CoordinatorProcess(CFG, name=pool_name) as proc:
        with client(proc) as c:
            workload(c, "x")
        out = subprocess.run([*KVSHM, "metrics", "--once", pool_name], capture_output=True,
                             text=True, timeout=30)
        by_path = subprocess.run([*KVSHM, "metrics", "--once", f"{SHM_DIR}/{pool_name}"],
                                 capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    fams = {f.name: f for f in parser.text_string_to_metric_families(out.stdout)}
    assert EXPECTED <= set(fams)
    assert value(fams, "kvshm_sessions_started", pool=pool_name) == 1
    assert by_path.returncode == 0, by_path.stderr
    assert f'kvshm_pool_up{{pool="{pool_name}"}} 1.0' in by_path.stdout


def test_logs_say_who_connected_resumed_and_ended(pool_name, tmp_path):
    with CoordinatorProcess(CFG, name=pool_name, extra_args=("--log-json", "--log-level", "info")) as proc:
        with client(proc, tenant="team-a", node=1) as c:
            c.add_request("r", tokens(0, 8))
            c.allocate_slots("r", 8)
            proc.kill()
            proc.restart()
            c.add_request("s", tokens(0, 8))
        with pytest.raises(Exception, match="at most 64 bytes"):
            client(proc, tenant="x" * 65)
        deadline = time.monotonic() + 10
        while "ended" not in proc.stderr and time.monotonic() < deadline:
            time.sleep(0.05)
        lines = [json.loads(ln) for ln in proc.stderr.splitlines() if ln.startswith("{")]
    messages = [ln["message"] for ln in lines]
    assert any("connected (pid" in s and "node 1, tenant 'team-a'" in s for s in messages)
    assert any("resumed" in s and "1 request(s) taken back" in s for s in messages)
    assert any("ended" in s and "closed by the client" in s and "2 request(s) freed" in s
               for s in messages), messages
    assert any("refused a session" in s and "at most 64 bytes" in s for s in messages)
    assert {ln["level"] for ln in lines} <= {"info", "warning"}
    assert not any("alloc" in s for s in messages)   # nothing per op


def test_percentiles_follow_one_rule_a_sample_at_the_rounded_rank():
    from kvshm.core.metrics import percentile
    assert percentile([], 50) is None
    assert percentile([7], 99) == 7
    assert percentile([4, 1, 3, 2], 50) == 3          # rank round(1.5) = 2, of the sorted
    assert percentile(range(1, 101), 99) == 99        # rank round(98.01) = 98
    assert percentile(range(1, 101), 100) == 100 and percentile(range(1, 101), 0) == 1
    assert percentile((x / 10 for x in range(11)), 50) == 0.5   # any iterable
