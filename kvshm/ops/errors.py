"""Errors of the service layer, the one table that maps a wire error code to
its exception class on the client, and the turning of Error replies into
exceptions (`raise_reply`, `batch_results`)."""

from __future__ import annotations

from kvshm.core.errors import (BadMultimodalInput, ConfigError, DuplicateRequest,
    InvalidArgument, KvshmError, NoFreeBlocks, RequestTableFull, RequestTooLong,
    SegmentError, ShmSpaceError, StaleHits, UnknownRequest)
from kvshm.ops.protocol import Error


class ProtocolError(KvshmError):
    """A message the coordinator could not accept (undecodable, wrong field
    types, unknown op, out of sequence)."""

    code = "BAD_MESSAGE"


class FrameTooLarge(ProtocolError):
    """A frame over the size limit; the coordinator closes the connection
    (the stream cannot be resynchronised after it)."""

    code = "FRAME_TOO_LARGE"
    fields = ("size", "limit")
    template = "frame of {size} bytes exceeds the limit of {limit}"


class BatchTooLarge(ProtocolError):
    code = "BATCH_TOO_LARGE"


class HandshakeRequired(ProtocolError):
    code = "HANDSHAKE_REQUIRED"


class HandshakeError(KvshmError):
    """The coordinator refused the connection at handshake."""

    code = "HANDSHAKE_FAILED"


class VersionMismatch(HandshakeError):
    code = "VERSION_MISMATCH"


class HashMismatch(HandshakeError):
    """Client and pool hash with different (algorithm, seed): their block
    hashes would silently never match."""

    code = "HASH_MISMATCH"


class Forbidden(HandshakeError):
    """Wrong uid or auth token, or an op that needs an admin session."""

    code = "FORBIDDEN"


class ResumeFailed(KvshmError):
    """A session could not be resumed (unknown, expired or live session,
    another tenant's token); the connection went on as a fresh session."""

    code = "RESUME_FAILED"


class ReplyLost(KvshmError):
    """The coordinator restarted after applying this call but before its
    reply could be delivered, and the reply was not kept: the call took
    effect exactly once; read the state back (e.g. get_block_ids)."""

    code = "REPLY_LOST"


class NotOwner(KvshmError):
    """The request belongs to another session."""

    code = "NOT_OWNER"


class InternalError(KvshmError):
    """A bug in the coordinator (reported, the coordinator keeps serving)."""

    code = "INTERNAL"


class SocketInUse(KvshmError):
    """Another coordinator already answers on the socket path."""

    code = "SOCKET_IN_USE"
    fields = ("path",)
    template = "another coordinator listens on {path}"


class PoolInUse(KvshmError):
    """The pool is served by a live process (its coordinator)."""

    code = "POOL_IN_USE"
    fields = ("name", "pid")
    template = "pool {name!r} is served by live process {pid}"


class ConnectionClosed(KvshmError):
    """This client closed the connection (or never opened it)."""

    code = "CLOSED"


class ConnectionLost(KvshmError):
    """The coordinator went away or broke the connection."""

    code = "CONNECTION_LOST"


class RequestTimeout(KvshmError):
    """No reply within the call's timeout (the reply is discarded if it
    comes later; the connection stays usable)."""

    code = "TIMEOUT"


ERROR_CLASSES: dict[str, type[KvshmError]] = {cls.code: cls for cls in (
    ConfigError, InvalidArgument, StaleHits, BadMultimodalInput, UnknownRequest,
    DuplicateRequest, RequestTableFull, RequestTooLong, SegmentError, ShmSpaceError, NoFreeBlocks,
    ProtocolError, FrameTooLarge, BatchTooLarge, HandshakeRequired, HandshakeError,
    VersionMismatch, HashMismatch, Forbidden, NotOwner, InternalError, ResumeFailed,
    ReplyLost, SocketInUse, PoolInUse,
)}


def error_from_wire(code: str, message: str,
                    fields: dict[str, int | str] | None = None) -> KvshmError:
    """The exception for an Error reply, with the values of its class's
    `fields` (unknown codes map to KvshmError)."""
    cls = ERROR_CLASSES.get(code, KvshmError)
    err = cls.from_message(message, fields)
    if cls is KvshmError:
        err.code = code
    return err


def raise_reply(reply) -> None:
    """Raise the exception of an `Error` reply (`protocol.Error`)."""
    raise error_from_wire(reply.code, reply.message, reply.fields)


def batch_results(reply) -> list:
    """The replies of a Batch frame.  Raises the error of a refused frame,
    or of the op that failed (with `.results`, the replies before it, and
    `.index` set)."""
    if reply.__class__ is Error:
        raise_reply(reply)
    results = reply.results
    if results and results[-1].__class__ is Error:
        last = results[-1]
        err = error_from_wire(last.code, last.message, last.fields)
        err.results = results[:-1]
        err.index = len(results) - 1
        raise err
    return results
