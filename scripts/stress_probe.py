#!/usr/bin/env python3
"""The latency probe of scripts/numa_stress.py: one process per node that
sends the smallest operation there is (`GetStats`, one op per frame, over
the blocking client) at a fixed rate and prints each round trip.

    python scripts/stress_probe.py SOCKET --rate 100 --seconds 60 [--cpus 0,1] [--resume]

Prints "ready" once connected, then one line per call: the wall-clock time
it was sent (time.time()) and its round trip in microseconds.  With
--resume its client rides through a coordinator restart as the clients
do (reconnect with backoff, resume the session, send the call again), so
the call a kill cuts off is timed until the next coordinator answers it.  It stops
after --seconds, or as soon as its stdin closes (the stress script's way of
stopping it), and exits 0.  Calls are paced from a fixed schedule, so a slow
reply delays the next call but does not shift the schedule.
"""

from __future__ import annotations

import argparse
import select
import signal
import sys
import time

from kvshm.core.hashing import DEFAULT_HASH_ALGORITHM, DEFAULT_HASH_SEED


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="stress_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("socket")
    ap.add_argument("--rate", type=float, default=100.0, help="calls per second (100)")
    ap.add_argument("--seconds", type=float, default=60.0, help="stop after this long (60)")
    ap.add_argument("--cpus", default="", help="pin to these CPUs (a cpulist, e.g. 0-3)")
    ap.add_argument("--node", type=int, default=-1, help="the node named in the handshake")
    ap.add_argument("--hash-algorithm", default=DEFAULT_HASH_ALGORITHM)
    ap.add_argument("--hash-seed", default=DEFAULT_HASH_SEED)
    ap.add_argument("--resume", action="store_true",
                    help="ride through coordinator restarts (default: a lost coordinator "
                         "ends the probe)")
    args = ap.parse_args(argv)
    if args.rate <= 0 or args.seconds <= 0:
        ap.error("--rate and --seconds must be positive")
    # The stress script stops us (stdin closes); Ctrl-C is its to handle.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if args.cpus:
        from kvshm.workers.topology import parse_cpulist, pin
        pin(parse_cpulist(args.cpus))
    from kvshm.service.sync_client import connect_sync
    client = connect_sync(args.socket, node=args.node, hash_algorithm=args.hash_algorithm,
                          hash_seed=args.hash_seed, resume=args.resume)
    out = sys.stdout
    try:
        out.write("ready\n")
        out.flush()
        period = 1.0 / args.rate
        start = time.monotonic()
        end = start + args.seconds
        due = start
        clock, wall = time.perf_counter, time.time
        while True:
            due += period
            now = time.monotonic()
            if due >= end:
                break
            # Sleep until the next call is due, waking at once if stdin closes.
            if select.select([sys.stdin], [], [], max(0.0, due - now))[0]:
                if not sys.stdin.readline():
                    break
            sent = wall()
            t0 = clock()
            client.stats()
            rtt = clock() - t0
            out.write(f"{sent:.6f} {rtt * 1e6:.1f}\n")
            out.flush()
    except BrokenPipeError:   # the stress script is gone
        pass
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
