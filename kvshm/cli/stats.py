"""`kvshm stats`: a pool's statistics, read from its segment directly."""

from __future__ import annotations

import argparse
import json

from kvshm.cli.common import add_name_argument, attach_named
from kvshm.core import fmt
from kvshm.pool.stats import read_stats

HELP = "pool statistics, read from the segment directly"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_name_argument(p)
    p.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    with attach_named(args.name) as (name, seg):
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
    if st["corrupt_blocks_reported"]:
        print(f"  CORRUPT blocks: {n['corrupt_blocks_reported']} reported by engines, "
              f"{n['corrupt_blocks_evicted']} uncached with the blocks computed from them "
              "(look at the host: something wrote into the KV arena)")
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
