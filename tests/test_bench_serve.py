"""scripts/bench_serve.py without vLLM: the best hit rates it prints for the
dataset, its TTFT breakdown by prefix, how it reads an engine's counters,
and the arguments it refuses before it starts anything."""

from __future__ import annotations

import subprocess
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from helpers import SCRIPTS, import_script


@pytest.fixture(scope="module")
def bench_serve():
    return import_script("bench_serve")


def test_the_best_hit_rates_of_the_default_dataset(bench_serve):
    args = types.SimpleNamespace(num_prompts=144, num_prefixes=12, prefix_len=1024,
                                 suffix_len=128)
    best = bench_serve.best_hit_rates(args, 128, 2)
    # 132 of 144 prompts hit their 1,024-token prefix on one cache; on two,
    # 120 (each engine computes each prefix once).
    assert best["shared"] == pytest.approx(132 * 1024 / (144 * 1152))
    assert best["per_engine"] == pytest.approx(120 * 1024 / (144 * 1152))
    # Only whole blocks hit; an engine that sees a prefix once never hits it.
    args.prefix_len, args.num_prompts = 1000, 24
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


@pytest.mark.parametrize("argv, message", [
    (["--modes", "own-rr,nearest"], "unknown modes ['nearest']"),
    (["--rate", "2", "--max-concurrency", "4"], "not allowed with argument"),
    ([], "run it with a vLLM environment's python"),
])
def test_bad_arguments_are_refused_before_anything_starts(argv, message):
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_serve.py"), *argv],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
