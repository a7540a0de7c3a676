"""Prometheus metrics of a pool, read from its segment (`kvshm metrics`).

Every scrape copies the pool's counters out of shared memory
(`kvshm.pool.stats.read_stats`, `kvshm.core.metrics.read_metrics`): no socket,
nothing asked of the coordinator.  The exporter outlives coordinator
restarts (the counters live in the segment) and reattaches when the pool is
made anew; while there is no pool it exports `kvshm_pool_up 0` only.

Names: vLLM's where the meaning is vLLM's (`vllm:kv_cache_usage_perc`,
`vllm:prefix_cache_queries` and `vllm:prefix_cache_hits` in tokens,
`vllm:num_preemptions`, labelled `model_name` = the pool name, so vLLM
dashboards read a pool as one engine), `kvshm_*` (labelled `pool`) for the
rest.  docs/operations.md lists them all.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from kvshm.cli.common import add_name_argument, segment_name
from kvshm.core.errors import ConfigError, SegmentError
from kvshm.core.metrics import LATENCY_BOUNDS_NS, read_metrics
from kvshm.pool.segment import SHM_DIR, PoolSegment
from kvshm.pool.stats import read_stats
from kvshm.service.process import die_with_parent

HELP = "serve a pool's Prometheus metrics, read from its segment (no socket)"

DEFAULT_PORT = 9108


def import_prometheus():
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError("metrics", "Prometheus metrics need the prometheus_client "
                          "package (pip install 'kvshm[metrics]')") from None
    return prometheus_client


class PoolCollector:
    """A prometheus_client collector of pool `name`'s metrics."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._seg: PoolSegment | None = None
        self._ino: int | None = None
        self._lock = threading.Lock()   # scrapes may come from several threads
        self.found = False              # whether the last scrape found the pool

    def _segment(self) -> PoolSegment | None:
        """The pool's segment, attached anew if it was made again since."""
        try:
            ino = os.stat(os.path.join(SHM_DIR, self.name)).st_ino
        except FileNotFoundError:
            ino = None
        if self._seg is not None and ino != self._ino:
            self._seg.close()
            self._seg = None
        if self._seg is None and ino is not None:
            try:
                self._seg = PoolSegment.attach(self.name)
                self._ino = ino
            except SegmentError:
                return None
        return self._seg

    def close(self) -> None:
        with self._lock:
            if self._seg is not None:
                self._seg.close()
                self._seg = None

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily
        with self._lock:
            seg = self._segment()
            self.found = seg is not None
            up = GaugeMetricFamily("kvshm_pool_up", "1 while the pool's segment exists",
                                   labels=["pool"])
            up.add_metric([self.name], 0 if seg is None else 1)
            yield up
            if seg is None:
                return
            stats = read_stats(seg)
            metrics = read_metrics(seg.metrics)
        yield from families(self.name, stats, metrics)


def families(pool: str, st: dict, m: dict):
    """The metric families of one reading of a pool."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    def one(family, name, doc, value, label="pool"):
        f = family(name, doc, labels=[label])
        f.add_metric([pool], value)
        return f

    G, C = GaugeMetricFamily, CounterMetricFamily
    # vLLM's own names, labelled by model_name as vLLM labels them
    for family, name, doc, value in (
        (G, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
         st["usage"]),
        (C, "vllm:prefix_cache_queries",
         "Prefix cache queries, in terms of number of queried tokens.", st["query_tokens"]),
        (C, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
         "tokens.", st["hit_tokens"]),
        (C, "vllm:num_preemptions", "Cumulative number of preemptions (frees with "
         "preempted=True).", m["preemptions"]),
    ):
        yield one(family, name, doc, value, label="model_name")
    blocks = GaugeMetricFamily("kvshm_blocks", "Blocks of the pool by state (total "
                               "excludes nothing; used = held by requests)",
                               labels=["pool", "state"])
    for state, key in (("total", "num_blocks"), ("free", "num_free_blocks"),
                       ("cached", "num_cached_blocks"), ("used", "num_used_blocks")):
        blocks.add_metric([pool, state], st[key])
    yield blocks
    for family, name, doc, value in (
        (G, "kvshm_requests", "Requests holding a slot of the request table",
         st["num_requests"]),
        (G, "kvshm_sessions", "Sessions connected now", m["sessions_open"]),
        (C, "kvshm_sessions_started", "Sessions ever opened (resumes excluded)",
         m["sessions_total"]),
        (C, "kvshm_sessions_resumed", "Sessions taken back after a coordinator restart",
         m["sessions_resumed"]),
        (C, "kvshm_handshakes_refused", "Connections refused at the handshake",
         m["handshakes_refused"]),
        (C, "kvshm_frames", "Frames (one op or one batch) executed", m["frames"]),
        (C, "kvshm_corrupt_blocks_reported", "Blocks engines found holding wrong K/V "
         "(report_corrupt)", m["corrupt_reported"]),
        (C, "kvshm_corrupt_blocks_evicted", "Blocks uncached for them: the reported ones "
         "and every cached block computed from them", m["corrupt_evicted"]),
        (C, "kvshm_prefix_cache_lookups", "Prefix-cache lookups (requests)", st["queries"]),
        (C, "kvshm_prefix_cache_lookup_hits", "Lookups that hit at least one block",
         st["hits"]),
        (C, "kvshm_blocks_allocated", "Blocks handed out by allocations",
         st["blocks_allocated"]),
        (C, "kvshm_evictions", "Cached blocks whose hash was dropped (to reuse the block, "
         "or by evict_blocks)", st["blocks_evicted"]),
        (C, "kvshm_coordinator_restarts", "Times a coordinator adopted this pool",
         st["generation"]),
        (G, "kvshm_coordinator_up", "1 while the pool's coordinator process lives",
         1 if st["coordinator_alive"] else 0),
        (C, "kvshm_events_published", "KV-event batches published", m["events_published"]),
        (C, "kvshm_events_dropped", "KV-event batches dropped (queue full or high-water "
         "mark)", m["events_dropped"]),
        (C, "kvshm_quota_refusals", "Allocations refused for a tenant's quota",
         m["quota_refusals"]),
    ):
        yield one(family, name, doc, value)
    errors = CounterMetricFamily("kvshm_errors", "Error replies by code",
                                 labels=["pool", "code"])
    for code, n in m["errors"].items():
        errors.add_metric([pool, code], n)
    yield errors
    ops = CounterMetricFamily("kvshm_ops", "Ops executed (errors included)",
                              labels=["pool", "op"])
    op_errors = CounterMetricFamily("kvshm_op_errors", "Ops that failed",
                                    labels=["pool", "op"])
    latency = HistogramMetricFamily("kvshm_op_latency_seconds", "Time to execute one op in "
                                    "the coordinator (socket excluded; failed ops not "
                                    "timed)", labels=["pool", "op"])
    bounds = [b / 1e9 for b in LATENCY_BOUNDS_NS]
    for name, op in m["ops"].items():
        ops.add_metric([pool, name], op["count"])
        op_errors.add_metric([pool, name], op["errors"])
        cumulative, seen = [], 0
        for bound, n in zip([*map(repr, bounds), "+Inf"], op["buckets"]):
            seen += n
            cumulative.append((bound, seen))
        latency.add_metric([pool, name], cumulative, op["seconds"])
    yield ops
    yield op_errors
    yield latency
    tenant_families = {key: family(name, doc, labels=["pool", "tenant"])
                       for key, family, name, doc in (
        ("blocks", G, "kvshm_tenant_blocks", "Blocks a tenant's requests hold"),
        ("quota", G, "kvshm_tenant_quota_blocks", "A tenant's quota in blocks (tenants with "
         "one)"),
        ("query_tokens", C, "kvshm_tenant_prefix_cache_queries",
         "A tenant's prefix-cache queries, in tokens"),
        ("hit_tokens", C, "kvshm_tenant_prefix_cache_hits",
         "A tenant's prefix-cache hits, in tokens"),
        ("quota_refusals", C, "kvshm_tenant_quota_refusals",
         "A tenant's allocations refused for its quota"),
        ("preemptions", C, "kvshm_tenant_preemptions", "A tenant's preemptions"),
    )}
    for tenant, t in sorted(m["tenants"].items()):
        for key, fam in tenant_families.items():
            if key == "quota" and t["quota"] < 0:
                continue
            fam.add_metric([pool, tenant], t[key])
    yield from tenant_families.values()


def serve_metrics(name: str, port: int, addr: str = ""):
    """Serve pool `name`'s metrics over HTTP on `addr:port` from a thread;
    returns (server, thread, collector)."""
    prom = import_prometheus()
    registry = prom.CollectorRegistry(auto_describe=False)
    collector = PoolCollector(name)
    registry.register(collector)
    try:
        server, thread = prom.start_http_server(port, addr=addr or "0.0.0.0",
                                                registry=registry)
    except OSError as e:
        collector.close()
        raise ConfigError("metrics_port", f"cannot listen on {addr or '*'}:{port}: "
                          f"{e.strerror}") from None
    return server, thread, collector


def check_port_free(port: int, addr: str = "", wait: float = 3.0) -> None:
    """Raise ConfigError unless `addr:port` can be listened on within `wait`
    seconds (the exporter of a killed coordinator takes a moment to go)."""
    deadline = time.monotonic() + wait
    while True:
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((addr, port))
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConfigError("metrics_port", f"cannot listen on {addr or '*'}:{port}: "
                                  f"{e.strerror}") from None
            time.sleep(0.1)
        finally:
            probe.close()


def start_exporter_process(name: str, port: int, addr: str = ""):
    """`kvshm metrics NAME --port PORT` as a child process that dies with
    this one (Linux's parent-death signal), for `kvshm serve --metrics-port`."""
    return subprocess.Popen([sys.executable, "-m", "kvshm", "metrics", name, "--port",
                             str(port), "--addr", addr], preexec_fn=die_with_parent,
                            stdout=subprocess.DEVNULL)


def add_arguments(p) -> None:
    add_name_argument(p)
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"HTTP port (default {DEFAULT_PORT}); 0 picks a free one")
    p.add_argument("--addr", default="", help="address to listen on (default: all)")
    p.add_argument("--once", action="store_true",
                   help="print one scrape in Prometheus' text format and exit")


def main(args) -> int:
    """`kvshm metrics`: serve until SIGINT/SIGTERM (or print one scrape)."""
    name = segment_name(args.name)
    prom = import_prometheus()
    if args.once:
        registry = prom.CollectorRegistry(auto_describe=False)
        collector = PoolCollector(name)
        registry.register(collector)
        try:
            text = prom.generate_latest(registry).decode()
        finally:
            collector.close()
        sys.stdout.write(text)
        if not collector.found:
            print(f"kvshm metrics: no pool {name!r} in {SHM_DIR}", file=sys.stderr)
            return 2
        return 0
    server, thread, collector = serve_metrics(name, args.port, args.addr)
    print(f"metrics of pool {name!r} on http://{args.addr or '0.0.0.0'}:"
          f"{server.server_port}/metrics", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    server.server_close()
    collector.close()
    return 0
