"""One CPU worker process: pins itself, connects to the coordinator, maps the
KV arena and runs the engine on its share of the workload.

It talks to its launcher through stdout, one JSON object a line: `ready`
(pid, CPUs, session), `progress` (every --progress seconds), then `done`
with the full figures, or `error` with a message (exit status 1).  The
launcher (`workers/launcher.py`) starts it as `python -m workers.worker`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import time
from dataclasses import asdict

from workers.traffic import SyntheticSpec, assign, load_jsonl, synthetic


def workload_items(workload: dict, index: int, num_workers: int):
    """This worker's share of the workload described by `workload`:
    {"kind": "synthetic", "spec": {...SyntheticSpec fields}} or
    {"kind": "jsonl", "path": ..., "vocab", "max_len"}; plus "assign" and
    "limit" (only the first `limit` items of the whole workload)."""
    kind = workload.get("kind")
    if kind == "synthetic":
        spec = dict(workload.get("spec", {}))
        for key in ("system_len", "user_len", "output_len"):
            if key in spec:
                spec[key] = tuple(spec[key])
        items = synthetic(SyntheticSpec(**spec))
    elif kind == "jsonl":
        items = load_jsonl(workload["path"], vocab=workload.get("vocab", 32000),
                           max_len=workload.get("max_len", 4096))
    else:
        raise ValueError(f"unknown workload kind {kind!r} (synthetic, jsonl)")
    if workload.get("limit") is not None:
        items = itertools.islice(items, workload["limit"])
    return assign(items, index, num_workers, workload.get("assign", "round-robin"))


def _emit(event: str, **fields) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def _progress(stats) -> dict:
    return {"finished": stats.finished, "prompt_tokens": stats.prompt_tokens,
            "hit_tokens": stats.hit_tokens, "cross_hit_tokens": stats.cross_hit_tokens,
            "computed_tokens": stats.computed_tokens,
            "generated_tokens": stats.generated_tokens, "preemptions": stats.preemptions,
            "integrity_failures": stats.integrity_failures,
            "coordinator_restarts": stats.coordinator_restarts}


async def serve_worker(args) -> int:
    from kvshm.service.client import connect
    from kvshm.service.resume import Reconnect
    from workers.engine import Engine, EngineOptions, EngineStats

    cfg_hash = json.loads(args.hash) if args.hash else {}
    client = await connect(args.socket, node=args.node, **cfg_hash,
                           reconnect=Reconnect(timeout=args.reconnect_timeout))
    arena = None
    try:
        arena = client.attach_arena()
        opts = EngineOptions(**json.loads(args.options))
        stats = EngineStats()
        engine = Engine(client, arena, client.config, opts, stats)
        _emit("ready", index=args.index, pid=os.getpid(), session=client.session_id,
              cpus=sorted(os.sched_getaffinity(0)), model=engine.model.fingerprint())
        items = workload_items(json.loads(args.workload), args.index, args.num_workers)
        t0 = time.monotonic()
        last = [t0]

        def on_step(st) -> None:
            now = time.monotonic()
            if now - last[0] >= args.progress:
                st.coordinator_restarts = len(client.restarts)
                last[0] = now
                _emit("progress", index=args.index, elapsed=now - t0, **_progress(st))

        await engine.run(items, t0 + args.duration, on_step,
                         hard_deadline=t0 + args.duration + args.grace)
        seconds = time.monotonic() - t0
        engine.restart_stats()
        del engine   # drop the arena views before unmapping
        report = asdict(stats)
        report.update(integrity_failures=stats.integrity_failures, seconds=seconds)
        _emit("done", index=args.index, **report)
        return 0
    finally:
        if arena is not None:
            try:
                arena.close()
            except Exception:   # noqa: BLE001 - views still alive at an error exit
                pass
        await client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workers.worker",
                                 description="one kvshm CPU worker (started by kvshm run)")
    ap.add_argument("--socket", required=True, help="the coordinator's socket")
    ap.add_argument("--index", type=int, default=0, help="this worker's index")
    ap.add_argument("--num-workers", type=int, default=1)
    ap.add_argument("--node", type=int, default=-1, help="NUMA node (reported in Hello)")
    ap.add_argument("--cpus", default="", help="CPU list to pin to, e.g. 0-3,8")
    ap.add_argument("--workload", default='{"kind": "synthetic"}', help="JSON workload")
    ap.add_argument("--options", default="{}", help="JSON EngineOptions fields")
    ap.add_argument("--hash", default="", help='JSON {"hash_algorithm", "hash_seed"}')
    ap.add_argument("--duration", type=float, default=30.0, help="seconds admitting requests")
    ap.add_argument("--grace", type=float, default=10.0,
                    help="seconds after --duration for running requests to finish "
                         "before they are aborted")
    ap.add_argument("--progress", type=float, default=0.5, help="seconds between reports")
    ap.add_argument("--reconnect-timeout", type=float, default=60.0,
                    help="how long to wait for a restarted coordinator before giving up")
    args = ap.parse_args(argv)
    # Ctrl-C goes to the whole process group; the launcher decides what stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if args.cpus:
            from workers.topology import parse_cpulist, pin
            pin(parse_cpulist(args.cpus))
        from kvshm.service.loop import run_async
        return run_async(serve_worker(args))
    except Exception as e:   # noqa: BLE001 - reported to the launcher, not a traceback
        _emit("error", index=args.index, message=f"{type(e).__name__}: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
