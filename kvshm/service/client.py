"""The asyncio client of the coordinator: `connect()` returns a `Client`.

    import kvshm

    async with await kvshm.connect("/run/kvshm/pool.sock") as c:
        await c.add_request("r1", prompt=tokens)
        hits, n = await c.get_computed_blocks("r1")
        new = await c.allocate_slots("r1", len(tokens) - n, n, use_computed_blocks=True)

`Client` has one method per operation of the protocol, `call` (one
message), `batch` (several in one frame) and `close`; `open_wire` connects
and handshakes.  Replies come back in order, so calls can be pipelined from
several tasks.  A cancelled or timed-out call never leaves the connection
half-read: its reply is read and discarded when it arrives.  The client
survives a coordinator restart (see `connect(resume=...)` and
kvshm/service/resume.py).  What it shares with the synchronous client
(sync_client.py) is in handshake.py (the Hello, the Welcome, `SessionInfo`)
and errors.py (`batch_results`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Sequence

import msgspec

from kvshm.core.errors import KvshmError
from kvshm.core.events import decode_events
from kvshm.core.hashing import DEFAULT_HASH_ALGORITHM, DEFAULT_HASH_SEED
from kvshm.ops import protocol as p
from kvshm.ops.errors import (
    ConnectionClosed,
    ConnectionLost,
    FrameTooLarge,
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


class _Wire(asyncio.Protocol):
    """One connection; replies go to its client in order."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        # Replies can legitimately be large (a batch of block tables): the
        # client trusts its coordinator and only guards against nonsense.
        self.reader = FrameReader(limit=REPLY_LIMIT_BYTES)
        self.decoder = msgspec.msgpack.Decoder(p.ServerMessage)
        self.on_reply = None            # set by the client: reply -> None
        self.on_lost = None             # set by the client: exception -> None
        self.handshake: asyncio.Future | None = None
        self.lost: Exception | None = None
        self.writable: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            for body in self.reader.feed(data):
                msg = self.decoder.decode(body)
                hs = self.handshake
                if hs is not None:
                    self.handshake = None
                    if not hs.done():
                        hs.set_result(msg)
                else:
                    self.on_reply(msg)
            if self.reader.broken is not None:
                raise self.reader.broken
        except (FrameTooLarge, msgspec.DecodeError, IndexError) as e:
            self.fail(ProtocolError(f"unreadable reply from the coordinator: {e}"))
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(ConnectionLost("the coordinator closed the connection"
                                 + (f": {exc}" if exc else "")))

    def fail(self, err: Exception) -> None:
        if self.lost is not None:
            return
        self.lost = err
        hs, self.handshake = self.handshake, None
        if hs is not None and not hs.done():
            hs.set_exception(err)
        if self.writable is not None and not self.writable.done():
            self.writable.set_exception(err)
        if self.on_lost is not None:
            self.on_lost(err)

    def pause_writing(self) -> None:
        self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None


class _Call:
    """A frame sent (or to be sent again after a restart) awaiting its reply."""

    __slots__ = ("fut", "msg", "frame", "seq")

    def __init__(self, fut: asyncio.Future, msg, frame: bytearray) -> None:
        self.fut = fut
        self.msg = msg
        self.frame = frame
        self.seq = 0


class Client(SessionInfo):
    """A session with the coordinator; make one with `connect()`."""

    def __init__(self, path, hello: p.Hello, wire: _Wire, welcome: p.Welcome,
                 reconnect: "Reconnect | None") -> None:
        self.path = path
        self._hello = hello
        self.reconnect = reconnect
        self.tenant = hello.tenant
        self._pending: deque[_Call] = deque()
        self._seq = 0                    # frames sent in this session
        self._closed = False
        self._lost: Exception | None = None          # for good: no reconnecting
        self._resuming: asyncio.Task | None = None
        self._resumed: asyncio.Event = asyncio.Event()
        self.requests = RequestMirror()
        self.restarts: list[tuple[float, float]] = []   # (lost at, resumed at), monotonic
        self.replies_lost = 0
        self.resumed_requests = 0        # requests restored after restarts
        self.take_welcome(welcome)
        self._attach(wire)

    def _attach(self, wire: _Wire) -> None:
        self._wire = wire
        wire.on_reply = self._on_reply
        wire.on_lost = lambda err, wire=wire: self._on_lost(wire, err)
        self._resumed.set()

    # -- lifecycle -------------------------------------------------------------------
    async def close(self) -> None:
        """Close the session; the coordinator frees every request it owns."""
        if self._closed:
            return
        self._closed = True
        if self._resuming is not None:
            self._resuming.cancel()
        t = self._wire.transport
        if t is not None and not t.is_closing():
            t.close()
        self._give_up(ConnectionClosed("the client closed this connection"))

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- raw calls ------------------------------------------------------------------------
    async def call(self, msg: msgspec.Struct, timeout: float | None = None):
        """Send one message, return its reply struct (Error replies raise)."""
        reply = await self.request(msg, timeout)
        if reply.__class__ is p.Error:
            raise_reply(reply)
        return reply

    async def batch(self, ops: Sequence[msgspec.Struct], timeout: float | None = None) -> list:
        """Run `ops` in one frame, atomically with respect to other sessions.
        Returns their replies; if one failed, raises its error with
        `.results` (the replies before it) and `.index` set."""
        return batch_results(await self.request(p.Batch(list(ops)), timeout))

    async def request(self, msg: msgspec.Struct, timeout: float | None = None):
        """Send one message and return its reply struct as it is (an `Error`
        reply is returned, not raised).  While the client reconnects after a
        coordinator restart, the message waits and goes out after the resume."""
        if self._lost is not None:
            raise self._lost
        wire = self._wire
        if wire.writable is not None and wire.lost is None:
            try:
                await wire.writable
            except KvshmError:
                pass   # the connection broke: the call waits for the resume
        if self._lost is not None:
            raise self._lost
        fut = asyncio.get_running_loop().create_future()
        call = _Call(fut, msg, encode_frame(msg))
        self._pending.append(call)
        if self._wire.lost is None and self._resumed.is_set():
            self._write(call)
        if timeout is None:
            return await fut
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise RequestTimeout(f"no reply within {timeout}s") from None

    def _write(self, call: _Call) -> None:
        self._seq += 1
        call.seq = self._seq
        self._wire.transport.write(call.frame)

    def _on_reply(self, msg) -> None:
        if msg.__class__ is p.Shutdown:   # a clean stop: nothing will come back
            self._give_up(ConnectionLost(f"the coordinator shut down ({msg.reason})"))
            return
        call = self._pending.popleft()
        self.requests.apply(call.msg, msg)
        if not call.fut.done():  # cancelled or timed-out calls just drop their reply
            call.fut.set_result(msg)

    def _give_up(self, err: Exception) -> None:
        self._lost = err
        self._give_up_pending(err)
        self._resumed.set()

    def _on_lost(self, wire: _Wire, err: Exception) -> None:
        if wire is not self._wire or self._lost is not None:
            return
        if self._closed or self.reconnect is None or not self.resume_token:
            self._give_up(err)
            return
        if self._resuming is not None:   # lost again while resuming: start over
            self._resuming.cancel()
        self._resumed.clear()
        self._resuming = asyncio.get_running_loop().create_task(
            self._resume(err, time.monotonic()))

    # -- riding through a coordinator restart -------------------------------------------------
    async def _resume(self, err: Exception, lost_at: float) -> None:
        """Reconnect, take the session back, restore the requests, settle
        the calls in flight and resend those not applied.  A new loss of
        the connection meanwhile cancels this and starts over."""
        try:
            welcome = await self._reconnect(err)
            if not welcome.resumed:
                # A fresh session: the old one's requests are gone.
                self.requests.clear()
                self._give_up_pending(ResumeFailed(
                    "the coordinator restarted and this session could not be resumed: "
                    + (welcome.resume_error or "it keeps no session records")))
                self._seq = 0
                self._resumed.set()
                return
            self._settle_in_flight(welcome)
            self._seq = welcome.last_seq
            self.resumed_requests += len(self.requests)
            for frame in self.requests.restore_frames(welcome.requests):
                await self._send_now(frame)
            for call in self._pending:    # not applied: send again, in order
                self._write(call)
            self.restarts.append((lost_at, time.monotonic()))
            self._resumed.set()
        except KvshmError as e:
            self._give_up(e)
        except asyncio.CancelledError:
            pass
        finally:
            if self._resuming is asyncio.current_task():
                self._resuming = None

    async def _reconnect(self, err: Exception) -> p.Welcome:
        policy = self.reconnect
        hello = msgspec.structs.replace(self._hello, resume_token=self.resume_token)
        deadline = time.monotonic() + policy.timeout
        delay = policy.initial_delay
        while True:
            if self._closed:
                raise ConnectionClosed("the client closed this connection")
            try:
                wire, welcome = await open_wire(self.path, hello, policy.connect_timeout)
                break
            except (ConnectionLost, RequestTimeout, OSError) as e:
                if time.monotonic() + delay > deadline:
                    raise ConnectionLost(f"the coordinator went away ({err}) and did not come "
                                         f"back within {policy.timeout:g}s: {e}") from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, policy.max_delay)
        self.take_welcome(welcome)
        self._attach(wire)
        self._resumed.clear()
        return welcome

    def _settle_in_flight(self, welcome: p.Welcome) -> None:
        """Calls up to `last_seq` were applied: the last one gets its kept
        reply, earlier ones (replies lost with the old connection) ReplyLost."""
        last = welcome.last_seq
        pending = self._pending
        while pending and 0 < pending[0].seq <= last:
            call = pending.popleft()
            reply = None
            if call.seq == last and welcome.last_reply:
                reply = self._wire.decoder.decode(welcome.last_reply)
            if reply is not None:
                self.requests.apply(call.msg, reply)
                if not call.fut.done():
                    call.fut.set_result(reply)
            else:
                self.replies_lost += 1
                self.requests.forget(call.msg)
                if not call.fut.done():
                    call.fut.set_exception(ReplyLost(
                        "the coordinator restarted after applying this call, before its "
                        "reply was delivered; read the state back"))

    async def _send_now(self, msg) -> None:
        """One restore frame, ahead of the waiting calls; raises its errors."""
        fut = asyncio.get_running_loop().create_future()
        call = _Call(fut, msg, encode_frame(msg))
        self._pending.appendleft(call)
        self._write(call)
        try:
            reply = await fut
        except asyncio.CancelledError:
            if call in self._pending:
                self._pending.remove(call)
            raise
        results = reply.results if reply.__class__ is p.BatchReply else (reply,)
        for r in results:
            if r.__class__ is p.Error:
                raise error_from_wire(r.code, "restoring requests after a coordinator "
                                      f"restart: {r.message}", r.fields)

    def _give_up_pending(self, err: Exception) -> None:
        while self._pending:
            call = self._pending.popleft()
            if not call.fut.done():
                call.fut.set_exception(err)

    # -- operations --------------------------------------------------------------------------
    async def add_request(self, req: str, prompt: Sequence[int] | None = None, *,
                          block_hashes: list[bytes] | None = None, num_tokens: int = 0,
                          lora_name: str | None = None, cache_salt: str | None = None,
                          skip_reading_prefix_cache: bool = False, mm_features=None,
                          prompt_embeds=None, timeout: float | None = None) -> None:
        """Add a request: its prompt's token ids (with its multimodal items
        and prompt embeds, if any), or the hashes of its full blocks and its
        token count (see `protocol.add_request`)."""
        await self.call(p.add_request(req, prompt, block_hashes, num_tokens, lora_name,
                                      cache_salt, skip_reading_prefix_cache, mm_features,
                                      prompt_embeds), timeout)

    async def advance(self, req: str, num_computed_tokens: int,
                      append: Sequence[int] = (), *, append_hashes: list[bytes] = (),
                      num_appended: int = 0, timeout: float | None = None) -> None:
        await self.call(p.Advance(req, num_computed_tokens, list(append),
                                  list(append_hashes), num_appended), timeout)

    async def get_computed_blocks(self, req: str, timeout: float | None = None
                                  ) -> tuple[list[list[int]], int]:
        r = await self.call(p.GetComputedBlocks(req), timeout)
        return r.block_ids, r.num_computed_tokens

    async def allocate_slots(self, req: str, num_new_tokens: int,
                             num_new_computed_tokens: int = 0, *,
                             use_computed_blocks: bool = False,
                             num_lookahead_tokens: int = 0,
                             num_external_computed_tokens: int = 0,
                             delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                             timeout: float | None = None) -> list[list[int]] | None:
        """New block ids per group, or None if the pool is short of blocks.
        `use_computed_blocks` passes this request's last lookup's hits."""
        r = await self.call(p.AllocateSlots(
            req, num_new_tokens, num_new_computed_tokens, use_computed_blocks,
            num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
            num_encoder_tokens), timeout)
        return r.new_block_ids

    async def admit(self, req: str, max_new_tokens: int, *, num_lookahead_tokens: int = 0,
                    delay_cache_blocks: bool = False, wait_in_flight: int = 0,
                    timeout: float | None = None) -> p.Admitted:
        """Lookup + allocation of a waiting request in one atomic step (see
        `protocol.Admit`); `.new_block_ids` is None if the pool is short, or
        if at least `wait_in_flight` (> 0) tokens past the hit are in
        flight (`.num_in_flight_tokens`)."""
        return await self.call(p.Admit(req, max_new_tokens, num_lookahead_tokens,
                                       delay_cache_blocks, wait_in_flight), timeout)

    async def cache_blocks(self, req: str, num_computed_tokens: int,
                           timeout: float | None = None) -> None:
        await self.call(p.CacheBlocks(req, num_computed_tokens), timeout)

    async def free(self, req: str, *, preempted: bool = False,
                   timeout: float | None = None) -> int:
        """Free the request's blocks; it is forgotten unless `preempted`.
        Returns the pool's free-block count."""
        return (await self.call(p.Free(req, preempted), timeout)).num_free_blocks

    async def remove_skipped_blocks(self, req: str, total_computed_tokens: int,
                                    timeout: float | None = None) -> int:
        r = await self.call(p.RemoveSkippedBlocks(req, total_computed_tokens), timeout)
        return r.num_free_blocks

    async def get_block_ids(self, req: str, timeout: float | None = None) -> list[list[int]]:
        return (await self.call(p.GetBlockIds(req), timeout)).block_ids

    async def get_num_common_prefix_blocks(self, req: str,
                                           timeout: float | None = None) -> list[int]:
        return (await self.call(p.NumCommonPrefixBlocks(req), timeout)).num_blocks

    async def reset_prefix_cache(self, timeout: float | None = None) -> bool:
        return (await self.call(p.ResetPrefixCache(), timeout)).ok

    async def evict_blocks(self, block_ids: Sequence[int],
                           timeout: float | None = None) -> int:
        return (await self.call(p.EvictBlocks(list(block_ids)), timeout)).num_free_blocks

    async def stats(self, free_head: int = 0, timeout: float | None = None) -> p.Stats:
        return await self.call(p.GetStats(free_head), timeout)

    async def take_events(self, timeout: float | None = None) -> list:
        """The KV-cache events this session's frames caused since its last
        call (kvshm.core.events structs; the first call starts recording)."""
        return decode_events((await self.call(p.TakeEvents(), timeout)).payload)


async def connect(path: str | os.PathLike | None = None, *, name: str | None = None,
                  tenant: str = "", node: int = -1,
                  token: str | None = None, admin: bool = False,
                  admin_token: str | None = None,
                  hash_algorithm: str | None = DEFAULT_HASH_ALGORITHM,
                  hash_seed: str = DEFAULT_HASH_SEED, timeout: float = 10.0,
                  reconnect: "Reconnect | None" = None, resume: bool = True) -> Client:
    """Open a session with the coordinator listening at `path`, or with pool
    `name`'s (at its default socket, where `kvshm serve --name NAME` listens
    without `--socket`): give one of them.  `admin=True` reads the coordinator's generated admin
    token from beside its socket (or pass `admin_token`): the session may
    then reset the prefix cache, evict blocks and read the free queue.
    The coordinator refuses a client whose `hash_algorithm` and `hash_seed`
    differ from the pool's (HashMismatch); `hash_algorithm=None` takes the
    pool's, whatever they are (hash with `make_hasher()`).

    With `resume` (the default) the client rides through coordinator
    restarts: it reconnects with bounded exponential backoff (`reconnect`,
    default `Reconnect()`), takes its session back with its resume token,
    restores its requests and resends the calls that were not applied
    (kvshm/service/resume.py).

    Raises TypeError if given both or neither of `path` and `name`,
    InvalidArgument for a `name` that cannot name a pool, ConnectionLost if
    nothing listens at the socket, HandshakeError subclasses
    (VersionMismatch, HashMismatch, Forbidden) if the coordinator refuses,
    RequestTimeout if it does not answer."""
    path = socket_path(path, name)
    hello = make_hello(path, tenant=tenant, node=node, token=token, admin=admin,
                       admin_token=admin_token, hash_algorithm=hash_algorithm,
                       hash_seed=hash_seed)
    wire, welcome = await open_wire(path, hello, timeout)
    return Client(path, hello, wire, welcome,
                  (reconnect or Reconnect()) if resume else None)


async def open_wire(path, hello: p.Hello, timeout: float) -> tuple[_Wire, p.Welcome]:
    """Connect and handshake; the wire and its Welcome (errors raised)."""
    loop = asyncio.get_running_loop()
    try:
        _, wire = await asyncio.wait_for(
            loop.create_unix_connection(_Wire, str(path)), timeout)
    except (FileNotFoundError, ConnectionRefusedError) as e:
        raise ConnectionLost(f"no coordinator listening at {path}: {e.strerror}") from None
    except asyncio.TimeoutError:
        raise RequestTimeout(f"connecting to {path} took over {timeout}s") from None
    try:
        wire.handshake = loop.create_future()
        wire.transport.write(encode_frame(hello))
        try:
            welcome = check_welcome(await asyncio.wait_for(wire.handshake, timeout))
        except asyncio.TimeoutError:
            raise RequestTimeout(f"no Welcome from {path} within {timeout}s") from None
    except BaseException:
        wire.transport.close()
        raise
    return wire, welcome
