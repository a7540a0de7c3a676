"""The synchronous client of the coordinator: a blocking Unix socket and no
event loop, for callers that are synchronous themselves (vLLM's scheduler).

    from kvshm.service.sync_client import connect_sync

    with connect_sync("/run/kvshm/pool.sock") as c:
        c.add_request("r1", prompt=tokens)
        hits, n = c.get_computed_blocks("r1")
        new = c.allocate_slots("r1", len(tokens) - n, n, use_computed_blocks=True)

Same method names, arguments and errors as the asyncio client
(kvshm/service/client.py), one call at a time; `batch()` runs several ops
in one round trip.  It rides through a coordinator restart the same way:
reconnect with backoff, take the session back with its resume token,
restore the requests from its `RequestMirror`, settle the call in flight
(applied: its kept reply; not applied: sent again).  Not thread-safe: one
thread per client.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence

import msgspec

from kvshm.core.errors import KvshmError
from kvshm.core.events import decode_events
from kvshm.core.hashing import DEFAULT_HASH_ALGORITHM, DEFAULT_HASH_SEED
from kvshm.ops import protocol as p
from kvshm.ops.errors import (
    ConnectionClosed,
    ConnectionLost,
    ProtocolError,
    ReplyLost,
    RequestTimeout,
    ResumeFailed,
    batch_results,
    error_from_wire,
    raise_reply,
)
from kvshm.ops.protocol import encode_frame
from kvshm.service.framing import REPLY_LIMIT_BYTES, FrameReader
from kvshm.service.handshake import SessionInfo, check_welcome, make_hello, socket_path
from kvshm.service.resume import Reconnect, RequestMirror

_RECV_BYTES = 1 << 16


class _Wire:
    """One blocking connection: frames out, reply structs in."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FrameReader(limit=REPLY_LIMIT_BYTES)
        self.decoder = msgspec.msgpack.Decoder(p.ServerMessage)
        self._ready: list = []
        self._timeout: float | None = sock.gettimeout()

    def _set_timeout(self, timeout: float | None) -> None:
        # NOTE: settimeout is a system call; the hot path (no timeout) makes none.
        if timeout != self._timeout:
            self.sock.settimeout(timeout)
            self._timeout = timeout

    def send(self, frame: bytes) -> None:
        try:
            self.sock.sendall(frame)
        except OSError as e:
            raise ConnectionLost(f"the coordinator closed the connection: {e}") from None

    def receive(self, timeout: float | None):
        """The next reply (RequestTimeout after `timeout` seconds)."""
        ready = self._ready
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ready:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RequestTimeout(f"no reply within {timeout}s")
                self._set_timeout(left)
            elif self._timeout is not None:
                self._set_timeout(None)
            try:
                data = self.sock.recv(_RECV_BYTES)
            except socket.timeout:
                raise RequestTimeout(f"no reply within {timeout}s") from None
            except OSError as e:
                raise ConnectionLost(f"the coordinator closed the connection: {e}") from None
            if not data:
                raise ConnectionLost("the coordinator closed the connection")
            try:
                for body in self.reader.feed(data):
                    ready.append(self.decoder.decode(body))
            except (msgspec.DecodeError, IndexError) as e:
                raise ProtocolError(f"unreadable reply from the coordinator: {e}") from None
            if self.reader.broken is not None:
                raise ProtocolError(f"unreadable reply from the coordinator: "
                                    f"{self.reader.broken}")
        return ready.pop(0)

    def close(self) -> None:
        self.sock.close()


def open_wire_sync(path, hello: p.Hello, timeout: float) -> tuple[_Wire, p.Welcome]:
    """Connect and handshake (blocking); the wire and its Welcome."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise ConnectionLost(f"no coordinator listening at {path}: {e.strerror}") from None
        except socket.timeout:
            raise RequestTimeout(f"connecting to {path} took over {timeout}s") from None
        sock.settimeout(None)
        wire = _Wire(sock)
        wire.send(encode_frame(hello))
        try:
            welcome = check_welcome(wire.receive(timeout))
        except RequestTimeout:
            raise RequestTimeout(f"no Welcome from {path} within {timeout}s") from None
    except BaseException:
        sock.close()
        raise
    return wire, welcome


class SyncClient(SessionInfo):
    """A session with the coordinator; make one with `connect_sync()`."""

    def __init__(self, path, hello: p.Hello, wire: _Wire, welcome: p.Welcome,
                 reconnect: Reconnect | None) -> None:
        self.path = path
        self._hello = hello
        self.reconnect = reconnect
        self.tenant = hello.tenant
        self.requests = RequestMirror()
        self.restarts: list[tuple[float, float]] = []   # (lost at, resumed at), monotonic
        self.replies_lost = 0
        self.resumed_requests = 0
        self._wire: _Wire | None = wire
        self._seq = 0
        self._owed: list = []     # messages whose replies a timeout left unread
        self._lost: KvshmError | None = None
        self.take_welcome(welcome)

    # -- lifecycle -------------------------------------------------------------------
    def close(self) -> None:
        """Close the session; the coordinator frees every request it owns."""
        if self._wire is not None:
            self._wire.close()
            self._wire = None
        if self._lost is None:
            self._lost = ConnectionClosed("the client closed this connection")

    def __enter__(self) -> "SyncClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- raw calls ------------------------------------------------------------------------
    def call(self, msg: msgspec.Struct, timeout: float | None = None):
        """Send one message, return its reply struct (Error replies raise)."""
        reply = self.request(msg, timeout)
        if reply.__class__ is p.Error:
            raise_reply(reply)
        return reply

    def batch(self, ops: Sequence[msgspec.Struct], timeout: float | None = None) -> list:
        """Run `ops` in one frame, atomically with respect to other sessions.
        Returns their replies; if one failed, raises its error with
        `.results` (the replies before it) and `.index` set."""
        return batch_results(self.request(p.Batch(list(ops)), timeout))

    def request(self, msg: msgspec.Struct, timeout: float | None = None):
        """Send one message and return its reply struct as it is (an `Error`
        reply is returned, not raised).  A coordinator restart meanwhile is
        ridden through (see the module docstring)."""
        frame = encode_frame(msg)
        while True:
            seq = 0
            if self._lost is not None:
                raise self._lost
            try:
                self._drain_owed(timeout)
                seq = self._send(frame)
                reply = self._receive(msg, timeout)
                break
            except (ConnectionLost, ProtocolError) as e:
                welcome = self._resume(e)
                if 0 < seq <= welcome.last_seq:   # applied before the crash
                    reply = self._kept_reply(msg, seq, welcome)
                    break
        return reply

    def _send(self, frame: bytes) -> int:
        self._wire.send(frame)
        self._seq += 1
        return self._seq

    def _receive(self, msg, timeout: float | None):
        try:
            reply = self._wire.receive(timeout)
        except RequestTimeout:
            self._owed.append(msg)
            raise
        if reply.__class__ is p.Shutdown:
            self._give_up(ConnectionLost(f"the coordinator shut down ({reply.reason})"))
            raise self._lost
        self.requests.apply(msg, reply)
        return reply

    def _drain_owed(self, timeout: float | None) -> None:
        while self._owed:
            msg = self._owed[0]
            reply = self._wire.receive(timeout)
            self._owed.pop(0)
            if reply.__class__ is p.Shutdown:
                self._give_up(ConnectionLost(f"the coordinator shut down ({reply.reason})"))
                raise self._lost
            self.requests.apply(msg, reply)

    def _kept_reply(self, msg, seq: int, welcome: p.Welcome):
        if seq == welcome.last_seq and welcome.last_reply:
            reply = self._wire.decoder.decode(welcome.last_reply)
            self.requests.apply(msg, reply)
            return reply
        self.replies_lost += 1
        self.requests.forget(msg)
        raise ReplyLost("the coordinator restarted after applying this call, before its "
                        "reply was delivered; read the state back")

    def _give_up(self, err: KvshmError) -> None:
        self._lost = err
        if self._wire is not None:
            self._wire.close()
            self._wire = None

    # -- riding through a coordinator restart -------------------------------------------------
    def _resume(self, err: Exception) -> p.Welcome:
        """Reconnect, take the session back and restore the requests; the
        Welcome says which frames were applied.  Raises (and gives up) when
        the session cannot be resumed."""
        lost_at = time.monotonic()
        if self._wire is not None:
            self._wire.close()
            self._wire = None
        if self.reconnect is None or not self.resume_token:
            self._give_up(err if isinstance(err, KvshmError) else ConnectionLost(str(err)))
            raise self._lost
        policy = self.reconnect
        hello = msgspec.structs.replace(self._hello, resume_token=self.resume_token)
        deadline = lost_at + policy.timeout
        delay = policy.initial_delay
        while True:
            try:
                wire, welcome = open_wire_sync(self.path, hello, policy.connect_timeout)
                break
            except (ConnectionLost, RequestTimeout, OSError) as e:
                if time.monotonic() + delay > deadline:
                    self._give_up(ConnectionLost(
                        f"the coordinator went away ({err}) and did not come back within "
                        f"{policy.timeout:g}s: {e}"))
                    raise self._lost from None
                time.sleep(delay)
                delay = min(delay * 2, policy.max_delay)
        self._wire = wire
        self._owed.clear()   # replies of the old connection are gone with it
        self.take_welcome(welcome)
        if not welcome.resumed:
            self.requests.clear()
            self._give_up(ResumeFailed(
                "the coordinator restarted and this session could not be resumed: "
                + (welcome.resume_error or "it keeps no session records")))
            raise self._lost
        self._seq = welcome.last_seq
        self.resumed_requests += len(self.requests)
        for frame in self.requests.restore_frames(welcome.requests):
            self._send(encode_frame(frame))
            reply = wire.receive(policy.connect_timeout)
            for r in (reply.results if reply.__class__ is p.BatchReply else (reply,)):
                if r.__class__ is p.Error:
                    self._give_up(error_from_wire(
                        r.code, f"restoring requests after a coordinator restart: {r.message}",
                        r.fields))
                    raise self._lost
        self.restarts.append((lost_at, time.monotonic()))
        return welcome

    # -- operations (as the asyncio client's) --------------------------------------------------
    def add_request(self, req: str, prompt: Sequence[int] | None = None, *,
                    block_hashes: list[bytes] | None = None, num_tokens: int = 0,
                    lora_name: str | None = None, cache_salt: str | None = None,
                    skip_reading_prefix_cache: bool = False, mm_features=None,
                    prompt_embeds=None, timeout: float | None = None) -> None:
        """Add a request: its prompt's token ids (with its multimodal items
        and prompt embeds, if any), or the hashes of its full blocks and its
        token count (see `protocol.add_request`)."""
        self.call(p.add_request(req, prompt, block_hashes, num_tokens, lora_name, cache_salt,
                                skip_reading_prefix_cache, mm_features, prompt_embeds), timeout)

    def advance(self, req: str, num_computed_tokens: int, append: Sequence[int] = (), *,
                append_hashes: list[bytes] = (), num_appended: int = 0,
                timeout: float | None = None) -> None:
        self.call(p.Advance(req, num_computed_tokens, list(append), list(append_hashes),
                            num_appended), timeout)

    def get_computed_blocks(self, req: str, timeout: float | None = None
                            ) -> tuple[list[list[int]], int]:
        r = self.call(p.GetComputedBlocks(req), timeout)
        return r.block_ids, r.num_computed_tokens

    def allocate_slots(self, req: str, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       *, use_computed_blocks: bool = False, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0,
                       timeout: float | None = None) -> list[list[int]] | None:
        """New block ids per group, or None if the pool is short of blocks."""
        return self.call(p.AllocateSlots(
            req, num_new_tokens, num_new_computed_tokens, use_computed_blocks,
            num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
            num_encoder_tokens), timeout).new_block_ids

    def admit(self, req: str, max_new_tokens: int, *, num_lookahead_tokens: int = 0,
              delay_cache_blocks: bool = False, wait_in_flight: int = 0,
              timeout: float | None = None) -> p.Admitted:
        return self.call(p.Admit(req, max_new_tokens, num_lookahead_tokens,
                                 delay_cache_blocks, wait_in_flight), timeout)

    def cache_blocks(self, req: str, num_computed_tokens: int,
                     timeout: float | None = None) -> None:
        self.call(p.CacheBlocks(req, num_computed_tokens), timeout)

    def free(self, req: str, *, preempted: bool = False, timeout: float | None = None) -> int:
        return self.call(p.Free(req, preempted), timeout).num_free_blocks

    def remove_skipped_blocks(self, req: str, total_computed_tokens: int,
                              timeout: float | None = None) -> int:
        return self.call(p.RemoveSkippedBlocks(req, total_computed_tokens),
                         timeout).num_free_blocks

    def get_block_ids(self, req: str, timeout: float | None = None) -> list[list[int]]:
        return self.call(p.GetBlockIds(req), timeout).block_ids

    def get_num_common_prefix_blocks(self, req: str, timeout: float | None = None) -> list[int]:
        return self.call(p.NumCommonPrefixBlocks(req), timeout).num_blocks

    def reset_prefix_cache(self, timeout: float | None = None) -> bool:
        return self.call(p.ResetPrefixCache(), timeout).ok

    def evict_blocks(self, block_ids: Sequence[int], timeout: float | None = None) -> int:
        return self.call(p.EvictBlocks(list(block_ids)), timeout).num_free_blocks

    def stats(self, free_head: int = 0, timeout: float | None = None) -> p.Stats:
        return self.call(p.GetStats(free_head), timeout)

    def take_events(self, timeout: float | None = None) -> list:
        """The KV-cache events this session's frames caused since its last
        call (kvshm.core.events structs; the first call starts recording)."""
        return decode_events(self.call(p.TakeEvents(), timeout).payload)


def connect_sync(path: str | os.PathLike | None = None, *, name: str | None = None,
                 tenant: str = "", node: int = -1,
                 token: str | None = None, admin: bool = False,
                 admin_token: str | None = None,
                 hash_algorithm: str | None = DEFAULT_HASH_ALGORITHM,
                 hash_seed: str = DEFAULT_HASH_SEED, timeout: float = 10.0,
                 reconnect: Reconnect | None = None, resume: bool = True) -> SyncClient:
    """Open a session (blocking) with the coordinator at `path` or pool
    `name`'s; the arguments and errors of `connect()`."""
    path = socket_path(path, name)
    hello = make_hello(path, tenant=tenant, node=node, token=token, admin=admin,
                       admin_token=admin_token, hash_algorithm=hash_algorithm,
                       hash_seed=hash_seed)
    wire, welcome = open_wire_sync(path, hello, timeout)
    return SyncClient(path, hello, wire, welcome, (reconnect or Reconnect()) if resume else None)
