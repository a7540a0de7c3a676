#!/usr/bin/env python3
"""NUMA stress of one coordinator: per NUMA node, K pinned client processes
drive one coordinator with realistic scheduler traffic, for each K of a ramp.

    python scripts/numa_stress.py --clients-per-node 1 2 4 --duration 10 --out OUT

Nodes are the host's real NUMA nodes where it has several; otherwise
`--nodes` (default 2) virtual nodes carved from its CPUs, and it says so
(kvshm.workers.topology.plan, as `kvshm run` places its workers).  The
coordinator (`kvshm serve`) gets a CPU of its own where there are enough.

The clients are the CPU workers of `kvshm run` (kvshm.workers: the same
launcher, worker processes and scheduler, one `Client.batch` per step with
admission, allocation, Advance / CacheBlocks / Free bookkeeping, preemption,
over the synthetic chat workload with shared system prompts), run as load
generators (`EngineOptions.load_only`: the same ops, no model compute) so
that the coordinator is what is measured; `--compute` runs their model too
(K/V into the arena, decode attention from it).  All clients of a step
start together and run --duration seconds.

Per node and in total, at each step: ops/s, scheduler-step round trip
p50/p99/p99.9, single-op round trip (a probe per node: one GetStats a call,
--probe-rate calls/s) and the coordinator's event-loop lag (that round trip
above its idle baseline), fairness across nodes (Jain's index of per-node
ops/s), the coordinator's CPU per op and RSS, pool churn (blocks allocated
and evicted per second, from the pool segment's counters), and arena
traffic (K/V bytes of prefix-cache hits in blocks the client wrote itself
or another client wrote; bytes written), with where the clients' arena
pages are (numa_maps).  `--arena-policy bind|interleave|first-touch` places
the arena's pages before the clients touch them (libnuma), one ramp per
policy, on hosts with several NUMA nodes.  `--soak S` runs one step of S
seconds instead and reports the coordinator's RSS and the latency drift,
and RSS, pool counters and fairness window by window;
`--kill-coordinator-every K` SIGKILLs the coordinator every K seconds of
it, restarts it on its pool at once (the clients resume by themselves) and
reports each restart's stall and what is left at the end
(scripts/stress_soak.py).

Writes OUT/numa_stress.json, OUT/numa_stress.md and, with matplotlib, PNG
plots.  Exit status: 0, 1 when a client failed or the pool was not whole
after a step (or, in a soak, a coordinator did not come back or something
was left), 2 for bad arguments, 130 after Ctrl-C (what finished is
written; nothing is left running nor in /dev/shm).  docs/numa_stress.md
says how to read the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from dataclasses import dataclass

from kvshm.config import preset_config
from kvshm.core.errors import KvshmError
from kvshm.core.specs import KV_DTYPES, KVShape, PoolConfig
from kvshm.pool.lifecycle import pool_bytes
from kvshm.pool.numa import POLICIES, LibNuma, mapped_pages, place
from kvshm.pool.shm import check_shm_space
from kvshm.workload.spec import WorkloadSpec
from kvshm.workers.engine_types import EngineOptions, EngineStats
from kvshm.workers.launcher import Launch, LaunchOptions, RunResult
from kvshm.workers.topology import Node, Plan, allowed_cpus, discover, format_cpulist
from kvshm.workers.topology import plan as plan_nodes
from kvshm.workload.items import SyntheticSpec
from stress_measure import (
    Probes,
    Sampler,
    arena_pages,
    coordinator_window,
    jain,
    quantiles,
)
from stress_report import write_outputs
from stress_soak import Killer, Watch, end_line, left_behind, segments_left, soak_lines
from stress_soak import KILL_MARGIN_S, soak_record, window_period

BASELINE_S = 0.5     # idle probe window before each step


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="numa_stress.py",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients-per-node", type=int, nargs="+", default=[1, 2, 4], metavar="K",
                    help="the ramp: client processes per node at each step (1 2 4)")
    ap.add_argument("--duration", type=float, default=10.0,
                    help="seconds of traffic per step, all clients together (10)")
    ap.add_argument("--soak", type=float, metavar="S",
                    help="instead of the ramp: one step of S seconds at the largest K, "
                         "reporting RSS and latency drift")
    ap.add_argument("--kill-coordinator-every", type=float, metavar="K",
                    help="with --soak: SIGKILL the coordinator every K seconds and restart "
                         "it on its pool at once, reporting each restart's stall")
    ap.add_argument("--out", default="bench-results/numa-stress", help="output directory")
    ap.add_argument("--nodes", type=int,
                    help="nodes to drive from (default: every real NUMA node, or 2 virtual "
                         "nodes on a host with one)")
    ap.add_argument("--no-pin", action="store_true", help="pin neither clients nor coordinator")
    ap.add_argument("--arena-policy", nargs="+", choices=POLICIES, default=["first-touch"],
                    help="place the arena's pages (one ramp per policy; several NUMA "
                         "nodes only): bind, interleave or first-touch (default)")
    ap.add_argument("--arena-node", type=int,
                    help="the node of --arena-policy bind (default: the first node)")
    wl = ap.add_argument_group("workload (SyntheticSpec / EngineOptions)")
    wl.add_argument("--shared-prefix", type=float, default=0.8, metavar="F",
                    help="share of conversations opening with a shared system prompt (0.8)")
    wl.add_argument("--system-prompts", type=int, default=3, help="shared system prompts (3)")
    wl.add_argument("--system-len", type=int, nargs=2, default=(400, 1200),
                    metavar=("MIN", "MAX"), help="system prompt tokens, uniform (400 1200)")
    wl.add_argument("--user-median", type=float, default=120.0,
                    help="median user tokens per turn (lognormal; 120)")
    wl.add_argument("--output-median", type=float, default=80.0,
                    help="median output tokens per turn (lognormal; 80)")
    wl.add_argument("--mean-turns", type=float, default=2.5, help="turns per conversation (2.5)")
    wl.add_argument("--token-budget", type=int, default=512, help="tokens per step (512)")
    wl.add_argument("--max-running", type=int, default=16, help="running requests per client")
    wl.add_argument("--compute", action="store_true",
                    help="run the workers' model too: K/V written into the arena, decode "
                         "attention read from it (the pages are then really touched, which "
                         "--arena-policy needs to matter; the clients then cost far more "
                         "CPU than the coordinator)")
    wl.add_argument("--verify-hits", type=float, default=0.0, metavar="F",
                    help="with --compute: fraction of hit blocks re-read and checked (0)")
    wl.add_argument("--seed", type=int, default=0)
    pool = ap.add_argument_group("pool")
    pool.add_argument("--num-blocks", type=int, default=8192, help="pool size in blocks (8192)")
    pool.add_argument("--kv-shape", type=int, nargs=3, default=(1, 1, 8),
                      metavar=("LAYERS", "HEADS", "HEAD_SIZE"),
                      help="the arena's K/V shape per token (1 1 8: compute stays negligible)")
    pool.add_argument("--kv-dtype", choices=KV_DTYPES, default="float32")
    ap.add_argument("--probe-rate", type=float, default=100.0,
                    help="latency probe calls per second per node (100)")
    ap.add_argument("--plan-only", action="store_true",
                    help="print the placement and the arena policy, then exit")
    return ap.parse_args(argv)


@dataclass
class Setup:
    args: argparse.Namespace
    config: PoolConfig
    workload: WorkloadSpec
    engine: EngineOptions
    base: Plan                    # one entry per node
    real_of: list[int | None]     # the real NUMA node of each node
    multi_node: bool
    policies: list[str]           # what is applied, in order
    placement_note: str
    ramp: list[int]
    duration: float


def build(args: argparse.Namespace) -> Setup:
    """Check the arguments and make the setup; raises ValueError or
    KvshmError with a message for the user (exit 2)."""
    ramp = args.clients_per_node
    if any(k < 1 for k in ramp):
        raise ValueError(f"--clients-per-node values must be at least 1 (got {ramp})")
    if args.duration <= 0:
        raise ValueError(f"--duration must be positive (got {args.duration:g})")
    if args.soak is not None:
        if args.soak <= 0:
            raise ValueError(f"--soak must be positive (got {args.soak:g})")
        ramp = [max(ramp)]
    kill = args.kill_coordinator_every
    if kill is not None:
        if args.soak is None:
            raise ValueError("--kill-coordinator-every needs --soak (the kills happen "
                             "during the soak step)")
        if kill <= 0:
            raise ValueError(f"--kill-coordinator-every must be positive (got {kill:g})")
        if kill > args.soak - KILL_MARGIN_S:
            raise ValueError(f"--kill-coordinator-every must be shorter than the soak, by "
                             f"{KILL_MARGIN_S:g}s at least (its last second has no kill): "
                             f"got {kill:g}s for a {args.soak:g}s soak")
    if args.nodes is not None and args.nodes < 1:
        raise ValueError(f"--nodes must be at least 1 (got {args.nodes})")
    if args.probe_rate <= 0 or args.probe_rate > 10000:
        raise ValueError(f"--probe-rate must be in (0, 10000] (got {args.probe_rate:g})")
    if not 0.0 <= args.verify_hits <= 1.0:
        raise ValueError(f"--verify-hits must be within [0, 1] (got {args.verify_hits:g})")
    if args.verify_hits and not args.compute:
        raise ValueError("--verify-hits needs --compute (without it no K/V is written)")
    if args.token_budget < 1 or args.max_running < 1:
        raise ValueError("--token-budget and --max-running must be positive")
    layers, heads, head_size = args.kv_shape
    real = discover()
    multi = len(real) > 1
    n = args.nodes or (len(real) if multi else 2)
    if args.no_pin:
        cpus = tuple(allowed_cpus())
        base = Plan([Node(i, cpus, True) for i in range(n)], None,
                    ["pinning off: clients and coordinator float on every allowed CPU"])
    else:
        base = plan_nodes(n, real)
    real_of = [next((r.id for r in real if set(node.cpus) <= set(r.cpus)), None)
               for node in base.workers]
    workers = n * max(ramp)
    config = preset_config("tiny", num_blocks=args.num_blocks,
                           kv=KVShape(num_layers=layers, num_kv_heads=heads,
                                      head_size=head_size, dtype=args.kv_dtype),
                           max_num_seqs=max(1024, 2 * workers * args.max_running))
    check_shm_space(pool_bytes(config))
    spec = SyntheticSpec(seed=args.seed, num_system_prompts=args.system_prompts,
                         system_len=tuple(args.system_len), share_system=args.shared_prefix,
                         user_median=args.user_median, output_median=args.output_median,
                         mean_turns=args.mean_turns).fit(config.max_model_len).validate()
    engine = EngineOptions(token_budget=args.token_budget, max_running=args.max_running,
                           verify_hits=args.verify_hits, check_decode=0.0,
                           load_only=not args.compute, seed=args.seed)
    policies, note = placement(args, multi, real, real_of)
    return Setup(args, config, WorkloadSpec(synthetic=spec), engine, base, real_of, multi,
                 policies, note, ramp, args.soak or args.duration)


def placement(args, multi: bool, real: list[Node], real_of) -> tuple[list[str], str]:
    """The page policies to run and a line saying what they do here."""
    asked = list(dict.fromkeys(args.arena_policy))
    if not multi:
        if asked != ["first-touch"] or args.arena_node is not None:
            return ["first-touch"], (
                f"arena policy {' '.join(asked)}: this host has one NUMA node (node "
                f"{real[0].id}), so there is nothing to place: every page is on it; the "
                "arena is left to first touch")
        return ["first-touch"], "arena pages: first touch (one NUMA node: all local)"
    ids = [r.id for r in real]
    if args.arena_node is not None and args.arena_node not in ids:
        raise ValueError(f"--arena-node {args.arena_node} is not a NUMA node of this host "
                         f"(nodes {ids})")
    if set(asked) - {"first-touch"}:
        LibNuma()   # PlacementError naming libnuma when it is missing
    return asked, f"arena policies: {', '.join(asked)} (libnuma mbind before first touch)"


def policy_nodes(setup: Setup, policy: str) -> list[int]:
    if policy == "bind":
        first = next((r for r in setup.real_of if r is not None), 0)
        return [setup.args.arena_node if setup.args.arena_node is not None else first]
    if policy == "interleave":
        return sorted({r for r in setup.real_of if r is not None})
    return []


def header(setup: Setup) -> str:
    cfg, a = setup.config, setup.args
    kv = cfg.kv
    virtual = any(n.virtual for n in setup.base.workers)
    lines = [
        f"numa_stress: {len(setup.base.workers)} {'virtual ' if virtual else ''}nodes x "
        f"clients per node {' '.join(map(str, setup.ramp))}, "
        + (f"one soak step of {a.soak:g}s" if a.soak else f"{a.duration:g}s per step")
        + (f", the coordinator SIGKILLed every {a.kill_coordinator_every:g}s"
           if a.kill_coordinator_every else "")
        + f"; pool of {cfg.num_blocks:,} blocks, K/V {kv.num_layers}x{kv.num_kv_heads}x"
          f"{kv.head_size} {kv.dtype} ({cfg.kv_block_bytes:,} bytes a block)",
        "placement:",
        *(f"  node {n.id} ({'virtual' if n.virtual else 'NUMA'} node): CPUs "
          f"{format_cpulist(n.cpus)}, each of its clients pinned to all of them"
          for n in setup.base.workers),
        "  coordinator: " + (f"CPUs {format_cpulist(setup.base.coordinator_cpus)}"
                             if setup.base.coordinator_cpus else "floating (any allowed CPU)"),
        *(f"    - {note}" for note in setup.base.notes),
        setup.placement_note]
    return "\n".join(lines)


def step_plan(setup: Setup, k: int) -> Plan:
    base = setup.base
    return Plan([n for n in base.workers for _ in range(k)], base.coordinator_cpus,
                [*base.notes, f"{k} client(s) per node, each pinned to the node's CPUs"])


# -- running ---------------------------------------------------------------------------------------
class Stopper:
    """SIGINT / SIGTERM set `stopped` while no Launch has them (a Launch
    installs its own for its run; `listen()` takes them back after)."""

    def __init__(self) -> None:
        self.stopped = asyncio.Event()
        self.loop = asyncio.get_running_loop()

    def listen(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.loop.add_signal_handler(sig, self.stopped.set)

    def close(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.loop.remove_signal_handler(sig)

    async def sleep(self, seconds: float) -> bool:
        """Sleep; True if stopped meanwhile."""
        try:
            await asyncio.wait_for(self.stopped.wait(), seconds)
        except asyncio.TimeoutError:
            pass
        return self.stopped.is_set()


async def stress(setup: Setup) -> int:
    stopper = Stopper()
    stopper.listen()
    doc = {"steps": [], "problems": []}
    try:
        for policy in setup.policies:
            try:
                await run_policy(setup, policy, stopper, doc)
            except (RuntimeError, KvshmError, OSError) as e:   # e.g. no coordinator
                doc["problems"].append(f"{policy}: {type(e).__name__}: {e}")
                break
            if stopper.stopped.is_set():
                break
    finally:
        stopper.close()
        doc["interrupted"] = stopper.stopped.is_set()
        for line in write_outputs(setup, doc):
            print(line, flush=True)
    if doc["interrupted"]:
        return 130
    for p in doc["problems"]:
        print(f"problem: {p}", file=sys.stderr)
    return 1 if doc["problems"] else 0


async def run_policy(setup: Setup, policy: str, stopper: Stopper, doc: dict) -> None:
    from kvshm.service.process import CoordinatorProcess
    from kvshm.service.sync_client import connect_sync
    from kvshm.workers.topology import pin
    cfg = setup.config
    soak = None
    hashing = {"hash_algorithm": cfg.hash_algorithm, "hash_seed": cfg.hash_seed}
    # From this thread, which outlives it: PDEATHSIG follows the starting thread.
    # With several nodes, the arena's pages are placed below (or left to first
    # touch), so the coordinator must not allocate them at creation.
    coord = CoordinatorProcess(cfg, new_session=True, with_parent=True,
                               extra_args=("--no-reserve-arena",) if setup.multi_node else ())
    admin = arena = sampler = probes = None
    try:
        coord.wait_ready()
        if setup.base.coordinator_cpus and not setup.args.no_pin:
            pin(setup.base.coordinator_cpus, coord.proc.pid)
        admin = connect_sync(str(coord.socket), admin=True, resume=False, **hashing)
        arena = admin.attach_arena()
        arena_path = f"/dev/shm/{arena.name}"
        if setup.multi_node and policy != "first-touch":
            place(arena.buffer, policy, policy_nodes(setup, policy))
        shown = mapped_pages("self", arena_path)
        doc.setdefault("coordinator", {"pid": coord.proc.pid,
                                       "cpus": list(setup.base.coordinator_cpus or []),
                                       "pinned": bool(setup.base.coordinator_cpus)})
        doc.setdefault("placements", []).append(
            {"policy": policy, "nodes": policy_nodes(setup, policy) if setup.multi_node else [],
             "numa_maps_policies": shown.policies if shown else None})
        sampler = Sampler(coord.proc.pid, coord.name)
        sampler.start()
        probes = Probes(str(coord.socket), setup.base.workers, rate=setup.args.probe_rate,
                        seconds=len(setup.ramp) * (setup.duration + 120) + 60,
                        pin=not setup.args.no_pin,
                        resume=bool(setup.args.kill_coordinator_every), **hashing)
        await probes.start()
        for i, k in enumerate(setup.ramp):
            if not admin.reset_prefix_cache():   # each step starts from a cold cache
                doc["problems"].append(f"{policy}, {k} per node: the prefix cache could not "
                                       "be reset (blocks still in use)")
            base_t1 = time.time() + BASELINE_S
            if await stopper.sleep(BASELINE_S):
                return
            print(f"step {i + 1}/{len(setup.ramp)}: {policy}, {k} client(s) per node x "
                  f"{len(setup.base.workers)} nodes, {setup.duration:g}s ...", flush=True)
            step = await run_step(setup, policy, k, coord, sampler, probes,
                                  arena_path, (base_t1 - BASELINE_S, base_t1))
            stopper.listen()
            if step is None:   # interrupted
                stopper.stopped.set()
                return
            doc["steps"].append(step)
            doc["problems"] += step.pop("problems")
            print(step_line(step), flush=True)
            if "soak" in step:
                soak = step["soak"]
                for line in soak_lines(soak):
                    print(line, flush=True)
    finally:
        if probes is not None:
            await probes.stop()
        if sampler is not None:
            await sampler.stop()
        if arena is not None:
            arena.close()
        if admin is not None:
            admin.close()
        # The script made the pool: nothing of it stays, however its coordinator ended.
        code = await asyncio.to_thread(coord.stop, owns_pool=True)
        if code != 0:
            doc["problems"].append(f"the coordinator exited with {code}: {coord.stderr[-300:]}")
        if soak is not None:
            end = soak["end"]
            left = left_behind(coord.name)
            end["segments_left"] += left["segments_left"]
            end["processes_left"] = left["processes_left"]
            doc["problems"] += [f"soak: left behind: {x}" for x in end["segments_left"]
                                + end["processes_left"]]
            print(end_line(end), flush=True)


async def run_step(setup: Setup, policy: str, k: int, coord, sampler: Sampler,
                   probes: Probes, arena_path: str,
                   baseline: tuple[float, float]) -> dict | None:
    """One step of the ramp: K clients per node started by the launcher of
    `kvshm run` on the running coordinator `coord` (all together, for
    --duration seconds, then whatever still runs is freed); in a soak,
    watched over time and with --kill-coordinator-every its coordinator
    killed and restarted.  Its record, or None if it was interrupted."""
    cfg = setup.config
    opts = LaunchOptions(
        num_workers=len(setup.base.workers) * k, duration=setup.duration, grace=0.0,
        connect=str(coord.socket), workload=setup.workload, engine=setup.engine,
        pin=not setup.args.no_pin, live=False, start_together=True,
        hash_algorithm=cfg.hash_algorithm, hash_seed=cfg.hash_seed)
    launch = Launch(opts, step_plan(setup, k), "shared")
    pages: dict = {}
    watcher = asyncio.ensure_future(_read_pages_late(setup, launch, k, arena_path, pages))
    watch = killer = None
    if setup.args.soak:
        watch = Watch(launch, coord.name, window_period(setup.duration))
        watch.start()
        if setup.args.kill_coordinator_every:
            cpus = None if setup.args.no_pin else setup.base.coordinator_cpus
            killer = Killer(coord, setup.args.kill_coordinator_every, sampler, cpus,
                            on_failure=lambda: _stop_clients(launch))
            killer.start(launch, setup.duration)
    try:
        res = await launch.run()
    finally:
        watcher.cancel()
        if killer is not None:
            await killer.stop()
        if watch is not None:
            await watch.stop()
    if res.interrupted:
        return None
    step = step_record(setup, policy, k, res, launch.started_at, sampler, probes, baseline,
                       pages, (watch, killer))
    if "soak" in step and launch.turns is not None:   # the launcher unlinks its turn board
        step["soak"]["end"]["segments_left"] += segments_left([launch.turns.name])
    return step


def _stop_clients(launch: Launch) -> None:
    """A coordinator did not come back: stop the clients now rather than
    after their reconnect timeout."""
    for proc in launch.procs:
        if proc.returncode is None:
            proc.terminate()


async def _read_pages_late(setup: Setup, launch: Launch, k: int, path: str,
                           pages: dict) -> None:
    """Near the end of the step, where each node's clients have their arena
    pages (numa_maps)."""
    while launch.started_at is None:
        await asyncio.sleep(0.05)
    await asyncio.sleep(max(0.0, launch.started_at + 0.85 * setup.duration - time.time()))
    for j, real in enumerate(setup.real_of):
        pids = [w.pid for w in launch.results[j * k:(j + 1) * k] if w.pid]
        pages[j] = arena_pages(pids, path, real)


def step_record(setup: Setup, policy: str, k: int, res: RunResult, t0: float | None,
                sampler: Sampler, probes: Probes, baseline, pages: dict, soak=None) -> dict:
    """The figures of one step, per node and in total (`soak`: the soak's
    Watch and Killer, or None)."""
    cfg = setup.config
    per_token = cfg.kv_block_bytes / cfg.kv_block_size
    problems = [f"{policy}, {k} per node: client {w.index} {w.status}: {w.message}"
                for w in res.workers if w.status != "done"]
    whole = cfg.num_blocks - 1 - cfg.num_sink_blocks   # every block free but null (and sinks)
    for pool in res.pools:
        if (not pool["check_clean"] or pool.get("num_requests")
                or pool.get("num_free_blocks") != whole):
            problems.append(f"{policy}, {k} per node: the pool after the step is not whole: "
                            f"{pool.get('num_requests')} requests left, "
                            f"{pool.get('num_free_blocks')} of {whole} blocks free; "
                            + "; ".join(pool["problems"]))
    t0 = t0 or time.time()
    secs = max([w.seconds for w in res.workers] + [1e-9])
    t1 = t0 + secs
    idle = [x for per_node in probes.window(*baseline) for x in per_node]
    idle_p50 = quantiles(idle)["p50"]
    op_rtts = probes.window(t0, t1)
    rows = []
    for j, node in enumerate(setup.base.workers):
        ws = res.workers[j * k:(j + 1) * k]
        st = EngineStats.total(w.stats for w in ws)
        ops_s = sum(w.stats.ops / w.seconds for w in ws if w.seconds)
        lat, op = quantiles(st.batch_us), quantiles(op_rtts[j])
        rows.append({
            "policy": policy, "node": node.id, "virtual": node.virtual,
            "real_node": setup.real_of[j], "cpus": list(node.cpus), "clients": k,
            "ops_per_s": round(ops_s, 1),
            "p50_us": lat["p50"], "p99_us": lat["p99"], "p999_us": lat["p999"],
            "steps_per_s": round(sum(w.stats.steps / w.seconds for w in ws if w.seconds), 1),
            "ops_per_step": round(st.ops / st.steps, 2) if st.steps else None,
            "op_p50_us": op["p50"], "op_p99_us": op["p99"], "op_p999_us": op["p999"],
            "probe_calls": len(op_rtts[j]),
            "requests_finished": st.finished, "preemptions": st.preemptions,
            "prompt_tokens": st.prompt_tokens, "hit_tokens": st.hit_tokens,
            "cross_hit_tokens": st.cross_hit_tokens,
            "arena_read_own_bytes_per_s": round((st.hit_tokens - st.cross_hit_tokens)
                                                * per_token / secs),
            "arena_read_other_bytes_per_s": round(st.cross_hit_tokens * per_token / secs),
            "arena_written_bytes_per_s": round(st.computed_tokens * per_token / secs),
            "arena_pages": pages.get(j),
            "_batch_us": st.batch_us,            # for the plots; not written
        })
    total_ops = sum(r["ops_per_s"] for r in rows)
    probe_calls = sum(len(x) for x in op_rtts)
    lat_all = quantiles([x for r in rows for x in r["_batch_us"]])
    op_all = quantiles([x for per_node in op_rtts for x in per_node])
    coordinator = coordinator_window(sampler, t0, t1,
                                     sum(w.stats.ops for w in res.workers) + probe_calls)
    step = {
        "policy": policy, "clients_per_node": k, "clients": len(res.workers),
        "seconds": round(secs, 3), "ops_per_s": round(total_ops, 1),
        "p50_us": lat_all["p50"], "p99_us": lat_all["p99"], "p999_us": lat_all["p999"],
        "op_p50_us": op_all["p50"], "op_p99_us": op_all["p99"], "op_p999_us": op_all["p999"],
        "idle_op_p50_us": idle_p50,
        "loop_lag_us": {q: (round(v - idle_p50, 1) if v is not None and idle_p50 is not None
                            else None) for q, v in op_all.items()},
        "fairness": jain(r["ops_per_s"] for r in rows),
        "fairness_clients": jain(w.stats.ops / w.seconds for w in res.workers if w.seconds),
        "coordinator": coordinator,
        "arena_bytes_per_token": per_token,
        "rows": rows, "problems": problems,
    }
    if soak is not None and soak[0] is not None:
        nodes = [list(range(j * k, (j + 1) * k)) for j in range(len(setup.base.workers))]
        step["soak"], more = soak_record(res, probes, sampler, *soak, nodes, t0, t1, whole)
        problems += more
    return step


def step_line(step: dict) -> str:
    c = step["coordinator"]
    nodes = ", ".join(f"node {r['node']} {r['ops_per_s']:,.0f} ops/s p99 {r['p99_us']:,} us"
                      for r in step["rows"])
    return (f"  {step['ops_per_s']:,.0f} ops/s ({nodes}); fairness {step['fairness']:.3f}; "
            f"coordinator {c['cpu_us_per_op']} us CPU/op ({c['ops_per_frame']} ops a frame, "
            f"{c['cpu_us_per_frame']} us a frame), {c['cpu_util']:.0%} of a CPU; "
            f"loop lag p99 {step['loop_lag_us']['p99']} us")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        setup = build(args)
    except (ValueError, KvshmError) as e:
        print(f"numa_stress.py: {e}", file=sys.stderr)
        return 2
    print(header(setup), flush=True)
    if args.plan_only:
        return 0
    from kvshm.service.loop import run_async
    try:
        return run_async(stress(setup))
    except KeyboardInterrupt:   # before the loop could take the signal over
        return 130


if __name__ == "__main__":
    sys.exit(main())
