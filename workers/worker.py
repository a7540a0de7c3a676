"""One CPU worker process: pins itself, connects to the coordinator, maps the
KV arena and runs the engine on its share of the workload.

The launcher (`workers/launcher.py`) starts it as `python -m kvshm.workers.worker
SPEC`, SPEC being a `WorkerSpec` as JSON, and reads its reports from stdout
(`Ready`, `Progress`, then `Done` or `Failed`; workers/channel.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time

import msgspec

from kvshm.workers.channel import Done, Failed, Progress, Ready, WorkerSpec, emit
from kvshm.workload.spec import WorkloadSpec, workload_stream
from kvshm.workers.turns import TurnBoard, assign


def workload_items(workload: WorkloadSpec, index: int, num_workers: int):
    """Worker `index`'s share (of `num_workers`) of the workload's items."""
    return assign(workload_stream(workload), index, num_workers, workload.assign)


async def wait_for_start() -> None:
    """Wait for the launcher's "start" line on stdin (every worker is Ready);
    raises RuntimeError if stdin ends first."""
    line = await asyncio.to_thread(sys.stdin.readline)
    if line.strip() != "start":
        raise RuntimeError("stdin closed before the launcher said start")


async def serve_worker(spec: WorkerSpec) -> int:
    from kvshm.service.client import connect
    from kvshm.service.resume import Reconnect
    from kvshm.workers.engine import Engine
    from kvshm.workers.engine_types import EngineStats

    client = await connect(spec.socket, node=spec.node, hash_algorithm=spec.hash_algorithm,
                           hash_seed=spec.hash_seed,
                           reconnect=Reconnect(timeout=spec.reconnect_timeout))
    arena = turns = None
    try:
        arena = client.attach_arena()
        if spec.turns:
            turns = TurnBoard.attach(spec.turns)
        stats = EngineStats()
        engine = Engine(client, arena, client.config, spec.engine, stats, turns=turns,
                        worker=spec.index)
        emit(Ready(spec.index, pid=os.getpid(), session=client.session_id,
                   cpus=tuple(sorted(os.sched_getaffinity(0))),
                   model=engine.compute.fingerprint()))
        items = workload_items(spec.workload, spec.index, spec.num_workers)
        if spec.wait_for_start:
            await wait_for_start()
        t0 = time.monotonic()
        last = [t0]

        running = [engine]   # emptied before the arena views are dropped

        def stopped() -> None:
            # The launcher stops us (Ctrl-C): report everything done so far,
            # samples included, then exit.
            if running:
                running[0].restart_stats()
            try:
                emit(Progress(spec.index, elapsed=time.monotonic() - t0, stats=stats))
            except OSError:
                pass   # the launcher is gone (SIGKILLed: this SIGTERM is its PDEATHSIG)
            raise SystemExit(128 + signal.SIGTERM)

        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stopped)

        def on_step(st: EngineStats) -> None:
            now = time.monotonic()
            if now - last[0] >= spec.progress:
                st.coordinator_restarts = len(client.restarts)
                last[0] = now
                emit(Progress(spec.index, elapsed=now - t0, stats=st.without_samples()))

        await engine.run(items, t0 + spec.duration, on_step,
                         hard_deadline=t0 + spec.duration + spec.grace)
        seconds = time.monotonic() - t0
        loop.remove_signal_handler(signal.SIGTERM)
        engine.restart_stats()
        running.clear()
        del engine   # drop the arena views before unmapping
        emit(Done(spec.index, seconds=seconds, stats=stats))
        return 0
    finally:
        if turns is not None:
            turns.close()
        if arena is not None:
            try:
                arena.close()
            except Exception:   # noqa: BLE001 - views still alive at an error exit
                pass
        await client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvshm.workers.worker",
                                 description="one kvshm CPU worker (started by kvshm run)")
    ap.add_argument("spec", help="the worker's WorkerSpec as JSON (workers/channel.py)")
    args = ap.parse_args(argv)
    # Ctrl-C goes to the whole process group; the launcher decides what stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        spec = WorkerSpec.decode(args.spec)
    except msgspec.DecodeError as e:
        emit(Failed(-1, message=f"bad worker spec: {e}"))
        return 2
    try:
        if spec.cpus:
            from kvshm.workers.topology import pin
            pin(spec.cpus)
        from kvshm.service.loop import run_async
        return run_async(serve_worker(spec))
    except Exception as e:   # noqa: BLE001 - reported to the launcher, not a traceback
        emit(Failed(spec.index, message=f"{type(e).__name__}: {e}"))
        return 1


if __name__ == "__main__":
    sys.exit(main())
