"""The load of scripts/bench_service.py (a module it imports, not a benchmark
of its own): the workload recorded once per client as protocol ops, the
frames it is replayed in, its replay in this process (on an embedded core,
and through the coordinator's op executor and codec without a socket), and
the client processes that replay it against a coordinator and report their
timings.

The recording: kvshm.workload's compute-free scheduler (seed + client
index, so clients share no prefix) drives an embedded KVCacheManager
through the op executor and every protocol op is kept, grouped by the
scheduler's frames (one a step, and one per preemption), with the hit
tokens of every lookup and admission, so that a replay can check its hits.
(Until 2026-12-04 the scheduler ran one op a call, and its stream was
another: figures from before then are not comparable.)
"""

from __future__ import annotations

import collections
import cProfile
import gc
import io
import multiprocessing as mp
import os
import pstats
import signal
import statistics
import time
import traceback
from array import array
from dataclasses import dataclass, field

import msgspec

from kvshm.core.metrics import percentile
from kvshm.core.specs import PoolConfig
from kvshm.ops import protocol as p
from kvshm.ops.executor import OpExecutor
from kvshm.ops.protocol import encode_frame
from kvshm.pool.kv_cache_manager import KVCacheManager
from kvshm.service.process import CoordinatorProcess
from kvshm.service.sync_client import connect_sync
from kvshm.workload.scheduler import EmbeddedBackend, Scheduler, drive, system_workload


# -- the recording ---------------------------------------------------------------
@dataclass
class Recording:
    steps: list[list]             # protocol structs, one list per scheduler frame
    hits: list[int]               # num_computed_tokens of each lookup or admission, in op order
    num_ops: int = 0
    new_blocks: int = 0           # blocks taken from the free queue
    failed_allocs: int = 0        # allocations and admissions refused
    preemptions: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    counts: dict = field(default_factory=dict)


# The replies that say whether an allocation got its blocks, and the ops
# whose replies carry hit tokens.
ALLOCATING = (p.Allocated, p.Admitted)
LOOKUPS = (p.GetComputedBlocks, p.Admit)


class RecordingBackend(EmbeddedBackend):
    """kvshm.workload's embedded backend that also records every frame of
    protocol ops it runs, with the recording's counters."""

    def __init__(self, mgr: KVCacheManager) -> None:
        super().__init__(mgr)
        self.rec = Recording([], [])

    def run_frame(self, ops: list) -> list:
        replies = super().run_frame(ops)
        rec = self.rec
        rec.steps.append(list(ops))
        rec.num_ops += len(ops)
        for reply in replies:
            cls = reply.__class__
            if cls is p.ComputedBlocks or cls is p.Admitted:
                rec.hits.append(reply.num_computed_tokens)
            if cls in ALLOCATING:
                if reply.new_block_ids is None:
                    rec.failed_allocs += 1
                else:
                    rec.new_blocks += sum(len(g) for g in reply.new_block_ids)
        return replies


def record_workload(config: PoolConfig, scheduler: Scheduler) -> Recording:
    """Run kvshm.workload's compute-free scheduler on an embedded manager
    through a RecordingBackend."""
    with KVCacheManager(config) as mgr:
        backend = RecordingBackend(mgr)
        res = drive(backend, scheduler)
    rec = backend.rec
    rec.preemptions, rec.prompt_tokens, rec.hit_tokens = (
        res.preemptions, res.prompt_tokens, res.hit_tokens)
    counts: collections.Counter = collections.Counter()
    for step in rec.steps:
        for op in step:
            counts[type(op).__name__] += 1
    rec.counts = dict(counts)
    return rec


def client_scheduler(requests: int, seed: int, max_len: int) -> Scheduler:
    """The compute-free scheduler of one benchmark client: `requests`
    system-prompt requests of at most `max_len` tokens drawn from `seed`."""
    return Scheduler(system_workload(requests, seed, max_len))


def build_frames(steps: list[list], hits: list[int], batch: int, prefix: str = ""):
    """Frames of at most `batch` ops, never spanning two recorded frames
    (batch 1: bare ops, else Batch), with request ids prefixed; plus, per
    frame, the (index, expected hit tokens) of its lookups and admissions,
    and its op count."""
    replace = msgspec.structs.replace
    frames, checks, sizes = [], [], []
    it = iter(hits)
    for step in steps:
        ops = [replace(op, req=prefix + op.req) for op in step] if prefix else step
        for s in range(0, len(ops), batch):
            chunk = ops[s:s + batch]
            exp = [(j, next(it)) for j, op in enumerate(chunk)
                   if op.__class__ in LOOKUPS]
            frames.append(chunk[0] if batch == 1 else p.Batch(chunk))
            checks.append(exp or None)
            sizes.append(len(chunk))
    return frames, checks, sizes


# -- the recording replayed in this process (no socket) ------------------------------
class Embedded:
    """Executes recorded protocol structs with the coordinator's op executor
    on a KVCacheManager (no socket, no codec)."""

    def __init__(self, mgr: KVCacheManager) -> None:
        self.executor = OpExecutor(mgr)
        self.owner = self.executor.lifecycle.open(1)
        self.failed = 0

    def run(self, steps: list[list]) -> None:
        execute, owner = self.executor.execute, self.owner
        for step in steps:
            for op in step:
                r = execute(owner, op)
                if r.__class__ in ALLOCATING and r.new_block_ids is None:
                    self.failed += 1


def bench_embedded(config: PoolConfig, rec: Recording, runs: int) -> dict:
    times, failed = [], 0
    for _ in range(runs):
        with KVCacheManager(config) as mgr:
            e = Embedded(mgr)
            t0 = time.perf_counter()
            e.run(rec.steps)
            times.append(time.perf_counter() - t0)
            failed += e.failed
            leftover = len(mgr.table)
        if leftover:
            raise RuntimeError(f"embedded run left {leftover} requests in the table")
    med = statistics.median(times)
    return {"ops": rec.num_ops, "runs": runs, "seconds": times, "ops_per_s": rec.num_ops / med,
            "us_per_op": med / rec.num_ops * 1e6, "failed_allocs": failed}


def bench_inprocess(config: PoolConfig, rec: Recording, batch: int, runs: int,
                    profile: bool) -> tuple[dict, str | None]:
    """The coordinator's own cost of the recorded frames: decode each body,
    run it with the op executor, encode the reply frame, in this process,
    no socket; and the client's codec cost (encode frames, decode replies)."""
    mgr = KVCacheManager(config, name=f"kvshm-bench-{os.getpid()}-{os.urandom(3).hex()}")
    try:
        executor = OpExecutor(mgr)
        owner = executor.lifecycle.open(1, admin=True)
        decode = msgspec.msgpack.Decoder(p.Message).decode
        enc = msgspec.msgpack.Encoder()
        execute = executor.execute
        times, profile_text = [], None
        for r in range(runs + (1 if profile else 0)):
            frames, _, _ = build_frames(rec.steps, rec.hits, batch, f"ip{r}-")
            bodies = [enc.encode(f) for f in frames]
            if not mgr.reset_prefix_cache():
                raise RuntimeError("reset_prefix_cache failed between in-process runs")
            prof = cProfile.Profile() if r == runs else None
            replies = []
            gc.collect()
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            for body in bodies:
                replies.append(encode_frame(execute(owner, decode(body))))
            if prof is not None:
                prof.disable()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
                profile_text = out.getvalue()
            else:
                times.append(time.perf_counter() - t0)
        # The client's side of the same frames: encode each, decode each reply.
        dec = msgspec.msgpack.Decoder(p.ServerMessage)
        t0 = time.perf_counter()
        for f in frames:
            encode_frame(f)
        t_enc = time.perf_counter() - t0
        t0 = time.perf_counter()
        decoded = [dec.decode(memoryview(b)[4:]) for b in replies]
        t_dec = time.perf_counter() - t0
        errors = sum(1 for m in decoded for r in (m.results if m.__class__ is p.BatchReply
                                                  else (m,)) if r.__class__ is p.Error)
        med = statistics.median(times)
        n = rec.num_ops
        return ({"batch": batch, "ops": n, "runs": runs, "seconds": times,
                 "ops_per_s": n / med, "us_per_op": med / n * 1e6,
                 "client_encode_us_per_op": t_enc / n * 1e6,
                 "client_decode_us_per_op": t_dec / n * 1e6,
                 "reply_bytes_per_op": sum(map(len, replies)) / n,
                 "request_bytes_per_op": sum(map(len, bodies)) / n,
                 "error_replies": errors}, profile_text)
    finally:
        executor.lifecycle.close(owner)
        mgr.close()


# -- client processes --------------------------------------------------------------
def worker_main(conn, index: int, blob: bytes, hits: list[int], hash_algorithm: str,
                 hash_seed: str) -> None:
    """A client process: for each ("run", socket, batch, prefix) command,
    connect, say ready, wait for "go", replay, send the figures back."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    try:
        from kvshm.service.loop import run_async

        steps = msgspec.msgpack.Decoder(list[list[p.Op]]).decode(blob)
        del blob
        gc.collect()
        gc.freeze()
        while True:
            try:
                cmd = conn.recv()
            except EOFError:
                return
            if cmd[0] != "run":
                return
            _, path, batch, prefix = cmd
            frames, checks, sizes = build_frames(steps, hits, batch, prefix)
            res = run_async(client_run(conn, path, frames, checks, sizes,
                                        hash_algorithm, hash_seed))
            del frames, checks
            conn.send(("result", res))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return
    except BaseException:
        try:
            conn.send(("error", f"client {index}: {traceback.format_exc()}"))
        except Exception:  # noqa: BLE001
            pass


async def client_run(conn, path, frames, checks, sizes, hash_algorithm, hash_seed) -> dict:
    from kvshm.service.client import connect

    client = await connect(path, hash_algorithm=hash_algorithm, hash_seed=hash_seed)
    try:
        conn.send(("ready",))
        if conn.recv() != "go":
            return {}
        send = client.request
        perf = time.perf_counter_ns
        BatchReply, Error = p.BatchReply, p.Error
        lat = array("q")
        failed = errors = mismatches = 0
        first_error = None
        start = perf()
        for frame, check in zip(frames, checks):
            t = perf()
            reply = await send(frame, None)
            lat.append(perf() - t)
            results = reply.results if reply.__class__ is BatchReply else (reply,)
            for r in results:
                c = r.__class__
                if c in ALLOCATING:
                    if r.new_block_ids is None:
                        failed += 1
                elif c is Error:
                    errors += 1
                    if first_error is None:
                        first_error = f"{r.code}: {r.message}"
            if check:
                for j, want in check:
                    if j < len(results) and getattr(results[j], "num_computed_tokens",
                                                    None) != want:
                        mismatches += 1
        end = perf()
        return {"start": start, "end": end, "lat": lat, "sizes": array("i", sizes),
                "failed_allocs": failed, "errors": errors, "first_error": first_error,
                "hit_mismatches": mismatches}
    finally:
        await client.close()


class Workers:
    """Persistent client processes (spawned once, reused by every run)."""

    def __init__(self, recs: list[Recording], config: PoolConfig) -> None:
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        try:
            for k, rec in enumerate(recs):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=worker_main, name=f"bench-client-{k}", daemon=True,
                    args=(child, k, msgspec.msgpack.encode(rec.steps), rec.hits,
                          config.hash_algorithm, config.hash_seed))
                # Started with SIGINT blocked (inherited: the client never sees
                # Ctrl-C; this process stops it); here it is delivered after.
                old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
                try:
                    proc.start()
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
        except BaseException:
            self.stop(graceful=False)
            raise

    def _recv(self, k: int, timeout: float = 300.0):
        conn, proc = self.conns[k], self.procs[k]
        deadline = time.monotonic() + timeout
        while not conn.poll(0.2):
            if not proc.is_alive():
                raise RuntimeError(f"client process {k} died (exit code {proc.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"client process {k}: no answer in {timeout:.0f}s")
        msg = conn.recv()
        if msg[0] == "error":
            raise RuntimeError(msg[1])
        return msg

    def run(self, n: int, path, batch: int, tag: str) -> list[dict]:
        for k in range(n):
            self.conns[k].send(("run", str(path), batch, f"c{k}-{tag}-"))
        for k in range(n):
            if self._recv(k)[0] != "ready":
                raise RuntimeError(f"client {k}: unexpected message")
        for k in range(n):
            self.conns[k].send("go")
        return [self._recv(k)[1] for k in range(n)]

    def stop(self, graceful: bool = True) -> None:
        """Graceful: ask each client to exit, then wait; else terminate."""
        if graceful:
            for conn in self.conns:
                try:
                    conn.send(("stop",))
                except (OSError, ValueError):
                    pass
        for proc in self.procs:
            if graceful:
                proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []


def weighted_pct(pairs: list[tuple[float, int]], q: float) -> float:
    """Percentile of values each counted `weight` times."""
    pairs.sort()
    total = sum(w for _, w in pairs)
    target = q * total
    acc = 0
    for v, w in pairs:
        acc += w
        if acc >= target:
            return v
    return pairs[-1][0]


def summarize_run(n: int, batch: int, results: list[dict], cpu_s: float) -> dict:
    start = min(r["start"] for r in results)
    end = max(r["end"] for r in results)
    wall = (end - start) / 1e9
    ops = sum(sum(r["sizes"]) for r in results)
    frames = sum(len(r["lat"]) for r in results)
    per_frame = sorted(x for r in results for x in r["lat"])
    per_op = [(lat / s, s) for r in results for lat, s in zip(r["lat"], r["sizes"])]
    return {
        "clients": n, "batch": batch, "ops": ops, "frames": frames,
        "ops_per_frame": ops / frames, "seconds": wall, "ops_per_s": ops / wall,
        "per_client_ops_per_s": [sum(r["sizes"]) / ((r["end"] - r["start"]) / 1e9)
                                 for r in results],
        "op_p50_us": weighted_pct(list(per_op), 0.50) / 1e3,
        "op_p99_us": weighted_pct(per_op, 0.99) / 1e3,
        "frame_p50_us": percentile(per_frame, 50) / 1e3,
        "frame_p99_us": percentile(per_frame, 99) / 1e3,
        "coordinator_cpu_us_per_op": cpu_s / ops * 1e6,
        "coordinator_cpu_util": cpu_s / wall,
        "failed_allocs": sum(r["failed_allocs"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "first_error": next((r["first_error"] for r in results if r["first_error"]), None),
        "hit_mismatches": sum(r["hit_mismatches"] for r in results),
    }


# -- coordinators ------------------------------------------------------------------
def start_coordinator(config: PoolConfig, extra_args: tuple = ()) -> CoordinatorProcess:
    """A `kvshm serve` child (with `extra_args`), ready (CoordinatorProcess.stop:
    SIGTERM, then SIGKILL after 10 s with its segments removed)."""
    coord = CoordinatorProcess(config, extra_args=extra_args, new_session=True,
                               with_parent=True)
    try:
        coord.wait_ready()
    except BaseException:
        coord.stop()
        raise
    return coord


def admin_connection(path):
    """A blocking admin session (set-up between runs, and the raw floor),
    on whatever hashing the pool has."""
    return connect_sync(path, admin=True, hash_algorithm=None)


def reset_pool(path) -> None:
    """Between runs: nothing may be left, and the prefix cache is emptied so
    the next run's lookups hit exactly as recorded."""
    with admin_connection(path) as c:
        st = c.stats()
        if st.num_requests:
            raise RuntimeError(f"{st.num_requests} requests left in the pool after a run")
        if not c.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache refused")


# -- A/B benchmarks (bench_events.py, bench_metrics.py) -----------------------------
def add_ab_arguments(ap) -> None:
    """The workload and round flags of an A/B benchmark."""
    ap.add_argument("--num-blocks", type=int, default=65536)
    ap.add_argument("--requests", type=int, default=200, help="workload requests per client")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--rounds", type=int, default=3)


def ab_workload(args) -> tuple[PoolConfig, list[Recording]]:
    """The pool config and each client's recorded workload of an A/B run."""
    from kvshm.core.specs import FullSpec
    config = PoolConfig(num_blocks=args.num_blocks, hash_block_size=16, max_model_len=4096,
                        groups=(FullSpec(16),), max_num_seqs=1024)
    recs = [record_workload(config, client_scheduler(args.requests, args.seed + k,
                                                     config.max_model_len))
            for k in range(max(args.clients))]
    print(f"workload: {args.requests} requests/client, {recs[0].num_ops:,} ops a client",
          flush=True)
    return config, recs


def ab_rounds(args, workers: "Workers", sockets: dict, what: str, before=None) -> dict:
    """Replay the workload against `sockets` (mode -> coordinator socket;
    two modes, "off" and "on"), per round and (clients, batch), the order of
    the modes alternating per round; `before(mode)` runs before each run.
    Returns {(mode, clients, batch): [ops/s per round]}."""
    configs = [(n, b) for n in sorted(set(args.clients)) for b in args.batches]
    runs: dict = {(mode, n, b): [] for mode in ("off", "on") for n, b in configs}
    for rnd in range(args.rounds):
        order = ("off", "on") if rnd % 2 == 0 else ("on", "off")
        for n, b in configs:
            for mode in order:
                reset_pool(sockets[mode])
                if before is not None:
                    before(mode)
                row = summarize_run(n, b, workers.run(n, sockets[mode], b, f"{mode}{rnd}"),
                                    0.0)
                if row["errors"] or row["hit_mismatches"]:
                    raise RuntimeError(f"{mode}: {row['errors']} errors, "
                                       f"{row['hit_mismatches']} hit mismatches")
                runs[(mode, n, b)].append(row["ops_per_s"])
                print(f"  round {rnd + 1}/{args.rounds}: {what} {mode:3s} {n} client(s), "
                      f"batch {b:>2}: {row['ops_per_s']:>9,.0f} ops/s", flush=True)
    return runs


def ab_rows(runs: dict) -> list[dict]:
    """Per (clients, batch): the median ops/s of each mode and the median
    per-round ratio on / off."""
    rows = []
    for (mode, n, b), off in runs.items():
        if mode != "off":
            continue
        on = runs[("on", n, b)]
        rows.append({"clients": n, "batch": b, "ops_per_s_off": statistics.median(off),
                     "ops_per_s_on": statistics.median(on),
                     "ratio": statistics.median(a / c for a, c in zip(on, off)),
                     "rounds_off": off, "rounds_on": on})
    return rows
