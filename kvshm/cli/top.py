"""`kvshm top`: a live view of a pool, read from its segment (no socket).

Every interval it copies the pool's state and counters out of shared
memory and shows what changed since the last copy: usage, the prefix-cache
hit rate, ops per second and latency p50/p99 per op, evictions per second,
the sessions (pid, NUMA node, tenant, requests, blocks), tenants with
quotas, and whether the coordinator lives and how often it was restarted.

On a terminal it redraws in place and `q` quits; on a dumb terminal or a
pipe it prints one frame after another; `--once` prints one frame (the
rates over `--interval` seconds) and exits.  Lines are cut to the
terminal's width, and narrow terminals lose the latency columns first.
"""

from __future__ import annotations

import os
import select
import shutil
import sys
import time
from dataclasses import dataclass

from kvshm.cli.common import add_name_argument, attach_named
from kvshm.core import fmt
from kvshm.core.metrics import quantile, read_metrics
from kvshm.ops.sessions import SessionTable, tenant_digest
from kvshm.pool.stats import read_stats

HELP = "a live view of a pool, read from its segment"


@dataclass
class Sample:
    t: float
    stats: dict
    metrics: dict
    sessions: dict     # session id -> (pid, node, tenant digest)


def sample(seg) -> Sample:
    records = {r.session_id: (r.pid, r.node, r.tenant) for r in SessionTable(seg).records()}
    return Sample(time.monotonic(), read_stats(seg), read_metrics(seg.metrics), records)


def _rate(new: float, old: float, dt: float) -> float:
    return (new - old) / dt if dt > 0 else 0.0


def render(prev: Sample, cur: Sample, name: str, width: int = 100) -> list[str]:
    """The lines of one frame: `cur`, with rates since `prev`."""
    st, m = cur.stats, cur.metrics
    ps, pm = prev.stats, prev.metrics
    dt = cur.t - prev.t
    live = "alive" if st["coordinator_alive"] else "DEAD"
    up = f", up {fmt.count(st['uptime_s'])}s" if st["uptime_s"] is not None else ""
    dq = st["query_tokens"] - ps["query_tokens"]
    dh = st["hit_tokens"] - ps["hit_tokens"]
    hit = fmt.percent(dh / dq) if dq else "-"
    lines = [
        f"kvshm top: pool {name}  coordinator pid {st['coordinator_pid']} {live}{up}, "
        f"{fmt.count(st['generation'])} restart(s)",
        f"blocks {fmt.count(st['num_blocks'])}: {fmt.count(st['num_used_blocks'])} used, "
        f"{fmt.count(st['num_cached_blocks'])} cached, {fmt.count(st['num_free_blocks'])} free"
        f"  usage {fmt.percent(st['usage'])}",
        f"hit rate {hit} ({fmt.count(dh)} of {fmt.count(dq)} tokens)  evictions/s "
        f"{fmt.count(_rate(st['blocks_evicted'], ps['blocks_evicted'], dt))}  preemptions/s "
        f"{fmt.count(_rate(m['preemptions'], pm['preemptions'], dt))}  requests "
        f"{fmt.count(st['num_requests'])}  sessions {fmt.count(m['sessions_open'])}",
    ]
    if m["corrupt_reported"]:
        lines.append(f"CORRUPT blocks {fmt.count(m['corrupt_reported'])} reported, "
                     f"{fmt.count(m['corrupt_evicted'])} uncached")
    lines += [
        "",
    ]
    wide = width >= 60
    lines.append(f"{'op':<12}{'ops/s':>10}{'errors/s':>10}" +
                 (f"{'p50 us':>10}{'p99 us':>10}" if wide else ""))
    total = 0.0
    for op, o in m["ops"].items():
        po = pm["ops"][op]
        n = o["count"] - po["count"]
        if not n:
            continue
        total += n
        row = (f"{op:<12}{fmt.count(_rate(o['count'], po['count'], dt)):>10}"
               f"{fmt.count(_rate(o['errors'], po['errors'], dt)):>10}")
        if wide:
            buckets = [a - b for a, b in zip(o["buckets"], po["buckets"])]
            p50, p99 = quantile(buckets, 0.5), quantile(buckets, 0.99)
            row += "".join(f"{'-' if q is None else fmt.count(q * 1e6):>10}" for q in (p50, p99))
        lines.append(row)
    lines.append(f"{'all':<12}{fmt.count(total / dt if dt > 0 else 0):>10}")
    lines.append("")
    names = {tenant_digest(t): t for t in m["tenants"]}
    lines.append(f"{'session':>8}{'pid':>9}{'node':>6}  {'tenant':<16}{'requests':>9}"
                 f"{'blocks':>8}")
    by_id = {s["session"]: s for s in st["sessions"]}
    for sid in sorted(set(by_id) | set(cur.sessions)):
        pid, node, digest = cur.sessions.get(sid, (0, -1, b""))
        row = by_id.get(sid, {"requests": 0, "blocks": 0})
        tenant = names.get(digest, "?") or "(default)"
        lines.append(f"{sid:>8}{pid or '-':>9}{node if node >= 0 else '-':>6}  "
                     f"{tenant[:15]:<16}{fmt.count(row['requests']):>9}"
                     f"{fmt.count(row['blocks']):>8}")
    quotas = [(t, v) for t, v in sorted(m["tenants"].items()) if v["quota"] >= 0]
    if quotas:
        lines.append("")
        for t, v in quotas:
            lines.append(f"tenant {t or '(default)'}: {fmt.count(v['blocks'])} of "
                         f"{fmt.count(v['quota'])} blocks, {fmt.count(v['quota_refusals'])} "
                         "refused")
    return [ln[:width] for ln in lines]


def add_arguments(p) -> None:
    add_name_argument(p)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between frames")
    p.add_argument("--once", action="store_true", help="print one frame and exit")


def main(args) -> int:
    if not args.interval > 0:
        print("kvshm top: --interval must be > 0", file=sys.stderr)
        return 2
    with attach_named(args.name) as (name, seg):
        prev = sample(seg)
        if args.once:
            time.sleep(args.interval)
            print("\n".join(render(prev, sample(seg), name, _width())))
            return 0
        term = os.environ.get("TERM", "dumb")
        if sys.stdout.isatty() and sys.stdin.isatty() and term not in ("dumb", ""):
            return _live(seg, name, prev, args.interval)
        try:
            while True:   # a pipe or a dumb terminal: frame after frame
                time.sleep(args.interval)
                cur = sample(seg)
                print("\n".join(render(prev, cur, name, _width())) + "\n", flush=True)
                prev = cur
        except KeyboardInterrupt:
            return 0


def _width() -> int:
    return max(20, shutil.get_terminal_size((100, 24)).columns)


def _live(seg, name: str, prev: Sample, interval: float) -> int:
    import termios
    import tty
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    out = sys.stdout
    try:
        tty.setcbreak(fd)
        out.write("\x1b[?25l")                  # hide the cursor
        deadline = time.monotonic() + interval
        while True:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if ready and os.read(fd, 1) in (b"q", b"Q"):
                return 0
            if time.monotonic() < deadline:
                continue
            cur = sample(seg)
            size = shutil.get_terminal_size((100, 24))
            lines = render(prev, cur, name, max(20, size.columns))[:max(1, size.lines - 1)]
            out.write("\x1b[H\x1b[2J" + "\r\n".join(lines) + "\r\n(q quits)")
            out.flush()
            prev = cur
            deadline += interval
    except KeyboardInterrupt:
        return 0
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
        out.write("\x1b[?25h\n")
        out.flush()
