"""The error vocabulary of the allocator core.

Everything a caller can trigger raises a subclass of `KvshmError` carrying the
numbers involved; `assert` is reserved for internal invariants.  Each class
has a stable `code` that the wire protocol will carry as a typed reply.
"""

from __future__ import annotations


class KvshmError(Exception):
    """Base class of every error kvshm raises on purpose.

    `fields` names the attributes (ints and strings) that travel with the
    error on the wire, so that the client's copy has them too."""

    code = "ERROR"
    fields: tuple[str, ...] = ()

    def wire_fields(self) -> dict[str, int | str]:
        """This error's `fields` and their values."""
        return {f: getattr(self, f) for f in self.fields}

    @classmethod
    def from_message(cls, message: str,
                     fields: dict[str, int | str] | None = None) -> "KvshmError":
        """Rebuild an error from its wire form (code -> class, message, the
        values of its `fields`; a field the sender did not give is None)."""
        err = cls.__new__(cls)
        Exception.__init__(err, message)
        given = fields or {}
        for f in cls.fields:
            setattr(err, f, given.get(f))
        return err


class ConfigError(KvshmError, ValueError):
    """A pool config breaks a rule; `field` names the offending field."""

    code = "BAD_CONFIG"
    fields = ("field", "rule")

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}")
        self.field = field
        self.rule = rule


class InvalidArgument(KvshmError, ValueError):
    """A call's argument is out of its domain (negative count, bad id, ...)."""

    code = "BAD_ARGUMENT"


class BadMultimodalInput(InvalidArgument):
    """A request's multimodal placeholders or prompt embeds are malformed
    (overlapping or out-of-range placeholders, an identifier that is not a
    string, embeddings that do not split into one row per prompt token)."""

    code = "BAD_MM_INPUT"


class UnknownRequest(KvshmError, KeyError):
    """An operation names a request id that does not exist."""

    code = "UNKNOWN_REQUEST"
    fields = ("request_id",)

    def __init__(self, request_id: str) -> None:
        super().__init__(f"unknown request {request_id!r}")
        self.request_id = request_id

    def __str__(self) -> str:  # KeyError would quote the whole message
        return self.args[0]


class DuplicateRequest(KvshmError, ValueError):
    """A request id is added twice."""

    code = "DUPLICATE_REQUEST"
    fields = ("request_id",)

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id!r} already exists")
        self.request_id = request_id


class StaleHits(InvalidArgument):
    """Prefix-cache hits passed to allocate_slots are no longer cached (another
    request reused those blocks in between): look them up again."""

    code = "STALE_HITS"


class RequestTableFull(KvshmError):
    """No free request slot in the shared-memory request table."""

    code = "TABLE_FULL"
    fields = ("capacity",)

    def __init__(self, capacity: int) -> None:
        super().__init__(
            f"all {capacity} request slots are in use "
            "(raise max_num_seqs in the pool config)"
        )
        self.capacity = capacity


class RequestTooLong(KvshmError, ValueError):
    """A request would hold more blocks than its request-table row can."""

    code = "REQUEST_TOO_LONG"
    fields = ("group", "needed", "capacity")

    def __init__(self, group: int, needed: int, capacity: int) -> None:
        super().__init__(
            f"group {group}: request needs {needed} blocks, a request-table row "
            f"holds {capacity} (max_model_len / max_encoder_len bound it)"
        )
        self.group = group
        self.needed = needed
        self.capacity = capacity


class SegmentError(KvshmError):
    """A shared-memory segment is missing, foreign, or of another layout."""

    code = "BAD_SEGMENT"


class ShmSpaceError(KvshmError):
    """Not enough free space in /dev/shm for a segment."""

    code = "NO_SHM_SPACE"
    fields = ("needed", "available", "path")

    def __init__(self, needed: int, available: int, path: str) -> None:
        super().__init__(
            f"the pool's shared memory needs {needed:,} bytes but {path} has only "
            f"{available:,} free; enlarge it (for example "
            f"`mount -o remount,size=8G {path}`, or `docker run --shm-size=8g`) "
            "or lower num_blocks / --kv-memory / max_num_seqs"
        )
        self.needed = needed
        self.available = available
        self.path = path


class NoFreeBlocks(KvshmError):
    """More blocks were requested from the pool than are free."""

    code = "NO_FREE_BLOCKS"
    fields = ("requested", "available")

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"requested {requested} blocks, {available} free")
        self.requested = requested
        self.available = available


class PoolRefused(KvshmError):
    """An inference engine and the pool it was pointed at do not fit (shape,
    hashing, size): the message names each difference and the fix."""

    code = "POOL_REFUSED"
