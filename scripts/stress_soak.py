"""The soak of scripts/numa_stress.py (a module it imports, not a script):
one long step watched over time, the coordinator SIGKILLed and restarted on
its pool every K seconds (`--kill-coordinator-every`), and what is left.

Over time, per window (the span between two reads of the pool segment,
every `window_period(S)` seconds): the coordinator's RSS and its private
part (per incarnation: each restart is a new process), the pool's free,
cached and used blocks, requests and churn counters (`kvshm.pool.stats.
read_stats`, from shared memory), each node's ops/s (its clients' op
counts from their progress reports, interpolated to the window's edges)
and Jain's index of them, and the probes' single-op round trips.

Per restart: the kill's time, how long until the new coordinator was
ready, its segment check (as `kvshm run`'s supervisor does), and the
stall: from the kill to each probe's first reply after it (the probes run
with `--resume`, so the call the kill cut off is answered by the next
coordinator), and the longest gap between two replies of one probe.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import time

import psutil

from kvshm.core.check import check_segment
from kvshm.core.metrics import percentile
from kvshm.pool.arena import arena_name
from kvshm.pool.segment import SHM_DIR, PoolSegment
from kvshm.pool.stats import read_stats
from kvshm.service.process import CoordinatorProcess
from kvshm.workers.launcher import Launch, RunResult
from kvshm.workers.topology import pin
from stress_measure import Probes, Sampler, jain, quantiles

KILL_MARGIN_S = 1.0   # no kill in the soak's last second: its restart ends before the soak
POLL_S = 0.1          # how often the clients' op counts and the coordinator are looked at
PROGRESS_S = 0.5      # a client's progress reports, at most this often (WorkerSpec.progress)
# A reply read this soon after a kill was written by the killed coordinator
# (a new one takes longer than that to start).
OLD_REPLY_S = 0.02
MIB = 1 << 20


def window_period(soak_s: float) -> float:
    """Seconds between two reads of the pool: 5, less for a soak too short
    for 20 windows, never under 0.5."""
    return min(5.0, max(0.5, soak_s / 20))


def _summary(values) -> dict:
    """Median (p50, by kvshm's percentile rule) and max of `values`."""
    s = sorted(v for v in values if v is not None)
    return {"count": len(s), "median": percentile(s, 50), "max": s[-1] if s else None}


# -- while it runs -------------------------------------------------------------------------------
class Watch:
    """Every client's op count as its progress reports bring it (looked at
    every POLL_S) and the pool's counters read from its segment every
    `period` seconds, from the moment the clients start (`start()`, then
    `await stop()`)."""

    def __init__(self, launch: Launch, pool_name: str, period: float) -> None:
        self.launch = launch
        self.period = period
        self.segment = PoolSegment.attach(pool_name)
        self.ops: list[list[tuple[float, int]]] = []   # per client: (seen at, ops so far)
        self.pool: list[tuple[float, dict]] = []       # (read at, read_stats)
        self._stopping = False
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        launch = self.launch
        while launch.started_at is None:
            if self._stopping:
                return
            await asyncio.sleep(0.05)
        due = launch.started_at
        self.ops = [[(due, 0)] for _ in launch.results]
        while not self._stopping:
            now = time.time()
            for seen, w in zip(self.ops, launch.results):
                if w.stats.ops != seen[-1][1]:
                    seen.append((now, w.stats.ops))
            if now >= due:
                due += self.period
                # In a thread: a copy torn by a mutation is retried (up to 0.5 s).
                stats = await asyncio.to_thread(read_stats, self.segment, 0.5)
                self.pool.append((now, stats))
            await asyncio.sleep(POLL_S)

    async def stop(self) -> None:
        """Stop after the read under way (the segment is unmapped after it)."""
        self._stopping = True
        if self._task is not None:
            await self._task
        self.segment.close()


class Killer:
    """SIGKILLs the coordinator every `every` seconds from `start`, up to
    KILL_MARGIN_S before the soak's end, and restarts it at once with the
    same command line: it adopts its pool from shared memory.  A kill due
    while the last restart was still under way is skipped (`skipped`).  A
    coordinator that dies by itself meanwhile is restarted too, and said.
    When one does not come back, `on_failure()` is called (the clients
    would wait for it in vain) and no more kills follow."""

    def __init__(self, coord: CoordinatorProcess, every: float, sampler: Sampler,
                 cpus: tuple[int, ...] | None, on_failure) -> None:
        self.coord = coord
        self.every = every
        self.sampler = sampler
        self.cpus = cpus
        self.on_failure = on_failure
        self.restarts: list[dict] = []
        self.skipped = 0
        self._stopping = False
        self._task: asyncio.Task | None = None

    def start(self, launch: Launch, soak_s: float) -> None:
        self._task = asyncio.ensure_future(self._run(launch, soak_s))

    async def stop(self) -> None:
        """No more kills; a restart under way is finished first."""
        self._stopping = True
        if self._task is not None:
            await self._task

    async def _run(self, launch: Launch, soak_s: float) -> None:
        while launch.started_at is None:
            if self._stopping:
                return
            await asyncio.sleep(0.05)
        last = launch.started_at + soak_s - KILL_MARGIN_S
        due = launch.started_at + self.every
        while not self._stopping:
            await asyncio.sleep(POLL_S)
            if self.coord.proc.poll() is not None:
                cause = "died"
            elif due <= last and time.time() >= due:
                cause = "killed"
                due += self.every
            else:
                continue
            if not await self._restart(cause):
                return
            while due <= min(time.time(), last):
                due += self.every
                self.skipped += 1

    async def _restart(self, cause: str) -> bool:
        coord = self.coord
        rec: dict = {"cause": cause, "killed_pid": coord.proc.pid}
        if cause == "killed":
            self.sampler.sample()   # the last reading of this incarnation
            rec["at"] = time.time()
            coord.kill()            # SIGKILL, reaped: its segments stay for the next one
        else:                       # (it died up to POLL_S before this)
            rec["at"] = time.time()
            rec["exit"] = coord.proc.returncode
        try:
            coord.restart(wait=False)   # from this thread: PDEATHSIG follows it
            await asyncio.to_thread(coord.wait_ready)
            rec["ready_ms"] = round((time.time() - rec["at"]) * 1000, 1)
            rec["pid"] = coord.proc.pid
            if self.cpus:
                pin(self.cpus, coord.proc.pid)
            self.sampler.follow(coord.proc.pid)
            report, generation = await asyncio.to_thread(_check, coord.name)
            rec.update(check_clean=report.clean, problems=report.problems[:5],
                       generation=generation)
        except Exception as e:   # noqa: BLE001 - reported: the soak fails
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["check_clean"] = False
        self.restarts.append(rec)
        if "error" in rec:
            self.on_failure()
            return False
        return True


def _check(pool_name: str):
    """The segment check of a restarted coordinator's pool, from outside,
    and the pool's generation (adoptions so far)."""
    with PoolSegment.attach(pool_name) as seg:
        return check_segment(seg), seg.get("generation")


# -- the figures ---------------------------------------------------------------------------------
def reply_times(samples: list[tuple[float, float]], t: float) -> tuple[float | None,
                                                                         float | None]:
    """For one probe's calls, (sent at, round trip us) in the order sent:
    when its last reply before time t came and its first reply after t
    (None where there is none).  A probe's calls are serial, so its replies
    come in the order of the calls."""
    i = bisect.bisect_left(samples, (t,))            # the first call sent at or after t
    if i and samples[i - 1][0] + samples[i - 1][1] / 1e6 > t:
        i -= 1                                       # ... or the call t cut off
    reply = [s + rtt / 1e6 for s, rtt in samples[max(0, i - 1):i + 1]]
    before = reply[0] if i else None
    after = reply[-1] if i < len(samples) else None
    return before, after


def stalls(probes: Probes, t_kill: float) -> dict:
    """A kill's stall as the probes saw it: per node, from the kill to the
    probe's first reply served after it, and the gap between that reply and
    the one before (ms; None: no reply after it).  NOTE: replies read
    within OLD_REPLY_S of the kill are the killed coordinator's, still in
    the socket, and are skipped."""
    by_node, gaps = [], []
    for p in probes.probes:
        before, after = reply_times(p.samples, t_kill + OLD_REPLY_S)
        by_node.append(None if after is None else round((after - t_kill) * 1000, 1))
        gaps.append(None if after is None or before is None
                    else round((after - before) * 1000, 1))
    seen = [s for s in by_node if s is not None]
    return {"stall_ms": max(seen) if len(seen) == len(by_node) and seen else None,
            "stall_ms_by_node": by_node,
            "reply_gap_ms": max((g for g in gaps if g is not None), default=None)}


def ops_at(seen: list[tuple[float, int]], t: float) -> float:
    """A client's op count at time t, interpolated between the counts seen
    (its progress reports, at most every PROGRESS_S seconds).  NOTE: a
    client stalled by a restart reports nothing until it is served again,
    so the ops of a longer gap between reports are put in its last
    PROGRESS_S seconds, not spread over the stall."""
    i = bisect.bisect_left(seen, (t,))
    if i == 0:
        return float(seen[0][1]) if seen else 0.0
    if i == len(seen):
        return float(seen[-1][1])
    (ta, a), (tb, b) = seen[i - 1], seen[i]
    ta = max(ta, tb - PROGRESS_S)
    return a + (b - a) * max(0.0, t - ta) / (tb - ta) if tb > ta else float(b)


def windows(watch: Watch, probes: Probes, sampler: Sampler, nodes: list[list[int]],
            t0: float, t1: float, kills: list[float]) -> list[dict]:
    """One row per window of the soak (`nodes`: each node's client indexes;
    `kills`: when the coordinator was killed).  The coordinator's figures
    are its last sample in the window (None: it was down then)."""
    snaps = [(t, s) for t, s in watch.pool if t <= t1 + POLL_S]
    times = [s.t for s in sampler.samples]
    pids = list(dict.fromkeys(s.pid for s in sampler.samples if s.rss is not None))
    rows = []
    for (ta, a), (tb, b) in zip(snaps, snaps[1:]):
        secs = max(tb - ta, 1e-9)
        node_ops = [sum(ops_at(watch.ops[i], tb) - ops_at(watch.ops[i], ta) for i in ws) / secs
                    for ws in nodes]
        op_us = [x for per_node in probes.window(ta, tb) for x in per_node]
        op = {**quantiles(op_us), "max": max(op_us, default=None)}
        i = bisect.bisect_right(times, tb)
        coord = sampler.samples[i - 1] if i else None
        if coord is not None and coord.rss is None:
            coord = None
        rows.append({
            "t_s": round(tb - t0, 2), "seconds": round(secs, 2),
            "restart": any(ta <= k < tb for k in kills),
            "pid": coord.pid if coord else None,
            "incarnation": pids.index(coord.pid) if coord else None,
            "rss": coord.rss if coord else None,
            "private_rss": coord.rss - coord.shared if coord else None,
            "free_blocks": b["num_free_blocks"], "cached_blocks": b["num_cached_blocks"],
            "used_blocks": b["num_used_blocks"], "requests": b["num_requests"],
            "blocks_allocated": b["blocks_allocated"], "blocks_evicted": b["blocks_evicted"],
            "allocated_per_s": round((b["blocks_allocated"] - a["blocks_allocated"]) / secs, 1),
            "evicted_per_s": round((b["blocks_evicted"] - a["blocks_evicted"]) / secs, 1),
            "generation": b["generation"], "consistent": b["consistent"],
            "ops_per_s_by_node": [round(x, 1) for x in node_ops],
            "fairness": jain(node_ops),
            "op_p50_us": op["p50"], "op_p99_us": op["p99"], "op_max_us": op["max"],
        })
    return rows


def incarnations(sampler: Sampler, t0: float, t1: float) -> list[dict]:
    """The coordinator processes of the soak in order, each with its RSS and
    private RSS (RSS less shared pages) at its first and last sample and
    its highest."""
    runs: dict[int, list[tuple[float, int, int]]] = {}
    for t, rss, shared, pid in sampler.rss_in(t0, t1):
        runs.setdefault(pid, []).append((t, rss, rss - shared))
    out = []
    for pid, ss in runs.items():
        out.append({"pid": pid, "from_s": round(ss[0][0], 2), "to_s": round(ss[-1][0], 2),
                    "rss_first": ss[0][1], "rss_last": ss[-1][1],
                    "rss_max": max(r for _, r, _ in ss),
                    "private_first": ss[0][2], "private_last": ss[-1][2],
                    "private_max": max(p for _, _, p in ss)})
    return out


def drift(res: RunResult, probes: Probes, sampler: Sampler, t0: float, t1: float) -> dict:
    """Latency of the first tenth of the soak against its last tenth (step
    round trips by each client's step order, probe round trips by time) and
    the coordinator's RSS (after the first tenth, at the end, highest),
    over every incarnation."""
    tenth = (t1 - t0) / 10

    def tenths(samples: list[int]):
        n = max(1, len(samples) // 10)
        return samples[:n], samples[-n:]

    first, last = [], []
    for w in res.workers:
        a, b = tenths(w.stats.batch_us)
        first += a
        last += b
    op_first = [x for p in probes.window(t0, t0 + tenth) for x in p]
    op_last = [x for p in probes.window(t1 - tenth, t1) for x in p]
    rss = sampler.rss_in(t0, t1)
    after = [(r, sh) for t, r, sh, _ in rss if t >= tenth] or [(r, sh) for _, r, sh, _ in rss]
    warm = [r for r, _ in after]
    anon = [r - sh for r, sh in after]
    return {
        "step_us_first_tenth": quantiles(first), "step_us_last_tenth": quantiles(last),
        "op_us_first_tenth": quantiles(op_first), "op_us_last_tenth": quantiles(op_last),
        "rss_after_first_tenth": warm[0] if warm else None,
        "rss_end": warm[-1] if warm else None, "rss_max": max(warm) if warm else None,
        "rss_growth_bytes": (warm[-1] - warm[0]) if warm else None,
        # RSS counts the pool segment's pages once touched: the private part
        # is what a leak would grow.
        "private_rss_growth_bytes": (anon[-1] - anon[0]) if anon else None,
        "rss_series": [[round(t, 1), r, sh, pid]
                       for t, r, sh, pid in rss[:: max(1, len(rss) // 200)]],
    }


def soak_record(res: RunResult, probes: Probes, sampler: Sampler, watch: Watch,
                killer: Killer | None, nodes: list[list[int]], t0: float,
                t1: float, num_free_whole: int) -> tuple[dict, list[str]]:
    """The soak's figures and the problems they show (`num_free_whole`: the
    free blocks of a whole pool)."""
    problems = []
    rec = drift(res, probes, sampler, t0, t1)
    rec["window_s"] = watch.period
    kills = [r["at"] for r in killer.restarts] if killer else []
    rec["samples"] = windows(watch, probes, sampler, nodes, t0, t1, kills)
    rec["incarnations"] = incarnations(sampler, t0, t1)
    rec["kill_coordinator_every"] = killer.every if killer else None
    if killer is not None:
        for r in killer.restarts:
            at = r["at"]
            r["at_s"] = round(at - t0, 3)
            r.update(stalls(probes, at))
            if "error" in r:
                problems.append(f"soak: the coordinator did not come back after the "
                                f"{r['cause']} at {r['at_s']:.1f}s: {r['error']}")
                continue
            if r["cause"] == "died":
                problems.append(f"soak: the coordinator died by itself (status {r['exit']}) "
                                f"at {r['at_s']:.1f}s; restarted")
            if not r["check_clean"]:
                problems.append(f"soak: the pool check failed after the restart at "
                                f"{r['at_s']:.1f}s: " + "; ".join(r["problems"]))
            if r["stall_ms"] is None:
                problems.append(f"soak: a probe got no reply after the restart at "
                                f"{r['at_s']:.1f}s (by node: {r['stall_ms_by_node']})")
        restarts = [{k: v for k, v in r.items() if k != "at"} for r in killer.restarts]
        rec["restarts"] = restarts
        rec["kills_skipped"] = killer.skipped
        rec["stall_ms"] = _summary(r.get("stall_ms") for r in restarts)
        rec["ready_ms"] = _summary(r.get("ready_ms") for r in restarts)
        rec["reply_gap_ms"] = _summary(r.get("reply_gap_ms") for r in restarts)
    t = res.totals
    rec["clients"] = {
        "coordinator_restarts": [w.stats.coordinator_restarts for w in res.workers],
        "requests_resumed": t.requests_resumed, "requests_lost": t.requests_lost,
        "recomputed_tokens": t.recomputed_tokens,
        "stall_ms": _summary(t.stalls_ms),
        "errors": [f"client {w.index}: {w.stats.first_error}" for w in res.workers
                   if w.stats.first_error],
    }
    if t.requests_lost:
        problems.append(f"soak: {t.requests_lost} request(s) could not be resumed after a "
                        f"coordinator restart ({'; '.join(rec['clients']['errors'][:3])})")
    pool = res.pools[0] if res.pools else {}
    rec["end"] = {
        "num_blocks": pool.get("num_blocks"), "num_free_blocks": pool.get("num_free_blocks"),
        "num_free_whole": num_free_whole,
        "num_cached_blocks": pool.get("num_cached_blocks"),
        "num_requests": pool.get("num_requests"), "check_clean": pool.get("check_clean", False),
        "whole": bool(pool.get("check_clean")) and pool.get("num_requests") == 0
        and pool.get("num_free_blocks") == num_free_whole,
        "segments_left": [], "processes_left": [],
    }
    return rec, problems


def segments_left(names: list[str]) -> list[str]:
    """Which of the segments `names` are still in /dev/shm."""
    return [n for n in names if os.path.exists(f"{SHM_DIR}/{n}")]


def left_behind(pool_name: str) -> dict:
    """Once everything is stopped: the pool's segments (it and its arena)
    still in /dev/shm, and the descendants of this process still running."""
    segments = segments_left([pool_name, arena_name(pool_name)])
    procs = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                procs.append(f"{p.pid}: {' '.join(p.cmdline())[:160]}")
        except psutil.Error:   # gone meanwhile
            pass
    return {"segments_left": segments, "processes_left": procs}


# -- lines for the terminal ----------------------------------------------------------------------
def _mib(v) -> str:
    return "-" if v is None else f"{v / MIB:,.1f}"


def _n(v) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _range(values, fmt: str = ",.0f") -> str:
    vs = [v for v in values if v is not None]
    return "-" if not vs else f"{format(min(vs), fmt)}-{format(max(vs), fmt)}"


def soak_lines(soak: dict) -> list[str]:
    """What the soak showed, in a few lines (the end state is `end_line`'s)."""
    rows = soak["samples"]
    inc = soak["incarnations"]
    lines = [
        f"  soak over {len(rows)} windows of {soak['window_s']:g}s: coordinator RSS "
        f"{_mib(soak['rss_end'])} MiB at the end (max {_mib(soak['rss_max'])}), private "
        f"{_range((r['private_rss'] / MIB for r in rows if r['private_rss']), ',.1f')} MiB; "
        f"free blocks {_range(r['free_blocks'] for r in rows)}, cached "
        f"{_range(r['cached_blocks'] for r in rows)}, requests "
        f"{_range(r['requests'] for r in rows)}; fairness per window "
        f"{_range((r['fairness'] for r in rows), '.3f')}"]
    if soak.get("restarts") is not None:
        s, ready, c = soak["stall_ms"], soak["ready_ms"], soak["clients"]
        lines.append(
            f"  restarts: {len(soak['restarts'])} (every {soak['kill_coordinator_every']:g}s, "
            f"{soak['kills_skipped']} skipped; {len(inc)} coordinator processes); stall "
            f"(kill -> first probe reply) median {_n(s['median'])} ms, max {_n(s['max'])} ms; "
            f"ready median {_n(ready['median'])} ms; clients rode "
            f"{_range(c['coordinator_restarts'])} restarts each, "
            f"{c['requests_resumed']:,} requests resumed, "
            f"{c['requests_lost']} lost")
    return lines


def end_line(end: dict) -> str:
    whole = ("pool whole" if end["whole"] else "pool NOT whole")
    return (f"  end: {whole} ({end['num_free_blocks']} of {end['num_free_whole']} blocks free, "
            f"{end['num_requests']} requests, check {'clean' if end['check_clean'] else 'FAILED'})"
            f"; {len(end['segments_left'])} segment(s) left in /dev/shm, "
            f"{len(end['processes_left'])} process(es) left")
