"""The asyncio client of the coordinator.

    async with await kvshm.connect("/run/kvshm/pool.sock") as c:
        await c.add_request("r1", prompt=tokens)
        hits, n = await c.get_computed_blocks("r1")
        new = await c.allocate_slots("r1", len(tokens) - n, n, use_computed_blocks=True)

Replies come back in order, so calls can be pipelined from several tasks.
A cancelled or timed-out call never leaves the connection half-read: its
reply is read and discarded when it arrives.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import Sequence

import msgspec

from kvshm.core.hashing import BlockHasher, hash_fingerprint
from kvshm.core.specs import PoolConfig
from kvshm.service import protocol as p
from kvshm.service.errors import (
    ConnectionClosed,
    ConnectionLost,
    Forbidden,
    ProtocolError,
    RequestTimeout,
    error_from_wire,
)


REPLY_LIMIT_BYTES = 2**30


class _Wire(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        # Replies can legitimately be large (a batch of block tables): the
        # client trusts its coordinator and only guards against nonsense.
        self.reader = p.FrameReader(limit=REPLY_LIMIT_BYTES)
        self.decoder = msgspec.msgpack.Decoder(p.ServerMessage)
        self.waiters: deque[asyncio.Future] = deque()
        self.lost: Exception | None = None
        self._writable: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            for body in self.reader.feed(data):
                msg = self.decoder.decode(body)
                fut = self.waiters.popleft()
                if not fut.done():  # cancelled calls just drop their reply
                    fut.set_result(msg)
            if self.reader.broken is not None:
                raise self.reader.broken
        except (p.FrameTooLarge, msgspec.DecodeError, IndexError) as e:
            self._fail(ProtocolError(f"unreadable reply from the coordinator: {e}"))
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost is None:
            self._fail(ConnectionLost("the coordinator closed the connection"
                                      + (f": {exc}" if exc else "")))

    def _fail(self, err: Exception) -> None:
        self.lost = err
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_exception(err)
        if self._writable is not None and not self._writable.done():
            self._writable.set_exception(err)

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None


class Client:
    """A session with the coordinator; make one with `connect()`."""

    def __init__(self, wire: _Wire, welcome: p.Welcome, tenant: str) -> None:
        self._wire = wire
        self.session_id = welcome.session_id
        self.config = PoolConfig.from_json(welcome.config)
        self.pool_segment = welcome.pool_segment
        self.hash_fingerprint = welcome.hash_fingerprint
        self.arena_segment = welcome.arena_segment
        self.tenant = tenant
        self.admin = welcome.admin
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------
    async def close(self) -> None:
        """Close the session; the coordinator frees every request it owns."""
        if self._closed:
            return
        self._closed = True
        t = self._wire.transport
        if t is not None and not t.is_closing():
            t.close()
        if self._wire.lost is None:
            self._wire._fail(ConnectionClosed("the client closed this connection"))

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def make_hasher(self) -> BlockHasher | None:
        """A hasher producing the pool's block hashes, for clients that hash
        prompts themselves (send them with `block_hashes=`)."""
        cfg = self.config
        if not cfg.enable_caching:
            return None
        return BlockHasher(cfg.hash_algorithm, cfg.hash_seed, cfg.hash_block_size)

    def attach_arena(self):
        """Map the pool's KV data arena (a `kvshm.arena.KVArena`; close it
        when done).  Raises SegmentError if the pool has none."""
        from kvshm.arena import KVArena
        from kvshm.core.errors import SegmentError
        if not self.arena_segment:
            raise SegmentError("this pool has no KV arena (its config has no kv shape)")
        return KVArena.attach(self.arena_segment, self.config)

    # -- raw calls ------------------------------------------------------------------------
    async def call(self, msg: msgspec.Struct, timeout: float | None = None):
        """Send one message, return its reply struct (Error replies raise)."""
        reply = await self._send(msg, timeout)
        if reply.__class__ is p.Error:
            raise error_from_wire(reply.code, reply.message)
        return reply

    async def batch(self, ops: Sequence[msgspec.Struct], timeout: float | None = None) -> list:
        """Run `ops` in one frame, atomically with respect to other sessions.
        Returns their replies; if one failed, raises its error with
        `.results` (the replies before it) and `.index` set."""
        reply = await self._send(p.Batch(list(ops)), timeout)
        if reply.__class__ is p.Error:
            raise error_from_wire(reply.code, reply.message)
        results = reply.results
        if results and results[-1].__class__ is p.Error:
            last = results[-1]
            err = error_from_wire(last.code, last.message)
            err.results = results[:-1]
            err.index = len(results) - 1
            raise err
        return results

    async def _send(self, msg: msgspec.Struct, timeout: float | None):
        wire = self._wire
        if wire.lost is not None:
            raise wire.lost
        if wire._writable is not None:
            await wire._writable
        fut = asyncio.get_running_loop().create_future()
        wire.waiters.append(fut)
        wire.transport.write(p.encode_frame(msg))
        if timeout is None:
            return await fut
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise RequestTimeout(f"no reply within {timeout}s") from None

    # -- operations --------------------------------------------------------------------------
    async def add_request(self, req: str, prompt: Sequence[int] | None = None, *,
                          block_hashes: list[bytes] | None = None, num_tokens: int = 0,
                          lora_name: str | None = None, cache_salt: str | None = None,
                          skip_prefix_cache_read: bool = False,
                          timeout: float | None = None) -> None:
        await self.call(p.AddRequest(req, None if prompt is None else list(prompt),
                                     block_hashes, num_tokens, lora_name, cache_salt,
                                     skip_prefix_cache_read), timeout)

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
                    delay_cache_blocks: bool = False,
                    timeout: float | None = None) -> p.Admitted:
        """Lookup + allocation of a waiting request in one atomic step (see
        `protocol.Admit`); `.new_block_ids` is None if the pool is short."""
        return await self.call(p.Admit(req, max_new_tokens, num_lookahead_tokens,
                                       delay_cache_blocks), timeout)

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


async def connect(path: str | os.PathLike, *, tenant: str = "", node: int = -1,
                  token: str | None = None, admin: bool = False,
                  admin_token: str | None = None, hash_algorithm: str = "sha256",
                  hash_seed: str = "kvshm-0", timeout: float = 10.0) -> Client:
    """Open a session.  `admin=True` reads the coordinator's generated admin
    token from beside its socket (or pass `admin_token`): the session may
    then reset the prefix cache, evict blocks and read the free queue.
    Raises ConnectionLost if nothing listens at `path`, HandshakeError
    subclasses (VersionMismatch, HashMismatch, Forbidden) if the coordinator
    refuses, RequestTimeout if it does not answer."""
    if admin and admin_token is None:
        admin_token = read_admin_token(path)
    loop = asyncio.get_running_loop()
    try:
        _, wire = await asyncio.wait_for(
            loop.create_unix_connection(_Wire, str(path)), timeout)
    except (FileNotFoundError, ConnectionRefusedError) as e:
        raise ConnectionLost(f"no coordinator listening at {path}: {e.strerror}") from None
    except asyncio.TimeoutError:
        raise RequestTimeout(f"connecting to {path} took over {timeout}s") from None
    hello = p.Hello(p.PROTOCOL_VERSION, os.getpid(),
                    hash_fingerprint(hash_algorithm, hash_seed), node, tenant, token or "",
                    admin_token or "")
    client = Client.__new__(Client)
    client._wire = wire
    client._closed = False
    try:
        welcome = await Client._send(client, hello, timeout)
        if welcome.__class__ is p.Error:
            raise error_from_wire(welcome.code, welcome.message)
        if welcome.__class__ is not p.Welcome:
            raise ProtocolError(f"expected Welcome, got {type(welcome).__name__}")
    except BaseException:
        wire.transport.close()
        raise
    Client.__init__(client, wire, welcome, tenant)
    return client


def read_admin_token(socket_path: str | os.PathLike) -> str:
    """The admin token a coordinator generated beside `socket_path`.
    Raises Forbidden if it cannot be read (not this coordinator's user, or
    the coordinator was given its admin token by --admin-token-file)."""
    from kvshm.service.server import admin_token_path
    path = admin_token_path(socket_path)
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        raise Forbidden(f"cannot read the admin token {path}: {e.strerror}") from None
