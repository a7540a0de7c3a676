"""`kvshm events`: follow a KV-event stream (`kvshm serve --kv-events-config`,
or a vLLM engine's) and print its events as JSON lines."""

from __future__ import annotations

import argparse
import sys

import msgspec

from kvshm.service.events import EventSubscriber

HELP = ("follow a KV-event stream (kvshm serve --kv-events-config, or a vLLM engine's) "
        "and print its events as JSON lines: {seq, ts, rank, event}")


def add_arguments(p: argparse.ArgumentParser) -> None:
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


def main(args: argparse.Namespace) -> int:
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
