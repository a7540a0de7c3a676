"""scripts/bench_serve.py without vLLM: the best hit rates it prints for the
dataset, its TTFT breakdown by prefix, how it reads an engine's counters,
and the arguments it refuses before it starts anything."""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from helpers import SCRIPTS, import_script


@pytest.fixture(scope="module")
def bench_serve():
    return import_script("bench_serve")


def test_the_best_hit_rates_of_the_default_dataset(bench_serve):
    args = bench_serve.parse_args([])
    best = bench_serve.best_hit_rates(args, 128, 2)
    # 144 of 160 prompts hit their 1,024-token prefix on one cache; on two,
    # 128 (each engine computes each prefix once).
    assert best["shared"] == pytest.approx(144 * 1024 / (160 * 1056))
    assert round(best["shared"], 3) == 0.873           # the figure
    assert best["per_engine"] == pytest.approx(128 * 1024 / (160 * 1056))
    # Only whole blocks hit; an engine that sees a prefix once never hits it.
    args.prefix_len, args.num_prompts, args.num_prefixes, args.suffix_len = 1000, 24, 12, 128
    best = bench_serve.best_hit_rates(args, 128, 4)
    assert best["shared"] == pytest.approx(12 * 896 / (24 * 1128))
    assert best["per_engine"] == 0


def test_the_ttft_breakdown_by_prefix(bench_serve):
    got = bench_serve.by_class([5.0, 1.0, 3.0, 2.0, 9.0],
                               ["first", "seen", "seen", "seen", "other engine"])
    assert got == {"first": {"count": 1, "ttft_p50_ms": 5.0},
                   "other engine": {"count": 1, "ttft_p50_ms": 9.0},
                   "seen": {"count": 3, "ttft_p50_ms": 2.0}}


METRICS = """\
# HELP vllm:prefix_cache_queries Prefix cache queries
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1152.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e+09
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1024.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 1152.0
vllm:num_preemptions_total{engine="0",model_name="m"} 1.0
vllm:num_preemptions_total{engine="1",model_name="m"} 2.0
"""


def test_an_engine_s_counters_are_read_from_its_metrics(bench_serve):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = METRICS.encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        got = bench_serve.scrape(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert got == {"prefix_cache_queries": 1152.0, "prefix_cache_hits": 1024.0,
                   "prompt_tokens": 1152.0, "num_preemptions": 3.0}


def test_each_pool_mode_is_compared_with_each_own_cache_mode(bench_serve):
    def run(mode, p50, p99, rps):
        return {"mode": mode, "ttft_p50_ms": p50, "ttft_p99_ms": p99, "request_throughput": rps}
    got = bench_serve.ratios_of([run("own-rr", 1000, 4000, 1.0),
                                 run("own-cache-aware", 500, 8000, 1.0),
                                 run("pool-rr", 250, 2000, 1.5)])
    assert got == {"pool-rr/own-rr": {"ttft_p50": 0.25, "ttft_p99": 0.5, "throughput": 1.5},
                   "pool-rr/own-cache-aware": {"ttft_p50": 0.5, "ttft_p99": 0.25,
                                               "throughput": 1.5}}
    assert bench_serve.ratios_of([run("own-rr", 1, 1, 1)]) == {}


@pytest.mark.parametrize("argv, message", [
    (["--modes", "own-rr,nearest"], "unknown modes ['nearest']"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--rate", "2", "--max-concurrency", "4"], "not allowed with argument"),
    ([], "run it with a vLLM environment's python"),
])
def test_bad_arguments_are_refused_before_anything_starts(argv, message):
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_serve.py"), *argv],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_the_no_wait_mode_sets_the_engines_wait_knob(bench_serve):
    assert bench_serve.MODES["pool-rr-nowait"] == ("pool", "round_robin",
                                                    {"KVSHM_WAIT_IN_FLIGHT": "0"})


def test_rounds_alternate_the_first_mode_and_report_the_medians_of_their_ratios(
        bench_serve, monkeypatch, tmp_path):
    """main() end to end with the hosts and the client stood in for."""
    import json
    order = []
    p50 = iter([1000, 500, 300, 1000, 1000, 400])   # own, pool / pool, own / own, pool

    def fake_run(args, mode, model, config, tmp):
        order.append(mode)
        return {"mode": mode, "ttft_p50_ms": next(p50), "ttft_p99_ms": 100.0,
                "request_throughput": 1.0, "output_throughput": 32.0, "failed": 0,
                "server_hit_rate": 0.8, "engines_cpu_s": [1.0, 1.0], "wall_s": 10.0,
                "requests_per_engine": [1, 1], "servers": [{}, {}], "ttfts_ms": []}

    monkeypatch.setattr(bench_serve, "run_mode", fake_run)
    monkeypatch.setattr(bench_serve, "vllm_release", lambda: "0.32.0")
    out = tmp_path / "serve.json"
    assert bench_serve.main(["--modes", "own-rr,pool-rr", "--rounds", "3",
                             "--json", str(out)]) == 0
    assert order == ["own-rr", "pool-rr", "pool-rr", "own-rr", "own-rr", "pool-rr"]
    doc = json.loads(out.read_text())
    # the rounds' ratios are 0.5, 0.3 and 0.4: their median is 0.4
    assert doc["ratios"]["pool-rr/own-rr"]["ttft_p50"] == pytest.approx(0.4)
    assert doc["round_1_ratios"]["pool-rr/own-rr"]["ttft_p50"] == pytest.approx(0.5)
    assert [r["mode"] for r in doc["runs"]] == ["own-rr", "pool-rr"]
    assert len(doc["rounds"]) == 2
