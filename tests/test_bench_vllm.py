"""scripts/bench_vllm.py's streams and arguments, without vLLM: what each
engine is given (waves, or an open-loop Poisson stream with --rate) and
the arguments it refuses before it starts anything."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import SCRIPTS, import_script
from kvshm.vllm.engine import workload_json
from kvshm.workload.items import RagSpec, rag


@pytest.fixture(scope="module")
def bench_vllm():
    return import_script("bench_vllm")


def _requests(work):
    return [r for wl in work for ph in wl["phases"] for r in ph]


def test_rag_at_a_rate_is_one_open_loop_phase_per_engine_in_list_order(bench_vllm):
    waves = bench_vllm.rag_streams(2, True, 1, 500)
    paced = bench_vllm.rag_streams(2, True, 1, 500, rate=4.0)
    assert [len(wl["phases"]) for wl in paced] == [1, 1]
    # the same requests on the same engines, in the same order
    assert [[r["id"] for r in wl["phases"][0]] for wl in paced] == \
        [[r["id"] for r in wl["phases"][0]] for wl in waves]
    assert all("at" not in r for r in _requests(waves))
    reqs = sorted(_requests(paced), key=lambda r: r["at"])
    # round robin in list order: request i of the list arrives i-th
    assert [r["id"] for r in reqs] == [f"d{i // 6}-q{i % 6}" for i in range(36)]
    assert reqs[0]["at"] == 0.0 and all(r["max_tokens"] == 16 for r in reqs)
    # both modes and every run see the same times
    assert paced == bench_vllm.rag_streams(2, True, 1, 500, rate=4.0)


def test_a_staggered_rag_list_gives_each_engine_its_requests_from_another_document(bench_vllm):
    lockstep = bench_vllm.rag_streams(2, True, 1, 500)
    staggered = bench_vllm.rag_streams(2, True, 1, 500, order="staggered")
    ids = [[r["id"] for r in wl["phases"][0]] for wl in staggered]
    # the same requests on each engine, the same prompts ...
    assert [sorted(e) for e in ids] == [sorted(r["id"] for r in wl["phases"][0])
                                        for wl in lockstep]
    by_id = {r["id"]: r for r in _requests(lockstep)}
    assert all(r == by_id[r["id"]] for r in _requests(staggered))
    # ... engine 0 from the first document, engine 1 from the fourth (of 6),
    # a document's questions in their order
    assert ids[0] == [f"d{d}-q{q}" for d in range(6) for q in (0, 2, 4)]
    assert ids[1] == [f"d{(d + 3) % 6}-q{q}" for d in range(6) for q in (1, 3, 5)]
    paced = bench_vllm.rag_streams(2, True, 1, 500, rate=4.0, order="staggered")
    order = [r["id"] for r in sorted(_requests(paced), key=lambda r: r["at"])]
    assert order[:4] == ["d0-q0", "d3-q1", "d0-q2", "d3-q3"]


def test_best_hit_rates_count_each_distinct_block_once_per_cache(bench_vllm):
    def req(rid, prompt):
        return {"id": rid, "prompt_ids": list(prompt), "max_tokens": 4}
    doc = list(range(100, 196))                      # 3 blocks of 32
    work = [{"phases": [[req("a0", doc + [1]), req("a1", doc + [2, 3])]]},
            {"phases": [[req("b0", doc + [4])], [req("b1", doc)]]}]
    rates = bench_vllm.best_hit_rates(work, 32)
    total = 97 + 98 + 97 + 96
    # one cache: a0 computes the document, the three others hit it (b1's hit
    # stops a block short: a hit never covers a prompt's last token)
    assert rates["shared"] == pytest.approx((96 + 96 + 64) / total)
    # a cache per engine: each engine computes it once
    assert rates["isolated"] == pytest.approx((96 + 64) / total)
    assert bench_vllm.best_hit_rates(bench_vllm.rag_streams(2, False, 1, 500), 32) == \
        {"shared": 0.0, "isolated": 0.0}
    chat = bench_vllm.best_hit_rates(bench_vllm.streams(2, 16, 4, 4, 512, 1, 500), 32)
    assert 0 < chat["isolated"] < chat["shared"] < 1


def _mode_run(scale: float, tokens: dict) -> dict:
    return {"wall_s": 2.0 * scale, "tokens_per_s": 100 / scale, "ttft_p50_ms": 10 * scale,
            "ttft_p99_ms": 30 * scale, "generate_s": 1.9 * scale, "engine_cpu_s": 3.0,
            "steps": 40, "hit_tokens": 64, "hit_rate": 0.5, "engines": ["e0", "e1"],
            "per_request": {k: {"tokens": t, "cached": 32, "ttft_s": 0.01}
                            for k, t in tokens.items()}}


def test_rounds_give_medians_and_the_median_of_their_ratios(bench_vllm):
    same = {"a": [1, 2], "b": [3]}
    rounds = [bench_vllm.compare({"isolated": _mode_run(1.0, same),
                                  "shared": _mode_run(s, same)}, first)
              for s, first in ((0.5, "isolated"), (0.9, "shared"), (0.8, "isolated"))]
    assert [r["first"] for r in rounds] == ["isolated", "shared", "isolated"]
    assert rounds[1]["ratios"]["generate_s"] == pytest.approx(0.9)
    out = bench_vllm.summarize(rounds)
    assert out["ratios"]["generate_s"] == pytest.approx(0.8)       # median of 0.5, 0.9, 0.8
    assert out["ratios"]["tokens_per_s"] == pytest.approx(1.25)    # median of 2, 1.11, 1.25
    assert out["shared"]["generate_s"] == pytest.approx(1.9 * 0.8)
    assert out["shared"]["per_request"] == rounds[0]["shared"]["per_request"]
    assert [r["shared"]["wall_s"] for r in out["rounds"]] == pytest.approx([1.0, 1.8, 1.6])
    assert out["same_tokens"] and out["differing_requests"] == []
    # one round whose tokens differ makes the whole run differ, naming the request
    other = bench_vllm.compare({"isolated": _mode_run(1.0, same),
                                "shared": _mode_run(1.0, {"a": [1, 2], "b": [4]})}, "shared")
    out = bench_vllm.summarize(rounds + [other])
    assert not out["same_tokens"] and out["differing_requests"] == ["b"]


def test_chat_at_a_rate_arrives_turn_by_turn_on_the_waves_engines(bench_vllm):
    waves = bench_vllm.streams(2, 6, 3, 2, 40, 1, 500)
    paced = bench_vllm.streams(2, 6, 3, 2, 40, 1, 500, rate=8.0)
    engine_of = {r["id"]: e for e, wl in enumerate(waves) for ph in wl["phases"] for r in ph}
    assert {r["id"]: e for e, wl in enumerate(paced) for r in wl["phases"][0]} == engine_of
    order = [r["id"] for r in sorted(_requests(paced), key=lambda r: r["at"])]
    assert order == [f"c{c}-t{t}" for t in range(3) for c in range(6)]
    by_id = {r["id"]: r for r in _requests(waves)}
    assert all(r["prompt_ids"] == by_id[r["id"]]["prompt_ids"] for r in _requests(paced))


def test_workload_json_gives_each_request_its_arrival():
    items = list(rag(RagSpec(num_docs=1, questions=3, doc_len=(5, 5), question_len=(2, 2))))
    wl = workload_json([items[:2], items[2:]], max_tokens=4,
                       arrivals={"d0-q0": 0.0, "d0-q1": 0.5, "d0-q2": 0.25})
    assert [[(r["id"], r["at"], r["max_tokens"]) for r in ph] for ph in wl["phases"]] == \
        [[("d0-q0", 0.0, 4), ("d0-q1", 0.5, 4)], [("d0-q2", 0.25, 4)]]
    assert all("at" not in r for ph in workload_json([items])["phases"] for r in ph)


@pytest.mark.parametrize("argv, message", [
    (["--rate", "-1"], "--rate must be a finite number >= 0, got -1.0"),
    (["--rate", "nan"], "--rate must be a finite number >= 0, got nan"),
    (["--rate", "inf"], "--rate must be a finite number >= 0, got inf"),
    (["--rate", "2", "--sequential"], "--rate and --sequential exclude each other"),
    (["--rag-order", "shuffled"], "argument --rag-order: invalid choice: 'shuffled'"),
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
])
def test_bad_arguments_are_refused_before_anything_starts(argv, message, tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_vllm.py"), *argv,
                           "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr
    assert not (tmp_path / "out").exists()
