"""The asyncio client of the coordinator: `connect()` returns a `Client`.

    import kvshm

    async with await kvshm.connect("/run/kvshm/pool.sock") as c:
        await c.add_request("r1", prompt=tokens)
        hits, n = await c.get_computed_blocks("r1")
        new = await c.allocate_slots("r1", len(tokens) - n, n, use_computed_blocks=True)

`Client` has one awaitable method per operation of the protocol (written
once for both clients, in client_core.py), `call` (one message), `batch`
(several in one frame) and `close`; `open_wire` connects and handshakes.  Replies come back in order, so calls can be pipelined from
several tasks.  A cancelled or timed-out call never leaves the connection
half-read: its reply is read and discarded when it arrives.  The client
survives a coordinator restart (see `connect(resume=...)` and
client_core.py).  What it shares with the synchronous client
(sync_client.py) is in client_core.py (the operations, the reconnect
schedule, the calls in flight and their settling), handshake.py (the Hello,
the Welcome, `SessionInfo`) and resume.py (`Reconnect`, `RequestMirror`).
"""

from __future__ import annotations

import asyncio
import os
import time

import msgspec

from kvshm.core.errors import KvshmError
from kvshm.core.hashing import DEFAULT_HASH_ALGORITHM, DEFAULT_HASH_SEED
from kvshm.ops import protocol as p
from kvshm.ops.errors import (
    ConnectionClosed,
    ConnectionLost,
    Forbidden,
    FrameTooLarge,
    ProtocolError,
    RequestTimeout,
)
from kvshm.ops.protocol import encode_frame
from kvshm.service.client_core import (CONNECT_ERRORS, Backoff, Call, ClientSession,
    check_restored, checked, resume_hello, shutdown_error)
from kvshm.service.framing import REPLY_LIMIT_BYTES, FrameReader
from kvshm.service.handshake import check_welcome, make_hello, socket_path
from kvshm.service.resume import Reconnect


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


class Client(ClientSession):
    """A session with the coordinator; make one with `connect()`."""

    def __init__(self, path, hello: p.Hello, wire: _Wire, welcome: p.Welcome,
                 reconnect: "Reconnect | None") -> None:
        super().__init__(path, hello, welcome, reconnect)
        self._closed = False
        self._lost: Exception | None = None          # for good: no reconnecting
        self._resuming: asyncio.Task | None = None
        self._resumed: asyncio.Event = asyncio.Event()
        self._attach(wire)
        if wire.lost is not None:   # lost after its Welcome, before anyone watched it
            self._on_lost(wire, wire.lost)

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

    @property
    def connected(self) -> bool:
        """Whether the client holds a live connection now (False while it
        reconnects after a coordinator restart, and once it is closed or
        lost for good)."""
        return not self._closed and self._lost is None and self._wire.lost is None

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- raw calls ------------------------------------------------------------------------
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
        call = Call(msg, fut)
        self._flight.add(call)
        if self._wire.lost is None and self._resumed.is_set():
            self._write(call)
        if timeout is None:
            return await fut
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise RequestTimeout(f"no reply within {timeout}s") from None

    def _op(self, msg, timeout, answer):
        return self._answer(msg, timeout, answer)

    async def _answer(self, msg, timeout, answer):
        return answer(checked(await self.request(msg, timeout)))

    def _write(self, call: Call) -> None:
        frame = self._flight.number(call)
        t = self._wire.transport
        # A transport the peer closed refuses writes before its
        # connection_lost has run; that loss starts the resume, which sends
        # the call again.
        if not t.is_closing():
            t.write(frame)

    def _on_reply(self, msg) -> None:
        if msg.__class__ is p.Shutdown:   # a clean stop: nothing will come back
            self._give_up(shutdown_error(msg))
            return
        _deliver(self._flight.answered(msg))

    def _give_up(self, err: Exception) -> None:
        self._lost = err
        for call in self._flight.fail_all(err):
            _deliver(call)
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

    # -- riding through a coordinator restart (client_core.py) ---------------------------------
    async def _resume(self, err: Exception, lost_at: float) -> None:
        """Reconnect, take the session back, restore the requests, settle
        the calls in flight and resend those not applied.  A new loss of
        the connection meanwhile cancels this and starts over."""
        flight = self._flight
        try:
            backoff = Backoff(self.reconnect, err)
            while True:
                welcome = await self._reconnect(backoff)
                settled = (flight.resumed(welcome, self._wire.decoder.decode)
                           if welcome.resumed else flight.fresh_session(welcome))
                for call in settled:
                    _deliver(call)
                if self._wire.lost is None:
                    break
                # Lost between its Welcome and now, while nothing watched it
                # (a coordinator killed just after answering): nothing would
                # say so, and a write would go nowhere.  Again, from this
                # Welcome's state, on the same schedule.
                await asyncio.sleep(backoff.next_delay(self._wire.lost))
            if not welcome.resumed:
                self._resumed.set()
                return
            for frame in self.requests.restore_frames(welcome.requests):
                await self._restore(frame)
            for call in flight.to_resend():    # not applied: send again, in order
                self._write(call)
            self.restarts.append((lost_at, time.monotonic()))
            self._resumed.set()
        except KvshmError as e:
            self._give_up(e)
        except asyncio.CancelledError:
            pass
        except Exception as e:   # noqa: BLE001 - a resume must end: never leave calls waiting
            self._give_up(ConnectionLost(f"resuming the session after the coordinator went "
                                         f"away failed: {type(e).__name__}: {e}"))
        finally:
            if self._resuming is asyncio.current_task():
                self._resuming = None

    async def _reconnect(self, backoff: Backoff) -> p.Welcome:
        policy = self.reconnect
        hello = resume_hello(self._hello, self.resume_token, self._flight)
        while True:
            if self._closed:
                raise ConnectionClosed("the client closed this connection")
            try:
                wire, welcome = await open_wire(self.path, hello, policy.connect_timeout)
                break
            except CONNECT_ERRORS as e:
                await asyncio.sleep(backoff.next_delay(e))
        self.take_welcome(welcome)
        self._attach(wire)
        self._resumed.clear()
        return welcome

    async def _restore(self, msg) -> None:
        """One restore frame, ahead of the waiting calls; raises its errors."""
        call = Call(msg, asyncio.get_running_loop().create_future())
        self._flight.add(call, first=True)
        self._write(call)
        try:
            reply = await call.waiter
        except asyncio.CancelledError:
            if call in self._flight.calls:
                self._flight.calls.remove(call)
            raise
        check_restored(reply)


def _deliver(call: Call) -> None:
    """Hand a settled call's outcome to its waiter (a cancelled or timed-out
    call just drops it)."""
    fut = call.waiter
    if not fut.done():
        if call.error is None:
            fut.set_result(call.reply)
        else:
            fut.set_exception(call.error)


async def connect(path: str | os.PathLike | None = None, *, name: str | None = None,
                  tenant: str = "", node: int = -1,
                  token: str | None = None, admin: bool = False,
                  admin_token: str | None = None,
                  hash_algorithm: str | None = DEFAULT_HASH_ALGORITHM,
                  hash_seed: str = DEFAULT_HASH_SEED, timeout: float = 10.0,
                  reconnect: "Reconnect | None" = None, resume: bool = True,
                  tenant_token: str | None = None, vllm_version: str = "") -> Client:
    """Open a session with the coordinator listening at `path`, or with pool
    `name`'s (at its default socket, where `kvshm serve --name NAME` listens
    without `--socket`): give one of them.  `admin=True` reads the coordinator's generated admin
    token from beside its socket (or pass `admin_token`): the session may
    then reset the prefix cache, evict blocks and read the free queue.
    The coordinator refuses a client whose `hash_algorithm` and `hash_seed`
    differ from the pool's (HashMismatch); `hash_algorithm=None` takes the
    pool's, whatever they are (hash with `make_hasher()`).  `tenant` names
    the session's tenant; where the coordinator declares tenants (`kvshm
    serve --tenant`), the claim must be proven: by this process's uid or
    group, or by `tenant_token`, the content of the tenant's token file
    (Forbidden otherwise).  A vLLM engine's session names its release
    (`vllm_version`): a pool reproducing another's refuses it
    (HandshakeError, naming both).

    With `resume` (the default) the client rides through coordinator
    restarts: it reconnects with bounded exponential backoff (`reconnect`,
    default `Reconnect()`), takes its session back with its resume token,
    restores its requests and resends the calls that were not applied
    (kvshm/service/client_core.py).

    Raises TypeError if given both or neither of `path` and `name`,
    InvalidArgument for a `name` that cannot name a pool, ConnectionLost if
    nothing listens at the socket, HandshakeError subclasses
    (VersionMismatch, HashMismatch, Forbidden) if the coordinator refuses,
    RequestTimeout if it does not answer."""
    path = socket_path(path, name)
    hello = make_hello(path, tenant=tenant, node=node, token=token, admin=admin,
                       admin_token=admin_token, hash_algorithm=hash_algorithm,
                       hash_seed=hash_seed, tenant_token=tenant_token,
                       vllm_version=vllm_version)
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
    except PermissionError as e:   # the socket's (or its directory's) mode
        raise Forbidden(f"connecting to {path}: {e.strerror} (the OS lets in only the "
                        "coordinator's user, or the members of its --group)") from None
    except asyncio.TimeoutError:
        raise RequestTimeout(f"connecting to {path} took over {timeout}s") from None
    try:
        if wire.lost is not None or wire.transport.is_closing():
            # Accepted, then closed: a coordinator killed as it came up.
            raise ConnectionLost(f"the coordinator at {path} closed the connection before "
                                 "the handshake")
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
