"""The coordinator's KV-event stream (kvshm/service/events.py): a pool served
with --kv-events-config publishes, while `kvshm replay --ipc --connect`
replays a trace, exactly the stream vLLM emitted for it; a subscriber that
joins late gets every batch from the replay socket with no gap; drops are
counted; an adopted pool restates its cache; bad settings are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvshm.core.events import AllBlocksCleared, BlockStored
from kvshm.replay import events_trace, load_events, load_trace, trace_pool_config
from kvshm.service.events import EventPublisher, EventSubscriber, KVEventsConfig
from kvshm.service.process import CoordinatorProcess

pytestmark = pytest.mark.serial   # a refused serve must leave /dev/shm as it found it

pytest.importorskip("zmq")

DATA = Path(__file__).parent / "data" / "conformance"
STREAMS = sorted((DATA / "events").glob("*.events.jsonl.gz"))
# CI replays a sample through a coordinator; KVSHM_ALL_EVENTS=1 all 94.
SAMPLE = STREAMS if os.environ.get("KVSHM_ALL_EVENTS") == "1" else [
    s for s in STREAMS if s.name.startswith(("full16-tiny-chat-s1000", "mamba16-tiny-chat",
                                             "sw128-small-sys", "chunked32-tiny-chat"))]
KVSHM = [sys.executable, "-m", "kvshm"]


def kvshm(*args, timeout=120):
    return subprocess.run([*KVSHM, *args], capture_output=True, text=True, timeout=timeout)


def endpoints(d: Path) -> dict:
    return {"enable_kv_cache_events": True, "endpoint": f"ipc://{d}/pub",
            "replay_endpoint": f"ipc://{d}/replay", "topic": "kvshm"}


def events_of(kv: dict, **kw) -> list[dict]:
    """Every event the publisher still buffers, as `kvshm events` prints them."""
    r = kvshm("events", "--endpoint", kv["endpoint"], "--replay-endpoint",
              kv["replay_endpoint"], "--from", "0", "--idle-timeout", "0.3",
              "--topic", kv["topic"], **kw)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


@pytest.mark.parametrize("path", SAMPLE, ids=[p.name.split(".")[0] for p in SAMPLE])
def test_a_served_pool_publishes_vllm_s_stream(path, sockdir):
    _, want = load_events(path)
    trace = events_trace(path, DATA / "traces")
    cfg, ops = load_trace(trace)
    config = trace_pool_config(cfg, ops).replace(hash_algorithm="vllm-sha256",
                                                 hash_seed="kvshm-oracle-0")
    kv = endpoints(sockdir)
    with CoordinatorProcess(config, extra_args=("--kv-events-config", json.dumps(kv))) as pool:
        r = kvshm("replay", "--ipc", "--connect", str(pool.socket), str(trace))
        assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout + r.stderr
        got = events_of(kv)          # joined after the fact: all from the replay socket
        # A second replay is refused: the pool is no longer a fresh one.
        again = kvshm("replay", "--ipc", "--connect", str(pool.socket), str(trace))
        assert again.returncode == 1 and "the pool is not fresh" in again.stdout
    assert [e["event"] for e in got] == [e for _, events in want for e in events]
    seqs = sorted({e["seq"] for e in got})
    assert seqs == list(range(len(seqs)))          # no gap
    assert all(e["rank"] == 0 for e in got)


DATA_032 = Path(__file__).parent / "data" / "conformance-0.32.0"
SAMPLE_032 = [DATA_032 / "events" / f"{name}.events.jsonl.gz" for name in (
    "full16-tiny-chat-s1000", "hyb-full16-sw32-small-sys-s2111")]


@pytest.mark.parametrize("path", SAMPLE_032, ids=[p.name.split(".")[0] for p in SAMPLE_032])
def test_a_served_0_32_pool_publishes_vllm_0_32_s_stream(path, sockdir):
    """A pool of 0.32's semantics publishes 0.32's maps, and its replay
    socket answers in 0.32's frames (with the topic), which `kvshm events`
    reads."""
    _, want = load_events(path)
    trace = events_trace(path, DATA_032 / "traces")
    cfg, ops = load_trace(trace)
    config = trace_pool_config(cfg, ops).replace(hash_algorithm="vllm-sha256",
                                                 hash_seed="kvshm-oracle-0")
    assert config.vllm_version == "0.32.0"
    kv = endpoints(sockdir)
    with CoordinatorProcess(config, extra_args=("--kv-events-config", json.dumps(kv))) as pool:
        r = kvshm("replay", "--ipc", "--connect", str(pool.socket), str(trace))
        assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout + r.stderr
        got = events_of(kv)
        # The replay socket's frames, raw: [b"", topic, seq, payload] ...
        # [b"", b"", -1, b""].
        import zmq
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(kv["replay_endpoint"])
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        assert sock.poll(5000)
        first = sock.recv_multipart()
        while True:
            assert sock.poll(5000)
            last = sock.recv_multipart()
            if last[2] == (-1).to_bytes(8, "big", signed=True):
                break
        sock.close()
    assert first[:3] == [b"", b"kvshm", (0).to_bytes(8, "big")] and len(first) == 4
    assert last == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert [e["event"] for e in got] == [e for _, events in want for e in events]
    assert got[0]["event"]["type"] == "BlockStored"


def test_a_live_subscriber_sees_each_frame_as_a_batch(sockdir):
    from helpers import make_config, tokens
    from kvshm.ops import protocol as p
    from kvshm.service.sync_client import connect_sync
    kv = endpoints(sockdir)
    config = make_config(num_blocks=16)
    with CoordinatorProcess(config, extra_args=("--kv-events-config", json.dumps(kv))) as pool:
        sub = EventSubscriber(kv["endpoint"], replay_endpoint=kv["replay_endpoint"],
                              topic="kvshm", from_seq=0)
        try:
            with connect_sync(pool.socket, hash_algorithm=None) as c:
                c.add_request("a", tokens(0, 10))
                c.batch([p.AllocateSlots("a", 10, 0, True),          # caches 2 blocks,
                         p.Advance("a", 10), p.Free("a")])           # ready, then frees
                c.add_request("b", tokens(0, 9))
                hits, n = c.get_computed_blocks("b")
                assert n == 8
            got = list(sub.batches(idle_timeout=0.5))
        finally:
            sub.close()
    assert [seq for seq, _ in got] == [0]          # one frame changed the cache
    [(_, (ts, events, rank))] = got
    assert abs(ts - time.time()) < 60 and rank == 0
    [stored] = events
    assert stored[0] == "BlockStored" and len(stored[1]) == 2 and stored[3] == tokens(0, 8)


def test_an_adopted_pool_restates_its_cache_first(sockdir):
    from helpers import make_config, tokens
    from kvshm.service.sync_client import connect_sync
    kv = endpoints(sockdir)
    config = make_config(num_blocks=16)
    with CoordinatorProcess(config, extra_args=("--kv-events-config", json.dumps(kv))) as pool:
        with connect_sync(pool.socket, hash_algorithm=None) as c:
            c.add_request("a", tokens(0, 10))
            c.allocate_slots("a", 10, 0, use_computed_blocks=True)
            c.advance("a", 10)
            c.free("a")
        first = events_of(kv)
        pool.kill()
        pool.restart()
        after = events_of(kv)
    stored = first[0]["event"]
    assert after[0]["event"] == ["AllBlocksCleared"] and after[0]["seq"] == 0
    # One BlockStored per cached block, oldest first: hash, no parent, no tokens.
    assert [e["event"][1] for e in after[1:]] == [[h] for h in stored[1]]
    assert all(e["event"][2] is None and e["event"][3] == [] for e in after[1:])


# -- the publisher itself ---------------------------------------------------------------------
def test_batches_refused_at_the_high_water_mark_are_counted_and_still_replayable(sockdir):
    import zmq
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{sockdir}/p",
                         replay_endpoint=f"ipc://{sockdir}/r", hwm=1, buffer_steps=100_000)
    pub = EventPublisher(cfg)
    ctx = zmq.Context.instance()
    lazy = ctx.socket(zmq.SUB)             # subscribes, never reads
    lazy.setsockopt(zmq.SUBSCRIBE, b"")
    lazy.setsockopt(zmq.RCVHWM, 1)
    lazy.connect(cfg.endpoint)
    try:
        time.sleep(0.3)                    # the subscription reaches the publisher
        big = [BlockStored(list(range(64)), None, list(range(1024)), 16, None, "GPU", None)]
        for _ in range(3000):
            pub.publish(big)
        deadline = time.monotonic() + 30
        while pub.published + pub.dropped < 3000 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pub.dropped > 0 and pub.published + pub.dropped == 3000
        assert pub.dropped_events == pub.dropped
        sub = EventSubscriber(cfg.endpoint, replay_endpoint=cfg.replay_endpoint)
        try:
            assert [s for s, _ in sub.replay(2990)] == list(range(2990, 3000))
        finally:
            sub.close()
    finally:
        lazy.close()
        pub.close()


def test_a_full_queue_drops_the_batch_without_blocking(sockdir):
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{sockdir}/p",
                         max_queue_size=2)
    pub = EventPublisher(cfg)
    pub.stall()                            # the thread stops taking batches
    t0 = time.perf_counter()
    for _ in range(5):
        pub.publish([AllBlocksCleared()])
    assert time.perf_counter() - t0 < 0.5
    st = pub.stats()
    assert (st["dropped_batches"], st["queued_batches"], st["numbered_batches"]) == (3, 2, 5)
    pub.close()          # (the dropped batches' seqs 2-4 are spent: a gap a subscriber sees)


# -- refusals -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown field `endpont`"),
    ('{"hwm": "many"}', "Expected `int`, got `str` - at `$.hwm`"),
    ('{"buffer_steps": 0}', "kv_events.buffer_steps: must be >= 1"),
    ('{"publisher": "kafka"}', "Invalid enum value 'kafka' - at `$.publisher` (fields: "
                               "enable_kv_cache_events, publisher, endpoint"),
    ("not json", "not JSON"),
])
def test_bad_kv_events_configs_are_refused(text, message, sockdir):
    r = kvshm("serve", "--preset", "tiny", "--num-blocks", "64", "--kv-events-config", text,
              "--socket", str(sockdir / "s.sock"), "--name", "kvshm-t-kvev")
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (sockdir / "s.sock").exists()


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_endpoint_in_use_is_refused_and_nothing_is_left(sockdir):
    from helpers import kvshm_segments, make_config
    kv = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{free_port()}"}
    config = make_config(num_blocks=16)
    before = kvshm_segments()
    with CoordinatorProcess(config, extra_args=("--kv-events-config", json.dumps(kv))):
        r = kvshm("serve", "--preset", "tiny", "--num-blocks", "64", "--kv-events-config",
                  json.dumps(kv), "--socket", str(sockdir / "b.sock"),
                  "--name", "kvshm-t-kvev-b")
        assert r.returncode == 2 and "cannot open tcp://" in r.stderr, r.stderr
        assert not (sockdir / "b.sock").exists()
    assert kvshm_segments() == before


def test_events_and_replay_argument_errors(sockdir):
    r = kvshm("events", "--from", "3")
    assert r.returncode == 2 and "--from needs --replay-endpoint" in r.stderr
    r = kvshm("replay", "--connect", str(sockdir / "x.sock"), str(STREAMS[0]))
    assert r.returncode == 2 and "--connect goes with --ipc" in r.stderr


def test_a_pool_of_another_config_is_refused_for_a_trace(sockdir):
    from helpers import make_config
    trace = events_trace(SAMPLE[0], DATA / "traces")
    with CoordinatorProcess(make_config(num_blocks=16)) as pool:
        r = kvshm("replay", "--ipc", "--connect", str(pool.socket), str(trace))
    assert r.returncode == 1 and "the pool's config is not the trace's (num_blocks" in r.stdout


# -- a session's own events (TakeEvents: the vLLM plugin's take_events) -------------------------
async def test_a_session_takes_the_events_of_its_own_frames(coordinator, monkeypatch):
    from helpers import make_config, tokens
    from kvshm.core.events import BlockRemoved as Removed
    from kvshm.core.events import decode_events
    from kvshm.ops import owner
    from kvshm.ops import protocol as p
    from kvshm.service.client import connect
    coord = await coordinator(make_config(num_blocks=6))      # 5 usable blocks of 4 tokens
    async with await connect(coord.socket_path) as a, await connect(coord.socket_path) as b:
        assert await a.take_events() == []                    # starts a's recording
        await a.add_request("a", tokens(0, 9))
        await a.allocate_slots("a", 9, 0, use_computed_blocks=True)
        await a.advance("a", 9)
        await a.free("a")
        await b.add_request("b", tokens(100, 117))            # b's allocation evicts a's blocks
        await b.allocate_slots("b", 17, 0, use_computed_blocks=True)
        [stored] = await a.take_events()
        assert isinstance(stored, BlockStored) and stored.token_ids == tokens(0, 8)
        assert await a.take_events() == []                     # b's frames are not a's
        assert await b.take_events() == []                     # b starts now: nothing before
        await b.advance("b", 17)
        await b.free("b")
        await a.add_request("c", tokens(200, 221))
        await a.allocate_slots("c", 20, 0, use_computed_blocks=True)   # evicts b's blocks
        got = await a.take_events()
        assert any(isinstance(e, Removed) for e in got)
        assert any(isinstance(e, BlockStored) for e in got)
        monkeypatch.setattr(owner, "MAX_OWNER_EVENTS", 1)
        await a.advance("c", 20)
        await a.free("c")
        await a.add_request("d", tokens(300, 321))
        await a.allocate_slots("d", 20, 0, use_computed_blocks=True)
        reply = await a.call(p.TakeEvents())
        assert reply.dropped > 0 and len(decode_events(reply.payload)) == 1
