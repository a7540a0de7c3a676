#!/usr/bin/env python3
"""N vLLM engine processes, one per (real or virtual) NUMA node, on the same
workload: one shared kvshm pool against each engine's own prefix cache.

    .venv-vllm/bin/python scripts/bench_vllm.py [--workload chat|rag|unique]
        [--sequential | --rate R] [--engines 2] [--model small] [--out bench-results]
    .venv-vllm-0.32.0/bin/python scripts/bench_vllm.py ...     # on vLLM 0.32.0

It runs on the vLLM of the environment it is started in (0.14.0 or 0.32.0:
the shared pool reproduces that release's semantics) and says which.

Workloads, routed round robin:

- `chat` (the default): multi-turn conversations over a few shared system
  prompts, so a conversation's next turn usually lands on another engine
  (the case vLLM users running local replicas ask about); turn k of every
  conversation forms wave k (one `generate()` call per engine).
- `rag`: documents of 800-1,500 tokens, each asked 6 questions in a row
  (kvshm.workload.items.rag), so every engine gets questions on the same
  document together; the whole list arrives at once (one burst, one
  `generate()` call per engine), so an engine whose next request waits for
  a document another engine is computing can start on the next document.
- `unique`: the same lengths with nothing shared (`RagSpec(shared=False)`):
  the control that shows what the pool itself costs.

`--sequential` serves one request at a time per engine (every request its
own `generate()` call): the plugin's cost per scheduler step and per
request, with no batching to hide it.

`--rounds N` runs both modes N times, the first mode alternating, so
that a drift of the machine's speed during a run weighs on both modes
alike: each mode's figures are medians over the rounds, its requests (and
the TTFT plot) round 1's, and the ratios printed last the median of the
rounds' own ratios.

`--rag-order staggered` gives each engine the same rag (or unique)
requests with its documents in another order (engine e of N starts at
document e * 6 / N), so the engines reach a document at different times
instead of together: one at a time, the lockstep list cannot save wall
time with any pool (the engine that does not compute a document waits for
it), a staggered one can.  Its files end in `-staggered`.

`--rate R` serves the same requests open loop instead of in waves: a
seeded Poisson stream of R requests a second over all engines, in the
waves' order (chat: turn by turn), each added to its engine at its time
whatever the engine is doing, so a time to first token is what a client of
a server at that load would see (in a burst it is mostly the wait behind
the requests admitted before it).  Generated tokens per second then follow
the rate as long as the engines keep up; compare TTFT and CPU time.

Runs, in this order, on the same streams: `isolated` (KVSHM_POOL unset;
vLLM's own manager; each engine's pool has 1/N of the shared pool's blocks)
and `shared` (one `kvshm serve --vllm-model` coordinator).  Engines are
pinned to their node's CPUs (vLLM's OpenMP threads to the same CPUs,
OMP_NUM_THREADS their number); the coordinator is not pinned; all engines
start generating together.

Reports per mode: TTFT p50/p99, generated tokens per second (all engines,
wall clock to the last engine's exit), the generation time (the slowest
engine's, start-up and exit excluded) and the engines' CPU time in it,
scheduler steps, prefix hit rate (hit tokens / prompt tokens); for the
shared pool the coordinator's CPU time, frames and ops per step, and the
extra hit tokens it gave (hits beyond the engine's own cache in the isolated
run: prefixes another engine computed); checks that every request generated
the same tokens in both modes.  Before the runs it prints the best hit rates
perfect caches would give the workload (`best_hit_rates`: one cache shared
by the engines, and one per engine), so a run's hit rate says how much a
cache left on the table.  Writes OUT/vllm-WORKLOAD.json and
OUT/vllm-WORKLOAD.svg (the TTFT distributions; needs matplotlib), with
`-sequential` before the suffix for --sequential.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import RESULTS, cpu_seconds
from kvshm.config import model_pool_config, parse_size
from kvshm.core.errors import ConfigError
from kvshm.core.metrics import percentile, read_metrics
from kvshm.pool.segment import PoolSegment
from kvshm.vllm.release import SUPPORTED_VLLM, vllm_release
from kvshm.service.process import CoordinatorProcess
from kvshm.vllm.engine import workload_json
from kvshm.vllm.model import write_tiny_model
from kvshm.workers.topology import format_cpulist, plan
from kvshm.workload.items import RagSpec, conversations as chat, poisson_arrivals, rag

BLOCK = 32
WORKLOADS = ("chat", "rag", "unique")


def streams(engines: int, conversations: int, turns: int, system_prompts: int,
            system_len: int, seed: int, vocab: int, rate: float = 0.0) -> list[dict]:
    """One workload per engine: multi-turn conversations over a few shared
    system prompts (kvshm.workload.items.conversations), turn k of
    conversation c served by engine (c + k) % N (round-robin routing: a
    conversation's next turn usually lands on another engine), turn k of
    every conversation in wave k; 16 tokens generated per turn.  With a
    `rate`, the waves in order arrive open loop instead (`arrive`)."""
    waves = [[[] for _ in range(turns)] for _ in range(engines)]
    order = []
    for n, it in enumerate(chat(conversations, turns, system_prompts, system_len,
                                seed=seed, vocab=vocab)):
        engine = (n // turns + it.turn) % engines
        waves[engine][it.turn].append(it)
        order.append((it.turn, n // turns, engine, it))
    if rate:
        return arrive([(e, it) for _, _, e, it in sorted(order, key=lambda o: o[:2])],
                      engines, rate, seed)
    return [workload_json(w, max_tokens=16) for w in waves]


def rag_streams(engines: int, shared: bool, seed: int, vocab: int,
                rate: float = 0.0, order: str = "lockstep") -> list[dict]:
    """One workload per engine: RAG requests (kvshm.workload.items.rag),
    request i served by engine i % N, all in one wave (a burst), or with a
    `rate` arriving open loop, the engines taking turns (`arrive`).

    `order`: "lockstep" serves the requests in the list's order, so every
    engine reaches a document when the others do; "staggered" gives each
    engine the same requests, its documents in an order rotated by
    e * num_docs / N (engine 1 of 2 starts at the fourth of six), so the
    engines reach a document at different times, as readers of different
    documents would."""
    spec = RagSpec(seed=seed, vocab=vocab, shared=shared)
    lists: list[list] = [[] for _ in range(engines)]
    for i, it in enumerate(rag(spec)):   # (document by document)
        e = i % engines
        place = (i // spec.questions - e * spec.num_docs // engines) % spec.num_docs
        lists[e].append((place if order == "staggered" else 0, it))
    # (sorted is stable: within a document, the questions keep their order)
    lists = [[it for _, it in sorted(mine, key=lambda pair: pair[0])] for mine in lists]
    if rate:
        turns = max(len(mine) for mine in lists)
        return arrive([(e, lists[e][k]) for k in range(turns) for e in range(engines)
                       if k < len(lists[e])], engines, rate, seed)
    return [workload_json([mine]) for mine in lists]


def arrive(routed: list, engines: int, rate: float, seed: int) -> list[dict]:
    """Open-loop streams: `routed` [(engine, item)] in arrival order, the
    arrivals a Poisson stream of `rate` requests a second over all engines
    (seeded, so both modes see the same times); 16 tokens generated each."""
    at = dict(zip((it.rid for _, it in routed), poisson_arrivals(len(routed), rate, seed)))
    return [workload_json([[it for e, it in routed if e == engine]], max_tokens=16,
                          arrivals=at) for engine in range(engines)]


def best_hit_rates(work: list[dict], block: int) -> dict[str, float]:
    """The hit rates (hit tokens / prompt tokens) that perfect prefix caches
    would give `work` (one workload per engine), block by block, nothing
    evicted: "shared", one cache all engines read, so every distinct block is
    computed once; "isolated", a cache per engine.  Requests are taken phase
    by phase, the engines' k-th requests of a phase in turn.  A hit never
    covers a prompt's last token, and generated tokens are never hit (later
    prompts do not repeat them).  A run's hit rate at its best hit rate
    means the cache left nothing to gain: what sharing can still save is
    bounded by the prefill left to compute."""
    shared: dict = {}
    own: list[dict] = [{} for _ in work]
    hits = {"shared": 0, "isolated": 0}
    total = 0
    for e, prompt in _served(work):
        total += len(prompt)
        blocks = [tuple(prompt[b:b + block]) for b in range(0, len(prompt) - block + 1, block)]
        usable = (len(prompt) - 1) // block
        for mode, node in (("shared", shared), ("isolated", own[e])):
            hit = 0
            for key in blocks:   # the cached prefix; past a miss, every node is new
                child = node.get(key)
                if child is None:
                    child = node[key] = {}
                else:
                    hit += 1
                node = child
            hits[mode] += min(hit, usable) * block
    return {mode: h / total if total else 0.0 for mode, h in hits.items()}


def _served(work: list[dict]):
    """(engine, prompt ids) of every request of `work`, phase by phase, the
    engines' k-th requests of a phase in turn."""
    for k in range(max(len(wl["phases"]) for wl in work)):
        phases = [wl["phases"][k] if k < len(wl["phases"]) else [] for wl in work]
        for i in range(max(map(len, phases))):
            for e, phase in enumerate(phases):
                if i < len(phase):
                    yield e, phase[i]["prompt_ids"]


def one_at_a_time(work: list[dict]) -> list[dict]:
    """The same streams, every request its own phase (in order)."""
    return [{"phases": [[r] for ph in wl["phases"] for r in ph]} for wl in work]


def pool_counters(coord) -> dict:
    """The coordinator's CPU time, frames and per-op counts so far."""
    seg = PoolSegment.attach(coord.name)
    try:
        m = read_metrics(seg.metrics)
    finally:
        seg.close()
    return {"cpu_s": cpu_seconds(coord.proc.pid), "frames": m["frames"],
            "ops": {k: v["count"] for k, v in m["ops"].items() if v["count"]}}


def run_mode(mode: str, args, model: Path, work: list[dict], tmp: Path, cpu_plan,
             coord, engine_blocks: int) -> dict:
    procs, outs = [], []
    go = tmp / f"{mode}.go"
    for e, wl in enumerate(work):
        wl_path = tmp / f"{mode}-{e}.workload.json"
        wl_path.write_text(json.dumps(wl))
        out = tmp / f"{mode}-{e}.json"
        cpus = cpu_plan.workers[e].cpus
        env = {k: v for k, v in os.environ.items() if k not in ("KVSHM_POOL", "PYTHONHASHSEED")}
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="2",
                   VLLM_CPU_OMP_THREADS_BIND=format_cpulist(cpus),
                   OMP_NUM_THREADS=str(len(cpus)))
        if coord is not None:
            env["KVSHM_POOL"] = str(coord.socket)
        argv = [sys.executable, "-m", "kvshm.vllm.engine", str(model), str(wl_path),
                "--out", str(out), "--block-size", str(BLOCK),
                "--max-num-seqs", str(args.max_num_seqs), "--dtype", args.dtype,
                "--ready-file", str(tmp / f"{mode}-{e}.ready"), "--go-file", str(go)]
        if coord is None:
            argv += ["--num-blocks", str(engine_blocks)]
        log = open(tmp / f"{mode}-{e}.log", "w")
        procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log,
                                      preexec_fn=lambda c=cpus: os.sched_setaffinity(0, c)))
        outs.append(out)
    deadline = time.monotonic() + 600
    while not all((tmp / f"{mode}-{e}.ready").exists() for e in range(len(work))):
        if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise RuntimeError(f"{mode}: an engine failed to start; see {tmp}/{mode}-*.log")
        time.sleep(0.05)
    before = pool_counters(coord) if coord is not None else None
    t0 = time.perf_counter()
    go.touch()
    for e, p in enumerate(procs):
        if p.wait(timeout=1800) != 0:
            raise RuntimeError(f"{mode}: engine {e} exited {p.returncode}; see "
                               f"{tmp}/{mode}-{e}.log")
    wall = time.perf_counter() - t0
    reports = [json.loads(o.read_text()) for o in outs]
    reqs = [r for rep in reports for r in rep["requests"]]
    ttft = sorted(r["ttft_s"] for r in reqs)
    prompt_tokens = sum(len(q["prompt_ids"]) for wl in work for ph in wl["phases"] for q in ph)
    gen = sum(len(r["token_ids"]) for r in reqs)
    hits = sum(r["num_cached_tokens"] for r in reqs)
    steps = sum(rep["steps"] for rep in reports)
    result = {
        "mode": mode, "wall_s": wall, "requests": len(reqs),
        "generated_tokens": gen, "tokens_per_s": gen / wall,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "generate_s": max(rep["elapsed_s"] for rep in reports),
        "engine_cpu_s": sum(rep["cpu_s"] for rep in reports), "steps": steps,
        "hit_tokens": hits, "prompt_tokens": prompt_tokens, "hit_rate": hits / prompt_tokens,
        "engines": [{"engine": e, "cpus": list(cpu_plan.workers[e].cpus),
                     "startup_s": rep["startup_s"], "elapsed_s": rep["elapsed_s"],
                     "cpu_s": rep["cpu_s"], "minor_faults": rep["minor_faults"],
                     "steps": rep["steps"], "plugin": rep["plugin"],
                     "manager": rep["manager"]} for e, rep in enumerate(reports)],
        "per_request": {r["id"]: {"tokens": r["token_ids"], "cached": r["num_cached_tokens"],
                                  "ttft_s": r["ttft_s"]} for r in reqs}}
    if coord is not None:
        after = pool_counters(coord)
        frames = after["frames"] - before["frames"]
        result["coordinator"] = {
            "cpu_s": after["cpu_s"] - before["cpu_s"], "frames": frames,
            "frames_per_step": frames / steps if steps else None,
            "ops": {k: n - before["ops"].get(k, 0) for k, n in after["ops"].items()
                    if n > before["ops"].get(k, 0)}}
    return result


def plot(result: dict, path: Path) -> bool:
    """The TTFT distribution of both modes (CDF) into `path` (SVG); False
    when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode, colour in (("isolated", "tab:orange"), ("shared", "tab:blue")):
        r = result[mode]
        ttft = sorted(1e3 * q["ttft_s"] for q in r["per_request"].values())
        ax.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post",
                color=colour, label=f"{mode}: p50 {r['ttft_p50_ms']:.0f} ms, "
                f"{r['tokens_per_s']:.0f} tokens/s, hit rate {100 * r['hit_rate']:.0f}%")
    how = ("one request at a time per engine" if result["sequential"] else
           f"round robin, {result['rate']:g}/s open loop" if result["rate"] else "round robin")
    ax.set(title=f"{result['workload']}: {result['engines']} vLLM engines, {result['model']} "
           f"model ({result['dtype']}), {result['requests']} requests, {how}",
           xlabel="time to first token (ms)", ylabel="fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.text(0.01, 0.97, f"same tokens in both modes: {result['same_tokens']}",
            transform=ax.transAxes, va="top", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


RATIOS = ("ttft_p50_ms", "ttft_p99_ms", "tokens_per_s", "generate_s")
MEDIANS = ("wall_s", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "generate_s",
           "engine_cpu_s", "steps", "hit_tokens", "hit_rate")


def compare(runs: dict, first: str) -> dict:
    """One round: both modes' results, which ran first, shared/isolated
    ratios, and whether every request generated the same tokens in both."""
    iso, sh = runs["isolated"]["per_request"], runs["shared"]["per_request"]
    differing = sorted(k for k in iso if iso[k]["tokens"] != sh[k]["tokens"])
    return {"first": first, "isolated": runs["isolated"], "shared": runs["shared"],
            "ratios": {k: runs["shared"][k] / runs["isolated"][k] for k in RATIOS},
            "same_tokens": not differing, "differing_requests": differing,
            "extra_hit_tokens_from_sharing": sum(max(0, sh[k]["cached"] - iso[k]["cached"])
                                                 for k in iso)}


def ratio_line(ratios: dict) -> str:
    return (f"TTFT p50 {ratios['ttft_p50_ms']:.2f}x, tokens/s {ratios['tokens_per_s']:.2f}x, "
            f"generating {ratios['generate_s']:.2f}x")


def print_round(rnd: dict) -> None:
    for mode in ("isolated", "shared"):
        r = rnd[mode]
        print(f"{mode:>9}: TTFT p50 {r['ttft_p50_ms']:7.1f} ms  p99 {r['ttft_p99_ms']:7.1f} ms  "
              f"{r['tokens_per_s']:7.1f} tokens/s  hit rate {100 * r['hit_rate']:5.1f}%  "
              f"wall {r['wall_s']:.2f} s  generating {r['generate_s']:.2f} s "
              f"(engines' CPU {r['engine_cpu_s']:.2f} s, {r['steps']} steps)")
    c = rnd["shared"]["coordinator"]
    print(f"coordinator: CPU {c['cpu_s']:.2f} s, {c['frames']} frames "
          f"({c['frames_per_step']:.2f} per step), ops {c['ops']}")
    print(f"shared/isolated: {ratio_line(rnd['ratios'])}; extra hit tokens from other "
          f"engines {rnd['extra_hit_tokens_from_sharing']}; same tokens in both modes: "
          f"{rnd['same_tokens']}")


def summarize(rounds: list[dict]) -> dict:
    """The JSON's figures over the rounds: each mode's as in round 1 (its
    requests, engines and coordinator counters) with MEDIANS replaced by
    their medians over the rounds; ratios the median of the rounds' ratios."""
    out = {"rounds": [{k: v for k, v in rnd.items() if k not in ("isolated", "shared")}
                      for rnd in rounds]}
    for mode in ("isolated", "shared"):
        out[mode] = dict(rounds[0][mode])
        for k in MEDIANS:
            out[mode][k] = statistics.median(rnd[mode][k] for rnd in rounds)
        for i, rnd in enumerate(out["rounds"]):
            rnd[mode] = {k: rounds[i][mode][k] for k in MEDIANS}
    out["ratios"] = {k: statistics.median(rnd["ratios"][k] for rnd in rounds) for k in RATIOS}
    out["same_tokens"] = all(rnd["same_tokens"] for rnd in rounds)
    out["differing_requests"] = sorted({k for rnd in rounds for k in rnd["differing_requests"]})
    out["extra_hit_tokens_from_sharing"] = statistics.median(
        rnd["extra_hit_tokens_from_sharing"] for rnd in rounds)
    return out


def _size(text: str) -> int:
    """A --kv-memory value in bytes (argparse reports a bad one)."""
    try:
        return parse_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(e.rule) from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=WORKLOADS, default="chat")
    ap.add_argument("--sequential", action="store_true",
                    help="one request at a time per engine (each its own generate() call)")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="requests a second over all engines, arriving open loop (a seeded "
                    "Poisson stream, the same in both modes); 0 (the default): in waves")
    ap.add_argument("--rag-order", choices=("lockstep", "staggered"), default="lockstep",
                    help="rag and unique: every engine reaches a document when the others "
                    "do (lockstep, the default), or each engine walks the documents from "
                    "another one (staggered)")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--model", choices=("tiny", "small"), default="small",
                    help="the Llama to write (config and seeded weights)")
    ap.add_argument("--conversations", type=int, default=16, help="chat")
    ap.add_argument("--turns", type=int, default=4, help="chat: one wave (generate() call) each")
    ap.add_argument("--system-prompts", type=int, default=4, help="chat")
    ap.add_argument("--system-len", type=int, default=512, help="chat: tokens")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32",
                    help="model and KV dtype (float32, the default, makes reused K/V "
                    "bit-equal to recomputed K/V, so tokens must match; in bfloat16 the "
                    "rounding of a prefill depends on its batch, as in vLLM itself)")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--kv-memory", type=_size, default="512M",
                    help="KV memory budget of the shared pool, all engines' (e.g. 512M, 1G), "
                    "as kvshm serve's and kvshm run's --kv-memory")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run both modes this many times, the first mode alternating "
                    "(isolated first in round 1, shared first in round 2, ...); figures are "
                    "medians over the rounds, ratios the median of the rounds' ratios")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.rate < 0 or args.rate != args.rate or args.rate == float("inf"):
        ap.error(f"--rate must be a finite number >= 0, got {args.rate}")
    if args.rate and args.sequential:
        ap.error("--rate and --sequential exclude each other (open loop against one at a time)")
    release = vllm_release()
    if release not in SUPPORTED_VLLM:
        print(f"bench_vllm.py: runs on vLLM {', '.join(SUPPORTED_VLLM)}, not "
              f"{release or 'none'} (start it with .venv-vllm/bin/python or "
              ".venv-vllm-0.32.0/bin/python)", file=sys.stderr)
        return 2
    print(f"vLLM {release}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cpu_plan = plan(args.engines)
    for note in cpu_plan.notes:
        print(f"note: {note}")
    with tempfile.TemporaryDirectory(prefix="kvshm-bench-vllm-") as d:
        tmp = Path(d)
        model = write_tiny_model(tmp / "model", args.model)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        if args.workload == "chat":
            work = streams(args.engines, args.conversations, args.turns, args.system_prompts,
                           args.system_len, args.seed, vocab, args.rate)
        else:
            work = rag_streams(args.engines, args.workload == "rag", args.seed, vocab,
                               args.rate, args.rag_order)
        if args.sequential:
            work = one_at_a_time(work)
        config = model_pool_config(model, kv_memory=args.kv_memory, block_size=BLOCK,
                                   max_model_len=4096, dtype=args.dtype
                                   ).replace(vllm_version=release)
        result = {"vllm_version": release, "workload": args.workload,
                  "sequential": args.sequential, "rate": args.rate,
                  "rag_order": args.rag_order,
                  "engines": args.engines, "model": args.model, "dtype": args.dtype,
                  "requests": sum(len(ph) for wl in work for ph in wl["phases"]),
                  "pool_blocks": config.num_blocks, "plan_notes": cpu_plan.notes}
        if args.workload == "chat":
            result.update(conversations=args.conversations, turns=args.turns)
        result["best_hit_rate"] = best = best_hit_rates(work, BLOCK)
        print(f"best possible hit rates (perfect caches, nothing evicted): shared "
              f"{100 * best['shared']:.1f}%, isolated {100 * best['isolated']:.1f}%")
        rounds = []
        for r in range(args.rounds):
            order = ("isolated", "shared") if r % 2 == 0 else ("shared", "isolated")
            runs = {}
            where = tmp / f"round{r + 1}"   # (each round's engine files apart)
            where.mkdir()
            for mode in order:
                if mode == "isolated":
                    runs[mode] = run_mode(mode, args, model, work, where, cpu_plan, None,
                                          config.num_blocks // args.engines)
                else:
                    with CoordinatorProcess(config) as coord:
                        runs[mode] = run_mode(mode, args, model, work, where, cpu_plan,
                                              coord, 0)
            rounds.append(compare(runs, order[0]))
            if args.rounds > 1:
                print(f"round {r + 1}/{args.rounds} ({order[0]} first):")
            print_round(rounds[-1])
    result.update(summarize(rounds))
    if args.rounds > 1:
        print(f"median of {args.rounds} rounds' ratios: {ratio_line(result['ratios'])}; "
              f"same tokens in both modes in every round: {result['same_tokens']}")
    stem = (f"vllm-{args.workload}{'-sequential' if args.sequential else ''}"
            f"{'-staggered' if args.rag_order == 'staggered' else ''}"
            f"{f'-rate{args.rate:g}' if args.rate else ''}")
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    wrote = [out / f"{stem}.json"]
    if plot(result, out / f"{stem}.svg"):
        wrote.append(out / f"{stem}.svg")
    else:
        print("note: no TTFT plot (matplotlib is not installed)")
    print("wrote " + " and ".join(map(str, wrote)))
    return 0 if result["same_tokens"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
