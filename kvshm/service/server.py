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
import socket
import stat
import struct
from collections import deque
from collections.abc import Callable
from pathlib import Path

import msgspec

from kvshm.core.errors import DuplicateRequest, InvalidArgument, KvshmError, UnknownRequest
from kvshm.core.hashing import hash_fingerprint
from kvshm.core.manager import KVCacheManager
from kvshm.core.request import Request
from kvshm.core.specs import PoolConfig
from kvshm.service import protocol as p
from kvshm.service.errors import (
    BatchTooLarge,
    Forbidden,
    FrameTooLarge,
    HandshakeRequired,
    HashMismatch,
    InternalError,
    NotOwner,
    ProtocolError,
    VersionMismatch,
)

log = logging.getLogger("kvshm.coordinator")

# Counts beyond this are certainly mistakes (and would only feed huge
# arithmetic); max_model_len bounds every real count far below it.
MAX_COUNT = 2**31 - 1
FREE_HEAD_MAX = 4096


class _ReqState:
    __slots__ = ("request", "owner", "hits")

    def __init__(self, request: Request, owner: "Session") -> None:
        self.request = request
        self.owner = owner
        self.hits = None


class Session(asyncio.Protocol):
    """One client connection."""

    def __init__(self, coord: "Coordinator") -> None:
        self.coord = coord
        self.id = 0
        self.transport: asyncio.Transport | None = None
        self.reader = p.FrameReader(coord.max_frame_bytes)
        self.hello: p.Hello | None = None
        self.hasher = None
        self.requests: set[str] = set()
        self.peer_pid = 0
        self._bodies: deque = deque()   # frames read but not yet answered
        self._paused = False            # the peer is not reading our replies

    # -- asyncio.Protocol ----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.set_write_buffer_limits(high=self.coord.write_buffer_high)
        self.id = next(self.coord._session_ids)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family == socket.AF_UNIX:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                    struct.calcsize("3i"))
            self.peer_pid, uid, _gid = struct.unpack("3i", creds)
            if uid != os.getuid() and not self.coord.allow_other_uids:
                self._reply(p.Error(Forbidden.code,
                                    f"peer uid {uid} is not this coordinator's uid "
                                    f"{os.getuid()} (serve with --allow-other-uids)"))
                transport.close()
                return
        self.coord.sessions[self.id] = self

    def connection_lost(self, exc: Exception | None) -> None:
        self.coord._end_session(self)

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
        bodies = self._bodies
        handle = self.coord._handle
        while bodies and not self._paused:
            t = self.transport
            if t is None or t.is_closing():
                bodies.clear()
                return
            self._reply(handle(self, bodies.popleft()))
        if not bodies and self.reader.broken is not None and not self.transport.is_closing():
            self._fatal(FrameTooLarge.code, str(self.reader.broken))

    # -- helpers -----------------------------------------------------------------------
    def _reply(self, msg: msgspec.Struct | None) -> None:
        if msg is not None:
            self.transport.write(p.encode_frame(msg))

    def _fatal(self, code: str, message: str) -> None:
        self._reply(p.Error(code, message))
        self.transport.close()


class Coordinator:
    """Owns a `KVCacheManager` over a named segment and serves it on a Unix
    socket.

    Args:
        config: the pool config.
        name: pool name; the segment is /dev/shm/<name>.
        socket_path: where to listen (its directory is created 0700).
        token: if set, clients must present it in Hello.
        allow_other_uids: accept peers of another uid (SO_PEERCRED).
    """

    def __init__(self, config: PoolConfig, *, name: str, socket_path: str | Path,
                 token: str | None = None, allow_other_uids: bool = False,
                 max_frame_bytes: int = p.MAX_FRAME_BYTES,
                 max_batch_ops: int = p.MAX_BATCH_OPS,
                 write_buffer_high: int = 4 * 2**20) -> None:
        self.socket_path = Path(socket_path)
        self.token = token or None
        self.allow_other_uids = allow_other_uids
        self.max_frame_bytes = max_frame_bytes
        self.max_batch_ops = max_batch_ops
        self.write_buffer_high = write_buffer_high
        self.arena = None
        if config.kv is not None:
            from kvshm.arena import arena_bytes
            from kvshm.core.segment import Layout, check_shm_space
            # Both segments must fit: refuse before creating either.
            check_shm_space(Layout(config.validate()).size + arena_bytes(config))
        self.mgr = KVCacheManager(config, name=name)
        self.config = self.mgr.config
        self.name = name
        if config.kv is not None:
            from kvshm.arena import KVArena, arena_name
            try:
                self.arena = KVArena.create(self.config, arena_name(name), check_space=False)
            except BaseException:
                self.mgr.close()
                raise
        self.base_hasher = self.mgr.make_hasher()
        self.fingerprint = hash_fingerprint(self.config.hash_algorithm, self.config.hash_seed)
        self.sessions: dict[int, Session] = {}
        self.requests: dict[str, _ReqState] = {}
        self._session_ids = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None
        self._bound = False
        self._decoder = msgspec.msgpack.Decoder(p.Message)
        self._config_json = self.config.to_json()
        self._hashers: dict[str, object] = {}
        self._dispatch: dict[type, Callable] = {
            p.AddRequest: self._add, p.Advance: self._advance,
            p.GetComputedBlocks: self._hits, p.AllocateSlots: self._alloc, p.Admit: self._admit,
            p.CacheBlocks: self._cache, p.Free: self._free,
            p.RemoveSkippedBlocks: self._skip, p.GetBlockIds: self._ids,
            p.NumCommonPrefixBlocks: self._common, p.ResetPrefixCache: self._reset,
            p.EvictBlocks: self._evict, p.GetStats: self._stats,
        }

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        path = self.socket_path
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise InvalidArgument(f"{path} exists and is not a socket")
            if _socket_answers(path):
                raise InvalidArgument(f"another coordinator listens on {path}")
            path.unlink()  # a stale socket of a dead coordinator
        old_umask = os.umask(0o177)
        try:
            self._server = await asyncio.get_running_loop().create_unix_server(
                lambda: Session(self), str(path))
        finally:
            os.umask(old_umask)
        self._bound = True
        os.chmod(path, 0o600)

    async def stop(self) -> None:
        """Stop accepting, end every session (freeing its requests), release
        the pool and unlink the segment and the socket."""
        if self._server is not None:
            self._server.close()
            for s in list(self.sessions.values()):
                if s.transport is not None:
                    s.transport.close()
            await self._server.wait_closed()
            self._server = None
        for s in list(self.sessions.values()):
            self._end_session(s)
        if self._bound:  # only ever remove the socket this coordinator made
            self._bound = False
            try:
                self.socket_path.unlink()
            except FileNotFoundError:
                pass
        self.mgr.close()
        if self.arena is not None:
            self.arena.close()
            self.arena.unlink()
            self.arena = None

    # -- sessions ----------------------------------------------------------------------------
    def _end_session(self, s: Session) -> None:
        if self.sessions.pop(s.id, None) is None:
            return
        mgr = self.mgr
        for rid in s.requests:
            self.requests.pop(rid, None)
            if not mgr.segment.closed:
                mgr.free(rid)
        s.requests.clear()

    def _hasher_for(self, tenant: str):
        if self.base_hasher is None:
            return None
        h = self._hashers.get(tenant)
        if h is None:
            h = self._hashers[tenant] = self.base_hasher.for_namespace(tenant)
        return h

    # -- frames --------------------------------------------------------------------------------
    def _handle(self, s: Session, body: bytes) -> msgspec.Struct:
        try:
            msg = self._decoder.decode(body)
        except msgspec.DecodeError as e:  # ValidationError included: it names the path
            return p.Error(ProtocolError.code, f"bad message: {e}")
        self.mgr.table.current_owner = s.id
        if s.hello is None:
            if msg.__class__ is not p.Hello:
                return p.Error(HandshakeRequired.code, "the first message must be Hello")
            reply = self._handshake(s, msg)
            if reply.__class__ is p.Error:  # no second guess on this connection
                s.transport.write(p.encode_frame(reply))
                s.transport.close()
                return None
            return reply
        cls = msg.__class__
        if cls is p.Batch:
            ops = msg.ops
            if len(ops) > self.max_batch_ops:
                return p.Error(BatchTooLarge.code, f"a batch holds at most "
                               f"{self.max_batch_ops} ops (got {len(ops)})")
            results = []
            dispatch = self._dispatch
            op = None
            try:
                for op in ops:
                    results.append(dispatch[op.__class__](s, op))
            except Exception as e:  # the batch stops at its first error
                results.append(self._error_reply(op, e))
            return p.BatchReply(results)
        if cls is p.Hello:
            return p.Error(ProtocolError.code, "Hello was already received")
        return self._run(s, msg)

    def _handshake(self, s: Session, hello: p.Hello) -> msgspec.Struct:
        if hello.version != p.PROTOCOL_VERSION:
            return p.Error(VersionMismatch.code, f"protocol version {hello.version} "
                           f"is not this coordinator's {p.PROTOCOL_VERSION}")
        if self.token is not None and not hmac.compare_digest(hello.token.encode(),
                                                              self.token.encode()):
            return p.Error(Forbidden.code, "missing or wrong auth token")
        if hello.hash_fingerprint != self.fingerprint:
            return p.Error(HashMismatch.code, f"hash fingerprint {hello.hash_fingerprint} "
                           f"differs from the pool's {self.fingerprint} (same "
                           "hash_algorithm and hash_seed needed)")
        s.hello = hello
        s.hasher = self._hasher_for(hello.tenant)
        return p.Welcome(p.PROTOCOL_VERSION, s.id, self._config_json, self.mgr.segment.name,
                         self.fingerprint, self.arena.name if self.arena is not None else "")

    def _run(self, s: Session, op) -> msgspec.Struct:
        try:
            return self._dispatch[op.__class__](s, op)
        except Exception as e:
            return self._error_reply(op, e)

    @staticmethod
    def _error_reply(op, e: Exception) -> p.Error:
        if isinstance(e, KvshmError):
            return p.Error(e.code, str(e))
        # A bug: report it, keep serving the others.
        log.exception("internal error on %r", op)
        return p.Error(InternalError.code, f"{type(e).__name__}: {e}")

    def _owned(self, s: Session, rid: str) -> _ReqState:
        st = self.requests.get(rid)
        if st is None:
            raise UnknownRequest(rid)
        if st.owner is not s:
            raise NotOwner(f"request {rid!r} belongs to another session")
        return st

    # -- operations ------------------------------------------------------------------------
    def _add(self, s: Session, op: p.AddRequest):
        rid = op.req
        if rid in self.requests:
            raise DuplicateRequest(rid)
        if (op.prompt is None) == (op.block_hashes is None):
            raise InvalidArgument("add_request needs either prompt or block_hashes")
        if op.prompt is not None:
            if len(op.prompt) > self.config.max_model_len:
                raise InvalidArgument(f"prompt of {len(op.prompt)} tokens exceeds "
                                      f"max_model_len {self.config.max_model_len}")
            req = Request(rid, op.prompt, s.hasher, lora_name=op.lora_name,
                          cache_salt=op.cache_salt,
                          skip_reading_prefix_cache=op.skip_prefix_cache_read)
        else:
            _check_count("num_tokens", op.num_tokens, self.config.max_model_len)
            req = Request.from_block_hashes(
                rid, op.block_hashes, op.num_tokens, s.hasher, lora_name=op.lora_name,
                cache_salt=op.cache_salt, skip_reading_prefix_cache=op.skip_prefix_cache_read)
        self.requests[rid] = _ReqState(req, s)
        s.requests.add(rid)
        return p.Done()

    def _advance(self, s: Session, op: p.Advance):
        req = self._owned(s, op.req).request
        n = op.num_computed_tokens
        # It may run ahead of the tokens (speculative drafts are computed
        # before they are accepted): only its sign and size are checked.
        if not 0 <= n <= MAX_COUNT:
            _check_count("num_computed_tokens", n, MAX_COUNT)
        if op.append_hashes or op.num_appended:
            _check_count("num_appended", req.num_tokens + op.num_appended, MAX_COUNT)
            req.append_block_hashes(op.append_hashes, op.num_appended)
        elif op.append:
            req.append_token_ids(op.append)
        req.num_computed_tokens = n
        return p.Done()

    def _hits(self, s: Session, op: p.GetComputedBlocks):
        st = self._owned(s, op.req)
        blocks, n = self.mgr.get_computed_blocks(st.request)
        st.hits = blocks
        return p.ComputedBlocks(blocks, n)

    def _alloc(self, s: Session, op: p.AllocateSlots):
        st = self._owned(s, op.req)
        if (op.num_new_tokens | op.num_new_computed_tokens | op.num_lookahead_tokens
                | op.num_external_computed_tokens | op.num_encoder_tokens) > MAX_COUNT:
            for name in ("num_new_tokens", "num_new_computed_tokens", "num_lookahead_tokens",
                         "num_external_computed_tokens", "num_encoder_tokens"):
                _check_count(name, max(getattr(op, name), 0), MAX_COUNT)
        mgr = self.mgr
        res = mgr.allocate_slots(
            st.request, op.num_new_tokens, op.num_new_computed_tokens,
            st.hits if op.use_computed_blocks else None, op.num_lookahead_tokens,
            op.num_external_computed_tokens, op.delay_cache_blocks, op.num_encoder_tokens)
        # res is a tuple of fresh lists: msgspec encodes it as is.
        return p.Allocated(res, mgr.block_pool.num_free_blocks)

    def _admit(self, s: Session, op: p.Admit):
        st = self._owned(s, op.req)
        if not 1 <= op.max_new_tokens <= MAX_COUNT:
            raise InvalidArgument(f"max_new_tokens must be in [1, {MAX_COUNT}] "
                                  f"(got {op.max_new_tokens})")
        _check_count("num_lookahead_tokens", op.num_lookahead_tokens, MAX_COUNT)
        mgr = self.mgr
        req = st.request
        if req.num_computed_tokens:
            raise InvalidArgument(f"request {op.req!r} already has "
                                  f"{req.num_computed_tokens} computed tokens; Admit is "
                                  "for a waiting request (free it with preempted=true first)")
        hits, num_hit = mgr.get_computed_blocks(req)
        n = min(op.max_new_tokens, req.num_tokens - num_hit)
        new = mgr.allocate_slots(req, n, num_hit, hits, op.num_lookahead_tokens, 0,
                                 op.delay_cache_blocks)
        return p.Admitted(hits, num_hit, n, new, mgr.block_pool.num_free_blocks)

    def _cache(self, s: Session, op: p.CacheBlocks):
        st = self._owned(s, op.req)
        self.mgr.cache_blocks(st.request, op.num_computed_tokens)
        return p.Done()

    def _free(self, s: Session, op: p.Free):
        self._owned(s, op.req)
        mgr = self.mgr
        mgr.free(op.req)
        if op.preempted:
            self.requests[op.req].request.num_preemptions += 1
        else:  # finished or aborted: the request is gone
            del self.requests[op.req]
            s.requests.discard(op.req)
        return p.FreeBlocks(mgr.block_pool.num_free_blocks)

    def _skip(self, s: Session, op: p.RemoveSkippedBlocks):
        self._owned(s, op.req)
        _check_count("total_computed_tokens", op.total_computed_tokens, MAX_COUNT)
        mgr = self.mgr
        mgr.remove_skipped_blocks(op.req, op.total_computed_tokens)
        return p.FreeBlocks(mgr.block_pool.num_free_blocks)

    def _ids(self, s: Session, op: p.GetBlockIds):
        self._owned(s, op.req)
        return p.BlockIds(list(self.mgr.get_block_ids(op.req)))

    def _common(self, s: Session, op: p.NumCommonPrefixBlocks):
        self._owned(s, op.req)
        counts = self.mgr.get_num_common_prefix_blocks(op.req)
        return p.CommonPrefix(counts)

    def _reset(self, s: Session, op: p.ResetPrefixCache):
        return p.ResetResult(self.mgr.reset_prefix_cache())

    def _evict(self, s: Session, op: p.EvictBlocks):
        self.mgr.evict_blocks(op.block_ids)
        return p.FreeBlocks(self.mgr.block_pool.num_free_blocks)

    def _stats(self, s: Session, op: p.GetStats):
        pool = self.mgr.block_pool
        q, h, qt, ht = pool.stats
        head = pool.free_queue(min(max(op.free_head, 0), FREE_HEAD_MAX)) if op.free_head else []
        return p.Stats(self.config.num_blocks, pool.num_free_blocks, pool.num_cached_blocks,
                       pool.get_usage(), len(self.mgr.table), len(self.sessions),
                       q, h, qt, ht, head)


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


def _check_count(name: str, value: int, limit: int) -> None:
    if not 0 <= value <= limit:
        raise InvalidArgument(f"{name} must be in [0, {limit}] (got {value})")



def default_socket_path(name: str) -> Path:
    """$XDG_RUNTIME_DIR/kvshm/<name>.sock, else /tmp/kvshm-<uid>/<name>.sock."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    root = Path(base) / "kvshm" if base else Path(f"/tmp/kvshm-{os.getuid()}")
    return root / f"{name}.sock"


async def serve(config: PoolConfig, *, name: str, socket_path: str | Path,
                token: str | None = None, allow_other_uids: bool = False,
                ready: Callable[[Coordinator], None] | None = None) -> None:
    """Run a coordinator until SIGINT/SIGTERM, then shut down cleanly."""
    import gc
    import signal

    from kvshm.core.segment import segment_info

    info = segment_info(name)
    if info is not None:
        if info["alive"]:
            raise InvalidArgument(f"pool {name!r} is served by live process {info['pid']}")
        raise InvalidArgument(f"a segment {name!r} of a dead coordinator (pid "
                              f"{info['pid']}) exists: remove it with `kvshm rm {name}`")
    coord = Coordinator(config, name=name, socket_path=socket_path, token=token,
                        allow_other_uids=allow_other_uids)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
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


def run_async(coro):
    """Run `coro` to completion on uvloop (the coordinator's event loop)."""
    import uvloop
    return uvloop.run(coro)
