#!/usr/bin/env python3
"""Round trip of the synchronous client against a raw blocking-socket echo
of the same frame, measured in one run.

    .venv/bin/python scripts/bench_sync_client.py [--rounds N] [--json OUT]

Three figures per frame, each the median (and p99) of `--rounds` round trips:
- `echo`: a blocking client sends the frame's bytes to a blocking echo
  server process and reads them back (the transport's floor); `uvloop_echo`
  the same against an asyncio echo server on uvloop (the coordinator's
  event loop, without its work); `shm_echo` the same bytes through a
  shared-memory slot each way with an eventfd wake-up (`ShmEcho`: the
  transport issue 22 lists as a candidate, measured beside the socket);
- `raw`: the same blocking client sends the frame to a coordinator and reads
  the reply bytes (the coordinator's work, no client-side encode/decode);
- `sync`: `SyncClient.request(msg)` to the coordinator (what vLLM engines
  pay per call).
The frames: `GetBlockIds` of a held request, and the Batch the plugin sends
for a running request's allocation (Advance + AllocateSlots, freed again).

Every figure is taken with the processes pinned, in two placements, since
on a VM a wake-up across CPUs costs several times one on the same CPU (and
an unpinned run lands on either at the scheduler's whim):
- `separate_cpus`: the client on CPU 0, each server (echo or coordinator)
  on CPU 1, as an engine and its coordinator run (the figures at the top
  level of each frame's JSON, `sync_vs_echo_p50` among them);
- `same_cpu`: client and server on CPU 0.
On a one-CPU host only `same_cpu` is measured.  Prints a table and writes
JSON (default bench-results/sync_client.json), with the CPU time the
coordinator spent per round trip in each placement.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import socket
import statistics
import struct
import tempfile
import time

from bench_common import add_json_argument, cpu_seconds, write_results
from kvshm.core.metrics import percentile
from kvshm.core.specs import FullSpec, PoolConfig
from kvshm.ops import protocol as p
from kvshm.ops.protocol import encode_frame
from kvshm.service.handshake import make_hello
from kvshm.service.process import CoordinatorProcess
from kvshm.service.sync_client import connect_sync, open_wire_sync

CONFIG = PoolConfig(num_blocks=4096, hash_block_size=16, max_model_len=4096,
                    groups=(FullSpec(16),), max_num_seqs=64)


def _echo_server(path: str, ready) -> None:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    ready.set()
    conn, _ = srv.accept()
    while True:
        data = conn.recv(1 << 16)
        if not data:
            return
        conn.sendall(data)


def _uvloop_echo_server(path: str, ready) -> None:
    import asyncio

    import uvloop

    class Echo(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport

        def data_received(self, data):
            self.transport.write(data)

    async def main():
        server = await asyncio.get_running_loop().create_unix_server(Echo, path)
        ready.set()
        async with server:
            await server.serve_forever()

    uvloop.run(main())


_SEQ, _LEN = struct.Struct("Q"), struct.Struct("I")


def _await_seq(mm: mmap.mmap, at: int, seq: int, wake: int) -> None:
    """Sleep on eventfd `wake` until the sequence number at `at` is `seq`
    (a wake-up left from a frame already seen just costs another read)."""
    while _SEQ.unpack_from(mm, at)[0] != seq:
        os.eventfd_read(wake)


class ShmEcho:
    """An echo over shared memory: one slot each way in a map the forked
    server shares (its sequence number at 0, the frame's length at 8, the
    frame from 64), and an eventfd each way to wake the side that sleeps in
    a blocking read of it, as a coordinator would in its event loop.  The
    frame is copied in, then its sequence number stored: on x86 (stores are
    seen in order) the other side reads the frame whole once it sees the
    number.  No spin: every round trip wakes the server and then the
    client, as a socket round trip does."""

    SLOT = 1 << 16
    REPLY = 64 + SLOT

    def __init__(self, ctx) -> None:
        self.map = mmap.mmap(-1, 2 * self.REPLY)    # MAP_SHARED: the fork shares it
        self.to_server, self.to_client = os.eventfd(0), os.eventfd(0)
        self.seq = 0
        self.proc = ctx.Process(target=self._serve, daemon=True)
        self.proc.start()

    def _serve(self) -> None:
        mm, reply, seq = self.map, self.REPLY, 0
        while True:
            seq += 1
            _await_seq(mm, 0, seq, self.to_server)
            n = _LEN.unpack_from(mm, 8)[0]
            mm[reply + 64:reply + 64 + n] = mm[64:64 + n]
            _LEN.pack_into(mm, reply + 8, n)
            _SEQ.pack_into(mm, reply, seq)
            os.eventfd_write(self.to_client, 1)

    def round_trip(self, frame: bytes) -> bytes:
        mm, reply, n = self.map, self.REPLY, len(frame)
        self.seq += 1
        mm[64:64 + n] = frame
        _LEN.pack_into(mm, 8, n)
        _SEQ.pack_into(mm, 0, self.seq)
        os.eventfd_write(self.to_server, 1)
        _await_seq(mm, reply, self.seq, self.to_client)
        return mm[reply + 64:reply + 64 + _LEN.unpack_from(mm, reply + 8)[0]]

    def close(self) -> None:
        """Stop the server; release the map and the eventfds."""
        self.proc.kill()
        self.proc.join(5)
        self.map.close()
        os.close(self.to_server)
        os.close(self.to_client)


def _read_frame(sock: socket.socket) -> None:
    buf = sock.recv(1 << 16)
    size = int.from_bytes(buf[:4], "little") + 4
    while len(buf) < size:
        buf += sock.recv(1 << 16)


def _time(fn, rounds: int) -> dict:
    for _ in range(min(200, rounds)):
        fn()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(rounds):
        t = clock()
        fn()
        samples.append(clock() - t)
    return {"p50_us": percentile(samples, 50) / 1e3, "p99_us": percentile(samples, 99) / 1e3}


class RawSession:
    """Just enough of a client to set up the raw session's requests."""

    def __init__(self, wire) -> None:
        self.wire = wire

    def _call(self, msg) -> None:
        self.wire.send(encode_frame(msg))
        reply = self.wire.receive(10)
        if reply.__class__ is p.Error:
            raise RuntimeError(reply.message)

    def add_request(self, req, prompt):
        self._call(p.AddRequest(req, prompt))

    def allocate_slots(self, req, n):
        self._call(p.AllocateSlots(req, n))

    def advance(self, req, n):
        self._call(p.Advance(req, n))


def frames(client, tag: str) -> dict:
    """The measured messages, on requests of `client` named after `tag`
    (request ids are the pool's: each session needs its own)."""
    held, run_ = f"held-{tag}", f"run-{tag}"
    client.add_request(held, list(range(100)))
    client.allocate_slots(held, 100)
    client.add_request(run_, list(range(1000, 1100)))
    client.allocate_slots(run_, 100)
    client.advance(run_, 100)
    # The same state each time: computed stays 100, one more slot is held.
    step = p.Batch([p.Advance(run_, 100), p.AllocateSlots(run_, 1)])
    return {"get_block_ids": p.GetBlockIds(held), "alloc_step": step}


def placements(cpus: list[int]) -> dict[str, tuple[set[int], set[int]]]:
    """Placement name -> (the client's CPUs, the servers' CPUs), on `cpus`."""
    out = {"same_cpu": ({cpus[0]}, {cpus[0]})}
    if len(cpus) > 1:
        out = {"separate_cpus": ({cpus[0]}, {cpus[1]}), **out}
    return out


def run(rounds: int) -> dict:
    out = {"rounds": rounds, "cpus": os.cpu_count(), "frames": {}}
    home = os.sched_getaffinity(0)
    try:
        return _run(rounds, out, placements(sorted(home)))
    finally:
        os.sched_setaffinity(0, home)


def _run(rounds: int, out: dict, layouts_to_measure: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvshm-bench-") as d, \
            CoordinatorProcess(CONFIG) as coord:
        ctx = mp.get_context("fork")
        servers, socks = [], {}
        for key, target in (("echo", _echo_server), ("uvloop_echo", _uvloop_echo_server)):
            path = os.path.join(d, f"{key}.sock")
            ready = ctx.Event()
            proc = ctx.Process(target=target, args=(path, ready), daemon=True)
            proc.start()
            ready.wait(10)
            socks[key] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            socks[key].connect(path)
            servers.append(proc)
        shm = ShmEcho(ctx)
        client = connect_sync(coord.socket, hash_algorithm=CONFIG.hash_algorithm,
                              hash_seed=CONFIG.hash_seed)
        raw, _ = open_wire_sync(coord.socket, make_hello(
            coord.socket, hash_algorithm=CONFIG.hash_algorithm, hash_seed=CONFIG.hash_seed), 10)
        msgs = frames(client, "sync")
        raw_msgs = frames(RawSession(raw), "raw")
        rsock = raw.sock
        for name, msg in msgs.items():
            frame = bytes(encode_frame(raw_msgs[name]))

            def echo_rt(sock=socks["echo"]):
                sock.sendall(frame)
                _read_frame(sock)

            def uv_rt(sock=socks["uvloop_echo"]):
                sock.sendall(frame)
                _read_frame(sock)

            if shm.round_trip(frame) != frame:
                raise RuntimeError("the shared-memory echo returned other bytes")

            def shm_rt():
                shm.round_trip(frame)

            def raw_rt():
                rsock.sendall(frame)
                _read_frame(rsock)

            def sync_rt():
                client.request(msg)

            layouts = {}
            for where, (mine, theirs) in layouts_to_measure.items():
                os.sched_setaffinity(0, mine)
                for pid in (coord.proc.pid, shm.proc.pid, *(proc.pid for proc in servers)):
                    os.sched_setaffinity(pid, theirs)
                row = {"frame_bytes": len(frame), "client_cpus": sorted(mine),
                       "server_cpus": sorted(theirs)}
                # Interleave the five, three times, so drift hits all alike.
                parts = {"echo": [], "uvloop_echo": [], "shm_echo": [], "raw": [], "sync": []}
                cpu = 0.0
                for _ in range(3):
                    for key, fn in (("echo", echo_rt), ("uvloop_echo", uv_rt),
                                    ("shm_echo", shm_rt), ("raw", raw_rt), ("sync", sync_rt)):
                        before = cpu_seconds(coord.proc.pid)
                        parts[key].append(_time(fn, rounds // 3))
                        if key == "sync":
                            cpu += cpu_seconds(coord.proc.pid) - before
                for key, runs in parts.items():
                    row[key] = {m: statistics.median(r[m] for r in runs) for m in runs[0]}
                row["sync_vs_echo_p50"] = row["sync"]["p50_us"] / row["echo"]["p50_us"]
                row["sync_vs_raw_p50"] = row["sync"]["p50_us"] / row["raw"]["p50_us"]
                row["shm_vs_echo_p50"] = row["shm_echo"]["p50_us"] / row["echo"]["p50_us"]
                # (warm-up calls included: a slight over-estimate)
                row["coordinator_cpu_us_per_sync_call"] = cpu / (3 * (rounds // 3)) * 1e6
                layouts[where] = row
            first = next(iter(layouts.values()))
            out["frames"][name] = {**first, "placements": layouts}
        client.close()
        raw.close()
        for sock in socks.values():
            sock.close()
        shm.close()
        for proc in servers:
            proc.kill()
            proc.join(5)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6000)
    add_json_argument(ap, "sync_client")
    args = ap.parse_args(argv)
    res = run(args.rounds)
    print(f"{'frame':<16}{'placement':<15}{'bytes':>6}{'echo p50':>10}{'uv echo':>9}"
          f"{'shm echo':>10}{'raw p50':>10}{'sync p50':>10}{'sync p99':>10}{'sync/echo':>11}"
          f"{'sync/raw':>10}"
          f"{'coord CPU':>11}   (microseconds)")
    for name, frame in res["frames"].items():
        for where, r in frame["placements"].items():
            print(f"{name:<16}{where:<15}{r['frame_bytes']:>6}{r['echo']['p50_us']:>10.1f}"
                  f"{r['uvloop_echo']['p50_us']:>9.1f}{r['shm_echo']['p50_us']:>10.1f}"
                  f"{r['raw']['p50_us']:>10.1f}{r['sync']['p50_us']:>10.1f}"
                  f"{r['sync']['p99_us']:>10.1f}{r['sync_vs_echo_p50']:>10.2f}x"
                  f"{r['sync_vs_raw_p50']:>9.2f}x"
                  f"{r['coordinator_cpu_us_per_sync_call']:>11.1f}")
    write_results(args.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
