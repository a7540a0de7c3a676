"""Tenants that must prove who they are (`kvshm serve --tenant NAME=PROOF`).

With no tenant declared, a session's Hello names any tenant it likes and
gets it (the behaviour of pools of cooperating clients).  Once one tenant is
declared, every tenant name a session claims must be declared and proven:

- `uid:N`: the peer process runs as user N (its effective uid when it
  connected, from the socket's SO_PEERCRED: the kernel's word, not the
  client's);
- `gid:N`: its effective gid or one of its supplementary groups is N
  (SO_PEERGROUPS);
- `token:FILE`: its Hello carries the content of FILE (`connect(...,
  tenant_token=...)`), read once at start-up; FILE must be readable by its
  owner only (mode 0600 or stricter), so that a token in a world-readable
  file is refused before anyone can rely on it.

A tenant may be declared several times; any one of its proofs admits it.
`=PROOF` declares the default tenant (""): then a session that names no
tenant must prove that one too, and with it undeclared the default tenant
stays open to every session the socket lets in.  Admin sessions (the
coordinator's admin token) may act as any tenant.

A refused claim gets FORBIDDEN naming the tenant and never which check
failed (a prober learns nothing about the proofs); the coordinator logs the
reason.  docs/operations.md has the trust model: what a proven tenant can
and cannot see.
"""

from __future__ import annotations

import errno
import hmac
import os
import socket
import stat
import struct
from pathlib import Path

import msgspec

from kvshm.core.errors import ConfigError
from kvshm.ops.tenants import tenant_name_problem

KINDS = ("uid", "gid", "token")
MAX_ID = 2**32 - 2   # uid_t / gid_t; (uid_t)-1 means "none"


class Proof(msgspec.Struct, frozen=True):
    """One way to prove tenant `tenant`: `kind` is uid, gid or token;
    `value` the id, or the token itself (never printed); `source` the
    declaration as given (for messages: a token's file, not its content)."""
    tenant: str
    kind: str
    value: int | str
    source: str


def parse_proof(spec: str, *, read_token=None) -> Proof:
    """`NAME=uid:N`, `NAME=gid:N` or `NAME=token:FILE` as a Proof.
    `read_token(path) -> str` reads a token file (default: `read_token_file`).
    Raises ConfigError naming what is wrong."""
    name, sep, proof = spec.partition("=")
    if not sep:
        raise ConfigError("tenant", f"{spec!r} is not NAME=uid:N, NAME=gid:N or "
                          "NAME=token:FILE")
    problem = tenant_name_problem(name)
    if problem:
        raise ConfigError("tenant", problem)
    kind, sep, value = proof.partition(":")
    if not sep or kind not in KINDS:
        raise ConfigError("tenant", f"{spec!r}: the proof must be uid:N, gid:N or "
                          f"token:FILE (got {proof!r})")
    if kind == "token":
        if not value:
            raise ConfigError("tenant", f"{spec!r}: token: needs a file")
        token = (read_token or read_token_file)(value)
        return Proof(name, kind, token, f"token:{value}")
    if not value.isdigit() or int(value) > MAX_ID:
        raise ConfigError("tenant", f"{spec!r}: {kind} must be a number in [0, {MAX_ID}] "
                          f"(got {value!r})")
    return Proof(name, kind, int(value), proof)


def read_token_file(path: str | os.PathLike) -> str:
    """A tenant's token from `path`: its content, stripped.  Raises
    ConfigError when the file cannot be read, is empty, or can be read or
    written by anyone but its owner."""
    p = Path(path)
    try:
        # (O_NONBLOCK: a FIFO put there must not hang the start-up)
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError("tenant", f"cannot read the token file {p}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError("tenant", f"the token file {p} is not a regular file")
        raw = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    if st.st_mode & 0o077:
        raise ConfigError("tenant", f"the token file {p} is mode {stat.S_IMODE(st.st_mode):04o}: "
                          "a tenant's token must be readable by its owner only "
                          f"(chmod 600 {p})")
    try:
        token = raw.decode().strip()
    except UnicodeDecodeError:
        raise ConfigError("tenant", f"the token file {p} is not text") from None
    if not token:
        raise ConfigError("tenant", f"the token file {p} is empty")
    return token


class Peer(msgspec.Struct, frozen=True):
    """Who is at the other end of a session's socket, by the kernel's word
    (uid -1: unknown, as over a socket pair of another family)."""
    pid: int = 0
    uid: int = -1
    gids: frozenset[int] = frozenset()


class TenantAuth:
    """The declared tenants and their proofs; `refusal(...)` decides a claim."""

    def __init__(self, proofs: list[Proof] | tuple[Proof, ...] = ()) -> None:
        self._proofs: dict[str, list[Proof]] = {}
        for proof in proofs:
            self._proofs.setdefault(proof.tenant, []).append(proof)

    @classmethod
    def from_specs(cls, specs, *, read_token=None) -> "TenantAuth":
        """From `NAME=PROOF` strings (the flag's and the config file's form)."""
        return cls([parse_proof(s, read_token=read_token) for s in specs])

    @property
    def declared(self) -> bool:
        """Whether any tenant is declared (then every claim needs a proof)."""
        return bool(self._proofs)

    @property
    def tenants(self) -> list[str]:
        return sorted(self._proofs)

    def describe(self) -> list[str]:
        """One line per declared tenant: its proofs (token files by name)."""
        return [f"tenant {t!r}: " + ", ".join(p.source for p in ps)
                for t, ps in sorted(self._proofs.items())]

    def refusal(self, tenant: str, peer: Peer, token: str, *, admin: bool) -> str | None:
        """Why the session of `peer`, presenting `token`, may not act as
        `tenant` (for the log only: the client is told FORBIDDEN naming
        the tenant, not this); None: it may."""
        if not self._proofs or admin:
            return None
        proofs = self._proofs.get(tenant)
        if proofs is None:
            if tenant == "":   # the default tenant, not declared: open
                return None
            return f"tenant {tenant!r} is not declared (declared: {', '.join(map(repr, self.tenants))})"
        given = token.encode()
        for proof in proofs:
            if proof.kind == "uid" and peer.uid == proof.value:
                return None
            if proof.kind == "gid" and proof.value in peer.gids:
                return None
            if proof.kind == "token" and token and hmac.compare_digest(
                    given, proof.value.encode()):
                return None
        said = "a token" if token else "no token"
        return (f"peer pid {peer.pid} (uid {peer.uid}, gids "
                f"{sorted(peer.gids) or 'unknown'}, {said}) proves none of "
                f"{', '.join(p.source for p in proofs)}")


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)   # Linux >= 4.13


def peer_credentials(sock: socket.socket) -> Peer:
    """The pid, uid and groups (effective gid and supplementary ones) of the
    process at the other end of Unix socket `sock`, as the kernel recorded
    them when it connected."""
    pid, uid, gid = struct.unpack("iII", sock.getsockopt(   # (uid_t, gid_t: unsigned)
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII")))
    gids = {gid}
    size = 64 * 4
    while size <= 65536 * 4:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, size)
        except OSError as e:
            if e.errno == errno.ERANGE:   # more groups than the buffer holds
                size *= 4
                continue
            break   # no SO_PEERGROUPS here: the effective gid only
        gids.update(struct.unpack(f"{len(raw) // 4}I", raw[:len(raw) // 4 * 4]))
        break
    return Peer(pid, uid, frozenset(gids))
