"""The coordinator: one asyncio process that owns a pool and serves sessions.

Each connection is a `Session` (an `asyncio.Protocol`); requests belong to
the session that added them, and ending a session by any means frees them.
All pool mutations happen synchronously inside `data_received`, so the event
loop is the only writer and every operation (and every batch) is atomic.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import secrets
import socket
import stat
from collections import deque
from collections.abc import Callable
from pathlib import Path

import msgspec

from kvshm.core.errors import InvalidArgument, KvshmError
from kvshm.core.faults import core_classes, install_from_env
from kvshm.core.hashing import hash_fingerprint
from kvshm.core.metrics import TENANT_SLOTS
from kvshm.core.specs import PoolConfig
from kvshm.core.state import REPLIES_KEPT, REPLY_RING_BYTES
from kvshm.ops import protocol as p
from kvshm.ops.errors import (
    Forbidden,
    HandshakeError,
    HandshakeRequired,
    HashMismatch,
    PoolInUse,
    ProtocolError,
    ResumeFailed,
    SocketInUse,
    VersionMismatch,
)
from kvshm.ops.executor import OpExecutor
from kvshm.ops.lifecycle import SessionLifecycle
from kvshm.ops.owner import Owner
from kvshm.ops.protocol import encode_frame
from kvshm.ops.sessions import DEFAULT_RESUME_GRACE, SessionTable
from kvshm.ops.tenants import tenant_name_problem
from kvshm.pool.lifecycle import adopt_pool, create_pool
from kvshm.service.events import EventPublisher, KVEventsConfig
from kvshm.service.framing import MAX_FRAME_BYTES, FrameReader
from kvshm.service.handshake import admin_token_path
from kvshm.service.tenant_auth import Peer, TenantAuth, peer_credentials
from kvshm.service.process import early_stop_requested

log = logging.getLogger("kvshm.coordinator")


class Session(asyncio.Protocol):
    """One client connection."""

    def __init__(self, coord: "Coordinator") -> None:
        self.coord = coord
        self.id = 0
        self.transport: asyncio.Transport | None = None
        self.reader = FrameReader(coord.max_frame_bytes)
        self.hello: p.Hello | None = None
        self.owner: Owner | None = None     # set by the handshake
        self.peer_pid = 0
        self.peer = Peer()              # the kernel's word on the client (SO_PEERCRED)
        self.refusal_reason = ""        # why its handshake was refused, for the log
        self._bodies: deque = deque()   # frames read but not yet answered
        self._paused = False            # the peer is not reading our replies

    # -- asyncio.Protocol ----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.set_write_buffer_limits(high=self.coord.write_buffer_high)
        self.id = next(self.coord._session_ids)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family == socket.AF_UNIX:
            self.peer = peer_credentials(sock)
            self.peer_pid, uid = self.peer.pid, self.peer.uid
            if uid != os.getuid() and not self.coord.allow_other_uids:
                why = (f"peer uid {uid} is not this coordinator's uid {os.getuid()} "
                       "(serve with --allow-other-uids)")
                self._reply([encode_frame(p.Error(Forbidden.code, why))])
                self.coord.refused(self, why)
                transport.close()
                return
        self.coord.sessions[self.id] = self

    def connection_lost(self, exc: Exception | None) -> None:
        self.coord._end_session(self, exc)

    def pause_writing(self) -> None:
        # The client is not reading its replies: stop reading (and answering)
        # its requests until it catches up, so nothing buffers without bound.
        self._paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
            self._answer()

    def data_received(self, data: bytes) -> None:
        self._bodies.extend(self.reader.feed(data))
        self._answer()

    def _answer(self) -> None:
        """Answer the frames read so far, their replies written together.
        NOTE: frames that arrived together (a pipelining client) are applied
        before their replies are written, so a crash in between loses
        several replies at once.  The session record keeps the replies of
        the last REPLIES_KEPT frames as far as they fit in half its ring
        (ops/sessions.py), for the client's resume: replies are written at
        least that often, and no more than that waits in the transport's
        buffer (`write_buffer_high`) before this stops answering."""
        bodies = self._bodies
        handle = self.coord.handle
        replies, size = [], 0
        while bodies and not self._paused:
            t = self.transport
            if t is None or t.is_closing():
                bodies.clear()
                break
            frame = handle(self, bodies.popleft())
            if frame is not None:
                replies.append(frame)
                size += len(frame)
                if len(replies) == REPLIES_KEPT or size >= REPLY_RING_BYTES // 2:
                    self._reply(replies)
                    replies, size = [], 0
        t = self.transport
        if t is None or t.is_closing():
            return
        if replies:
            self._reply(replies)
        if not bodies and self.reader.broken is not None:
            self._fatal(self.reader.broken)

    # -- helpers -----------------------------------------------------------------------
    def _reply(self, frames: list) -> None:
        """Write reply frames (one system call for several)."""
        if len(frames) == 1:
            self.transport.write(frames[0])
        else:
            self.transport.writelines(frames)

    def _fatal(self, err: KvshmError) -> None:
        self._reply([encode_frame(p.Error(err.code, str(err), err.wire_fields()))])
        self.transport.close()


class Coordinator:
    """Owns a `KVCacheManager` over a named segment and serves it on a Unix
    socket.

    Args:
        config: the pool config.
        name: pool name; the segment is /dev/shm/<name>.
        socket_path: where to listen (its directory is created 0700).
        token: if set, clients must present it in Hello.
        admin_token: sessions presenting it (`Hello.admin_token`) may run the
            pool-wide destructive ops (reset, evict) and read the free queue.
            None: `start()` makes a random one and writes it, 0600, to
            `admin_token_path(socket_path)` (removed by `stop()`), so tools
            of the coordinator's user can read it and tenants of other
            users cannot.
        allow_other_uids: accept peers of another uid (SO_PEERCRED).
        write_buffer_high: replies waiting in a session's transport buffer
            (its client is not reading them) past which the session's
            frames wait too; the default keeps every reply not yet handed
            to the kernel within what the session record keeps for a
            resume after a crash (ops/sessions.py).
        group: share the pool with the users of this group (a gid): the
            socket 0660 and its directory 0750 (when this user owns it),
            the segments and arena 0660, all of that group; peers of other
            uids are then accepted (the OS lets only the group connect and
            map).  The admin token stays 0600.
        kv_events: publish the pool's KV-cache events as vLLM does (one
            batch per frame that changed the prefix cache;
            service/events.py).
        tenant_quotas: tenant -> the most blocks its sessions may hold
            (ops/tenants.py; a tenant not named is unlimited).
        tenant_auth: the tenants sessions must prove (service/tenant_auth.py;
            None or none declared: a session may name any tenant).
        reserve_arena: allocate the arena's pages when the pool is made or
            adopted (off: they come at first touch, which keeps first-touch
            NUMA placement but lets a /dev/shm filled later kill a process
            with SIGBUS).
    """

    def __init__(self, config: PoolConfig, *, name: str, socket_path: str | Path,
                 token: str | None = None, admin_token: str | None = None,
                 allow_other_uids: bool = False,
                 max_frame_bytes: int = MAX_FRAME_BYTES,
                 max_batch_ops: int = p.MAX_BATCH_OPS,
                 write_buffer_high: int = REPLY_RING_BYTES // 2, adopt: bool = False,
                 resume_grace: float = DEFAULT_RESUME_GRACE,
                 kv_events: KVEventsConfig | None = None,
                 tenant_quotas: dict[str, int] | None = None,
                 tenant_auth: TenantAuth | None = None,
                 group: int | None = None, reserve_arena: bool = True) -> None:
        self.socket_path = Path(socket_path)
        self.group = group
        self.tenant_auth = tenant_auth or TenantAuth()
        self.token = token or None
        self.admin_token = admin_token or None
        self._admin_file: Path | None = None   # the token file start() wrote
        self.allow_other_uids = allow_other_uids or group is not None
        self.max_frame_bytes = max_frame_bytes
        self.max_batch_ops = max_batch_ops
        self.write_buffer_high = write_buffer_high
        self.resume_grace = resume_grace
        self.pool = (adopt_pool if adopt else create_pool)(config, name, group=group,
                                                           reserve_arena=reserve_arena)
        self.mgr = self.pool.mgr
        self.publisher: EventPublisher | None = None
        if kv_events is not None and kv_events.publishes:
            try:
                self.publisher = EventPublisher(
                    kv_events, replay_topic=self.mgr.semantics.event_maps)
            except BaseException:
                self.pool.close(unlink=not adopt)
                raise
            self.mgr.enable_events()   # (an adopted pool's cached blocks, restated)
        self.arena = self.pool.arena
        self.adoption = self.pool.adoption
        self.config = self.mgr.config
        self.name = name
        self.executor = OpExecutor(self.mgr, max_batch_ops=max_batch_ops, resumable=True,
                                   quotas=tenant_quotas)
        self.metrics = self.executor.metrics
        first_id = 1
        if self.adoption is not None:
            found = self.executor.lifecycle.adopt()
            self.adoption.notes.append(
                f"{found['sessions']} session(s) may resume within {resume_grace:g}s, "
                f"holding {found['requests']} request(s); freed "
                f"{found['freed_without_session']} request(s) of sessions without a record")
            first_id = self.executor.lifecycle.max_session_id() + 1
        self.fingerprint = hash_fingerprint(self.config.hash_algorithm, self.config.hash_seed)
        self.generation = self.mgr.segment.get("generation")
        self.sessions: dict[int, Session] = {}
        self._session_ids = itertools.count(first_id)
        self._server: asyncio.AbstractServer | None = None
        self._grace: asyncio.TimerHandle | None = None
        self._bound = False
        self._served = False
        self._decoder = msgspec.msgpack.Decoder(p.Message)
        self._config_json = self.config.to_json()

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        path = self.socket_path
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise InvalidArgument(f"{path} exists and is not a socket")
            if _socket_answers(path):
                raise SocketInUse(str(path))
            path.unlink()  # a stale socket of a dead coordinator
        old_umask = os.umask(0o177)
        try:
            self._server = await asyncio.get_running_loop().create_unix_server(
                lambda: Session(self), str(path))
        finally:
            os.umask(old_umask)
        self._bound = True
        self._served = True
        if self.group is None:
            os.chmod(path, 0o600)
        else:
            share_socket(path, self.group)
        if self.executor.lifecycle.unresumed:
            self._grace = asyncio.get_running_loop().call_later(self.resume_grace,
                                                                self.expire_unresumed)
        self.publish_events()
        if self.admin_token is None:
            self._admin_file = admin_token_path(path)
            # A coordinator taking over keeps its predecessor's token, so
            # admin sessions resume too.
            kept = _read_token(self._admin_file) if self.adoption is not None else ""
            self.admin_token = kept or secrets.token_urlsafe(32)
            write_private_file(self._admin_file, self.admin_token)

    async def stop(self) -> None:
        """Stop accepting, end every session (freeing its requests), release
        the pool and unlink the segment and the socket."""
        if self._server is not None:
            self._server.close()
            bye = encode_frame(p.Shutdown("the coordinator stopped"))
            for s in list(self.sessions.values()):
                if s.transport is not None and not s.transport.is_closing():
                    s.transport.write(bye)
                    s.transport.close()
            await self._server.wait_closed()
            self._server = None
        for s in list(self.sessions.values()):
            self._end_session(s)
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        if self._bound:  # only ever remove the socket this coordinator made
            self._bound = False
            try:
                self.socket_path.unlink()
            except FileNotFoundError:
                pass
        if self._admin_file is not None:
            self._admin_file.unlink(missing_ok=True)
            self._admin_file = None
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        # A pool taken over but never served is left as it was found.
        self.pool.close(unlink=self._served or self.adoption is None)
        self.arena = None

    def expire_unresumed(self) -> None:
        """End of the grace period: requests of sessions that did not come
        back are freed (their cached blocks stay cached)."""
        self._grace = None
        n = len(self.executor.lifecycle.unresumed)
        freed = self.executor.lifecycle.expire_unresumed()
        self.publish_events()
        if n:
            log.info("resume grace period over: %d session(s) did not come back, "
                     "freed their %d request(s)", n, freed)

    # -- sessions ----------------------------------------------------------------------------
    def _end_session(self, s: Session, exc: Exception | None = None) -> None:
        if self.sessions.pop(s.id, None) is None:
            return
        owner = s.owner
        if owner is not None:
            n = len(owner.requests)
            self.executor.lifecycle.close(owner)
            self.publish_events()
            how = "closed by the client" if exc is None else f"connection lost ({exc})"
            log.info("session %d ended (pid %d, node %d, tenant %r): %s; %d request(s) "
                     "freed", s.id, s.peer_pid, s.hello.node, owner.tenant, how, n)

    def refused(self, s: Session, why: str) -> None:
        """Count and log a refused handshake (the session is closed)."""
        self.metrics.add("handshakes_refused")
        log.warning("refused a session (pid %d): %s", s.peer_pid, why)

    def publish_events(self, s: Session | None = None) -> None:
        """Route the KV-cache events recorded since the last call (the work
        of session `s`'s last frame: to it, if it takes its own) and send
        them as one batch."""
        if self.mgr.events is not None:
            events = self.executor.route_events(s.owner if s is not None else None)
            pub = self.publisher
            if events and pub is not None:
                pub.publish(events)
                m = self.metrics
                m.set("events_published", pub.published)
                m.set("events_dropped", pub.dropped)

    # -- frames --------------------------------------------------------------------------------
    def handle(self, s: Session, body: bytes) -> bytes | None:
        """The encoded reply frame to one frame body from session `s`
        (None: the session was refused and its transport closed)."""
        try:
            msg = self._decoder.decode(body)
        except msgspec.DecodeError as e:  # ValidationError included: it names the path
            return encode_frame(p.Error(ProtocolError.code, f"bad message: {e}"))
        if s.owner is None:
            if msg.__class__ is not p.Hello:
                return encode_frame(p.Error(HandshakeRequired.code,
                                              "the first message must be Hello"))
            reply = self._handshake(s, msg)
            if reply.__class__ is p.Error:  # no second guess on this connection
                self.refused(s, f"{reply.code}: {reply.message}" + (
                    f" ({s.refusal_reason})" if s.refusal_reason else ""))
                s.transport.write(encode_frame(reply))
                s.transport.close()
                return None
            return encode_frame(reply)
        if msg.__class__ is p.Hello:
            return encode_frame(p.Error(ProtocolError.code, "Hello was already received"))
        reply = self.executor.execute_frame(s.owner, msg)
        if self.mgr.events is not None:
            self.publish_events(s)
        return reply

    def _handshake(self, s: Session, hello: p.Hello) -> msgspec.Struct:
        if hello.version != p.PROTOCOL_VERSION:
            return p.Error(VersionMismatch.code, f"protocol version {hello.version} "
                           f"is not this coordinator's {p.PROTOCOL_VERSION}")
        if self.token is not None and not hmac.compare_digest(hello.token.encode(),
                                                              self.token.encode()):
            return p.Error(Forbidden.code, "missing or wrong auth token")
        admin = False
        if hello.admin_token:
            if self.admin_token is None or not hmac.compare_digest(
                    hello.admin_token.encode(), self.admin_token.encode()):
                return p.Error(Forbidden.code, "wrong admin token")
            admin = True
        # An empty fingerprint takes the pool's hashing (from the Welcome).
        if hello.hash_fingerprint and hello.hash_fingerprint != self.fingerprint:
            return p.Error(HashMismatch.code, f"hash fingerprint {hello.hash_fingerprint} "
                           f"differs from the pool's {self.fingerprint} (same "
                           "hash_algorithm and hash_seed needed)")
        release = self.mgr.config.vllm_version
        if hello.vllm_version and hello.vllm_version != release:
            return p.Error(HandshakeError.code, f"this pool reproduces vLLM {release}'s allocation "
                           f"semantics, not vLLM {hello.vllm_version}'s, the engine's (serve a "
                           f"pool with vllm_version = \"{hello.vllm_version}\" for it)")
        tenant = hello.tenant
        problem = tenant_name_problem(tenant)
        if problem:
            return p.Error(HandshakeError.code, problem)
        # (before the tenant gets a slot: a refused claim changes nothing)
        why = self.tenant_auth.refusal(tenant, s.peer, hello.tenant_token, admin=admin)
        if why is not None:   # the reason goes to the log only (handle: refused)
            s.refusal_reason = why
            return p.Error(Forbidden.code, f"this session may not act as tenant {tenant!r}")
        ex = self.executor
        if ex.tenants.slot(tenant) is None:
            return p.Error(HandshakeError.code, f"this pool has {TENANT_SLOTS} tenants "
                           f"already; {tenant!r} is not one of them")
        s.hello = hello
        resumed, rids, resume_error = False, [], ""
        if hello.resume_token:
            try:
                owner, rids = ex.lifecycle.resume(hello.resume_token, hello.tenant, admin=admin)
            except ResumeFailed as e:   # go on as a fresh session, and say why
                resume_error = str(e)
            else:
                resumed = True
                del self.sessions[s.id]   # the session takes its old id back
                s.id = owner.id
                self.sessions[s.id] = s
                s.owner = owner
                log.info("session %d resumed (pid %d, node %d, tenant %r): %d request(s) "
                         "taken back", s.id, s.peer_pid, hello.node, tenant, len(rids))
        if not resumed:
            s.owner = ex.lifecycle.open(s.id, hello.tenant, admin=admin, pid=hello.pid,
                                        node=hello.node)
            log.info("session %d connected (pid %d, node %d, tenant %r%s)%s", s.id,
                     s.peer_pid, hello.node, tenant, ", admin" if admin else "",
                     f"; could not resume: {resume_error}" if resume_error else "")
        owner = s.owner
        first, replies = ex.kept_replies(owner, hello.resume_from) if resumed else (0, [])
        return p.Welcome(p.PROTOCOL_VERSION, s.id, self._config_json, self.mgr.segment.name,
                         self.fingerprint, self.arena.name if self.arena is not None else "",
                         admin, owner.resume_token, resumed, owner.seq, first, replies, rids,
                         resume_error, self.generation)


def _socket_answers(path: Path) -> bool:
    """Whether something accepts connections on the Unix socket `path`."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def share_socket(path: Path, gid: int) -> None:
    """`--group`: the socket 0660 and its directory 0750, of group `gid`
    (the directory only when this user owns it: another's is left as its
    owner made it).  Raises InvalidArgument when the OS refuses."""
    try:
        d = path.parent
        if d.stat().st_uid == os.getuid():
            os.chown(d, -1, gid)
            os.chmod(d, 0o750)
        os.chown(path, -1, gid)
        os.chmod(path, 0o660)
    except OSError as e:
        raise InvalidArgument(f"cannot give {e.filename or path} to group {gid}: "
                              f"{e.strerror}") from None


def _read_token(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def write_private_file(path: Path, text: str) -> None:
    """Write `text` to `path`, readable by this user only (replacing a stale file)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")


def crash_classes() -> dict:
    """The classes a crash spec (KVSHM_CRASH, core/faults.py) may name in a
    coordinator process: the core's, the ops layer's and the server's."""
    return {**core_classes(), "OpExecutor": OpExecutor, "SessionLifecycle": SessionLifecycle,
            "SessionTable": SessionTable, "Session": Session, "Coordinator": Coordinator}


async def serve(config: PoolConfig, *, name: str, socket_path: str | Path,
                token: str | None = None, admin_token: str | None = None,
                allow_other_uids: bool = False, fresh: bool = False,
                resume_grace: float = DEFAULT_RESUME_GRACE,
                kv_events: KVEventsConfig | None = None,
                tenant_quotas: dict[str, int] | None = None,
                tenant_auth: TenantAuth | None = None, group: int | None = None,
                reserve_arena: bool = True,
                ready: Callable[[Coordinator], None] | None = None) -> None:
    """Run a coordinator until SIGINT/SIGTERM, then shut down cleanly.

    A pool of a dead coordinator under `name` is adopted (`fresh`: discarded
    first, with its arena); a live one's is refused.  Raises PoolInUse,
    SocketInUse, InvalidArgument and SegmentError (refusals) before serving."""
    import gc
    import signal

    from kvshm.pool.arena import arena_name
    from kvshm.pool.segment import segment_info
    from kvshm.pool.lifecycle import remove_pool

    info = segment_info(name)
    if info is not None and info["alive"]:
        raise PoolInUse(name, info["pid"])
    if fresh and (info is not None or segment_info(arena_name(name)) is not None):
        for removed in remove_pool(name):
            log.warning("--fresh: removed segment %s", removed)
        info = None
    if info is None:
        stale = segment_info(arena_name(name))
        if stale is not None and not stale["alive"]:   # an arena without its pool
            remove_pool(name)
            log.warning("removed the KV arena %s of a dead coordinator (its pool was gone)",
                        arena_name(name))
    # NOTE: the handlers go in before the pool is adopted or created, so a
    # SIGTERM during start-up stops the coordinator cleanly once it is up
    # (segments removed), instead of killing it with its pool half-owned.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if early_stop_requested():
        stop.set()
    crash = install_from_env(crash_classes())
    if crash is not None:
        log.warning("fault injection: this coordinator exits at %s", crash)
    try:
        coord = Coordinator(config, name=name, socket_path=socket_path, token=token,
                            admin_token=admin_token, allow_other_uids=allow_other_uids,
                            adopt=info is not None, resume_grace=resume_grace,
                            kv_events=kv_events, tenant_quotas=tenant_quotas,
                            tenant_auth=tenant_auth, group=group,
                            reserve_arena=reserve_arena)
    except BaseException:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        raise
    if coord.adoption is not None:
        for line in coord.adoption.lines():
            log.warning("pool %s: %s", name, line)
    try:
        await coord.start()
        gc.collect()
        gc.freeze()  # start-up objects never need scanning again
        if ready is not None:
            ready(coord)
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await coord.stop()
