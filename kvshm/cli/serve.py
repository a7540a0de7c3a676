"""`kvshm serve`: the coordinator in the foreground."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvshm.cli import metrics
from kvshm.cli.logs import LEVELS, setup_logging
from kvshm.config import PoolSource, add_pool_arguments, resolve_config, serve_options
from kvshm.core import fmt
from kvshm.core.errors import ConfigError
from kvshm.ops.sessions import DEFAULT_RESUME_GRACE
from kvshm.ops.tenants import parse_quota
from kvshm.service.events import KVEventsConfig, import_zmq
from kvshm.service.handshake import default_socket_path
from kvshm.service.loop import run_async
from kvshm.service.server import serve
from kvshm.service.tenant_auth import TenantAuth

HELP = "run the coordinator in the foreground"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_pool_arguments(p, required=True)
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
    p.add_argument("--group", metavar="G",
                   help="share the pool with the users of group G (a name or a gid): the "
                   "socket 0660 and its directory 0750, the segments and the KV arena 0660, "
                   "of group G; clients of other uids are accepted (the OS lets only G's "
                   "members in).  The admin token stays 0600")
    p.add_argument("--kv-events-config", metavar="JSON",
                   help="publish KV-cache events as vLLM does, for KV-aware routers: vLLM's "
                   "KVEventsConfig fields as JSON, e.g. '{\"enable_kv_cache_events\": true, "
                   "\"endpoint\": \"tcp://*:5557\"}' (needs kvshm[events]; docs/events.md)")
    p.add_argument("--tenant", action="append", default=[], metavar="NAME=PROOF",
                   help="declare tenant NAME and how its sessions prove it: uid:N (the "
                   "client runs as user N), gid:N (in group N) or token:FILE (its Hello "
                   "carries FILE's content; FILE must be mode 0600).  Repeatable; with any "
                   "tenant declared, a session claiming an undeclared or unproven tenant is "
                   "refused (`=PROOF` declares the default tenant)")
    p.add_argument("--tenant-quota", action="append", default=[], metavar="NAME=N|P%",
                   help="the most blocks tenant NAME's sessions may hold, a count or a "
                   "percentage of the pool (repeatable; `=N` is the default tenant); "
                   "beyond it its allocations fail as on a full pool")
    p.add_argument("--no-reserve-arena", dest="reserve_arena", action="store_false",
                   help="leave the KV arena's pages to be allocated at first touch "
                   "(first-touch NUMA placement) instead of when the pool is made or "
                   "adopted; a /dev/shm filled later then kills the process that "
                   "touches a new page (SIGBUS)")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="also serve the pool's Prometheus metrics on PORT (a `kvshm "
                   "metrics` process beside the coordinator; needs kvshm[metrics])")
    p.add_argument("--log-level", choices=LEVELS,
                   help="log threshold (default info; warning with --quiet)")
    p.add_argument("--log-json", action="store_true", help="log JSON lines")
    p.add_argument("--quiet", action="store_true", help="print only the ready line")


def main(args: argparse.Namespace) -> int:
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
    group = None if args.group is None else resolve_group(args.group)
    if args.resume_grace < 0:
        print("kvshm serve: --resume-grace must be >= 0", file=sys.stderr)
        return 2
    kv_events = None
    if args.kv_events_config:
        kv_events = KVEventsConfig.from_json(args.kv_events_config)
        if kv_events.publishes:
            import_zmq()
    setup_logging(args.log_level or ("warning" if args.quiet else "info"), args.log_json)
    file_opts = serve_options(args.config)
    quotas = dict(parse_quota(q, config.num_blocks - 1)
                  for q in file_opts["tenant_quota"] + args.tenant_quota)
    tenant_auth = TenantAuth.from_specs(file_opts["tenant"] + args.tenant)
    if args.metrics_port is not None:
        metrics.import_prometheus()
        metrics.check_port_free(args.metrics_port)
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
            if tenant_auth.declared:
                for line in tenant_auth.describe():
                    print(f"kvshm coordinator: {line}", flush=True)
        if args.metrics_port is not None:
            children.append(metrics.start_exporter_process(args.name, args.metrics_port))
        print(f"ready {args.name} {sock}", flush=True)

    try:
        run_async(serve(config, name=args.name, socket_path=sock, **tokens,
                        allow_other_uids=args.allow_other_uids, fresh=args.fresh,
                        resume_grace=args.resume_grace, kv_events=kv_events,
                        tenant_quotas=quotas, tenant_auth=tenant_auth, group=group,
                        reserve_arena=args.reserve_arena,
                        ready=ready))
    finally:
        for child in children:   # the exporter beside it
            child.terminate()
            child.wait()
    if not args.quiet:
        print("kvshm coordinator: stopped, segment removed", flush=True)
    return 0


def resolve_group(spec: str) -> int:
    """`--group`'s gid (a group name or number).  Raises ConfigError when
    there is no such group, or this user may not give files to it (only
    root may give them to a group it is not in)."""
    import grp
    try:
        gid = int(spec) if spec.isdigit() else grp.getgrnam(spec).gr_gid
    except KeyError:
        raise ConfigError("group", f"no group named {spec!r}") from None
    if os.geteuid() != 0 and gid not in (os.getegid(), *os.getgroups()):
        raise ConfigError("group", f"this user (uid {os.geteuid()}) is not in group {spec!r}, "
                          "so it cannot give the pool's files to it")
    return gid
