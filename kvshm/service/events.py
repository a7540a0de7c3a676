"""The coordinator's KV-event stream: vLLM's `KVEventsConfig` and a ZMQ
publisher that speaks the wire protocol of the pool's vLLM release
(pyzmq: `kvshm[events]`).

Each batch (the events one frame caused, kvshm/core/events.py) goes out as
three frames `[topic, seq, payload]`: seq counts batches from 0 as 8 bytes
big-endian, the payload is the msgpack `EventBatch` `[ts, [events],
data_parallel_rank]`.  An endpoint with `*` (or `::`, `ipc://`,
`inproc://`) is bound, any other connected, as vLLM does.  The replay
socket (ROUTER, bound at `replay_endpoint`) answers a request `[start_seq
(8 bytes big-endian)]` with every buffered batch from that seq, each as
`[seq, payload]`, then `[-1 (8 bytes, signed), b""]` (vLLM 0.32, for a
pool of its semantics: `[topic, seq, payload]`, then `[b"", -1, b""]`); it
keeps the last `buffer_steps` batches.  The events themselves are in the
release's form too (kvshm/core/events.py).

The event loop never waits for the network: `publish()` numbers the batch
and puts it on a bounded queue (`max_queue_size` batches) that a thread
drains; a full queue drops the batch (counted; its seq is spent, so
subscribers see the gap).  The thread sends on an XPUB socket with
XPUB_NODROP, so a batch refused at the high-water mark `hwm` (a subscriber
that does not keep up) is counted as dropped too, instead of vanishing as
on a PUB socket, and still enters the replay buffer under its seq: a
subscriber that sees that gap can fetch what it missed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Literal

import msgspec

from kvshm.core.errors import ConfigError
from kvshm.core.events import Event, EventBatch

log = logging.getLogger("kvshm.events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# The publisher thread wakes at most once per COALESCE_S under load: a batch
# waits up to this long (vLLM's thread wakes per batch).
COALESCE_S = 0.002


class KVEventsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `KVEventsConfig` fields, meanings and defaults."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None    # None: "zmq" if enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"kv_events.{name}", f"must be >= 1 (got "
                                  f"{getattr(self, name)})")
        if not self.endpoint:
            raise ConfigError("kv_events.endpoint", "must name a ZMQ endpoint")

    @property
    def publishes(self) -> bool:
        """Whether events are recorded and sent at all."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        """Parse `--kv-events-config` JSON; ConfigError naming the field."""
        try:
            return msgspec.json.decode(text, type=cls)
        except msgspec.ValidationError as e:
            raise ConfigError("kv_events", f"{e} (fields: {', '.join(cls.__struct_fields__)}; "
                              "publisher 'null' or 'zmq')") from None
        except msgspec.DecodeError as e:
            raise ConfigError("kv_events", f"not JSON: {e}") from None


def _binds(endpoint: str) -> bool:
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith("ipc://")
            or endpoint.startswith("inproc://"))


def import_zmq():
    """pyzmq, or ConfigError saying how to get it."""
    try:
        import zmq
    except ImportError:
        raise ConfigError("kv_events", "publishing KV events needs pyzmq: "
                          "pip install 'kvshm[events]'") from None
    return zmq


class EventPublisher:
    """Publishes `EventBatch`es as configured; `close()` sends what is
    queued (up to `linger` seconds) and closes the sockets.  Raises
    ConfigError for an endpoint ZMQ refuses (e.g. a port in use)."""

    def __init__(self, config: KVEventsConfig, *, data_parallel_rank: int = 0,
                 linger: float = 1.0, replay_topic: bool = False) -> None:
        zmq = self._zmq = import_zmq()
        self.config = config
        self.replay_topic = replay_topic      # vLLM 0.32's replay frames (module doc)
        self.rank = data_parallel_rank
        self.linger = linger
        self.published = 0          # batches sent
        self.dropped = 0            # batches not sent (queue full, or the HWM hit)
        self.dropped_events = 0
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._replay = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._pub.setsockopt(zmq.XPUB_NODROP, 1)
            self._pub.setsockopt(zmq.LINGER, int(linger * 1000))
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ConfigError("kv_events", f"cannot open {config.endpoint}"
                              f"{' / ' + config.replay_endpoint if config.replay_endpoint else ''}"
                              f": {e}") from None
        self._running = True
        self._abandon = False
        self._next_seq = 0          # given by publish(), in the event loop's order
        self._thread = threading.Thread(target=self._run, name="kvshm-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[Event]) -> None:
        """Queue one batch (never blocks: a full queue drops it, counted)."""
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._queue.put_nowait((seq, EventBatch(time.time(), events, self.rank)))
        except queue.Full:
            # Lost, but its seq is spent: subscribers see the gap.
            if not self.dropped:
                log.warning("KV events: the publisher's queue is full (%d batches): "
                            "dropping batches (a gap in the sequence numbers)",
                            self.config.max_queue_size)
            self.dropped += 1
            self.dropped_events += len(events)

    def stall(self, timeout: float = 2.0) -> None:
        """Fault injection: stop the sending thread (within `timeout` s) and
        leave the queue as it is, as a sender stuck on its socket would:
        from now on batches queue up, and once the queue is full are
        dropped.  For fault tests; `close` still closes."""
        self._abandon = True
        self._thread.join(timeout)

    def stats(self) -> dict[str, int]:
        return {"numbered_batches": self._next_seq, "published_batches": self.published,
                "dropped_batches": self.dropped, "dropped_events": self.dropped_events,
                "queued_batches": self._queue.qsize()}

    def close(self) -> None:
        """Send what is queued (for up to `linger` s), then close."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=self.linger)   # after everything queued
        except queue.Full:
            self._abandon = True                         # give up on the rest
        self._thread.join(self.linger + 1.0)
        if self._thread.is_alive():
            self._abandon = True
            self._thread.join(1.0)
        self._close_sockets()
        st = self.stats()
        (log.warning if st["dropped_batches"] else log.info)(
            "KV events: %d batch(es) published, %d dropped (%d events; a full queue or "
            "the high-water mark), %d never sent", st["published_batches"],
            st["dropped_batches"], st["dropped_events"], st["queued_batches"])

    # -- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        zmq = self._zmq
        encode = msgspec.msgpack.Encoder().encode
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)          # subscriptions arrive here
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._abandon:
            try:
                for sock, _ in poller.poll(0):
                    if sock is self._replay:
                        self._answer_replay()
                    else:
                        self._pub.recv(zmq.NOBLOCK)      # (un)subscribe: nothing to do
            except zmq.ZMQError as e:   # noqa: PERF203 - a bad request must not stop us
                log.warning("KV events: replay/subscription error: %s", e)
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            # Let a burst gather, then send all of it: one wake-up (and one
            # GIL hand-over from the event loop) per COALESCE_S, not per
            # batch.  Each batch keeps its own seq.
            time.sleep(COALESCE_S)
            batches = [batch]
            try:
                while True:
                    batches.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            for item in batches:
                if item is None:
                    return
                seq, batch = item
                payload = encode(batch)
                seq_bytes = seq.to_bytes(8, "big")
                try:
                    self._pub.send_multipart((self._topic, seq_bytes, payload), zmq.NOBLOCK)
                    self.published += 1
                except zmq.Again:
                    self.dropped += 1
                    self.dropped_events += len(batch.events)
                except zmq.ZMQError as e:
                    log.warning("KV events: batch %d not sent: %s", seq, e)
                    self.dropped += 1
                    self.dropped_events += len(batch.events)
                self._buffer.append((seq, payload))

    def _answer_replay(self) -> None:
        zmq = self._zmq
        frames = self._replay.recv_multipart(zmq.NOBLOCK)
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: bad replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        head = (client, b"", self._topic) if self.replay_topic else (client, b"")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((*head, seq.to_bytes(8, "big"), payload))
        end = (client, b"", b"") if self.replay_topic else (client, b"")
        self._replay.send_multipart((*end, END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()


# -- the subscriber's side (`kvshm events`) ---------------------------------------------------
def connectable(endpoint: str) -> str:
    """A bound endpoint as a subscriber on this host connects to it
    (`tcp://*:5557` -> `tcp://127.0.0.1:5557`)."""
    return endpoint.replace("://*:", "://127.0.0.1:")


class EventSubscriber:
    """Follows a stream: `batches()` yields (seq, [ts, [events], rank]) in
    sequence order, as plain msgpack-decoded arrays (the wire form).  With a
    replay endpoint it first fetches the buffered batches from `from_seq`,
    and fills any later gap from it, so nothing is missed while the
    publisher's buffer holds it; without one, a gap is reported by
    `on_gap(first_missing, next_seen)` and skipped.  An endpoint ZMQ
    refuses is a ConfigError naming it."""

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None,
                 topic: str = "", from_seq: int | None = None, on_gap=None) -> None:
        zmq = self._zmq = import_zmq()
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        try:
            self._sub.connect(connectable(endpoint))
        except zmq.ZMQError as e:
            self._sub.close()
            raise ConfigError("endpoint", f"cannot connect to {endpoint}: {e}") from None
        self._replay_endpoint = connectable(replay_endpoint) if replay_endpoint else None
        self._from = from_seq
        self._on_gap = on_gap
        self._decode = msgspec.msgpack.Decoder().decode

    def replay(self, start: int, timeout: float = 5.0) -> list[tuple[int, list]]:
        """The buffered batches from seq `start` (asked of the replay socket).
        Raises TimeoutError if it does not answer, ConfigError if ZMQ refuses
        the endpoint."""
        zmq = self._zmq
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            try:
                sock.connect(self._replay_endpoint)
            except zmq.ZMQError as e:
                raise ConfigError("replay_endpoint", f"cannot connect to "
                                  f"{self._replay_endpoint}: {e}") from None
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            out = []
            while True:
                if not sock.poll(int(timeout * 1000)):
                    raise TimeoutError(f"no answer from the replay endpoint "
                                       f"{self._replay_endpoint} in {timeout:g}s")
                # [b"", seq, payload], or vLLM 0.32's [b"", topic, seq, payload]
                seq_bytes, payload = sock.recv_multipart()[-2:]
                if seq_bytes == END_SEQ:
                    return out
                out.append((int.from_bytes(seq_bytes, "big"), self._decode(payload)))
        finally:
            sock.close()

    def batches(self, idle_timeout: float | None = None):
        """Batches in order until `idle_timeout` seconds pass without one
        (None: forever)."""
        # The last seq yielded (None: take the stream from wherever it is).
        last = None if self._from is None else self._from - 1
        if self._from is not None and self._replay_endpoint:
            for seq, batch in self.replay(self._from):
                last = seq
                yield seq, batch
        wait = -1 if idle_timeout is None else int(idle_timeout * 1000)
        while True:
            if not self._sub.poll(wait):
                return
            _, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if last is not None and seq <= last:
                continue                       # already replayed
            if last is not None and seq > last + 1:
                if self._replay_endpoint:
                    for s, batch in self.replay(last + 1):
                        if s < seq:
                            last = s
                            yield s, batch
                if seq > last + 1 and self._on_gap is not None:
                    self._on_gap(last + 1, seq)
            last = seq
            yield seq, self._decode(payload)

    def close(self) -> None:
        self._sub.close()


class EventCollector:
    """A thread following a stream (`EventSubscriber`) from now until
    `stop()`: the batches' seqs and events, in order, or only their counts
    (`keep=False`, for a long benchmark)."""

    def __init__(self, endpoint: str, *, keep: bool = True) -> None:
        import threading
        self.sub = EventSubscriber(endpoint)
        self.keep = keep
        self.seqs: list[int] = []
        self.events: list = []
        self.num_batches = self.num_events = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvshm-events-in", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            for seq, batch in self.sub.batches(idle_timeout=0.1):
                self.num_batches += 1
                self.num_events += len(batch[1])
                if self.keep:
                    self.seqs.append(seq)
                    self.events.extend(batch[1])

    def stop(self) -> None:
        self._stop = True
        self._thread.join(5)
        self.sub.close()
