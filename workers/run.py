"""The `kvshm run` command (also `python -m kvshm.workers`): its arguments, the
shared / isolated / compare runs, and the printed summary.

Exit status: 0 when every integrity check passed and every worker finished
(or was the one `--kill-worker` killed), 1 otherwise (corrupt K/V found in
the arena too, even when it was healed and no output was affected: someone
must look at the host), 2 for bad arguments, 130 after Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvshm.config import (
    PRESETS,
    PoolSource,
    add_pool_arguments,
    resolve_config,
)
from kvshm.core.errors import KvshmError
from kvshm.core.hashing import DEFAULT_HASH_ALGORITHM, DEFAULT_HASH_SEED
from kvshm.core.metrics import percentile
from kvshm.pool.lifecycle import pool_bytes
from kvshm.workers.compute import MODELS
from kvshm.workers.engine_types import EngineOptions
from kvshm.workers.launcher import (
    LaunchOptions,
    RunResult,
    isolated_config,
    launch,
    make_plan,
)
from kvshm.workers.topology import describe, format_cpulist
from kvshm.workload.items import distinct_tokens
from kvshm.workload.spec import WorkloadSpec, workload_stream

DEFAULT_PRESET = "small"
DEFAULT_MODEL = "transformer"
# Each model's integrity knobs and their defaults.  The exact model's
# recompute is cheap: it checks every hit block.  The transformer's costs a
# prefill of the checked blocks: a fixed number of each request's full
# prompt blocks, hit or computed alike, so a shared and an isolated run
# spend the same on checks (its decode check is a gather of the context
# and one token).
CHECK_DEFAULTS = {"exact": {"verify_hits": 1.0, "check_decode": 0.02},
                  "transformer": {"check_blocks": 2, "check_decode": 0.02}}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workers", type=int, default=None,
                    help="worker processes (default: one per NUMA node, at least 2)")
    ap.add_argument("--duration", type=float, default=30.0,
                    help="seconds of workload (admissions stop then; default 30)")
    ap.add_argument("--grace", type=float, default=10.0,
                    help="seconds after --duration for running requests to finish (10)")
    pool = add_pool_arguments(ap, vllm=False, hashing=False, default_preset=DEFAULT_PRESET)
    pool.add_argument("--connect", metavar="SOCKET",
                      help="join a running coordinator instead of starting one")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--isolated", action="store_true",
                      help="each worker gets a private pool of total/N blocks")
    mode.add_argument("--compare", action="store_true",
                      help="run shared, then isolated, and compare them")
    ap.add_argument("--workload", default="synthetic",
                    help="'synthetic' (default: chat), 'rag' (documents asked several "
                         "questions each), 'unique' (the same lengths, nothing shared) "
                         "or a JSONL file of prompts")
    ap.add_argument("--requests", type=int, metavar="N",
                    help="serve only the first N requests of the workload, then stop "
                         "(a fixed amount of work: compare wall times); --duration "
                         "still caps the run")
    ap.add_argument("--assign", choices=("round-robin", "hash"), default="round-robin",
                    help="how requests go to workers (hash keeps a conversation on one)")
    ap.add_argument("--seed", type=int, default=0, help="workload and model seed")
    ap.add_argument("--token-budget", type=int, default=2048,
                    help="tokens per scheduler step (2,048: vLLM's default for a server on CPU)")
    ap.add_argument("--max-running", type=int, default=16, help="running requests per worker (16)")
    ap.add_argument("--model", choices=MODELS, default=DEFAULT_MODEL,
                    help="what the workers compute: 'transformer' (default: a decoder stack "
                         "with a real model's cost, so hits save real time; checked within a "
                         "tolerance) or 'exact' (a toy model whose K/V are bit-exact, for "
                         "exact integrity runs)")
    ap.add_argument("--verify-hits", type=float, default=None, metavar="F",
                    help="--model exact: the fraction of hit blocks compared bit for bit "
                         "with a recompute (default 1.0: every one)")
    ap.add_argument("--check-blocks", type=int, default=None, metavar="N",
                    help="--model transformer: full prompt blocks per request recomputed "
                         "and compared within a tolerance, hit or computed alike, drawn "
                         "from the request's id (the same blocks in a shared and an "
                         "isolated run; default 2; more than a prompt has: all of them)")
    ap.add_argument("--check-decode", type=float, default=None,
                    help="fraction of decode steps checked (default 0.02): exact, against "
                         "attention over a contiguous recompute; transformer, against "
                         "attention over the request's K/V read contiguously")
    ap.add_argument("--no-pin", action="store_true", help="do not pin workers to CPUs")
    ap.add_argument("--kill-worker", type=int, metavar="I",
                    help="fault injection: SIGKILL worker I after --kill-after seconds")
    ap.add_argument("--kill-after", type=float, default=5.0)
    ap.add_argument("--kill-coordinator-every", type=float, metavar="S",
                    help="fault injection: SIGKILL the coordinator every S seconds; "
                         "kvshm run restarts it (it adopts its pool) and the workers resume")
    ap.add_argument("--corrupt-pages", type=int, default=0, metavar="N",
                    help="fault injection: overwrite N random pages of the KV arena with "
                         "random bytes, once, --corrupt-after seconds in; the workers find "
                         "the bad hits, the pool uncaches them, and the run says so (exit 1)")
    ap.add_argument("--corrupt-after", type=float, default=5.0, metavar="S")
    ap.add_argument("--reconnect-timeout", type=float, default=60.0, metavar="S",
                    help="how long workers wait for a coordinator that went away to come "
                         "back (restarted by kvshm run or your supervisor) (60)")
    ap.add_argument("--hash-algorithm", default=DEFAULT_HASH_ALGORITHM, help="with --connect")
    ap.add_argument("--hash-seed", default=DEFAULT_HASH_SEED, help="with --connect")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--plot", metavar="FILE.png",
                    help="draw the run(s): hit rate and tokens/s over time, time to first "
                         "token (needs matplotlib: pip install 'kvshm[plot]')")
    ap.add_argument("--quiet", action="store_true", help="no live progress")


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    """LaunchOptions from parsed arguments; raises ValueError / KvshmError
    with a message for the user."""
    if args.workers is None:
        from kvshm.workers.topology import discover
        args.workers = max(2, sum(1 for node in discover() if not node.virtual))
    if args.workers < 1:
        raise ValueError(f"--workers must be at least 1 (got {args.workers})")
    if args.duration <= 0 or args.grace < 0:
        raise ValueError("--duration must be positive and --grace not negative")
    if args.kill_worker is not None and not 0 <= args.kill_worker < args.workers:
        raise ValueError(f"--kill-worker must be a worker index in [0, {args.workers})")
    if args.reconnect_timeout <= 0:
        raise ValueError("--reconnect-timeout must be positive")
    if args.corrupt_pages < 0 or args.corrupt_after < 0:
        raise ValueError("--corrupt-pages and --corrupt-after must not be negative")
    if args.kill_coordinator_every is not None:
        if args.kill_coordinator_every <= 0:
            raise ValueError("--kill-coordinator-every must be positive")
        if args.connect:
            raise ValueError("--kill-coordinator-every needs kvshm run's own coordinator "
                             "(not --connect: supervise that one yourself)")
    knobs = CHECK_DEFAULTS[args.model]
    for name in ("verify_hits", "check_blocks"):
        if name not in knobs and getattr(args, name) is not None:
            other = next(m for m, k in CHECK_DEFAULTS.items() if name in k)
            raise ValueError(f"--{name.replace('_', '-')} is a knob of --model {other}; "
                             f"--model {args.model} checks with "
                             + ", ".join(f"--{k.replace('_', '-')}" for k in knobs))
    for name, value in knobs.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("verify_hits", "check_decode"):
        if getattr(args, name) is not None and not 0.0 <= getattr(args, name) <= 1.0:
            raise ValueError(f"--{name.replace('_', '-')} must be within [0, 1]")
    if args.check_blocks is not None and args.check_blocks < 0:
        raise ValueError(f"--check-blocks must not be negative (got {args.check_blocks})")
    if args.token_budget < 1 or args.max_running < 1:
        raise ValueError("--token-budget and --max-running must be positive")
    config = None
    if args.connect:
        if args.isolated or args.compare:
            raise ValueError("--isolated/--compare start their own pools: not with --connect")
        if args.kv_memory or args.num_blocks:
            raise ValueError("--connect joins an existing pool: its size is the coordinator's")
    else:
        # Not PoolSource.from_args: --hash-algorithm/--hash-seed here go with
        # --connect only (a pool run starts hashes as its config says).
        config = resolve_config(
            PoolSource(preset=args.preset, config_file=args.config,
                       num_blocks=args.num_blocks, kv_memory=args.kv_memory),
            default_preset=DEFAULT_PRESET, need_kv=True)
    max_len = config.max_model_len if config else 4096
    if args.requests is not None and args.requests < 1:
        raise ValueError(f"--requests must be at least 1 (got {args.requests})")
    if args.workload == "synthetic":
        from kvshm.workload.items import SyntheticSpec
        spec = SyntheticSpec(seed=args.seed).fit(max_len).validate()
        workload = WorkloadSpec(kind="synthetic", synthetic=spec, limit=args.requests,
                                assign=args.assign)
    elif args.workload in ("rag", "unique"):
        from kvshm.workload.items import RagSpec
        spec = RagSpec(seed=args.seed, shared=args.workload == "rag").validate()
        if spec.max_item_len > max_len:
            raise ValueError(f"--workload {args.workload}: its requests reach "
                             f"{spec.max_item_len:,} tokens, the model's max is {max_len:,}")
        workload = WorkloadSpec(kind="rag", rag=spec, limit=args.requests, assign=args.assign)
    else:
        path = Path(args.workload)
        if not path.is_file():
            raise ValueError(f"--workload: {path} is not a file (or say 'synthetic', 'rag' "
                             "or 'unique')")
        from kvshm.workload.items import load_jsonl
        load_jsonl(path, max_len=max_len)    # bad lines fail here, not in N workers
        workload = WorkloadSpec(kind="jsonl", path=str(path.resolve()), max_len=max_len,
                                limit=args.requests, assign=args.assign)
    for flag in ("json", "plot"):
        path = getattr(args, flag)
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"--{flag}: the directory of {path} does not exist")
    if args.plot:
        from kvshm.workers.plot import require
        require()
    checks = {k: getattr(args, k) for k in knobs}
    preset = None if args.config or args.connect else PRESETS[args.preset or DEFAULT_PRESET]
    engine = EngineOptions(token_budget=args.token_budget, max_running=args.max_running,
                           seed=args.seed, model=args.model,
                           decoder=preset.decoder if preset else None, **checks)
    if config is not None:
        from kvshm.pool.arena import resolve_dtype
        from kvshm.pool.shm import check_shm_space
        from kvshm.workers.engine import check_supported
        check_supported(config, args.model)
        resolve_dtype(config.kv.dtype)   # e.g. bfloat16 without ml_dtypes: say so now
        pools = args.workers if (args.isolated or args.compare) else 1
        per_pool = config if pools == 1 else isolated_config(config, pools)
        # Refuse up front (exit 2) rather than from inside a coordinator child.
        check_shm_space(pools * pool_bytes(per_pool))
    return LaunchOptions(
        num_workers=args.workers, duration=args.duration, grace=args.grace, config=config,
        connect=args.connect, hash_algorithm=args.hash_algorithm, hash_seed=args.hash_seed,
        workload=workload, engine=engine, pin=not args.no_pin, kill_worker=args.kill_worker,
        kill_after=args.kill_after, kill_coordinator_every=args.kill_coordinator_every,
        corrupt_pages=args.corrupt_pages, corrupt_after=args.corrupt_after,
        reconnect_timeout=args.reconnect_timeout, start_together=True,
        live=not args.quiet)


def run(args: argparse.Namespace) -> int:
    from kvshm.service.loop import run_async

    try:
        opts = options_from_args(args)
    except (ValueError, KvshmError) as e:
        print(f"kvshm run: {e}", file=sys.stderr)
        return 2
    cpu_plan = make_plan(opts.num_workers, opts.pin)
    print(header(opts, cpu_plan), flush=True)
    modes = ["shared", "isolated"] if args.compare else [
        "isolated" if args.isolated else "shared"]
    results: list[RunResult] = []
    size = workload_size(opts.workload)
    for mode in modes:
        try:
            res = run_async(launch(opts, mode, cpu_plan))
        except KvshmError as e:   # e.g. nothing listens at --connect
            print(f"kvshm run: {e}", file=sys.stderr)
            return 2
        except RuntimeError as e:   # a coordinator failed to start or stop cleanly
            print(f"kvshm run: {e}", file=sys.stderr)
            return 1
        results.append(res)
        profile = model_profile(res.config, opts)
        print(summary(res, profile, size), flush=True)
        if res.interrupted:
            break
    if len(results) == 2:
        print(comparison(*results), flush=True)
    if args.json:
        doc = {"runs": [r.to_dict() for r in results]}
        if results and (profile := model_profile(results[0].config, opts)):
            doc["model"] = profile
        if size is not None:
            doc["workload"] = {"requests": size[0], "distinct_tokens": size[1]}
        if len(results) == 2:
            doc["speedup"] = speedup(*results)
        Path(args.json).write_text(json.dumps(doc, indent=2))
    if args.plot and results:
        from kvshm.workers.plot import plot_runs
        plot_runs(results, args.plot)
        print(f"plot: {args.plot}", flush=True)
    if any(r.interrupted for r in results):
        print("result: interrupted", flush=True)
        return 130
    problems = [p for r in results for p in _problems(r, opts)]
    found = sum(r.totals.corrupt_blocks_found for r in results)
    if problems:
        print("result: FAILED: " + "; ".join(problems), flush=True)
    elif found:   # no output was wrong, but someone must look at the host
        print(f"result: CORRUPTION FOUND AND HEALED: {found} block(s) held wrong K/V; the "
              "pool uncached them with the blocks computed from them, the requests that read "
              "them computed them again, and no checked output was wrong; something wrote "
              "into the KV arena: look at the host", flush=True)
    else:
        print("result: " + _verdict(results), flush=True)
    return 1 if problems or found else 0


def _problems(res: RunResult, opts: LaunchOptions) -> list[str]:
    """What makes a run a failure (exit 1), in words."""
    expected = {"done"} | ({"killed"} if opts.kill_worker is not None else set())
    out = []
    if res.totals.integrity_failures:
        out.append(f"{res.mode}: {res.totals.integrity_failures} integrity mismatch(es)")
    out += [f"{res.mode}: worker {w.index} {w.status}" for w in res.workers
            if w.status not in expected]
    out += [f"{res.mode}: pool check failed" for p in res.pools if not p["check_clean"]]
    for r in res.restarts:
        if "error" in r:
            out.append(f"{res.mode}: the coordinator could not be restarted: {r['error']}")
        elif not r.get("check_clean"):
            out.append(f"{res.mode}: pool check failed after a restart")
    t = res.totals
    if t.corrupt_refound:
        out.append(f"{res.mode}: {t.corrupt_refound} hit(s) on blocks the pool had uncached "
                   "as corrupt")
    if t.requests_lost:
        out.append(f"{res.mode}: {t.requests_lost} request(s) could not be "
                   "resumed after a coordinator restart")
    offered = t.finished + t.aborted + t.rejected
    if not t.finished:
        out.append(f"{res.mode}: no request finished")
    if 2 * t.rejected > offered:
        out.append(f"{res.mode}: {t.rejected:,} of {offered:,} requests rejected (longer than "
                   "the model or the pool: give the pool more memory)")
    return out


def _verdict(results: list[RunResult]) -> str:
    """The OK line: what was checked, in words that stay true."""
    workers = [w for r in results for w in r.workers]
    done = sum(1 for w in workers if w.status == "done")
    killed = [f"worker {w.index}" for w in workers if w.status == "killed"]
    finished = ("every worker finished" if done == len(workers) else
                f"{done} of {len(workers)} worker runs finished, "
                f"{', '.join(killed)} killed as asked")
    return f"OK (0 integrity mismatches, {finished}, pools whole)"


def workload_size(workload) -> tuple[int, int] | None:
    """(requests, distinct tokens: what a perfect prefix cache computes) of a
    finite workload; None for an endless one."""
    if workload.kind == "synthetic" and workload.limit is None:
        return None
    items = list(workload_stream(workload))
    return len(items), distinct_tokens(items)


def model_profile(config, opts: LaunchOptions) -> dict | None:
    """The transformer's cost profile on `config`'s KV shape
    (transformer.decoder_profile), or None for another model."""
    if opts.engine.model != "transformer" or config is None or config.kv is None:
        return None
    from kvshm.pool.arena import resolve_dtype
    from kvshm.workers.transformer import decoder_profile
    return decoder_profile(config.kv, opts.engine.decoder,
                           resolve_dtype(config.kv.dtype).itemsize)


# -- printing ---------------------------------------------------------------------------------
def header(opts: LaunchOptions, cpu_plan) -> str:
    lines = []
    cfg = opts.config
    if cfg is not None:
        kv = cfg.kv
        lines.append(
            f"kvshm run: {opts.num_workers} workers, {opts.duration:g}s of workload; pool of "
            f"{cfg.num_blocks:,} blocks x {cfg.kv_block_bytes:,} bytes "
            f"({cfg.num_blocks * cfg.kv_block_bytes / 2**20:,.0f} MiB KV: "
            f"{len(cfg.groups)} group(s) x {kv.num_layers} layers x {kv.num_kv_heads} KV heads "
            f"x {kv.head_size}, {kv.dtype})")
    else:
        lines.append(f"kvshm run: {opts.num_workers} workers joining {opts.connect}")
    lines.append("placement:")
    lines += ["  " + line for line in describe(cpu_plan).splitlines()]
    return "\n".join(lines)


def _pct(a: int, b: int) -> str:
    return f"{a / b:.1%}" if b else "-"


def summary(res: RunResult, profile: dict | None = None,
            size: tuple[int, int] | None = None) -> str:
    """A run's figures; `profile`: the model's (model_profile), `size`: the
    workload's (workload_size), if known."""
    t = res.totals
    lat = res.latencies
    secs = max(res.serving_seconds, 1e-9)
    prompt, hit, cross = t.prompt_tokens, t.hit_tokens, t.cross_hit_tokens
    out = [f"== {res.mode} pool{' (interrupted)' if res.interrupted else ''}: "
           f"{res.serving_seconds:.1f}s serving after {res.seconds - res.serving_seconds:.1f}s "
           f"of start-up (integrity checks {t.check_s:,.1f} CPU s of it, summed over "
           f"workers), {len(res.workers)} workers, {res.config.num_blocks:,} "
           f"blocks per pool x {len(res.pools) or 1} pool(s)"]
    if profile:
        from kvshm.workers.transformer import format_profile
        out.append(f"  model             {format_profile(profile)}")
    out += [
           f"  requests          {t.finished:,} finished ({t.finished / secs:,.1f}/s), "
           f"{t.aborted:,} aborted at the deadline"
           + (f", {t.rejected:,} rejected (longer than the model or the pool)"
              if t.rejected else ""),
           f"  tokens            {prompt:,} prompt ({prompt / secs:,.0f}/s), "
           f"{t.generated_tokens:,} generated ({t.generated_tokens / secs:,.0f}/s); "
           f"K/V computed for {t.computed_tokens:,} ({t.computed_tokens / secs:,.0f}/s)"
           + (f", {t.computed_tokens / size[1]:.2f}x the workload's {size[1]:,} distinct "
              f"tokens" if size and t.finished == size[0] and size[1] else ""),
           f"  prefix cache      hit rate {_pct(hit, prompt)}: {hit:,} prompt tokens not "
           f"recomputed; {cross:,} of them from blocks another worker wrote "
           f"({_pct(cross, hit)} of hits)",
           f"  allocation        step batch round trip p50 {percentile(lat, 50) or 0:,} us, "
           f"p99 {percentile(lat, 99) or 0:,} us over {len(lat):,} steps",
           f"  first token       p50 {percentile(sorted(t.ttft_ms), 50) or 0:,} ms, p99 "
           f"{percentile(sorted(t.ttft_ms), 99) or 0:,} ms from arrival (queueing included: p50 "
           f"{percentile(sorted(t.queue_ms), 50) or 0:,} ms from arrival to admission)",
           f"  preemptions       {t.preemptions:,}",
           f"  prefixes in flight {t.in_flight_waits:,} requests waited for blocks another "
           f"worker was computing ({t.in_flight_timeouts:,} stopped waiting and computed "
           "them)",
           f"  worker time       CPU s: K/V {t.kv_s:,.1f}, decode attention "
           f"{t.attention_s:,.1f}, integrity checks {t.check_s:,.1f}; waiting for "
           f"the coordinator {t.coord_s:,.1f}s (summed over workers)",
           f"  integrity         {t.hit_blocks_checked:,} hit blocks checked: "
           f"{t.hit_mismatches} mismatches; {t.computed_blocks_checked:,} computed blocks "
           f"checked: {t.computed_mismatches} mismatches; {t.decode_checks:,} decode "
           f"attention checks: {t.decode_mismatches} mismatches; {t.check_s:,.1f} CPU s"]
    if t.corrupt_blocks_found or res.corrupted_pages:
        out.append(f"  corruption        {res.corrupted_pages:,} arena pages overwritten "
                   f"(--corrupt-pages); {t.corrupt_blocks_found:,} blocks found wrong "
                   f"({t.corrupt_findings:,} times, by hit and decode checks), "
                   f"{t.corrupt_blocks_evicted:,} blocks uncached with them, "
                   f"{t.corrupt_requeued:,} requests computed again; {t.corrupt_refound} later "
                   f"hits on uncached blocks; first: {t.first_corruption or '-'}")
    seen = max((w.stats.coordinator_restarts for w in res.workers), default=0)
    if res.restarts or seen:
        stalls = res.stalls_ms
        clean = sum(1 for r in res.restarts if r.get("check_clean"))
        who = (f"coordinator restarted {len(res.restarts)} time(s) by kvshm run (pool check "
               f"clean after {clean})" if res.restarts else
               f"the coordinator restarted {seen} time(s) (by its own supervisor)")
        out.append(
            f"  restarts          {who}; {t.requests_resumed:,} requests resumed, "
            f"{t.requests_lost:,} lost, {t.recomputed_tokens:,} tokens recomputed; "
            f"stall per restart p50 {percentile(stalls, 50) or 0:,} ms, max "
            f"{stalls[-1] if stalls else 0:,} ms (kill -> workers resumed)")
    for i, pool in enumerate(res.pools):
        # (several pools: the isolated run's, pool i serving worker i)
        label = "pool after run" if len(res.pools) == 1 else f"worker {i}'s pool"
        if "error" in pool:
            out.append(f"  {label:<18}UNAVAILABLE: {pool['error']}")
            continue
        out.append(
            f"  {label:<18}{pool['num_requests']} requests, {pool['num_free_blocks']:,} "
            f"of {pool['num_blocks'] - 1:,} blocks free ({pool['num_cached_blocks']:,} "
            f"cached), segment check {'clean' if pool['check_clean'] else 'FAILED: '}"
            + "; ".join(pool["problems"]))
    for w in res.workers:
        s = w.stats
        out.append(
            f"  worker {w.index} cpus {format_cpulist(w.cpus):<6} pid {w.pid:<7} {w.status:<8} "
            f"requests {s.finished:>5,}  hit {_pct(s.hit_tokens, s.prompt_tokens):>6}  "
            f"cross-worker {s.cross_hit_tokens:>8,} tok  "
            f"computed {s.computed_tokens:>8,} tok  preempt {s.preemptions}  "
            f"mismatches {s.integrity_failures}")
        if w.message:
            out.append(f"    worker {w.index}: {w.message}")
        if s.first_error:
            out.append(f"    worker {w.index} first integrity failure: {s.first_error}")
    killed = [w for w in res.workers if w.status in ("killed", "died")]
    if killed and res.pools:
        back = all("error" not in p and p["num_requests"] == 0
                   and p["num_free_blocks"] == p["num_blocks"] - 1 for p in res.pools)
        out.append(f"  note: worker(s) {', '.join(str(w.index) for w in killed)} did not "
                   f"finish; the coordinator freed their requests when their sessions "
                   f"ended: {'every block is back in the pool' if back else 'BLOCKS MISSING'}")
    return "\n".join(out)


def comparison(shared: RunResult, isolated: RunResult) -> str:
    def row(name, a, b):
        return f"  {name:<26}{a:>16}{b:>16}"

    def rate(r):
        return f"{r.hit_rate:.1%}"

    def tps(r, key):
        return f"{getattr(r.totals, key) / max(r.serving_seconds, 1e-9):,.0f}"

    def lat(r, q):
        return f"{percentile(r.latencies, q) or 0:,}"

    def ttft(r, q):
        return f"{percentile(sorted(r.totals.ttft_ms), q) or 0:,}"

    rows = [
        "== shared vs isolated (same workload, same total blocks)",
        row("", "shared", "isolated"),
        row("serving time s", f"{shared.serving_seconds:,.1f}",
            f"{isolated.serving_seconds:,.1f}"),
        row("wall time s (with start-up)", f"{shared.seconds:,.1f}", f"{isolated.seconds:,.1f}"),
        row("integrity checks CPU s", f"{shared.totals.check_s:,.1f}",
            f"{isolated.totals.check_s:,.1f}"),
        row("blocks checked", f"{_checked(shared):,}", f"{_checked(isolated):,}"),
        row("time to first token p50 ms", ttft(shared, 50), ttft(isolated, 50)),
        row("time to first token p99 ms", ttft(shared, 99), ttft(isolated, 99)),
        row("prefix hit rate", rate(shared), rate(isolated)),
        row("tokens saved (hits)", f"{shared.totals.hit_tokens:,}",
            f"{isolated.totals.hit_tokens:,}"),
        row("cross-worker hit tokens", f"{shared.totals.cross_hit_tokens:,}",
            f"{isolated.totals.cross_hit_tokens:,}"),
        row("requests finished", f"{shared.totals.finished:,}",
            f"{isolated.totals.finished:,}"),
        row("requests/s", f"{shared.totals.finished / max(shared.serving_seconds, 1e-9):,.2f}",
            f"{isolated.totals.finished / max(isolated.serving_seconds, 1e-9):,.2f}"),
        row("prompt tok/s served", tps(shared, "prompt_tokens"), tps(isolated, "prompt_tokens")),
        row("generated tok/s", tps(shared, "generated_tokens"),
            tps(isolated, "generated_tokens")),
        row("K/V computed tok/s", tps(shared, "computed_tokens"),
            tps(isolated, "computed_tokens")),
        row("step round trip p50 us", lat(shared, 50), lat(isolated, 50)),
        row("step round trip p99 us", lat(shared, 99), lat(isolated, 99)),
        row("preemptions", f"{shared.totals.preemptions:,}",
            f"{isolated.totals.preemptions:,}"),
        *(row(f"worker {label}", f"{getattr(shared.totals, key):,.1f}",
              f"{getattr(isolated.totals, key):,.1f}")
          for label, key in (("CPU s: K/V", "kv_s"), ("CPU s: attention", "attention_s"),
                             ("s waiting: coordinator", "coord_s"))),
        row("integrity mismatches", str(shared.totals.integrity_failures),
            str(isolated.totals.integrity_failures)),
    ]
    diff = shared.hit_rate - isolated.hit_rate
    rows.append(f"  the shared pool's hit rate is {abs(diff) * 100:.1f} points "
                f"{'higher' if diff > 0 else 'LOWER'} than isolated pools'")
    rows.append("  " + speedup_line(shared, isolated))
    return "\n".join(rows)


def _checked(res: RunResult) -> int:
    t = res.totals
    return t.hit_blocks_checked + t.computed_blocks_checked


def speedup(shared: RunResult, isolated: RunResult) -> float | None:
    """Isolated serving time / shared serving time (start-up excluded: it
    is the same with or without a shared pool), when both did the same work
    (every request of a --requests workload finished in both)."""
    s, i = shared.totals, isolated.totals
    same = s.finished == i.finished and not s.aborted and not i.aborted
    a, b = isolated.serving_seconds, shared.serving_seconds
    return a / b if same and b else None


def speedup_line(shared: RunResult, isolated: RunResult) -> str:
    """The speedup, and in one sentence where the difference comes from."""
    s, i = shared.totals, isolated.totals
    x = speedup(shared, isolated)
    head = (f"speedup {x:.2f}x (isolated {isolated.serving_seconds:.1f} s / shared "
            f"{shared.serving_seconds:.1f} s serving, same work)" if x is not None else
            "no speedup figure: the runs did different amounts of work (give --requests N "
            "and a --duration long enough for both to finish)")
    first = ""
    t_s, t_i = (percentile(sorted(r.totals.ttft_ms), 50) for r in (shared, isolated))
    if t_s and t_i:
        first = (f"; time to first token p50 {t_s:,} vs {t_i:,} ms "
                 f"({t_i / t_s:.1f}x lower on the shared pool)" if t_s < t_i else
                 f"; time to first token p50 {t_s:,} vs {t_i:,} ms (not lower shared)")
    return (f"{head}: shared computed {s.computed_tokens:,} tokens' K/V vs {i.computed_tokens:,} "
            f"({i.computed_tokens - s.computed_tokens:+,} for isolated pools, from "
            f"{s.cross_hit_tokens:,} hit tokens another worker wrote); prefill CPU "
            f"{s.kv_s:,.1f} vs {i.kv_s:,.1f} s, decode {s.attention_s:,.1f} vs "
            f"{i.attention_s:,.1f} s{' (the same decode work in both)' if x else ''}{first}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvshm.workers", description="run kvshm CPU workers on a shared KV pool "
        "(same as `kvshm run`)")
    add_arguments(ap)
    return run(ap.parse_args(argv))
