#!/usr/bin/env python3
"""N vLLM engine processes, one per (real or virtual) NUMA node, on the same
shared-prefix workload: one shared kvshm pool against each engine's own
prefix cache.

    .venv-vllm/bin/python scripts/bench_vllm.py [--engines 2] [--model small]
        [--requests 24] [--system-prompts 6] [--out bench-results]

The workload: multi-turn conversations over a few shared system prompts,
routed round-robin, so a conversation's next turn usually lands on another
engine (the case vLLM users running local replicas ask about); turn k of
every conversation forms wave k.  Runs, in this order, on
the same streams: `isolated` (KVSHM_POOL unset; each engine's pool has
1/N of the shared pool's blocks) and `shared` (one `kvshm serve
--vllm-model` coordinator).  Engines are pinned to their node's CPUs (and
vLLM's OpenMP threads to the same CPUs); all start generating together.

Reports per mode: TTFT p50/p99, generated tokens per second (all engines,
wall clock), prefix hit rate (hit tokens / prompt tokens), and for the shared
pool the extra hit tokens it gave (hits beyond the engine's own cache in the
isolated run: prefixes another engine computed); checks that every request
generated the same tokens in both modes.  Writes OUT/vllm.json and
OUT/vllm.svg.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvshm.service.process import CoordinatorProcess  # noqa: E402
from kvshm.vllm.model import model_pool_config, write_tiny_model  # noqa: E402
from kvshm.workers.topology import format_cpulist, plan  # noqa: E402

BLOCK = 32


def streams(engines: int, conversations: int, turns: int, system_prompts: int,
            system_len: int, seed: int, vocab: int) -> list[dict]:
    """One workload per engine: multi-turn conversations over a few shared
    system prompts, turn k of conversation c served by engine (c + k) % N
    (round-robin routing: a conversation's next turn usually lands on
    another engine), turn k of every conversation in wave k."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(system_len)]
               for _ in range(system_prompts)]
    out = [{"phases": [[] for _ in range(turns)]} for _ in range(engines)]
    for c in range(conversations):
        prompt = list(rng.choice(systems))
        for k in range(turns):
            prompt += [rng.randrange(3, vocab) for _ in range(rng.randrange(64, 160))]
            out[(c + k) % engines]["phases"][k].append(
                {"id": f"c{c}-t{k}", "prompt_ids": list(prompt), "max_tokens": 16})
            # The assistant's answer, as the next turn's prompt carries it.
            prompt += [rng.randrange(3, vocab) for _ in range(rng.randrange(32, 96))]
    return out


def run_mode(mode: str, args, model: Path, work: list[dict], tmp: Path, cpu_plan,
             pool_socket: str | None, engine_blocks: int) -> dict:
    procs, outs = [], []
    go = tmp / f"{mode}.go"
    for e, wl in enumerate(work):
        wl_path = tmp / f"{mode}-{e}.workload.json"
        wl_path.write_text(json.dumps(wl))
        out = tmp / f"{mode}-{e}.json"
        cpus = cpu_plan.workers[e].cpus
        env = {k: v for k, v in os.environ.items() if k not in ("KVSHM_POOL", "PYTHONHASHSEED")}
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="2",
                   VLLM_CPU_OMP_THREADS_BIND=format_cpulist(cpus))
        if pool_socket:
            env["KVSHM_POOL"] = pool_socket
        argv = [sys.executable, "-m", "kvshm.vllm.engine", str(model), str(wl_path),
                "--out", str(out), "--block-size", str(BLOCK),
                "--max-num-seqs", str(args.max_num_seqs), "--dtype", args.dtype,
                "--ready-file", str(tmp / f"{mode}-{e}.ready"), "--go-file", str(go)]
        if not pool_socket:
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
    return {"mode": mode, "wall_s": wall, "requests": len(reqs),
            "generated_tokens": gen, "tokens_per_s": gen / wall,
            "ttft_p50_ms": 1e3 * statistics.median(ttft),
            "ttft_p99_ms": 1e3 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "hit_tokens": hits, "prompt_tokens": prompt_tokens, "hit_rate": hits / prompt_tokens,
            "engines": [{"engine": e, "cpus": list(cpu_plan.workers[e].cpus),
                         "startup_s": rep["startup_s"], "elapsed_s": rep["elapsed_s"],
                         "manager": rep["manager"]} for e, rep in enumerate(reports)],
            "per_request": {r["id"]: {"tokens": r["token_ids"], "cached": r["num_cached_tokens"],
                                      "ttft_s": r["ttft_s"]} for r in reqs}}


def svg(result: dict) -> str:
    """A small bar chart: TTFT p50/p99 and tokens/s, isolated vs shared."""
    modes = [result["isolated"], result["shared"]]
    panels = [("TTFT p50 (ms)", "ttft_p50_ms"), ("TTFT p99 (ms)", "ttft_p99_ms"),
              ("generated tokens/s", "tokens_per_s"), ("prefix hit rate (%)", "hit_rate")]
    colors = {"isolated": "#8c8c8c", "shared": "#2b7bba"}
    w, h, pad = 180, 220, 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w * len(panels)}" '
             f'height="{h + 40}" font-family="sans-serif" font-size="12">']
    for i, (title, key) in enumerate(panels):
        x0 = i * w
        vals = [m[key] * (100 if key == "hit_rate" else 1) for m in modes]
        top = max(vals) or 1
        parts.append(f'<text x="{x0 + w / 2}" y="16" text-anchor="middle">{title}</text>')
        for j, (m, v) in enumerate(zip(modes, vals)):
            bh = (h - 2 * pad) * v / top
            bx = x0 + pad + j * 60
            parts.append(f'<rect x="{bx}" y="{h - pad - bh}" width="45" height="{bh}" '
                         f'fill="{colors[m["mode"]]}"/>')
            parts.append(f'<text x="{bx + 22}" y="{h - pad - bh - 4}" '
                         f'text-anchor="middle">{v:.1f}</text>')
            parts.append(f'<text x="{bx + 22}" y="{h - pad + 14}" '
                         f'text-anchor="middle">{m["mode"]}</text>')
    parts.append(f'<text x="6" y="{h + 30}">{result["engines"]} vLLM engines, '
                 f'{result["model"]} model ({result["dtype"]}), {result["conversations"]} '
                 f'conversations x {result["turns"]} turns, round-robin; '
                 f'tokens equal in both modes: {result["same_tokens"]}</text></svg>')
    return "\n".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--model", choices=("tiny", "small"), default="small",
                    help="the Llama to write (config and seeded weights)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4, help="one wave (generate() call) each")
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=512, help="tokens")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32",
                    help="model and KV dtype (float32, the default, makes reused K/V "
                    "bit-equal to recomputed K/V, so tokens must match; in bfloat16 the "
                    "rounding of a prefill depends on its batch, as in vLLM itself)")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--kv-memory", type=int, default=512, help="MiB, shared pool total")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="bench-results")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cpu_plan = plan(args.engines)
    for note in cpu_plan.notes:
        print(f"note: {note}")
    with tempfile.TemporaryDirectory(prefix="kvshm-bench-vllm-") as d:
        tmp = Path(d)
        model = write_tiny_model(tmp / "model", args.model)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        work = streams(args.engines, args.conversations, args.turns, args.system_prompts,
                       args.system_len, args.seed, vocab)
        config = model_pool_config(model, kv_memory=args.kv_memory << 20, block_size=BLOCK,
                                   max_model_len=4096, dtype=args.dtype)
        result = {"engines": args.engines, "model": args.model, "dtype": args.dtype,
                  "conversations": args.conversations, "turns": args.turns,
                  "pool_blocks": config.num_blocks, "plan_notes": cpu_plan.notes}
        result["isolated"] = run_mode("isolated", args, model, work, tmp, cpu_plan, None,
                                      config.num_blocks // args.engines)
        with CoordinatorProcess(config) as coord:
            result["shared"] = run_mode("shared", args, model, work, tmp, cpu_plan,
                                        str(coord.socket), 0)
    iso, sh = result["isolated"]["per_request"], result["shared"]["per_request"]
    result["same_tokens"] = all(iso[k]["tokens"] == sh[k]["tokens"] for k in iso)
    result["differing_requests"] = sorted(k for k in iso if iso[k]["tokens"] != sh[k]["tokens"])
    result["extra_hit_tokens_from_sharing"] = sum(
        max(0, sh[k]["cached"] - iso[k]["cached"]) for k in iso)
    for mode in ("isolated", "shared"):
        r = result[mode]
        print(f"{mode:>9}: TTFT p50 {r['ttft_p50_ms']:7.1f} ms  p99 {r['ttft_p99_ms']:7.1f} ms  "
              f"{r['tokens_per_s']:7.1f} tokens/s  hit rate {100 * r['hit_rate']:5.1f}%  "
              f"wall {r['wall_s']:.2f} s")
    print(f"shared/isolated: TTFT p50 "
          f"{result['shared']['ttft_p50_ms'] / result['isolated']['ttft_p50_ms']:.2f}x, "
          f"tokens/s {result['shared']['tokens_per_s'] / result['isolated']['tokens_per_s']:.2f}x;"
          f" extra hit tokens from other engines {result['extra_hit_tokens_from_sharing']}; "
          f"same tokens in both modes: {result['same_tokens']}")
    (out / "vllm.json").write_text(json.dumps(result, indent=1))
    (out / "vllm.svg").write_text(svg(result))
    print(f"wrote {out / 'vllm.json'} and {out / 'vllm.svg'}")
    return 0 if result["same_tokens"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
