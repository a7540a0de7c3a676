#!/usr/bin/env python3
"""`vllm serve` engines driven by vLLM's own load generator (`vllm bench
serve`), on one kvshm pool against caches of their own, each behind vLLM's
router (`kvshm host`, kvshm/vllm/host.py).

    .venv-vllm-0.32.0/bin/python scripts/bench_serve.py [--rate 1.8 | --max-concurrency 16]
        [--num-prompts 160] [--prefix-len 1024] [--num-prefixes 16] [--modes ...]
    .venv-vllm/bin/python scripts/bench_serve.py ...      # on vLLM 0.14.0

It runs on the vLLM of the environment it is started in.  For each mode, in
this order, it starts a host (one `vllm serve` per NUMA node, a single-node
host split into virtual nodes, each engine pinned to its CPUs; the pool's
coordinator floats), waits for it, runs `vllm bench serve` against the
front door on vLLM's `prefix_repetition` dataset (random prefixes, each
shared by num_prompts / num_prefixes prompts, shuffled), and stops it:

- `own-rr`: the engines on caches of their own (each with its share of the
  pool's blocks: the same total), behind round robin;
- `own-cache-aware`: the same, behind vllm-router's cache-aware policy,
  which sends a prompt where its prefix went before (hits bought with
  imbalance);
- `pool-rr`: the engines on one pool, behind round robin;
- `pool-p2c`: the same behind power-of-two routing;
- `pool-rr-nowait`: `pool-rr` with engines that never wait for a prefix
  another engine is computing (KVSHM_WAIT_IN_FLIGHT=0): the A/B of those
  waits.

For each it reports what the client measured (TTFT p50/p99, the median
gap between a stream's tokens, request and output throughput, failed
requests), what the servers counted (each
engine's prefix-cache queries and hits from /metrics; the pool's own
stats), the engines' CPU seconds, and the best hit rates perfect caches
would give the dataset (one shared cache; a cache per engine under round
robin).  `--rounds N` runs every mode N times, the first mode alternating,
and prints the medians of the rounds' own ratios.  The JSON (round 1's
runs, the ratios, the later rounds) goes to
bench-results/serve-RELEASE.json (`--json`), the
TTFT CDF of every mode to the same name with .svg (needs matplotlib).  The
client (`python -m kvshm.vllm.command bench serve`, vLLM's own) is not
pinned: on a 2-CPU machine it shares the engines' CPUs.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_common import RESULTS, cpu_seconds, write_results
from kvshm.config import PoolSource, resolve_config
from kvshm.core.metrics import percentile
from kvshm.pool.segment import PoolSegment
from kvshm.pool.stats import read_stats
from kvshm.vllm.host import Host, HostOptions
from kvshm.vllm.model import write_tiny_model
from kvshm.vllm.release import vllm_release

# mode -> (kvshm host mode, the front door's policy, the engines' environment)
MODES = {"own-rr": ("own", "round_robin", {}),
         "own-cache-aware": ("own", "cache_aware", {}),
         "pool-rr": ("pool", "round_robin", {}),
         "pool-p2c": ("pool", "power_of_two", {}),
         # the pool without waits for prefixes in flight (docs/vllm.md)
         "pool-rr-nowait": ("pool", "round_robin", {"KVSHM_WAIT_IN_FLIGHT": "0"})}
COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:prompt_tokens_total", "vllm:num_preemptions_total")


def scrape(url: str) -> dict[str, float]:
    """An engine's counters (COUNTERS, summed over their labels)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {name.split(":")[1].removesuffix("_total"):
            sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$",
                                             text, re.M))
            for name in COUNTERS}


def tree_cpu(pid: int) -> float:
    """CPU seconds of process `pid` and its live descendants."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += cpu_seconds(p)
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


def best_hit_rates(args, block: int, engines: int) -> dict[str, float]:
    """The hit rates perfect caches (every prefix block computed once per
    cache, nothing evicted) give the dataset: each prompt is a prefix of
    `prefix_len` tokens shared by num_prompts / num_prefixes prompts and a
    suffix of its own, so only the prefix's whole blocks can hit.  Round
    robin over `engines` caches of their own: each computes each prefix at
    most once (the dataset shuffles the prompts, so nearly every engine
    sees every prefix)."""
    per = args.num_prompts // args.num_prefixes
    prompts = per * args.num_prefixes
    tokens = prompts * (args.prefix_len + args.suffix_len)
    whole = args.prefix_len // block * block
    own_computes = args.num_prefixes * min(engines, per)
    return {"shared": (prompts - args.num_prefixes) * whole / tokens,
            "per_engine": (prompts - own_computes) * whole / tokens}


def prefix_classes(args, model: str, engines: int) -> list[str]:
    """What each request of the dataset, in the order the client sends
    them, is to the caches: `first` (its prefix's first request on the
    host), `other engine` (the first on its engine under round robin, its
    prefix seen before on another one: a miss on caches of their own, a
    hit on a pool) or `seen` (seen before on its engine).  The dataset is
    drawn again as the client draws it (vLLM's own sampler, the same seed)."""
    from transformers import AutoTokenizer
    from vllm.benchmarks.datasets import PrefixRepetitionRandomDataset
    tokenizer = AutoTokenizer.from_pretrained(model)
    samples = PrefixRepetitionRandomDataset(random_seed=args.seed).sample(
        tokenizer=tokenizer, num_requests=args.num_prompts, prefix_len=args.prefix_len,
        suffix_len=args.suffix_len, num_prefixes=args.num_prefixes,
        output_len=args.output_len)
    host, per_engine, out = set(), [set() for _ in range(engines)], []
    for i, sample in enumerate(samples):
        prefix = tuple(tokenizer.encode(sample.prompt, add_special_tokens=False)
                       [:args.prefix_len])
        mine = per_engine[i % engines]
        out.append("seen" if prefix in mine else "other engine" if prefix in host else "first")
        host.add(prefix)
        mine.add(prefix)
    return out


def by_class(ttfts_ms: list[float], classes: list[str]) -> dict[str, dict]:
    """TTFT p50 and count of each class of request (`prefix_classes`)."""
    out = {}
    for c in ("first", "other engine", "seen"):
        xs = sorted(t for t, k in zip(ttfts_ms, classes) if k == c)
        if xs:
            out[c] = {"count": len(xs), "ttft_p50_ms": round(percentile(xs, 50), 1)}
    return out


def run_client(args, url: str, model: str, out: Path) -> dict:
    """vLLM's `vllm bench serve` against `url`; its saved result."""
    argv = [sys.executable, "-m", "kvshm.vllm.command", "bench", "serve",
            "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", model,
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(args.prefix_len),
            "--prefix-repetition-suffix-len", str(args.suffix_len),
            "--prefix-repetition-num-prefixes", str(args.num_prefixes),
            "--prefix-repetition-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--seed", str(args.seed),
            "--request-rate", str(args.rate if args.rate else "inf"),
            "--ignore-eos", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--save-result", "--save-detailed",
            "--result-dir", str(out.parent), "--result-filename", out.name]
    if args.max_concurrency:
        argv += ["--max-concurrency", str(args.max_concurrency)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n"
                           f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def run_mode(args, mode: str, model: str, config, tmp: Path) -> dict:
    kind, router, env = MODES[mode]
    serve_args = [] if args.compile else ["--enforce-eager"]
    serve_args += ["--max-num-seqs", str(args.max_num_seqs)]
    opts = HostOptions(model=model, config=config, name="kvshm-bench-serve",
                       engines=args.engines, port=args.port, router=router, mode=kind,
                       serve_args=serve_args, engine_env=env)
    host = Host(opts, out=sys.stderr)
    t0 = time.monotonic()
    host.start()
    try:
        started = time.monotonic() - t0
        before = [scrape(e.url) for e in host.engines]
        cpu0 = [tree_cpu(e.proc.pid) for e in host.engines]
        coord0 = tree_cpu(host.coordinator.proc.pid) if host.coordinator else 0.0
        t1 = time.monotonic()
        result = run_client(args, host.url, model, tmp / f"{mode}.json")
        wall = time.monotonic() - t1
        cpu = [tree_cpu(e.proc.pid) - c for e, c in zip(host.engines, cpu0)]
        coord = (tree_cpu(host.coordinator.proc.pid) - coord0) if host.coordinator else 0.0
        after = [scrape(e.url) for e in host.engines]
        servers = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
        pool = None
        if kind == "pool":
            with PoolSegment.attach(opts.name) as seg:
                st = read_stats(seg)
            pool = {k: st[k] for k in ("queries", "query_tokens", "hit_tokens")}
    finally:
        host.stop()
    queries = sum(s["prefix_cache_queries"] for s in servers)
    hits = sum(s["prefix_cache_hits"] for s in servers)
    return {
        "mode": mode, "router": router, "caches": kind, "start_s": round(started, 1),
        "wall_s": round(wall, 2), "engines_cpu_s": [round(c, 2) for c in cpu],
        "coordinator_cpu_s": round(coord, 2),
        "completed": result.get("completed"), "failed": result.get("failed", 0),
        "ttft_p50_ms": result["median_ttft_ms"], "ttft_p99_ms": result["p99_ttft_ms"],
        # the gap between a stream's tokens: what a step of the engine takes
        "itl_p50_ms": result["median_itl_ms"],
        "request_throughput": result["request_throughput"],
        "output_throughput": result["output_throughput"],
        "total_input_tokens": result["total_input_tokens"],
        "servers": servers, "server_hit_rate": hits / queries if queries else 0.0,
        "requests_per_engine": [s["prompt_tokens"] / (args.prefix_len + args.suffix_len)
                                for s in servers],
        "pool": pool, "ttfts_ms": [1000 * t for t in result.get("ttfts", [])],
    }


def print_run(run: dict) -> None:
    print(f"{run['mode']:16s} TTFT p50 {run['ttft_p50_ms']:8.0f} ms  p99 "
          f"{run['ttft_p99_ms']:8.0f} ms  ITL p50 {run.get('itl_p50_ms', 0):4.0f} ms  "
          f"{run['request_throughput']:.2f} req/s  "
          f"{run['output_throughput']:.1f} tok/s  hits {run['server_hit_rate']:.1%}  "
          f"failed {run['failed']}  engines' CPU {sum(run['engines_cpu_s']):.1f} s in "
          f"{run['wall_s']:.1f} s  per engine "
          f"{[round(n) for n in run['requests_per_engine']]}", flush=True)
    if run.get("by_prefix"):
        print("    TTFT p50 by prefix: " + "; ".join(
            f"{c} {v['ttft_p50_ms']:.0f} ms ({v['count']})"
            for c, v in run["by_prefix"].items()), flush=True)


def ratios_of(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Each pool mode's TTFT p50, p99 and throughput over each own-cache
    mode's, in one round's `runs`."""
    by = {r["mode"]: r for r in runs}
    out = {}
    for mode in by:
        for base in ("own-rr", "own-cache-aware"):
            if mode.startswith("pool") and base in by:
                out[f"{mode}/{base}"] = {
                    "ttft_p50": by[mode]["ttft_p50_ms"] / by[base]["ttft_p50_ms"],
                    "ttft_p99": by[mode]["ttft_p99_ms"] / by[base]["ttft_p99_ms"],
                    "throughput": (by[mode]["request_throughput"]
                                   / by[base]["request_throughput"])}
    return out


def plot(path: Path, runs: list[dict], title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no TTFT plot: matplotlib is missing (pip install 'kvshm[plot]')")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        xs = sorted(run["ttfts_ms"])
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                label=f"{run['mode']} (p50 {run['ttft_p50_ms']:.0f} ms)")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (argparse exits with the reason)."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="own-rr,own-cache-aware,pool-rr",
                    help=f"comma-separated, in order, of {', '.join(MODES)}")
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=1.8,
                      help="open loop: a Poisson stream of RATE requests a second (1.8: "
                      "between the own caches' capacity and the pool's on a 2-CPU AVX2 "
                      "host, about 1.5 and 2 requests a second in closed loop)")
    load.add_argument("--max-concurrency", type=int, default=0,
                      help="closed loop: at most N requests in flight, sent at once")
    ap.add_argument("--num-prompts", type=int, default=160)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--num-prefixes", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", type=int, default=0, help="default: one per NUMA node, >= 2")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--model", choices=("tiny", "small"), default="small")
    ap.add_argument("--kv-memory", default="256MiB",
                    help="the pool's K/V (own caches: the same blocks divided)")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--port", type=int, default=8470, help="the front door's port")
    ap.add_argument("--compile", action="store_true",
                    help="let vLLM compile the model (minutes per engine start on 2 CPUs; "
                    "default: --enforce-eager)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every mode N times, the first mode alternating; the ratios "
                    "printed are the medians of the rounds' own (each mode about 3 minutes "
                    "a round here)")
    ap.add_argument("--json", help="default bench-results/serve-RELEASE[-closed].json")
    args = ap.parse_args(argv)
    if args.max_concurrency:
        args.rate = 0.0
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1 (got {args.rounds})")
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown modes {unknown}: choose from {', '.join(MODES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    release = vllm_release()
    if not release:
        print("bench_serve.py: run it with a vLLM environment's python "
              "(./scripts/vllm_env.sh)", file=sys.stderr)
        return 2
    load_text = (f"open loop, {args.rate:g} requests/s" if args.rate
                 else f"closed loop, at most {args.max_concurrency} in flight")
    print(f"vLLM {release}; {load_text}; {args.num_prompts} prompts over {args.num_prefixes} "
          f"prefixes of {args.prefix_len} tokens (+{args.suffix_len} of their own, "
          f"{args.output_len} out)", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvshm-bench-serve-") as d:
        tmp = Path(d)
        model = str(write_tiny_model(tmp / f"{args.model}-llama", args.model))
        config = resolve_config(PoolSource(vllm_model=model, kv_memory=args.kv_memory,
                                           block_size=args.block_size, max_model_len=4096,
                                           vllm_version=release))
        rounds = []
        classes: dict[int, list[str]] = {}   # engines -> each request's prefix class
        for r in range(args.rounds):
            # (the first mode alternates, so a drift of the machine's speed
            # weighs on every mode alike)
            order = modes if r % 2 == 0 else modes[::-1]
            if args.rounds > 1:
                print(f"round {r + 1}/{args.rounds}: {', '.join(order)}", flush=True)
            runs = {}
            for mode in order:
                run = runs[mode] = run_mode(args, mode, model, config, tmp)
                # (the classes follow round robin's order of engines; the
                # dataset has as many prompts for every prefix)
                sent = args.num_prompts // args.num_prefixes * args.num_prefixes
                if len(run["ttfts_ms"]) == sent and run["router"] == "round_robin":
                    engines = len(run["servers"])
                    if engines not in classes:
                        classes[engines] = prefix_classes(args, model, engines)
                    run["by_prefix"] = by_class(run["ttfts_ms"], classes[engines])
                print_run(run)
            rounds.append([runs[m] for m in modes])
    engines = len(rounds[0][0]["servers"])
    best = best_hit_rates(args, args.block_size, engines)
    print(f"best hit rates: one shared cache {best['shared']:.1%}, a cache per engine "
          f"{best['per_engine']:.1%}")
    per_round = [ratios_of(runs) for runs in rounds]
    ratios = {name: {k: percentile(sorted(rr[name][k] for rr in per_round), 50)
                     for k in per_round[0][name]} for name in per_round[0]}
    for name, r in ratios.items():
        each = "; ".join(f"{rr[name]['ttft_p50']:.2f}x" for rr in per_round)
        print(f"{name}: TTFT p50 {r['ttft_p50']:.2f}x, p99 {r['ttft_p99']:.2f}x, "
              f"throughput {r['throughput']:.2f}x"
              + (f" (medians of {len(per_round)} rounds; TTFT p50 by round: {each})"
                 if len(per_round) > 1 else ""))
    runs = rounds[0]
    suffix = "-closed" if args.max_concurrency else ""
    path = Path(args.json or RESULTS / f"serve-{release}{suffix}.json")
    write_results(path, {"vllm_version": release, "load": load_text, "args": vars(args),
                         "best_hit_rates": best, "runs": runs, "ratios": ratios,
                         "rounds": [{"runs": rr, "ratios": ratio}
                                    for rr, ratio in zip(rounds[1:], per_round[1:])],
                         "round_1_ratios": per_round[0]})
    plot(path.with_suffix(".svg"), runs, f"vLLM {release}, {load_text}")
    return 0 if all(r["failed"] == 0 for runs in rounds for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
