"""The `kvshm` command line: run, replay, events, serve, stats, check, ls, rm,
demo.  Exit status: 0 success; 1 the command did its work and found a
problem (a check, a replay or a run that failed); 2 it could not do what it
was asked (a usage error, something not found, a refusal); 130 interrupted
(README.md, "Exit codes")."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kvshm import __version__
from kvshm.core import fmt
from kvshm.core.errors import KvshmError

REPO_TRACES = Path(__file__).resolve().parent.parent / "tests" / "data" / "conformance" / "traces"


def cmd_replay(args: argparse.Namespace) -> int:
    from kvshm.core.check import check_segment
    from kvshm.replay import bench_trace, expand_paths, load_trace, replay_trace

    if args.connect and not args.ipc:
        print("kvshm replay: --connect goes with --ipc", file=sys.stderr)
        return 2
    if args.connect and not os.path.exists(args.connect):
        print(f"kvshm replay: no coordinator listening at {args.connect} (no such socket)",
              file=sys.stderr)
        return 2
    missing = [a for a in args.paths if not os.path.exists(a)]
    if missing:
        print(f"kvshm replay: no such file or directory: {', '.join(missing)}",
              file=sys.stderr)
        return 2
    paths = list(expand_paths(args.paths))
    if not paths:
        print("no traces found in " + " ".join(args.paths), file=sys.stderr)
        return 2
    results = []
    passed = failed = 0
    for path in paths:
        row: dict = {"trace": path.name}
        try:
            cfg, ops = load_trace(path)
        except (OSError, ValueError, KvshmError) as e:
            row.update(passed=False, error=f"cannot load: {e}")
            failed += 1
            results.append(row)
            if not args.json:
                print(f"FAIL {path}: cannot load: {e}")
            continue
        row["ops"] = len(ops)
        reports = []
        try:
            if args.connect:
                from kvshm.ops.errors import ConnectionLost, HandshakeError
                from kvshm.service.ipc_replay import replay_trace_connected
                try:
                    mismatch, seconds, report = replay_trace_connected(
                        args.connect, cfg, ops, batch=args.batch_size if args.batch else 0)
                except (ConnectionLost, HandshakeError) as e:   # no coordinator to use
                    print(f"kvshm replay: {e}", file=sys.stderr)
                    return 2
                if report is not None:
                    reports.append(report)
                    row["ipc_ops_per_s"] = len(ops) / seconds if seconds else None
            elif args.ipc:
                from kvshm.service.ipc_replay import replay_trace_ipc
                mismatch, seconds, report = replay_trace_ipc(
                    cfg, ops, batch=args.batch_size if args.batch else 0)
                reports.append(report)
                row["ipc_ops_per_s"] = len(ops) / seconds if seconds else None
            else:
                mismatch = replay_trace(
                    cfg, ops, after=lambda mgr: reports.append(
                        check_segment(mgr.segment, mgr.block_pool)))
        except KvshmError as e:  # a config kvshm refuses
            mismatch = f"pool not created: {e}"
        problem = str(mismatch) if mismatch else None
        if problem is None and reports and not reports[0].clean:
            problem = "pool check after replay: " + "; ".join(reports[0].problems)
        if problem is None and args.bench and not args.ipc:
            bench_mismatch, times = bench_trace(cfg, ops, runs=args.runs)
            if bench_mismatch:
                problem = str(bench_mismatch)
            else:
                times.sort()
                med = times[len(times) // 2]
                row.update(runs=[round(t, 6) for t in times], median_s=med,
                           ops_per_s=len(ops) / med)
                if not args.json:
                    print(f"{path.name}: PASS ops={fmt.count(len(ops))} median={med:.4f}s "
                          f"-> {fmt.count(len(ops) / med)} ops/s", flush=True)
        row["passed"] = problem is None
        if problem is None:
            passed += 1
        else:
            failed += 1
            row["mismatch"] = problem
            if not args.json:
                print(f"FAIL {path}: {problem}", flush=True)
        results.append(row)
    if args.json:
        print(json.dumps({"passed": passed, "failed": failed, "traces": results}, indent=2))
    else:
        print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


def segment_name(arg: str) -> str:
    """The segment name that a command-line argument stands for.

    Args:
        arg: a segment name as `kvshm ls` prints it, or its path in SHM_DIR
            (`/dev/shm/NAME`; a relative path is taken from the cwd).

    Returns:
        The bare name.

    Raises:
        SegmentError: `arg` is a path outside SHM_DIR or not a valid name.
    """
    from kvshm.core.errors import SegmentError
    from kvshm.core.shm import SHM_DIR, valid_name

    name = arg
    if "/" in arg:
        directory, name = os.path.split(os.path.abspath(arg))
        if arg.endswith("/") or os.path.realpath(directory) != os.path.realpath(SHM_DIR):
            raise SegmentError(f"{arg!r} is not a segment in {SHM_DIR}: expected a segment "
                               f"name (see `kvshm ls`) or {SHM_DIR}/NAME")
    if not valid_name(name):
        raise SegmentError(f"bad segment name {name!r}: expected 1-200 letters, digits, "
                           "'.', '_' or '-' (see `kvshm ls`)")
    return name


def attach_pool(name: str):
    """PoolSegment.attach(name), with an OS refusal (a directory, an empty or
    unreadable file in SHM_DIR) raised as SegmentError too."""
    from kvshm.core.errors import SegmentError
    from kvshm.core.segment import SHM_DIR, PoolSegment

    path = f"{SHM_DIR}/{name}"
    try:
        return PoolSegment.attach(name)
    except OSError as e:
        raise SegmentError(f"cannot open {path} as a kvshm pool: {e.strerror}") from None
    except ValueError:  # mmap of an empty file
        raise SegmentError(f"{path} is empty: not a kvshm pool") from None


def cmd_check(args: argparse.Namespace) -> int:
    from kvshm.core.check import check_segment

    name = segment_name(args.name)
    with attach_pool(name) as seg:
        report = check_segment(seg)
    if args.json:
        print(json.dumps({"name": name, "clean": report.clean,
                          "num_blocks": report.num_blocks,
                          "num_free_blocks": report.num_free_blocks,
                          "num_cached_blocks": report.num_cached_blocks,
                          "num_requests": report.num_requests,
                          "problems": report.problems}, indent=2))
    else:
        print(f"pool {name}: {report.summary()}")
    return 0 if report.clean else 1


def cmd_ls(args: argparse.Namespace) -> int:
    from kvshm.core.segment import list_segments

    rows = list_segments()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no kvshm segments")
    for r in rows:
        state = "live" if r["alive"] else "STALE (owner dead: remove with `kvshm rm " \
            + r["name"] + "`)"
        kind = "KV arena" if r["kind"] == "arena" else "pool"
        print(f"{r['name']}: {kind}, {fmt.nbytes(r['bytes'])}, {fmt.count(r['num_blocks'])} "
              f"blocks, owner pid {r['pid']} {state}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from kvshm.core.segment import list_segments, remove_segment, segment_info
    from kvshm.service.adoption import remove_pool

    if args.stale == bool(args.names):
        print("kvshm rm: name pools to remove, or pass --stale (not both)", file=sys.stderr)
        return 2
    if args.stale:
        for info in list_segments():
            if not info["alive"]:
                remove_segment(info["name"], force=True)
                print(f"removed {info['name']} ({info['kind']} of dead process {info['pid']})")
        return 0
    names = [segment_name(a) for a in args.names]  # all valid, or remove none
    status = 0
    for name in names:
        info = segment_info(name)
        if info is not None and info["kind"] == "arena" and name.endswith(".kv"):
            name = name[:-len(".kv")]   # an arena goes with its pool
        try:
            for removed in remove_pool(name, force=args.force):
                print(f"removed {removed}")
        except KvshmError as e:   # not found, or its owner lives: the others are removed
            print(f"kvshm rm: {e}", file=sys.stderr)
            status = 2
    return status


def cmd_demo(args: argparse.Namespace) -> int:
    from kvshm.core.check import check_segment
    from kvshm.core.manager import KVCacheManager
    from kvshm.core.specs import FullSpec, PoolConfig
    from kvshm.workload import WorkloadSpec, run_workload

    config = PoolConfig(num_blocks=args.num_blocks, hash_block_size=16, max_model_len=4096,
                        groups=(FullSpec(16),), max_num_seqs=256)
    spec = WorkloadSpec(num_requests=args.requests, seed=args.seed)
    print(f"kvshm demo (embedded mode): one pool of {fmt.count(config.num_blocks)} blocks x "
          f"16 tokens, full attention, max_model_len {fmt.count(config.max_model_len)}")
    with KVCacheManager(config) as mgr:
        print(f"  segment /dev/shm/{mgr.segment.name}: {fmt.nbytes(mgr.segment.layout.size)}")
        res = run_workload(mgr, spec)
        report = check_segment(mgr.segment, mgr.block_pool)
        print(f"  {fmt.count(res.finished)} requests served in {fmt.count(res.steps)} "
              f"scheduler steps, {fmt.count(res.preemptions)} preemptions")
        print(f"  prefix-cache hit rate {fmt.percent(res.hit_rate)} of prompt tokens "
              f"({fmt.count(res.hit_tokens)} of {fmt.count(res.prompt_tokens)})")
        print(f"  peak usage {fmt.percent(res.peak_usage)}; {fmt.count(res.manager_calls)} "
              f"manager calls at {fmt.count(res.calls_per_second)} calls/s")
        print(f"  pool check: {report.summary()}")
    traces = Path(args.traces)
    if traces.exists():
        print(f"conformance replay of {traces}:")
        ns = argparse.Namespace(paths=[str(traces)], bench=False, runs=1, json=False,
                                ipc=False, batch=False, batch_size=0, connect=None)
        return cmd_replay(ns) or (0 if report.clean else 1)
    return 0 if report.clean else 1


def cmd_run(args: argparse.Namespace) -> int:
    from kvshm.workers.run import run
    return run(args)


def _preset_names() -> list[str]:
    from kvshm.config import PRESETS
    return list(PRESETS)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvshm.config import PoolSource, resolve_config
    from kvshm.service.loop import run_async
    from kvshm.service.handshake import default_socket_path
    from kvshm.service.server import serve

    config = resolve_config(PoolSource.from_args(args))
    tokens = {}
    for flag, path in (("token", args.token_file), ("admin_token", args.admin_token_file)):
        if path:
            try:
                tokens[flag] = Path(path).read_text().strip()
            except OSError as e:
                print(f"kvshm serve: cannot read {path}: {e.strerror}", file=sys.stderr)
                return 2
            if not tokens[flag]:
                print(f"kvshm serve: {path} is empty", file=sys.stderr)
                return 2
    if args.resume_grace < 0:
        print("kvshm serve: --resume-grace must be >= 0", file=sys.stderr)
        return 2
    kv_events = None
    if args.kv_events_config:
        from kvshm.service.events import KVEventsConfig, import_zmq
        kv_events = KVEventsConfig.from_json(args.kv_events_config)
        if kv_events.publishes:
            import_zmq()
    from kvshm.logs import setup_logging
    from kvshm.ops.tenants import parse_quota
    setup_logging(args.log_level or ("warning" if args.quiet else "info"), args.log_json)
    quotas = dict(parse_quota(q, config.num_blocks - 1) for q in args.tenant_quota)
    if args.metrics_port is not None:
        from kvshm import exporter
        exporter.import_prometheus()
        exporter.check_port_free(args.metrics_port)
    sock = Path(args.socket) if args.socket else default_socket_path(args.name)
    children = []

    def ready(coord) -> None:
        if not args.quiet:
            seg = coord.mgr.segment
            print(f"kvshm coordinator: pool {args.name!r}, {fmt.count(config.num_blocks)} "
                  f"blocks, {len(config.groups)} group(s), caching "
                  f"{'on' if config.enable_caching else 'off'}; segment /dev/shm/{seg.name} "
                  f"({fmt.nbytes(seg.layout.size)}); hash {config.hash_algorithm} "
                  f"fingerprint {coord.fingerprint}", flush=True)
            if coord.arena is not None:
                kv = config.kv
                print(f"kvshm coordinator: KV arena /dev/shm/{coord.arena.name} "
                      f"({fmt.nbytes(coord.arena.layout.size)}: {kv.num_layers} layers x "
                      f"{kv.num_kv_heads} KV heads x {kv.head_size}, {kv.dtype}, "
                      f"{fmt.nbytes(config.kv_block_bytes)} a block, {kv.layout} layout)",
                      flush=True)
        if args.metrics_port is not None:
            children.append(exporter.start_exporter_process(args.name, args.metrics_port))
        print(f"ready {args.name} {sock}", flush=True)

    try:
        run_async(serve(config, name=args.name, socket_path=sock, **tokens,
                        allow_other_uids=args.allow_other_uids, fresh=args.fresh,
                        resume_grace=args.resume_grace, kv_events=kv_events,
                        tenant_quotas=quotas, ready=ready))
    finally:
        for child in children:   # the exporter beside it
            child.terminate()
            child.wait()
    if not args.quiet:
        print("kvshm coordinator: stopped, segment removed", flush=True)
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from kvshm.core.stats import read_stats

    name = segment_name(args.name)
    with attach_pool(name) as seg:
        st = read_stats(seg)
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    n = {k: fmt.count(v) for k, v in st.items() if isinstance(v, int)}
    print(f"pool {name}: {n['num_blocks']} blocks, {n['num_free_blocks']} free, "
          f"{n['num_cached_blocks']} cached, {n['num_used_blocks']} used "
          f"(usage {fmt.percent(st['usage'])})")
    print(f"  requests {n['num_requests']}; prefix cache: {n['queries']} lookups, "
          f"{n['hits']} with a hit; {n['hit_tokens']} of {n['query_tokens']} tokens hit; "
          f"{n['blocks_allocated']} blocks allocated, {n['blocks_evicted']} evicted")
    if st["coordinator_alive"]:
        state = f"(alive), up {st['uptime_s']:.0f}s"
    else:
        state = f"(dead: not running; remove the stale pool with `kvshm rm {name}`)"
    print(f"  coordinator pid {st['coordinator_pid']} {state}, generation {st['generation']}")
    print(f"  preemptions {n['preemptions']}; KV events: {n['events_published']} batches "
          f"published, {n['events_dropped']} dropped")
    for tenant, t in sorted(st["tenants"].items()):
        c = {k: fmt.count(v) for k, v in t.items()}
        quota = "unlimited" if t["quota"] < 0 else f"quota {c['quota']}"
        print(f"  tenant {tenant or '(default)'}: {c['blocks']} blocks ({quota}, "
              f"{c['quota_refusals']} refused); {c['hit_tokens']} of {c['query_tokens']} "
              f"tokens hit")
    for sess in st["sessions"]:
        print(f"  session {sess['session']}: {fmt.count(sess['requests'])} requests, "
              f"{fmt.count(sess['blocks'])} block references")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvshm", description="Host-wide KV-cache block manager",
        epilog="exit status: 0 success; 1 the command found a problem (a check, replay or "
        "run that failed); 2 a usage error, something not found, or a refusal; 130 "
        "interrupted")
    ap.add_argument("--version", action="version", version=f"kvshm {__version__}")
    sub = ap.add_subparsers(dest="command")   # none: main() prints the help

    p = sub.add_parser("run", help="the main job: a coordinator and N pinned CPU workers "
                       "sharing one KV pool on a workload, with a summary")
    from kvshm.workers.run import add_arguments
    add_arguments(p)
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("replay", help="replay conformance traces in embedded mode")
    p.add_argument("paths", nargs="+", help=".jsonl/.jsonl.gz files or directories")
    p.add_argument("--bench", action="store_true", help="also time each trace (median of --runs)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--ipc", action="store_true",
                   help="replay through a coordinator process and the client")
    p.add_argument("--batch", action="store_true",
                   help="with --ipc: send ops in batches (scheduler-step frames)")
    p.add_argument("--batch-size", type=int, default=64, help="ops per batch (64)")
    p.add_argument("--connect", metavar="SOCKET",
                   help="with --ipc: replay through the coordinator already listening at "
                   "SOCKET (a fresh pool of the trace's config), e.g. to check its KV-event "
                   "stream")
    p.set_defaults(fn=cmd_replay)

    p = sub.add_parser("events", help="follow a KV-event stream (kvshm serve "
                       "--kv-events-config, or a vLLM engine's) and print its events as JSON "
                       "lines: {seq, ts, rank, event}")
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5557",
                   help="the publisher's endpoint (%(default)s; a bound tcp://*:PORT means "
                   "this host)")
    p.add_argument("--replay-endpoint", help="its replay endpoint: fills gaps, and --from")
    p.add_argument("--from", dest="from_seq", type=int, metavar="SEQ",
                   help="start with the buffered batches from SEQ (0: all it kept)")
    p.add_argument("--topic", default="", help="subscribe to this topic (prefix)")
    p.add_argument("--count", type=int, default=0, help="stop after N events")
    p.add_argument("--idle-timeout", type=float, metavar="S",
                   help="stop after S seconds without a batch (default: follow forever)")
    p.set_defaults(fn=cmd_events)

    from kvshm.ops.sessions import DEFAULT_RESUME_GRACE
    p = sub.add_parser("serve", help="run the coordinator in the foreground")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="pool config file (.toml or .json)")
    src.add_argument("--preset", help="a model-shaped preset: " + ", ".join(_preset_names()))
    src.add_argument("--vllm-model", metavar="DIR",
                     help="a pool for vLLM engines serving the model in DIR (its "
                     "config.json): one KV-cache group, the arena laid out as vLLM's CPU "
                     "attention tensors, vLLM's sha256 block hashes (docs/vllm.md)")
    p.add_argument("--block-size", type=int,
                   help="with --vllm-model: tokens per block (vLLM's CPU default, 128)")
    from kvshm.core.specs import KV_DTYPES
    p.add_argument("--dtype", choices=("auto", *KV_DTYPES),
                   help="with --vllm-model: the KV dtype (auto: as vLLM picks it)")
    p.add_argument("--max-model-len", type=int,
                   help="with --vllm-model: longest request (default: the model's)")
    from kvshm.core.hashing import HASH_ALGORITHMS
    p.add_argument("--hash-algorithm", choices=HASH_ALGORITHMS,
                   help="block hash algorithm (overrides the config's; vLLM engines need "
                   "vllm-sha256 or vllm-sha256-cbor)")
    p.add_argument("--hash-seed", help="block hash seed (overrides the config's; for vLLM "
                   "algorithms the engines' PYTHONHASHSEED)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, help="pool size in blocks")
    from kvshm.config import DEFAULT_KV_MEMORY
    size.add_argument("--kv-memory",
                      help="KV memory budget (e.g. 4G) -> blocks (needs a KV shape; a "
                      f"preset or --vllm-model without a size gets {DEFAULT_KV_MEMORY})")
    p.add_argument("--name", default="kvshm", help="pool name: segment and socket names")
    p.add_argument("--socket", help="socket path (default: per-user runtime dir)")
    p.add_argument("--token-file", help="clients must present this file's content")
    p.add_argument("--admin-token-file",
                   help="sessions presenting this file's content may reset the prefix "
                   "cache, evict blocks and read the free queue (default: a random token "
                   "written, 0600, to SOCKET.admin-token)")
    p.add_argument("--fresh", action="store_true",
                   help="discard a dead coordinator's pool and KV arena instead of adopting "
                   "them")
    p.add_argument("--resume-grace", type=float, default=DEFAULT_RESUME_GRACE, metavar="S",
                   help="after adopting a pool, how long its sessions may take to resume "
                   "before their requests are freed (%(default)s)")
    p.add_argument("--allow-other-uids", action="store_true",
                   help="accept clients of other users (default: same uid only)")
    p.add_argument("--kv-events-config", metavar="JSON",
                   help="publish KV-cache events as vLLM does, for KV-aware routers: vLLM's "
                   "KVEventsConfig fields as JSON, e.g. '{\"enable_kv_cache_events\": true, "
                   "\"endpoint\": \"tcp://*:5557\"}' (needs kvshm[events]; docs/events.md)")
    p.add_argument("--tenant-quota", action="append", default=[], metavar="NAME=N|P%",
                   help="the most blocks tenant NAME's sessions may hold, a count or a "
                   "percentage of the pool (repeatable; `=N` is the default tenant); "
                   "beyond it its allocations fail as on a full pool")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="also serve the pool's Prometheus metrics on PORT (a `kvshm "
                   "metrics` process beside the coordinator; needs kvshm[metrics])")
    from kvshm.logs import LEVELS
    p.add_argument("--log-level", choices=LEVELS,
                   help="log threshold (default info; warning with --quiet)")
    p.add_argument("--log-json", action="store_true", help="log JSON lines")
    p.add_argument("--quiet", action="store_true", help="print only the ready line")
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("metrics", help="serve a pool's Prometheus metrics, read from its "
                       "segment (no socket)")
    from kvshm import exporter
    exporter.add_arguments(p)
    p.set_defaults(fn=exporter.main)

    p = sub.add_parser("top", help="a live view of a pool, read from its segment")
    from kvshm import top
    top.add_arguments(p)
    p.set_defaults(fn=top.main)

    p = sub.add_parser("stats", help="pool statistics, read from the segment directly")
    p.add_argument("name", nargs="?", default="kvshm", help="pool name (default kvshm)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_stats)

    p = sub.add_parser("check", help="verify the invariants of a pool segment")
    p.add_argument("name", help="segment name (see `kvshm ls`)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_check)

    p = sub.add_parser("ls", help="list kvshm pool segments in /dev/shm")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_ls)

    p = sub.add_parser("rm", help="remove pools (each with its KV arena) whose owner is dead")
    p.add_argument("names", nargs="*", help="pool names (or /dev/shm paths)")
    p.add_argument("--stale", action="store_true",
                   help="remove every kvshm segment whose owner is dead")
    p.add_argument("--force", action="store_true", help="even if the owner is alive")
    p.set_defaults(fn=cmd_rm)

    p = sub.add_parser("demo", help="run a synthetic workload on an embedded pool")
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--traces", default=os.environ.get("KVSHM_TRACES", str(REPO_TRACES)),
                   help="conformance traces to replay afterwards (skipped if absent)")
    p.set_defaults(fn=cmd_demo)
    return ap


def cmd_events(args: argparse.Namespace) -> int:
    import msgspec

    from kvshm.service.events import EventSubscriber

    if args.from_seq is not None and args.from_seq < 0:
        print("kvshm events: --from must be >= 0", file=sys.stderr)
        return 2
    if args.from_seq is not None and not args.replay_endpoint:
        print("kvshm events: --from needs --replay-endpoint (where the buffered batches "
              "are asked for)", file=sys.stderr)
        return 2

    def gap(first: int, nxt: int) -> None:
        print(f"kvshm events: batches {first}..{nxt - 1} missed (not in the publisher's "
              "replay buffer, or no --replay-endpoint)", file=sys.stderr)

    sub = EventSubscriber(args.endpoint, replay_endpoint=args.replay_endpoint,
                          topic=args.topic, from_seq=args.from_seq, on_gap=gap)
    encode = msgspec.json.Encoder().encode
    out = sys.stdout.buffer
    n = 0
    try:
        for seq, batch in sub.batches(idle_timeout=args.idle_timeout):
            ts, events = batch[0], batch[1]
            rank = batch[2] if len(batch) > 2 else None
            for event in events:
                out.write(encode({"seq": seq, "ts": ts, "rank": rank, "event": event}) + b"\n")
                n += 1
                if args.count and n >= args.count:
                    out.flush()
                    return 0
            out.flush()
    except KeyboardInterrupt:
        return 130
    except TimeoutError as e:   # nothing answers at --replay-endpoint
        print(f"kvshm events: {e}", file=sys.stderr)
        return 2
    finally:
        sub.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] == ["serve"]:
        # A coordinator: a stop signal from now on stops it cleanly once up.
        from kvshm.service.process import defer_stop_signals
        defer_stop_signals()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:   # a usage error: the help, on stderr, exit 2
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.fn(args)
    except KvshmError as e:
        print(f"kvshm {args.command}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `kvshm replay ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
