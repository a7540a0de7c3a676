#!/usr/bin/env python3
"""Coordinator service benchmark: round trips, multi-client throughput against
the embedded core, and the coordinator's RSS over a long run.

One pool (full attention, 16-token blocks, max_model_len 4096, or --preset)
served by a `kvshm serve` child process.  Measures:

1. single-op round trip latency, one client, one op per frame, through the
   asyncio client: get_block_ids, stats, allocate_slots/free pairs (p50, p99,
   mean over --latency-calls), and stats over a raw blocking socket with a
   pre-encoded frame (the floor under the asyncio client);
2. throughput of 1, 2 and 4 client processes (each its own uvloop loop and
   connection) replaying a synthetic scheduler workload, each scheduler
   frame's ops (one frame a step, one per preemption) sent in frames of at
   most 1, 8 or 64 ops (a frame never spans two of the scheduler's; each
   waits for its reply): total ops/s, per-op latency (frame
   latency / ops in the frame, per op) and per-frame latency, and the
   coordinator's CPU time per op;
3. the same op lists executed on an embedded KVCacheManager in this process
   (no socket), the ratio coordinator ops/s (64-op frames) / embedded ops/s,
   and, to split the gap, the coordinator's own cost in-process (decode +
   dispatch + encode of the same frames, no socket) and the client's codec
   cost (encode the frames, decode the replies);
4. the coordinator's RSS over --rss-ops ops through one fresh coordinator
   (client 0's workload replayed round after round, 64-op frames, the prefix
   cache reset between rounds), sampled every --rss-every ops: first, last,
   max, and the change from the first sample after --rss-warmup ops to the
   last, with its anonymous and shared (pool segment) parts.  Segment pages
   count in RSS once touched, so this pool is sized (--rss-num-blocks) to
   be cycled through before the warm-up ends.

Every coordinator is a `kvshm serve` child stopped with SIGTERM (SIGKILL
after 10 s, then its segment removed) on success, error, Ctrl-C or SIGTERM.

The workload is recorded once per client (scripts/service_load.py): the
synthetic scheduler of kvshm.workload (seed + client index, so clients share
no prefix) drives an
embedded KVCacheManager and every manager call is recorded as a protocol
struct (add, hits, alloc, advance, free), grouped by scheduler step.  Both
the embedded run and the coordinator replay that recording; the prefix cache
is reset before every run and the pool is sized so that no run evicts a
cached block, so every lookup through the coordinator must hit exactly as
recorded (checked: "hit mismatches").  Struct creation is not timed;
encoding and decoding are.

    python scripts/bench_service.py                      # defaults (~1 min on 2 cores)
    python scripts/bench_service.py --rss-ops 1000000    # the long RSS run
    python scripts/bench_service.py --profile            # + cProfile of the coordinator
    python scripts/bench_service.py --against REV --rounds 1 --rss-ops 0   # vs a revision
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import signal
import statistics
import sys
import time
from array import array
from pathlib import Path

import msgspec
import psutil

from bench_common import add_json_argument, write_results
from bench_guard import (GuardError, alternate, compare, forwarded_args, service_figures,
    service_lower_is_better)
from kvshm.config import PoolSource, add_pool_arguments, resolve_config
from kvshm.core.errors import ConfigError
from kvshm.core.metrics import percentile
from kvshm.core.specs import FullSpec, PoolConfig
from kvshm.ops import protocol as p
from kvshm.ops.protocol import encode_frame
from kvshm.service.handshake import make_hello
from kvshm.service.process import CoordinatorProcess
from kvshm.service.sync_client import open_wire_sync
from service_load import (
    ALLOCATING,
    Recording,
    Workers,
    bench_embedded,
    bench_inprocess,
    build_frames,
    client_scheduler,
    record_workload,
    reset_pool,
    start_coordinator,
    summarize_run,
)

P50_TARGET_US = 50.0
RATIO_TARGET = 0.5
RSS_TOLERANCE = 0.05
PRESETS_OK = ("llama-8b", "gemma-hybrid", "jamba-hybrid")
DEFAULT_BLOCKS = 65536


# =============================================================================
# The coordinator and a blocking admin connection
# =============================================================================
# =============================================================================
# 1. single-op latency
# =============================================================================
def _summ(ns: array) -> dict:
    n = len(ns)
    return {"calls": n, "p50_us": percentile(ns, 50) / 1e3, "p99_us": percentile(ns, 99) / 1e3,
            "mean_us": sum(ns) / n / 1e3}


def bench_latency(path, config: PoolConfig, calls: int, warmup: int) -> dict:
    from kvshm.service.client import connect
    from kvshm.service.loop import run_async

    async def run() -> dict:
        c = await connect(path, hash_algorithm=config.hash_algorithm,
                          hash_seed=config.hash_seed)
        perf = time.perf_counter_ns
        out = {}
        try:
            await c.add_request("lat-held", list(range(64)))
            await c.allocate_slots("lat-held", 64)          # 4 blocks held
            await c.add_request("lat-pair", list(range(100, 108)))  # < 1 block: never cached
            gc.collect()
            for name in ("get_block_ids", "stats"):
                lat = array("q")
                for i in range(warmup + calls):
                    t = perf()
                    if name == "stats":
                        await c.stats()
                    else:
                        await c.get_block_ids("lat-held")
                    if i >= warmup:
                        lat.append(perf() - t)
                out[name] = _summ(lat)
            la, lf = array("q"), array("q")
            for i in range(warmup + calls):
                t0 = perf()
                got = await c.allocate_slots("lat-pair", 8)
                t1 = perf()
                await c.free("lat-pair", preempted=True)   # keeps the request
                t2 = perf()
                if got is None:
                    raise RuntimeError("allocate_slots failed in the latency loop")
                if i >= warmup:
                    la.append(t1 - t0)
                    lf.append(t2 - t1)
            out["allocate_slots"] = _summ(la)
            out["free"] = _summ(lf)
            out["allocate_free_pair"] = _summ(array("q", (a + b for a, b in zip(la, lf))))
            await c.free("lat-held")
            await c.free("lat-pair")
        finally:
            await c.close()
        return out

    out = run_async(run())
    # The floor: get_block_ids pre-encoded over a blocking socket (no asyncio,
    # no struct building on the client side; the reply is decoded).
    wire, _ = open_wire_sync(path, make_hello(path, hash_algorithm=None), 10.0)
    try:
        def call(msg):
            wire.send(encode_frame(msg))
            return wire.receive(None)

        call(p.AddRequest("lat-raw", list(range(64))))
        call(p.AllocateSlots("lat-raw", 64))
        frame = encode_frame(p.GetBlockIds("lat-raw"))
        if call(p.GetBlockIds("lat-raw")).__class__ is not p.BlockIds:
            raise RuntimeError("get_block_ids failed on the raw connection")
        send, receive = wire.send, wire.receive
        perf = time.perf_counter_ns
        lat = array("q")
        for i in range(warmup + calls):
            t = perf()
            send(frame)
            receive(None)
            if i >= warmup:
                lat.append(perf() - t)
        out["get_block_ids_raw_socket"] = _summ(lat)
        call(p.Free("lat-raw"))
    finally:
        wire.close()
    return out


# =============================================================================
# 2. multi-client throughput (worker processes)
# =============================================================================
def _cpu(ps: psutil.Process) -> float:
    t = ps.cpu_times()
    return t.user + t.system


# =============================================================================
# 4. RSS over a long run
# =============================================================================
def bench_rss(config: PoolConfig, rec: Recording, total_ops: int, every: int,
              warmup: int, batch: int) -> dict:
    from kvshm.service.client import connect
    from kvshm.service.loop import run_async

    with CoordinatorProcess(config, new_session=True, with_parent=True) as coord:
        ps = psutil.Process(coord.proc.pid)

        def sample(ops: int) -> dict:
            m = ps.memory_info()
            return {"ops": ops, "rss": m.rss, "anon": m.rss - m.shared, "shared": m.shared}

        async def run() -> dict:
            c = await connect(coord.socket, hash_algorithm=config.hash_algorithm,
                              hash_seed=config.hash_seed, admin=True)
            samples = [sample(0)]
            ops = rounds = errors = failed = mismatches = 0
            busy = 0.0
            next_sample = every
            send = c.request
            try:
                while ops < total_ops:
                    frames, checks, sizes = build_frames(rec.steps, rec.hits, batch,
                                                         f"rss{rounds}-")
                    t0 = time.perf_counter()
                    for frame, check, size in zip(frames, checks, sizes):
                        reply = await send(frame, None)
                        results = reply.results if reply.__class__ is p.BatchReply else (reply,)
                        for r in results:
                            if r.__class__ is p.Error:
                                errors += 1
                            elif r.__class__ in ALLOCATING and r.new_block_ids is None:
                                failed += 1
                        if check:
                            for j, want in check:
                                if j < len(results) and getattr(
                                        results[j], "num_computed_tokens", None) != want:
                                    mismatches += 1
                        ops += size
                        if ops >= next_sample:
                            busy += time.perf_counter() - t0
                            samples.append(sample(ops))
                            next_sample += every
                            t0 = time.perf_counter()
                    r = await send(p.ResetPrefixCache(), None)
                    ops += 1
                    busy += time.perf_counter() - t0
                    if r.__class__ is not p.ResetResult or not r.ok:
                        raise RuntimeError(f"reset_prefix_cache refused after round {rounds}")
                    rounds += 1
                    if errors:
                        break
            finally:
                await c.close()
            if samples[-1]["ops"] != ops:
                samples.append(sample(ops))
            return {"samples": samples, "ops": ops, "rounds": rounds, "errors": errors,
                    "failed_allocs": failed, "hit_mismatches": mismatches, "seconds": busy}

        res = run_async(run())
        time.sleep(0.2)  # the session's end is processed; one more sample, idle
        res["samples_idle_after"] = ps.memory_info().rss
    s = res["samples"]
    warm = next((x for x in s if x["ops"] >= warmup), s[-1])
    res.update({
        "num_blocks": config.num_blocks, "batch": batch, "every": every, "warmup_ops": warmup,
        "ops_per_s": res["ops"] / res["seconds"] if res["seconds"] else 0.0,
        "first_rss": s[0]["rss"], "warm_rss": warm["rss"], "warm_at_ops": warm["ops"],
        "last_rss": s[-1]["rss"], "max_rss": max(x["rss"] for x in s),
        "change_after_warmup": (s[-1]["rss"] - warm["rss"]) / warm["rss"],
        "anon_change_after_warmup": (s[-1]["anon"] - warm["anon"]) / warm["anon"],
        "shared_change_after_warmup": (s[-1]["shared"] - warm["shared"]) / warm["shared"],
    })
    return res


# =============================================================================
# main
# =============================================================================
def pool_config(args) -> PoolConfig:
    """The pool the flags name (kvshm serve's pool flags): a preset or a
    config file, else full attention with 16-token blocks and
    max_model_len 4096; DEFAULT_BLOCKS blocks unless sized otherwise.
    Raises ConfigError naming what to change."""
    source = PoolSource.from_args(args)
    if source.num_blocks is None and source.kv_memory is None:
        source = msgspec.structs.replace(source, num_blocks=DEFAULT_BLOCKS)
    if source.preset and source.preset not in PRESETS_OK:
        raise ConfigError("preset", f"the service benchmark runs the presets "
                          f"{', '.join(PRESETS_OK)} (got {source.preset!r})")
    if source.preset or source.config_file:
        return resolve_config(source)
    if source.kv_memory is not None:
        raise ConfigError("kv_memory", "--kv-memory needs a KV shape (--preset or --config); "
                          "use --num-blocks")
    config = PoolConfig(num_blocks=source.num_blocks, hash_block_size=16, max_model_len=4096,
                        groups=(FullSpec(16),))
    hashing = {f: getattr(source, f) for f in ("hash_algorithm", "hash_seed")
               if getattr(source, f) is not None}
    return config.replace(**hashing) if hashing else config


def _busy_cpu() -> tuple[float, float, float]:
    """(CPU seconds the whole machine has been busy, CPU seconds of this
    process and its reaped children, CPU seconds stolen by the hypervisor)."""
    t = psutil.cpu_times()
    busy = t.user + t.system + sum(getattr(t, f, 0.0) for f in ("nice", "irq", "softirq"))
    o = os.times()
    return busy, o.user + o.system + o.children_user + o.children_system, getattr(t, "steal", 0.0)


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


def _sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # The pool: kvshm serve's flags (default: full attention, 16-token
    # blocks, max_model_len 4096, DEFAULT_BLOCKS blocks; the pool must hold
    # the blocks all clients of a run take).
    add_pool_arguments(ap, vllm=False)
    ap.add_argument("--requests", type=int, default=200, help="workload requests per client")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--latency-calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3,
                    help="throughput rounds (interleaved); the median round is reported")
    ap.add_argument("--rss-ops", type=int, default=200_000,
                    help="ops through the RSS coordinator (the acceptance run: 1000000)")
    ap.add_argument("--rss-every", type=int, default=50_000)
    ap.add_argument("--rss-warmup", type=int, default=100_000)
    ap.add_argument("--rss-batch", type=int, default=64)
    ap.add_argument("--rss-num-blocks", type=int, default=0,
                    help="pool size of the RSS run (default: about twice the blocks one "
                    "workload round takes, so the segment is all touched during warm-up)")
    ap.add_argument("--profile", action="store_true",
                    help="print a cProfile of the coordinator handling 64-op frames in-process")
    ap.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    ap.add_argument("--against", metavar="REV", help="run this benchmark (its other "
                    "arguments) in this checkout and in git revision REV, alternating, and "
                    "compare their figures (scripts/bench_guard.py)")
    ap.add_argument("--against-rounds", type=int, default=3, help="alternations (3)")
    add_json_argument(ap, "service")
    args = ap.parse_args()
    if args.against:
        try:
            ours, theirs = alternate(args.against, args.against_rounds, "bench_service.py",
                                     forwarded_args(sys.argv[1:], ("--against",
                                                    "--against-rounds", "--json")),
                                     service_figures)
        except GuardError as e:
            ap.exit(2, f"bench_service: {e}\n")
        write_results(args.json, {"benchmark": "service", **compare(
            args.against, ours, theirs, service_lower_is_better)})
        return 0
    signal.signal(signal.SIGTERM, _sigterm)
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    try:
        config = pool_config(args)
    except ConfigError as e:
        ap.error(str(e))
    t_begin = time.perf_counter()
    print(f"kvshm service benchmark: {command}")
    groups = ", ".join(type(g).__name__ for g in config.groups)
    print(f"pool: {config.num_blocks:,} blocks, groups [{groups}], "
          f"max_model_len {config.max_model_len}, hash {config.hash_algorithm}; "
          f"{os.cpu_count()} CPUs", flush=True)
    out: dict = {"benchmark": "service", "command": command, "config": config.to_dict(),
                 "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}
    problems: list[str] = []
    busy0, ours0, steal0 = _busy_cpu()

    # -- record the workloads --------------------------------------------------
    nclients = max(args.clients)
    t0 = time.perf_counter()
    recs = [record_workload(config, client_scheduler(args.requests, args.seed + k,
                                                     config.max_model_len))
            for k in range(nclients)]
    gc.collect()
    gc.freeze()
    r0 = recs[0]
    out["workload"] = {
        "requests_per_client": args.requests, "seed": args.seed,
        "ops_per_client": [r.num_ops for r in recs],
        "frames_per_client": [len(r.steps) for r in recs],
        "op_counts_client0": r0.counts,
        "hit_rate_client0": r0.hit_tokens / max(1, r0.prompt_tokens),
        "new_blocks_per_client": [r.new_blocks for r in recs],
        "recording_failed_allocs": sum(r.failed_allocs for r in recs),
        "recording_preemptions": sum(r.preemptions for r in recs),
        "record_seconds": time.perf_counter() - t0,
    }
    need = sum(r.new_blocks for r in recs) + 1
    print(f"workload: {args.requests} requests/client, {r0.num_ops:,} ops in {len(r0.steps)} "
          f"scheduler frames (client 0: {', '.join(f'{k} {v}' for k, v in sorted(r0.counts.items()))}), "
          f"hit rate {out['workload']['hit_rate_client0']:.1%}; {need:,} blocks taken by "
          f"{nclients} clients", flush=True)
    if need > config.num_blocks - 1:
        problems.append(f"--num-blocks {config.num_blocks} < {need} blocks the clients of "
                        "a run take: cached blocks may be evicted and lookups diverge")
    if out["workload"]["recording_failed_allocs"]:
        problems.append("the recording itself ran out of blocks (raise --num-blocks)")

    coord = workers = None
    try:
        # -- 3. the coordinator's cost in-process (the embedded core runs per round) -------
        bench_embedded(config, r0, 1)  # warm-up, not counted
        inproc, prof = bench_inprocess(config, r0, 64, args.rounds, args.profile)
        out["coordinator_inprocess"] = inproc
        if inproc["error_replies"]:
            problems.append(f"{inproc['error_replies']} error replies in the in-process run")

        # -- 1. single-op latency ----------------------------------------------------------
        coord = start_coordinator(config)
        coord_ps = psutil.Process(coord.proc.pid)
        lat = bench_latency(coord.socket, config, args.latency_calls,
                            min(1000, args.latency_calls))
        out["latency"] = lat

        # -- 2. throughput -------------------------------------------------------------------
        workers = Workers(recs, config)
        configs = [(n, b) for n in sorted(set(args.clients)) for b in args.batches]
        runs: dict[tuple[int, int], list[dict]] = {c: [] for c in configs}
        emb_rounds: list[dict] = []
        run_no = 0
        for rnd in range(args.rounds):
            # The embedded core on the same ops, in each round, so that the
            # ratio compares figures taken under the same machine load.
            emb_rounds.append(bench_embedded(config, r0, 1))
            print(f"  round {rnd + 1}/{args.rounds}: embedded core: "
                  f"{emb_rounds[-1]['ops_per_s']:>9,.0f} ops/s", flush=True)
            for n, b in configs:
                reset_pool(coord.socket)
                run_no += 1
                cpu0 = _cpu(coord_ps)
                results = workers.run(n, coord.socket, b, f"{run_no}")
                cpu = _cpu(coord_ps) - cpu0
                row = summarize_run(n, b, results, cpu)
                runs[(n, b)].append(row)
                print(f"  round {rnd + 1}/{args.rounds}: {n} client(s), batch {b:>2}: "
                      f"{row['ops_per_s']:>9,.0f} ops/s ({row['ops']:,} ops in "
                      f"{row['seconds']:.2f}s)", flush=True)
                for key in ("errors", "hit_mismatches", "failed_allocs"):
                    if row[key]:
                        problems.append(f"{n} clients batch {b}: {row[key]} {key}"
                                        + (f" (first: {row['first_error']})"
                                           if key == "errors" else ""))
        reset_pool(coord.socket)
        rows = []
        for c in configs:  # the median round (by ops/s) of each configuration
            rs = sorted(runs[c], key=lambda r: r["ops_per_s"])
            row = dict(rs[(len(rs) - 1) // 2])
            row["rounds_ops_per_s"] = [r["ops_per_s"] for r in runs[c]]
            rows.append(row)
        out["throughput"] = rows
        emb_ops = statistics.median(e["ops_per_s"] for e in emb_rounds)
        emb = {"ops": r0.num_ops, "rounds": args.rounds, "ops_per_s": emb_ops,
               "us_per_op": 1e6 / emb_ops,
               "rounds_ops_per_s": [e["ops_per_s"] for e in emb_rounds],
               "failed_allocs": sum(e["failed_allocs"] for e in emb_rounds)}
        out["embedded"] = emb
        # coordinator (64-op frames) / embedded, per round, then the median
        ratios = {}
        for n in sorted(set(args.clients)):
            if (n, 64) in runs:
                per = [r["ops_per_s"] / e["ops_per_s"] for r, e in zip(runs[(n, 64)], emb_rounds)]
                ratios[n] = statistics.median(per)
                out.setdefault("ratio_rounds", {})[str(n)] = per
        workers.stop()
        workers = None
        coord.stop()
        coord = None

        # -- 4. RSS ------------------------------------------------------------------------------
        # The coordinator maps the pool segment: its pages count in its RSS
        # once touched, and a block's are first touched when the free queue
        # first hands it out.  A pool about twice one round's blocks is
        # cycled through within the first rounds (before --rss-warmup), so
        # later growth means the coordinator's own memory grows.
        rss_blocks = args.rss_num_blocks or -(-(2 * r0.new_blocks + 2) // 1024) * 1024
        rss = bench_rss(config.replace(num_blocks=max(rss_blocks, r0.new_blocks + 2)),
                        r0, args.rss_ops, args.rss_every, args.rss_warmup, args.rss_batch)
        out["rss"] = rss
        if rss["errors"] or rss["failed_allocs"] or rss["hit_mismatches"]:
            problems.append(f"RSS run: {rss['errors']} errors, {rss['failed_allocs']} "
                            f"failed allocations, {rss['hit_mismatches']} hit mismatches")
    except KeyboardInterrupt:
        print("\ninterrupted: stopping clients and coordinators", file=sys.stderr)
        return 130
    except BaseException:
        tail = "".join(coord.stderr.splitlines(keepends=True)[-40:]) if coord else ""
        if tail:
            sys.stderr.write("coordinator stderr (tail):\n" + tail)
        raise
    finally:  # only reached with these set when something went wrong
        # A second Ctrl-C must not cut the clean-up short.
        held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT,
                                                                     signal.SIGTERM)}
        if workers is not None:
            workers.stop(graceful=False)
        if coord is not None:
            coord.stop()
        for sig, handler in held.items():
            signal.signal(sig, handler)

    # -- the table -----------------------------------------------------------------------
    out["loadavg_end"] = os.getloadavg()
    busy1, ours1, steal1 = _busy_cpu()
    wall = time.perf_counter() - t_begin
    other = max(0.0, (busy1 - busy0) - (ours1 - ours0))
    out["other_processes_cpu_s"] = other
    out["steal_cpu_s"] = steal1 - steal0
    out["ratio_batch64_vs_embedded"] = {str(n): v for n, v in ratios.items()}
    print()
    print(f"== {command}")
    print("single-op round trips (1 client, 1 op per frame)   p50 us   p99 us  mean us")
    for name, s in lat.items():
        print(f"  {name:46s} {s['p50_us']:8.1f} {s['p99_us']:8.1f} {s['mean_us']:8.1f}")
    print()
    print(f"throughput (median of {args.rounds} rounds)")
    print("            clients batch  ops/frame      ops/s  op p50  op p99  frame p50 "
          "frame p99  coord CPU/op  coord util  (us)")
    for r in rows:
        print(f"            {r['clients']:7d} {r['batch']:5d} {r['ops_per_frame']:10.1f} "
              f"{r['ops_per_s']:10,.0f} {r['op_p50_us']:7.1f} {r['op_p99_us']:7.1f} "
              f"{r['frame_p50_us']:10.1f} {r['frame_p99_us']:9.1f} "
              f"{r['coordinator_cpu_us_per_op']:13.2f} {r['coordinator_cpu_util']:10.0%}")
    print()
    print(f"embedded core (same ops, in-process, no socket): {emb_ops:,.0f} ops/s "
          f"({emb['us_per_op']:.2f} us/op, median of {emb['rounds']} rounds)")
    print(f"coordinator in-process, 64-op frames (decode+dispatch+encode, no socket): "
          f"{inproc['ops_per_s']:,.0f} ops/s ({inproc['us_per_op']:.2f} us/op); client codec "
          f"{inproc['client_encode_us_per_op']:.2f} us/op encode + "
          f"{inproc['client_decode_us_per_op']:.2f} us/op decode; "
          f"{inproc['request_bytes_per_op']:.0f} B/op out, "
          f"{inproc['reply_bytes_per_op']:.0f} B/op back")
    print("coordinator/embedded ops/s, 64-op frames (median of per-round ratios): " + ", ".join(
        f"{n} client(s) {v:.2f}" for n, v in ratios.items()))
    print(f"coordinator RSS over {rss['ops']:,} ops ({rss['rounds']} workload rounds, "
          f"{rss['batch']}-op frames, {rss['ops_per_s']:,.0f} ops/s, pool of "
          f"{rss['num_blocks']:,} blocks): first {_mib(rss['first_rss'])}, after "
          f"{rss['warm_at_ops']:,} ops {_mib(rss['warm_rss'])}, last {_mib(rss['last_rss'])}, "
          f"max {_mib(rss['max_rss'])}; change after warm-up {rss['change_after_warmup']:+.2%} "
          f"(anonymous {rss['anon_change_after_warmup']:+.2%}, shared "
          f"{rss['shared_change_after_warmup']:+.2%})")
    if prof:
        print("\ncProfile of the coordinator handling 64-op frames in-process (by tottime):")
        print(prof)

    # -- acceptance -------------------------------------------------------------------------
    acc = {f"p50_us_{k}": {"target": f"<= {P50_TARGET_US}", "value": lat[k]["p50_us"],
                           "pass": lat[k]["p50_us"] <= P50_TARGET_US}
           for k in ("get_block_ids", "stats", "allocate_slots", "free")}
    if 1 in ratios:
        acc["ratio_1_client_batch64"] = {"target": f">= {RATIO_TARGET}", "value": ratios[1],
                                         "pass": ratios[1] >= RATIO_TARGET}
    if ratios:
        best = max(ratios.values())
        acc["ratio_best_batch64"] = {"target": f">= {RATIO_TARGET}", "value": best,
                                     "pass": best >= RATIO_TARGET}
    warm_ok = rss["warm_at_ops"] >= args.rss_warmup and rss["ops"] > rss["warm_at_ops"]
    acc["rss_change_after_warmup"] = {
        "target": f"within +-{RSS_TOLERANCE:.0%}" + ("" if rss["ops"] >= 1_000_000
                                                     else " (over >= 1M ops)"),
        "value": rss["change_after_warmup"],
        "pass": warm_ok and abs(rss["change_after_warmup"]) <= RSS_TOLERANCE,
        "ops": rss["ops"]}
    out["acceptance"] = acc
    out["problems"] = problems
    out["seconds_total"] = time.perf_counter() - t_begin
    print()
    for k, a in acc.items():
        v = a["value"]
        shown = f"{v:+.2%}" if k.startswith("rss") else f"{v:.2f}"
        print(f"  {'PASS' if a['pass'] else 'MISS'}  {k} = {shown} (target {a['target']})")
    for msg in problems:
        print(f"  PROBLEM: {msg}")
    print(f"total {out['seconds_total']:.0f}s; meanwhile other processes used {other:.1f} "
          f"CPU-seconds ({other / wall:.0%} of one CPU) and the hypervisor stole "
          f"{out['steal_cpu_s']:.1f}")
    write_results(args.json, out)
    if problems:
        return 1
    if args.strict and not all(a["pass"] for a in acc.values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
