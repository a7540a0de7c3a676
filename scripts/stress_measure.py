"""The measurements of scripts/numa_stress.py (a module it imports, not a
script): the latency probes, the sampler of the coordinator's CPU, RSS and
pool counters, and the figures made from them (quantiles, windows, Jain's
fairness index, where the arena's pages are).

Everything here reads the coordinator from outside: its CPU time and RSS
from /proc (psutil; a restarted coordinator is followed, `Sampler.follow`),
the pool's churn counters from the pool segment header (blocks_allocated /
blocks_evicted, as `kvshm stats` shows them: no socket, no cost to the
coordinator), the arena's pages from each client's /proc/PID/numa_maps;
only the probes talk to it.
"""

from __future__ import annotations

import asyncio
import bisect
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from kvshm.core.metrics import global_word, percentile
from kvshm.pool.numa import mapped_pages
from kvshm.pool.segment import PoolSegment
from kvshm.service.process import die_with_parent
from kvshm.workers.topology import Node, format_cpulist

PROBE = Path(__file__).resolve().parent / "stress_probe.py"


def quantiles(values) -> dict:
    """p50, p99 and p99.9 of `values` (None when there are none)."""
    s = sorted(values)
    return {"p50": percentile(s, 50), "p99": percentile(s, 99), "p999": percentile(s, 99.9)}


def jain(values) -> float | None:
    """Jain's fairness index of `values`: (sum x)^2 / (n * sum x^2); 1.0 when
    every value is equal, 1/n when one value takes everything (None for no
    values or all zeros)."""
    xs = list(values)
    sq = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * sq) if xs and sq else None


# -- the probes ----------------------------------------------------------------------------------
@dataclass
class Probe:
    node: Node
    proc: asyncio.subprocess.Process
    samples: list[tuple[float, float]] = field(default_factory=list)   # (sent at, rtt us)
    reader: asyncio.Task | None = None

    def window(self, t0: float, t1: float) -> list[float]:
        """Round trips (us) of the calls sent in [t0, t1)."""
        times = [s[0] for s in self.samples]
        lo, hi = bisect.bisect_left(times, t0), bisect.bisect_left(times, t1)
        return [s[1] for s in self.samples[lo:hi]]


class Probes:
    """One `stress_probe.py` process per node, pinned to the node's CPUs
    (`pin`), each sending `rate` GetStats calls a second for at most
    `seconds`; their round trips collected as they come.  With `resume`
    they ride through coordinator restarts (the call a restart cuts off
    is answered by the next coordinator, its round trip the stall)."""

    def __init__(self, socket: str, nodes: list[Node], *, rate: float, seconds: float,
                 hash_algorithm: str, hash_seed: str, pin: bool = True,
                 resume: bool = False) -> None:
        self.args = (socket, rate, seconds, hash_algorithm, hash_seed, pin)
        self.resume = resume
        self.nodes = nodes
        self.probes: list[Probe] = []

    async def start(self, timeout: float = 30.0) -> None:
        """Start every probe and wait until each is connected.  Raises
        RuntimeError (with its stderr) for one that fails."""
        socket, rate, seconds, algo, seed, pin = self.args
        for node in self.nodes:
            argv = [sys.executable, str(PROBE), socket, "--rate", str(rate), "--seconds",
                    str(seconds), "--node", str(node.id), "--hash-algorithm", algo,
                    "--hash-seed", seed]
            if pin:
                argv += ["--cpus", format_cpulist(node.cpus)]
            if self.resume:
                argv.append("--resume")
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True,
                preexec_fn=die_with_parent)
            self.probes.append(Probe(node, proc))
        for probe in self.probes:
            try:
                line = await asyncio.wait_for(probe.proc.stdout.readline(), timeout)
            except asyncio.TimeoutError:
                line = b""
            if line.strip() != b"ready":
                err = (await _drain(probe.proc)).strip()
                raise RuntimeError(f"the latency probe of node {probe.node.id} did not start: "
                                   f"{err.splitlines()[-1] if err else 'no output'}")
            probe.reader = asyncio.ensure_future(self._read(probe))

    async def _read(self, probe: Probe) -> None:
        async for line in probe.proc.stdout:
            sent, _, rtt = line.partition(b" ")
            try:
                probe.samples.append((float(sent), float(rtt)))
            except ValueError:
                continue

    def window(self, t0: float, t1: float) -> list[list[float]]:
        """Per node, the round trips (us) of the calls sent in [t0, t1)."""
        return [p.window(t0, t1) for p in self.probes]

    async def stop(self) -> None:
        """Close their stdin (they exit at once), reap them; kill a late one."""
        for probe in self.probes:
            if probe.proc.returncode is None and probe.proc.stdin is not None:
                probe.proc.stdin.close()
        for probe in self.probes:
            try:
                await asyncio.wait_for(probe.proc.wait(), 5.0)
            except asyncio.TimeoutError:
                probe.proc.kill()
                await probe.proc.wait()
            if probe.reader is not None:
                await probe.reader
            else:
                await _drain(probe.proc)
        self.probes = []


async def _drain(proc: asyncio.subprocess.Process) -> str:
    """A failed child's stderr (the child is killed and reaped first)."""
    if proc.returncode is None:
        proc.kill()
    await proc.wait()
    return (await proc.stderr.read()).decode(errors="replace")


# -- the coordinator, from outside ----------------------------------------------------------------
@dataclass
class Sample:
    t: float            # time.time()
    cpu_s: float        # the coordinator's user + system CPU seconds (every incarnation's)
    rss: int | None     # its resident set (bytes); None between a kill and the restart
    shared: int | None  # ... of which shared pages (the pool segment's, mostly)
    allocated: int      # the pool's blocks_allocated counter
    evicted: int        # ... and blocks_evicted
    pid: int            # the coordinator process read
    frames: int = 0     # frames the coordinators executed (the metrics' counter)


_FRAMES = global_word("frames")
_COUNTERS = ("cpu_s", "allocated", "evicted", "frames")   # what Sampler.at interpolates


class Sampler:
    """Samples the coordinator (pid) and its pool segment every `period`
    seconds while running (`start()` / `await stop()`).  A coordinator
    killed and restarted on the pool is a new process: `follow(pid)` reads
    that one from then on, its CPU seconds added to those of the ones
    before (as last read: CPU spent after the last sample of a killed one
    is not counted), its RSS its own."""

    def __init__(self, pid: int, pool_name: str, period: float = 0.2) -> None:
        self.proc = psutil.Process(pid)
        self.segment = PoolSegment.attach(pool_name)
        self.period = period
        self.samples: list[Sample] = []
        self._cpu_base = self._cpu_last = 0.0
        self._task: asyncio.Task | None = None

    def follow(self, pid: int) -> None:
        """Read the coordinator `pid` from now on (a restarted one)."""
        self._cpu_base = self._cpu_last
        self.proc = psutil.Process(pid)

    def sample(self) -> Sample:
        try:
            with self.proc.oneshot():
                cpu = self.proc.cpu_times()
                mem = self.proc.memory_info()
        except psutil.Error:   # killed and not restarted yet
            cpu_s, rss, shared = self._cpu_last, None, None
        else:
            cpu_s = self._cpu_base + cpu.user + cpu.system
            rss, shared = mem.rss or None, getattr(mem, "shared", 0)
        self._cpu_last = cpu_s
        seg = self.segment
        s = Sample(time.time(), cpu_s, rss, shared if rss else None,
                   seg.get("blocks_allocated"), seg.get("blocks_evicted"), self.proc.pid,
                   seg.metrics[_FRAMES])
        self.samples.append(s)
        return s

    def start(self) -> None:
        self.sample()
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            self.sample()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self.segment.close()

    def at(self, t: float) -> dict:
        """The counters at time t, interpolated between the two samples
        around it (the nearest one outside the sampled span)."""
        ss = self.samples
        times = [s.t for s in ss]
        i = bisect.bisect_left(times, t)
        if i == 0 or i == len(ss):
            s = ss[min(i, len(ss) - 1)]
            return {k: getattr(s, k) for k in _COUNTERS}
        a, b = ss[i - 1], ss[i]
        f = (t - a.t) / (b.t - a.t) if b.t > a.t else 1.0
        return {k: getattr(a, k) + f * (getattr(b, k) - getattr(a, k)) for k in _COUNTERS}

    def rss_in(self, t0: float, t1: float) -> list[tuple[float, int, int, int]]:
        """(seconds since t0, RSS, its shared part, pid) of the samples taken
        in [t0, t1] that read a live coordinator."""
        return [(s.t - t0, s.rss, s.shared, s.pid) for s in self.samples
                if t0 <= s.t <= t1 and s.rss is not None]


def coordinator_window(sampler: Sampler, t0: float, t1: float, num_ops: int) -> dict:
    """The coordinator's CPU and the pool's churn over [t0, t1]."""
    a, b = sampler.at(t0), sampler.at(t1)
    secs = max(t1 - t0, 1e-9)
    cpu = b["cpu_s"] - a["cpu_s"]
    frames = b["frames"] - a["frames"]
    rss = [r for _, r, _, _ in sampler.rss_in(t0, t1)]
    return {
        "cpu_s": round(cpu, 3),
        "cpu_util": round(cpu / secs, 3),      # share of one CPU
        "cpu_us_per_op": round(cpu / num_ops * 1e6, 2) if num_ops else None,
        # The frames (a client's scheduler step, a probe's GetStats) the ops came in.
        "frames_per_s": round(frames / secs, 1),
        "ops_per_frame": round(num_ops / frames, 2) if frames > 0 else None,
        "cpu_us_per_frame": round(cpu / frames * 1e6, 1) if frames > 0 else None,
        "rss_bytes": rss[-1] if rss else None,
        "allocated_per_s": round((b["allocated"] - a["allocated"]) / secs, 1),
        "evicted_per_s": round((b["evicted"] - a["evicted"]) / secs, 1),
    }


def arena_pages(pids: list[int], path: str, local_node: int | None) -> dict | None:
    """Where the arena pages that the processes `pids` have mapped live
    (numa_maps): pages by NUMA node summed over the processes (a page two
    of them map counts twice), and how many are on `local_node`, the real
    node their CPUs belong to.  None where numa_maps cannot be read."""
    by_node: dict[int, int] = {}
    policies: set[str] = set()
    page_bytes = 4096
    seen = False
    for pid in pids:
        pages = mapped_pages(pid, path)
        if pages is None:
            continue
        seen = True
        page_bytes = pages.page_bytes
        policies.update(pages.policies)
        for node, n in pages.pages.items():
            by_node[node] = by_node.get(node, 0) + n
    if not seen:
        return None
    total = sum(by_node.values())
    local = by_node.get(local_node, 0) if local_node is not None else None
    return {"by_node": {str(k): v for k, v in sorted(by_node.items())}, "pages": total,
            "local": local, "remote": None if local is None else total - local,
            "page_bytes": page_bytes, "policies": sorted(policies)}
