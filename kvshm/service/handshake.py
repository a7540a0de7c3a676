"""How a session starts, for both clients (client.py: asyncio, sync_client.py:
blocking) and the coordinator (server.py).

- `default_socket_path(name)`: where pool `name`'s coordinator listens by
  default (`kvshm serve --name NAME` without `--socket`); `socket_path(path,
  name)`: the socket a client's `connect()` means; `admin_token_path` /
  `read_admin_token`: the admin token it writes beside its socket.
- `make_hello(...)`: the Hello a client sends (`connect()`'s arguments);
  `check_welcome(reply)`: the coordinator's answer, or its refusal raised.
- `SessionInfo`: what a session knows of its pool from the Welcome (its
  config, segments, hashing, admin right, resume token); the base of both
  clients.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvshm.core.errors import InvalidArgument, SegmentError
from kvshm.core.hashing import (
    DEFAULT_HASH_ALGORITHM,
    DEFAULT_HASH_SEED,
    BlockHasher,
    hash_fingerprint,
)
from kvshm.core.specs import PoolConfig
from kvshm.ops import protocol as p
from kvshm.ops.errors import Forbidden, ProtocolError, raise_reply
from kvshm.pool.shm import valid_name


def default_socket_path(name: str) -> Path:
    """$XDG_RUNTIME_DIR/kvshm/<name>.sock, else /tmp/kvshm-<uid>/<name>.sock."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    root = Path(base) / "kvshm" if base else Path(f"/tmp/kvshm-{os.getuid()}")
    return root / f"{name}.sock"


def socket_path(path: str | os.PathLike | None, name: str | None) -> str | os.PathLike:
    """The socket a client connects to: `path` as given, or the default
    socket of pool `name` (where `kvshm serve --name NAME` listens unless
    given `--socket`).

    Raises:
        TypeError: both or neither of `path` and `name` are given.
        InvalidArgument: `name` is not a pool name.
    """
    if (path is None) == (name is None):
        raise TypeError("connect() takes a socket path or a pool name (name=...), "
                        f"not {'both' if name is not None else 'neither'}")
    if name is None:
        return path
    if not isinstance(name, str) or not valid_name(name):
        raise InvalidArgument(f"bad pool name {name!r}: expected 1-200 letters, digits, "
                              "'.', '_' or '-' (as `kvshm serve --name` takes it)")
    return default_socket_path(name)


def admin_token_path(socket_path: str | Path) -> Path:
    """Where a coordinator on `socket_path` writes its generated admin token."""
    return Path(f"{socket_path}.admin-token")


def make_hello(path, *, tenant: str = "", node: int = -1, token: str | None = None,
               admin: bool = False, admin_token: str | None = None,
               hash_algorithm: str | None = DEFAULT_HASH_ALGORITHM,
               hash_seed: str = DEFAULT_HASH_SEED,
               tenant_token: str | None = None, vllm_version: str = "") -> p.Hello:
    """The handshake of a session (`connect()`'s arguments); `admin=True`
    reads the admin token from beside the socket unless one is given, and
    `hash_algorithm=None` takes the pool's hashing, whatever it is (the
    client then hashes with `make_hasher()`).  `tenant_token` proves
    `tenant` to a coordinator that declares it `token:FILE`
    (service/tenant_auth.py).  `vllm_version`: the release of the vLLM
    engine the session serves; a pool reproducing another release's
    semantics refuses it."""
    if admin and admin_token is None:
        admin_token = read_admin_token(path)
    if tenant_token is not None and not isinstance(tenant_token, str):
        raise InvalidArgument(f"tenant_token must be a str (got {type(tenant_token).__name__})")
    fingerprint = "" if hash_algorithm is None else hash_fingerprint(hash_algorithm, hash_seed)
    return p.Hello(p.PROTOCOL_VERSION, os.getpid(), fingerprint, node, tenant, token or "",
                   admin_token or "", tenant_token=(tenant_token or "").strip(),
                   vllm_version=vllm_version)



def check_welcome(reply) -> p.Welcome:
    """The handshake's answer as a Welcome; a refusal raises its error."""
    if reply.__class__ is p.Error:
        raise_reply(reply)
    if reply.__class__ is not p.Welcome:
        raise ProtocolError(f"expected Welcome, got {type(reply).__name__}")
    return reply


class SessionInfo:
    """What a session knows of its pool from the coordinator's Welcome; the
    base of both clients (asyncio and synchronous)."""

    def take_welcome(self, welcome: p.Welcome) -> None:
        self.session_id = welcome.session_id
        self.config = PoolConfig.from_json(welcome.config)
        self.pool_segment = welcome.pool_segment
        self.hash_fingerprint = welcome.hash_fingerprint
        self.arena_segment = welcome.arena_segment
        self.admin = welcome.admin
        self.resume_token = welcome.resume_token
        self.generation = welcome.generation

    def make_hasher(self) -> BlockHasher | None:
        """A hasher producing the pool's block hashes, for clients that hash
        prompts themselves (send them with `block_hashes=`); None when the
        pool does not cache."""
        return self.config.block_hasher()

    def attach_arena(self):
        """Map the pool's KV data arena (a `kvshm.pool.arena.KVArena`; close it
        when done).  Raises SegmentError if the pool has none."""
        from kvshm.pool.arena import KVArena   # numpy: only for callers that map the arena
        if not self.arena_segment:
            raise SegmentError("this pool has no KV arena (its config has no kv shape)")
        return KVArena.attach(self.arena_segment, self.config)


def read_admin_token(socket_path: str | os.PathLike) -> str:
    """The admin token a coordinator generated beside `socket_path`.
    Raises Forbidden if it cannot be read (not this coordinator's user, or
    the coordinator was given its admin token by --admin-token-file)."""
    path = admin_token_path(socket_path)
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        raise Forbidden(f"cannot read the admin token {path}: {e.strerror}") from None
