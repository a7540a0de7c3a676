"""`kvshm run` / `python -m kvshm.workers`: start a coordinator (or join one), launch
N pinned CPU workers on a shared workload, show live progress, print a summary.

One run is a `Launch`: coordinator(s) as `kvshm serve` children, workers as
`python -m kvshm.workers.worker` children (each in its own session, so Ctrl-C
reaches only this process, which stops the workers, then the coordinators),
their reports (workers/channel.py) merged into progress and a final
`RunResult`.  `--isolated`
gives each worker a private pool of total/N blocks, as N separate engines
have today; `--compare` runs both and prints them side by side.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time
from dataclasses import dataclass

import msgspec

from kvshm.core.hashing import DEFAULT_HASH_ALGORITHM, DEFAULT_HASH_SEED
from kvshm.core.metrics import percentile
from kvshm.core.specs import PoolConfig
from kvshm.pool.arena import PAGE, ArenaLayout, arena_name
from kvshm.pool.segment import SHM_DIR
from kvshm.service.process import die_with_parent, exit_text
from kvshm.workers.channel import Done, Failed, Progress, Ready, WorkerSpec, read_report
from kvshm.workers.engine_types import EngineOptions, EngineStats
from kvshm.workload.spec import WorkloadSpec
from kvshm.workers.topology import (
    Node,
    Plan,
    allowed_cpus,
    discover,
    pin,
    plan,
)
from kvshm.workers.turns import TurnBoard


TIMELINE_PERIOD = 0.5   # seconds between the samples of RunResult.timeline


class WorkerResult(msgspec.Struct, kw_only=True):
    index: int
    cpus: tuple[int, ...]
    pid: int = 0
    session: int = 0
    affinity: tuple[int, ...] = ()   # what the worker reports after pinning itself
    status: str = "starting"     # running, done, killed (by --kill-worker), died, error
    message: str = ""
    seconds: float = 0.0         # how long it ran (from its Done report)
    stats: EngineStats = msgspec.field(default_factory=EngineStats)
    # ^ the Done report's figures, else the last Progress report's

    def to_dict(self) -> dict:
        stats = msgspec.to_builtins(self.stats)
        del stats["batch_us"], stats["ttft_ms"], stats["queue_ms"]
        return {"index": self.index, "cpus": list(self.cpus), "affinity": list(self.affinity),
                "pid": self.pid, "session": self.session, "status": self.status,
                "message": self.message, **stats,
                "integrity_failures": self.stats.integrity_failures, "seconds": self.seconds}


class RunResult(msgspec.Struct, kw_only=True):
    mode: str                     # shared | isolated
    config: PoolConfig
    workers: list[WorkerResult]
    seconds: float = 0.0
    pools: list[dict] = []        # per coordinator, after the run
    interrupted: bool = False
    restarts: list[dict] = []     # the coordinators' restarts
    # Every TIMELINE_PERIOD s: (seconds, prompt tokens, hit tokens, tokens served)
    timeline: list[tuple[float, int, int, int]] = []
    corrupted_pages: int = 0      # arena pages --corrupt-pages overwrote

    @property
    def serving_seconds(self) -> float:
        """From the workers' start (together, once all are Ready) to the
        last one's end: the time the workload took, without the start-up
        (coordinator, worker processes, model weights) the wall time also
        holds."""
        return max((w.seconds for w in self.workers), default=0.0) or self.seconds

    @property
    def totals(self) -> EngineStats:
        """The workers' figures summed."""
        return EngineStats.total(w.stats for w in self.workers)

    @property
    def stalls_ms(self) -> list[int]:
        """Every worker's stall per coordinator restart (loss -> resumed)."""
        return sorted(self.totals.stalls_ms)

    @property
    def hit_rate(self) -> float:
        t = self.totals
        return t.hit_tokens / t.prompt_tokens if t.prompt_tokens else 0.0

    @property
    def latencies(self) -> list[int]:
        return sorted(self.totals.batch_us)

    def to_dict(self) -> dict:
        t = self.totals
        lat = sorted(t.batch_us)
        stalls = sorted(t.stalls_ms)
        return {
            "mode": self.mode, "seconds": self.seconds,
            "serving_seconds": self.serving_seconds, "interrupted": self.interrupted,
            "num_blocks": self.config.num_blocks,
            "requests": t.finished, "aborted": t.aborted, "rejected": t.rejected,
            "prompt_tokens": t.prompt_tokens, "generated_tokens": t.generated_tokens,
            "hit_tokens": t.hit_tokens, "hit_rate": self.hit_rate,
            "cross_hit_tokens": t.cross_hit_tokens, "computed_tokens": t.computed_tokens,
            "preemptions": t.preemptions,
            "in_flight_waits": t.in_flight_waits, "in_flight_timeouts": t.in_flight_timeouts,
            "kv_s": t.kv_s, "attention_s": t.attention_s, "check_s": t.check_s,
            "coord_s": t.coord_s,
            "hit_blocks_checked": t.hit_blocks_checked, "hit_mismatches": t.hit_mismatches,
            "computed_blocks_checked": t.computed_blocks_checked,
            "computed_mismatches": t.computed_mismatches,
            "decode_checks": t.decode_checks, "decode_mismatches": t.decode_mismatches,
            "corrupted_pages": self.corrupted_pages,
            "corrupt_blocks_found": t.corrupt_blocks_found, "corrupt_findings": t.corrupt_findings,
            "corrupt_blocks_evicted": t.corrupt_blocks_evicted,
            "corrupt_requeued": t.corrupt_requeued, "corrupt_refound": t.corrupt_refound,
            "first_corruption": t.first_corruption,
            "step_batch_us_p50": percentile(lat, 50), "step_batch_us_p99": percentile(lat, 99),
            "ttft_ms_p50": percentile(sorted(t.ttft_ms), 50),
            "ttft_ms_p99": percentile(sorted(t.ttft_ms), 99),
            "queue_ms_p50": percentile(sorted(t.queue_ms), 50),
            "requests_per_s": t.finished / self.serving_seconds if self.serving_seconds else 0.0,
            "coordinator_restarts": len(self.restarts), "restarts": self.restarts,
            "requests_resumed": t.requests_resumed, "requests_lost": t.requests_lost,
            "recomputed_tokens": t.recomputed_tokens,
            "stall_ms_p50": percentile(stalls, 50),
            "stall_ms_max": stalls[-1] if stalls else None,
            "pools": self.pools,
            "timeline": [list(sample) for sample in self.timeline],
            "workers": [w.to_dict() for w in self.workers],
        }


@dataclass
class LaunchOptions:
    num_workers: int = 2
    duration: float = 30.0
    grace: float = 10.0
    config: PoolConfig | None = None      # None with `connect`
    connect: str | None = None            # join this coordinator's socket
    hash_algorithm: str = DEFAULT_HASH_ALGORITHM   # with `connect`: the pool's hashing
    hash_seed: str = DEFAULT_HASH_SEED
    workload: WorkloadSpec = WorkloadSpec()
    engine: EngineOptions = EngineOptions()
    pin: bool = True
    kill_worker: int | None = None
    kill_after: float = 5.0
    kill_coordinator_every: float | None = None   # SIGKILL the coordinator every S s
    corrupt_pages: int = 0                # overwrite this many arena pages, once, at
    corrupt_after: float = 5.0            # ... this many seconds into the run
    reconnect_timeout: float = 60.0       # workers wait this long for a restarted one
    start_together: bool = False          # workers wait until all are Ready, then start
    live: bool = True                     # progress lines while running


class Launch:
    """One run in one mode (shared or isolated)."""

    def __init__(self, opts: LaunchOptions, cpu_plan: Plan, mode: str,
                 out=sys.stdout) -> None:
        self.opts = opts
        self.plan = cpu_plan
        self.mode = mode
        self.out = out
        self.coordinators = []
        self.sockets: list[str] = []
        self.procs: list[asyncio.subprocess.Process] = []
        self.results = [WorkerResult(index=i, cpus=tuple(n.cpus))
                        for i, n in enumerate(cpu_plan.workers)]
        self.interrupted = asyncio.Event()
        self.config = opts.config
        self.pool_names: list[str] = []      # the joined pool's segment (--connect)
        self.corrupted_pages = 0             # arena pages --corrupt-pages overwrote
        self.restarts: list[dict] = []       # coordinator restarts by this supervisor
        self._restarting = 0                 # restarts under way (not listening yet)
        self._killed: set[int] = set()       # pids SIGKILLed and not yet seen dead
        self.started_at: float | None = None   # time.time() when start_together let them go
        self._arrived: set[int] = set()
        self.turns: TurnBoard | None = None   # when follow-up turns may arrive
        self._attached: set[int] = set()      # workers Ready (or gone): on the board
        self._stopping = False
        self._t0 = 0.0
        self._last_rate = (0.0, 0)   # (elapsed, tokens served) at the last status line
        self.timeline: list[tuple[float, int, int, int]] = []

    # -- coordinators ------------------------------------------------------------------------------
    def start_coordinators(self) -> None:
        from kvshm.service.process import CoordinatorProcess
        opts = self.opts
        if opts.connect:
            self.sockets = [opts.connect] * opts.num_workers
            return
        n = opts.num_workers if self.mode == "isolated" else 1
        cfg = opts.config
        if self.mode == "isolated":
            cfg = isolated_config(cfg, n)
        self.config = cfg
        for _ in range(n):
            proc = CoordinatorProcess(cfg, new_session=True, with_parent=True)
            self.coordinators.append(proc)
            proc.wait_ready()
            if opts.pin and self.plan.coordinator_cpus:
                pin(self.plan.coordinator_cpus, proc.proc.pid)
        self.sockets = [str(c.socket) for c in self.coordinators]
        if len(self.sockets) == 1:
            self.sockets *= opts.num_workers

    async def supervise(self) -> None:
        """Restart a coordinator that dies (SIGKILLed by --kill-coordinator-every
        or otherwise) with the same command line: it adopts its pool, and the
        workers' clients resume.  Each restart is checked from outside."""
        from kvshm.core.check import check_segment
        from kvshm.pool.segment import PoolSegment
        while True:
            await asyncio.sleep(0.02)
            for c in self.coordinators:
                if self._stopping or c.proc.poll() is None:
                    continue
                self._killed.discard(c.proc.pid)
                died = time.monotonic()
                code = c.proc.returncode
                rec = {"at_s": round(died - self._t0, 3), "exit": exit_text(code)}
                self._restarting += 1
                try:
                    c.restart(wait=False)    # from this thread: PDEATHSIG follows it
                    await asyncio.to_thread(c.wait_ready)
                    rec["ready_ms"] = int((time.monotonic() - died) * 1000)
                    if self.opts.pin and self.plan.coordinator_cpus:
                        pin(self.plan.coordinator_cpus, c.proc.pid)
                    with PoolSegment.attach(c.name) as seg:
                        report = check_segment(seg)
                    rec["check_clean"] = report.clean
                    rec["problems"] = report.problems[:5]
                except Exception as e:   # noqa: BLE001 - reported, the run fails
                    rec["error"] = f"{type(e).__name__}: {e}"
                    rec["check_clean"] = False
                finally:
                    self._restarting -= 1
                self.restarts.append(rec)
                if "error" in rec:
                    return

    async def _kill_coordinator_every(self, every: float) -> None:
        """SIGKILL each coordinator every `every` s, but never one still
        coming back from the last kill (the supervisor would give up on a
        coordinator that dies before it listens)."""
        while True:
            await asyncio.sleep(every)
            if self._restarting:
                continue
            for c in self.coordinators:
                if c.proc.poll() is None:
                    # Recorded before the kernel reaps it: poll() may still say
                    # "running" for a moment, and the run must not end then.
                    self._killed.add(c.proc.pid)
                    c.proc.kill()

    def stop_coordinators(self) -> None:
        errors = []
        for c in self.coordinators:
            code = c.stop(owns_pool=True)   # this run made the pool: leave nothing behind
            if code != 0:
                errors.append(f"coordinator {c.name} exited with {code}: {c.stderr[-500:]}")
        self.coordinators.clear()
        if errors:
            raise RuntimeError("; ".join(errors))

    async def pool_reports(self) -> list[dict]:
        """Every pool's state after the run, from the coordinator and a check
        of its segment."""
        from kvshm.core.check import check_segment
        from kvshm.core.errors import KvshmError
        from kvshm.pool.segment import PoolSegment
        from kvshm.service.client import connect
        reports = []
        for sock in dict.fromkeys(self.sockets):
            try:
                client = await connect(sock, **self._hash())
                try:
                    st = await client.stats()
                    with PoolSegment.attach(client.pool_segment) as seg:
                        check = check_segment(seg)
                finally:
                    await client.close()
            except KvshmError as e:   # the coordinator is gone: say so in the summary
                reports.append({"socket": sock, "error": str(e), "check_clean": False,
                                "problems": [f"coordinator unreachable after the run: {e}"]})
                continue
            reports.append({"socket": sock, "num_blocks": st.num_blocks,
                            "num_free_blocks": st.num_free_blocks,
                            "num_cached_blocks": st.num_cached_blocks,
                            "num_requests": st.num_requests, "num_sessions": st.num_sessions,
                            "check_clean": check.clean, "problems": check.problems[:5]})
        return reports

    def _hash(self) -> dict:
        cfg = self.config
        if cfg is None:
            return {"hash_algorithm": self.opts.hash_algorithm, "hash_seed": self.opts.hash_seed}
        return {"hash_algorithm": cfg.hash_algorithm, "hash_seed": cfg.hash_seed}

    # -- workers --------------------------------------------------------------------------------------
    async def spawn(self, i: int) -> asyncio.subprocess.Process:
        opts = self.opts
        node = self.plan.workers[i]
        threads = str(max(1, len(node.cpus)))
        env = {**os.environ, "OPENBLAS_NUM_THREADS": threads, "OMP_NUM_THREADS": threads,
               "MKL_NUM_THREADS": threads}
        spec = WorkerSpec(
            socket=self.sockets[i], index=i, num_workers=opts.num_workers, node=node.id,
            cpus=tuple(node.cpus) if opts.pin else (), workload=opts.workload,
            engine=opts.engine, **self._hash(), duration=opts.duration, grace=opts.grace,
            reconnect_timeout=opts.reconnect_timeout, wait_for_start=opts.start_together,
            turns=self.turns.name if self.turns is not None else "")
        args = [sys.executable, "-m", "kvshm.workers.worker", spec.encode()]
        return await asyncio.create_subprocess_exec(
            *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
            stdin=asyncio.subprocess.PIPE if opts.start_together else None,
            start_new_session=True, limit=2**26, preexec_fn=die_with_parent)

    def _arrive(self, i: int) -> None:
        """With `start_together`: worker i is Ready (or gone); once every
        worker is, tell them all to start."""
        if not self.opts.start_together or self.started_at is not None:
            return
        self._arrived.add(i)
        if len(self._arrived) < len(self.procs):
            return
        self.started_at = time.time()
        for proc in self.procs:
            if proc.returncode is None:
                proc.stdin.write(b"start\n")
            proc.stdin.close()

    def _on_board(self, i: int) -> None:
        """Worker i has attached the turn board (it is Ready) or is gone;
        once all have, the name goes (the mappings stay)."""
        self._attached.add(i)
        if self.turns is not None and len(self._attached) == len(self.procs):
            self.turns.unlink()

    async def watch(self, i: int, proc: asyncio.subprocess.Process) -> None:
        res = self.results[i]
        res.pid = proc.pid
        res.status = "running"
        stderr_task = asyncio.ensure_future(proc.stderr.read())
        async for line in proc.stdout:
            try:
                report = read_report(line)
            except msgspec.ValidationError as e:   # a worker of another version?
                res.status, res.message = "error", f"unreadable report: {e}"
                continue
            if res.status == "error":   # after an unreadable report: the run has failed
                continue
            if isinstance(report, Ready):
                res.session, res.affinity = report.session, report.cpus
                self._on_board(i)
                self._arrive(i)
            elif isinstance(report, Progress):
                res.stats = report.stats
            elif isinstance(report, Done):
                res.stats, res.seconds, res.status = report.stats, report.seconds, "done"
            elif isinstance(report, Failed):
                res.status, res.message = "error", report.message
        code = await proc.wait()
        self._arrive(i)   # one that died before Ready must not hold the others back
        self._on_board(i)
        if self.turns is not None and not self.interrupted.is_set():
            self.turns.mark_dead(i)   # (or done): turns after its own need not wait
        after = f" {time.monotonic() - self._t0:.1f}s into the run" if self._t0 else ""
        err = (await stderr_task).decode(errors="replace").strip()
        if res.status == "running":
            if code < 0 and -code == signal.SIGKILL and i == self.opts.kill_worker:
                res.status = "killed"
                res.message = (f"killed with SIGKILL by --kill-worker{after} (its figures are "
                               "those of its last progress report)")
            elif self.interrupted.is_set():
                res.status, res.message = "interrupted", "stopped by Ctrl-C"
            else:
                res.status = "died"
                res.message = (f"exited with {exit_text(code)}{after} (its figures are "
                               "those of its last progress report)"
                               + (f": {err.splitlines()[-1]}" if err else ""))

    async def run(self) -> RunResult:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, self.interrupted.set)
        loop.add_signal_handler(signal.SIGTERM, self.interrupted.set)
        t0 = self._t0 = time.monotonic()
        extras: list[asyncio.Future] = []
        try:
            self.turns = TurnBoard.create()
            # From this thread: children die with the thread that started them.
            self.start_coordinators()
            if self.config is None:   # joined a coordinator: learn its pool
                await self._learn_pool()
            self.procs = [await self.spawn(i) for i in range(self.opts.num_workers)]
            watchers = [asyncio.ensure_future(self.watch(i, p)) for i, p in enumerate(self.procs)]
            extras += [asyncio.ensure_future(self._progress(t0)),
                       asyncio.ensure_future(self._record_timeline(t0)),
                       asyncio.ensure_future(self._stop_on_interrupt())]
            if self.opts.kill_worker is not None:
                extras.append(asyncio.ensure_future(self._kill_later()))
            if self.opts.corrupt_pages:
                extras.append(asyncio.ensure_future(self._corrupt_later()))
            killer = None
            if self.coordinators:
                extras.append(asyncio.ensure_future(self.supervise()))
                if self.opts.kill_coordinator_every:
                    killer = asyncio.ensure_future(
                        self._kill_coordinator_every(self.opts.kill_coordinator_every))
                    extras.append(killer)
            await asyncio.gather(*watchers)
            if killer is not None:   # no more kills; let a restart under way finish
                killer.cancel()
            await self._coordinators_up()
            seconds = time.monotonic() - t0
            pools = [] if self.interrupted.is_set() else await self.pool_reports()
        finally:
            self._stopping = True
            for task in extras:
                task.cancel()
            for proc in self.procs:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            loop.remove_signal_handler(signal.SIGINT)
            loop.remove_signal_handler(signal.SIGTERM)
            await asyncio.to_thread(self.stop_coordinators)
            if self.turns is not None:
                self.turns.close()
        if self.opts.live:
            self.out.write("\n" if self.out.isatty() else "")
        self._sample(time.monotonic() - t0)
        return RunResult(mode=self.mode, config=self.config, workers=self.results,
                         seconds=seconds, pools=pools, interrupted=self.interrupted.is_set(),
                         restarts=self.restarts, timeline=self.timeline,
                         corrupted_pages=self.corrupted_pages)

    async def _coordinators_up(self, timeout: float = 30.0) -> None:
        """Wait (bounded) for the supervisor to bring a killed coordinator back
        (listening again and checked, not only started), including one killed
        a moment ago that the kernel has not reaped yet."""
        deadline = time.monotonic() + timeout
        while ((self._restarting or self._killed
                or any(c.proc.poll() is not None for c in self.coordinators))
               and time.monotonic() < deadline and not self.interrupted.is_set()):
            await asyncio.sleep(0.05)

    async def _learn_pool(self) -> None:
        """With --connect: the pool's config and segment, and whether the
        workers can run on it (refused here rather than in every worker)."""
        from kvshm.core.errors import InvalidArgument
        from kvshm.service.client import connect
        from kvshm.workers.engine import UnsupportedModel, check_supported
        client = await connect(self.sockets[0], **self._hash())
        try:
            self.config = client.config
            self.pool_names = [client.pool_segment]
            check_supported(client.config, self.opts.engine.model)
            if not client.arena_segment:
                raise UnsupportedModel("the coordinator has no KV arena")
        except UnsupportedModel as e:
            raise InvalidArgument(f"cannot run workers on the pool at {self.sockets[0]}: "
                                  f"{e}") from None
        finally:
            await client.close()

    async def _stop_on_interrupt(self) -> None:
        await self.interrupted.wait()
        for proc in self.procs:
            if proc.returncode is None:
                proc.terminate()

    async def _kill_later(self) -> None:
        await asyncio.sleep(self.opts.kill_after)
        proc = self.procs[self.opts.kill_worker]
        if proc.returncode is None:
            proc.kill()

    async def _corrupt_later(self) -> None:
        """--corrupt-pages: random bytes over random pages of the KV data of
        the run's arenas, from this process (as a stray writer would), once."""
        await asyncio.sleep(self.opts.corrupt_after)
        names = [c.name for c in self.coordinators] or self.pool_names
        rng = random.Random(self.opts.engine.seed)
        lay = ArenaLayout(self.config)
        pages = range(-(-lay.data_offset // PAGE), lay.size // PAGE)
        try:
            for _ in range(self.opts.corrupt_pages):
                with open(f"{SHM_DIR}/{arena_name(rng.choice(names))}", "r+b") as f:
                    f.seek(rng.choice(pages) * PAGE)
                    f.write(rng.randbytes(PAGE))
                self.corrupted_pages += 1
        except OSError as e:   # (an arena gone with its coordinator: say so, go on)
            self.out.write(f"kvshm run: --corrupt-pages stopped after "
                           f"{self.corrupted_pages} page(s): {e}\n")

    async def _record_timeline(self, t0: float) -> None:
        while True:
            await asyncio.sleep(TIMELINE_PERIOD)
            self._sample(time.monotonic() - t0)

    def _sample(self, elapsed: float) -> None:
        t = EngineStats.total(w.stats for w in self.results)
        self.timeline.append((round(elapsed, 3), t.prompt_tokens, t.hit_tokens,
                              t.computed_tokens + t.hit_tokens))

    async def _progress(self, t0: float) -> None:
        """A status line every second (rewritten in place on a terminal,
        every 5 s otherwise)."""
        if not self.opts.live:
            return
        tty = self.out.isatty()
        period = 1.0 if tty else 5.0
        while True:
            await asyncio.sleep(period)
            self.out.write(("\r" if tty else "") + self._status(time.monotonic() - t0)
                           + ("" if tty else "\n"))
            self.out.flush()

    def _status(self, elapsed: float) -> str:
        t = EngineStats.total(w.stats for w in self.results)
        prompt = t.prompt_tokens
        hit = t.hit_tokens
        tokens = t.computed_tokens + hit
        # The rate since the last line, not the average since the start.
        (then, before), self._last_rate = self._last_rate, (elapsed, tokens)
        rate = (tokens - before) / max(elapsed - then, 1e-9)
        usage = self._pool_usage()
        running = sum(1 for w in self.results if w.status == "running")
        return (f"[{self.mode} {elapsed:5.1f}s] workers {running}/{len(self.results)} | "
                f"requests {t.finished:,} | {rate:,.0f} tok/s served | "
                f"hit {hit / prompt if prompt else 0:.1%} (cross-worker "
                f"{t.cross_hit_tokens:,} tok) | pool {usage} | "
                f"preempt {t.preemptions} | mismatches {t.integrity_failures}  ")

    def _pool_usage(self) -> str:
        from kvshm.pool.segment import PoolSegment
        from kvshm.pool.stats import read_stats
        names = [c.name for c in self.coordinators] or self.pool_names
        if not names:
            return "?"
        used = []
        for name in names:
            try:
                with PoolSegment.attach(name) as seg:
                    used.append(read_stats(seg)["usage"])
            except Exception:   # noqa: BLE001 - starting or stopping: no figure this time
                return "?"
        return f"{sum(used) / len(used):.0%}"


def isolated_config(config: PoolConfig, num_workers: int) -> PoolConfig:
    """One worker's private pool in isolated mode: the same total of usable
    blocks, split (each pool keeps its own null block)."""
    return config.replace(num_blocks=(config.num_blocks - 1) // num_workers + 1)


def make_plan(num_workers: int, pin_cpus: bool = True) -> Plan:
    """Where the workers (and the coordinator) run: `topology.plan` over the
    discovered nodes, or every worker on every allowed CPU without pinning."""
    if pin_cpus:
        return plan(num_workers, discover())
    cpus = tuple(allowed_cpus())
    return Plan([Node(i, cpus, True) for i in range(num_workers)], None,
                ["pinning off: workers and coordinator float on every allowed CPU"])


async def launch(opts: LaunchOptions, mode: str, cpu_plan: Plan, out=sys.stdout) -> RunResult:
    """Run the workload once in `mode` ("shared" or "isolated")."""
    return await Launch(opts, cpu_plan, mode, out).run()
