"""The synchronous client of the coordinator: a blocking Unix socket and no
event loop, for callers that are synchronous themselves (vLLM's scheduler).

    from kvshm.service.sync_client import connect_sync

    with connect_sync("/run/kvshm/pool.sock") as c:
        c.add_request("r1", prompt=tokens)
        hits, n = c.get_computed_blocks("r1")
        new = c.allocate_slots("r1", len(tokens) - n, n, use_computed_blocks=True)

The same operations, arguments and errors as the asyncio client
(kvshm/service/client.py; both are written once, in client_core.py), one
call at a time; `batch()` runs several ops in one round trip.  It rides
through a coordinator restart the same way (client_core.py): reconnect
with backoff, take the session back with its resume token, restore the
requests from its `RequestMirror`, settle the calls in flight (applied:
its kept reply, or ReplyLost if it is no longer kept; not applied: sent
again); a session that
could not be given back fails them with ResumeFailed and goes on fresh.
It has no background: it notices a restart in its next call.  Not
thread-safe: one thread per client.
"""

from __future__ import annotations

import os
import socket
import time

import msgspec

from kvshm.core.errors import KvshmError
from kvshm.core.hashing import DEFAULT_HASH_ALGORITHM, DEFAULT_HASH_SEED
from kvshm.ops import protocol as p
from kvshm.ops.errors import (
    ConnectionClosed,
    ConnectionLost,
    Forbidden,
    ProtocolError,
    RequestTimeout,
)
from kvshm.ops.protocol import encode_frame
from kvshm.service.client_core import (CONNECT_ERRORS, Backoff, Call, ClientSession,
    check_restored, checked, resume_hello, shutdown_error)
from kvshm.service.framing import REPLY_LIMIT_BYTES, FrameReader
from kvshm.service.handshake import check_welcome, make_hello, socket_path
from kvshm.service.resume import Reconnect

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
        except PermissionError as e:   # the socket's (or its directory's) mode
            raise Forbidden(f"connecting to {path}: {e.strerror} (the OS lets in only the "
                            "coordinator's user, or the members of its --group)") from None
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


class SyncClient(ClientSession):
    """A session with the coordinator; make one with `connect_sync()`.  Its
    calls in flight are the call being made and those whose replies a
    timeout left unread (the next call reads them first)."""

    def __init__(self, path, hello: p.Hello, wire: _Wire, welcome: p.Welcome,
                 reconnect: Reconnect | None) -> None:
        super().__init__(path, hello, welcome, reconnect)
        self._wire: _Wire | None = wire
        self._lost: KvshmError | None = None

    # -- lifecycle -------------------------------------------------------------------
    def close(self) -> None:
        """Close the session; the coordinator frees every request it owns."""
        if self._wire is not None:
            self._wire.close()
            self._wire = None
        if self._lost is None:
            self._lost = ConnectionClosed("the client closed this connection")

    @property
    def connected(self) -> bool:
        """Whether the client holds a live connection now (False between a
        lost connection and its resume, and once it is closed or lost for
        good)."""
        return self._wire is not None and self._lost is None

    def break_connection(self) -> None:
        """Fault injection: shut the socket down both ways, as a network
        fault would, without closing the session; the next call finds the
        connection lost (the coordinator ends the session unless it is the
        one that went away).  For fault tests."""
        if self._wire is not None:
            self._wire.sock.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> "SyncClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- raw calls ------------------------------------------------------------------------
    def request(self, msg: msgspec.Struct, timeout: float | None = None):
        """Send one message and return its reply struct as it is (an `Error`
        reply is returned, not raised).  A coordinator restart meanwhile is
        ridden through (see the module docstring)."""
        if self._lost is not None:
            raise self._lost
        call = Call(msg)
        flight = self._flight
        flight.add(call)
        sent = False
        while True:
            try:
                if not sent:
                    sent = True
                    self._wire.send(flight.number(call))
                return self._wait(call, timeout)
            except (ConnectionLost, ProtocolError) as e:
                self._resume(e)      # settles the calls applied, sends the others again
                if call.settled:
                    if call.error is not None:
                        raise call.error from None
                    return call.reply

    def _op(self, msg, timeout, answer):
        return answer(checked(self.request(msg, timeout)))

    def _wait(self, call: Call, timeout: float | None):
        """Read replies until `call`'s (those of calls a timeout left unread
        come first).  On a timeout `call` stays in flight: its reply is read
        and recorded by the next call."""
        flight, wire = self._flight, self._wire
        while True:
            reply = wire.receive(timeout)
            if reply.__class__ is p.Shutdown:
                self._give_up(shutdown_error(reply))
                raise self._lost
            if flight.answered(reply) is call:
                return reply

    def _give_up(self, err: KvshmError) -> None:
        self._lost = err
        self._flight.fail_all(err)
        if self._wire is not None:
            self._wire.close()
            self._wire = None

    # -- riding through a coordinator restart (client_core.py) ---------------------------------
    def _resume(self, err: Exception) -> None:
        """Reconnect, take the session back, settle the calls applied,
        restore the requests and send the calls not applied again; or, when
        the session could not be given back, fail the calls in flight with
        ResumeFailed and go on as the fresh session.  Raises (and gives up)
        when the coordinator does not come back."""
        lost_at = time.monotonic()
        if self._wire is not None:
            self._wire.close()
            self._wire = None
        if self.reconnect is None or not self.resume_token:
            self._give_up(err if isinstance(err, KvshmError) else ConnectionLost(str(err)))
            raise self._lost
        policy = self.reconnect
        backoff = Backoff(policy, err)
        flight = self._flight
        while True:
            hello = resume_hello(self._hello, self.resume_token, flight)
            wire, welcome = self._reconnect(hello, backoff)
            if not welcome.resumed:
                flight.fresh_session(welcome)
                return
            flight.resumed(welcome, wire.decoder.decode)
            try:
                for msg in self.requests.restore_frames(welcome.requests):
                    restore = Call(msg)
                    flight.add(restore, first=True)
                    wire.send(flight.number(restore))
                    self._wait(restore, policy.connect_timeout)
                    check_restored(restore.reply)
                for call in flight.to_resend():    # not applied: send again, in order
                    wire.send(flight.number(call))
            except (ConnectionLost, ProtocolError):
                if self._lost is not None:      # the coordinator shut down
                    raise
                wire.close()                    # lost again while resuming: start over
                self._wire = None
                continue
            except KvshmError as e:
                self._give_up(e)
                raise
            break
        self.restarts.append((lost_at, time.monotonic()))

    def _reconnect(self, hello: p.Hello, backoff: Backoff) -> tuple[_Wire, p.Welcome]:
        """Connect again on the backoff's schedule (giving up after it)."""
        while True:
            try:
                wire, welcome = open_wire_sync(self.path, hello, self.reconnect.connect_timeout)
                break
            except CONNECT_ERRORS as e:
                try:
                    delay = backoff.next_delay(e)
                except ConnectionLost as gone:
                    self._give_up(gone)
                    raise self._lost from None
                time.sleep(delay)
        self._wire = wire
        self.take_welcome(welcome)
        return wire, welcome


def connect_sync(path: str | os.PathLike | None = None, *, name: str | None = None,
                 tenant: str = "", node: int = -1,
                 token: str | None = None, admin: bool = False,
                 admin_token: str | None = None,
                 hash_algorithm: str | None = DEFAULT_HASH_ALGORITHM,
                 hash_seed: str = DEFAULT_HASH_SEED, timeout: float = 10.0,
                 reconnect: Reconnect | None = None, resume: bool = True,
                 tenant_token: str | None = None, vllm_version: str = "") -> SyncClient:
    """Open a session (blocking) with the coordinator at `path` or pool
    `name`'s; the arguments and errors of `connect()`."""
    path = socket_path(path, name)
    hello = make_hello(path, tenant=tenant, node=node, token=token, admin=admin,
                       admin_token=admin_token, hash_algorithm=hash_algorithm,
                       hash_seed=hash_seed, tenant_token=tenant_token,
                       vllm_version=vllm_version)
    wire, welcome = open_wire_sync(path, hello, timeout)
    return SyncClient(path, hello, wire, welcome, (reconnect or Reconnect()) if resume else None)
