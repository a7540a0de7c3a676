"""The error vocabulary of the allocator core.

Everything a caller can trigger raises a subclass of `KvshmError` carrying the
numbers involved; `assert` is reserved for internal invariants.  Each class
has a stable `code` that the wire protocol will carry as a typed reply.
"""

from __future__ import annotations


class KvshmError(Exception):
    """Base class of every error kvshm raises on purpose.

    `fields` names the attributes (ints and strings) that travel with the
    error on the wire, so that the client's copy has them too.  A class with
    a `template` is raised with its fields' values, in `fields` order, and
    its message is the template formatted with them; one without takes a
    message, as any exception does."""

    code = "ERROR"
    fields: tuple[str, ...] = ()
    template = ""

    def __init__(self, *args: object) -> None:
        if not self.template:
            super().__init__(*args)
            return
        if len(args) != len(self.fields):
            raise TypeError(f"{type(self).__name__}({', '.join(self.fields)}) "
                            f"takes {len(self.fields)} values, got {len(args)}")
        values = dict(zip(self.fields, args))
        self.__dict__.update(values)
        super().__init__(self.template.format(**values))

    def __reduce__(self):  # a pickled copy is rebuilt from its fields, not its message
        if not self.template:
            return super().__reduce__()
        return type(self), tuple(getattr(self, f) for f in self.fields)

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
    template = "{field}: {rule}"


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
    template = "unknown request {request_id!r}"

    def __str__(self) -> str:  # KeyError would quote the whole message
        return self.args[0]


class DuplicateRequest(KvshmError, ValueError):
    """A request id is added twice."""

    code = "DUPLICATE_REQUEST"
    fields = ("request_id",)
    template = "request {request_id!r} already exists"


class StaleHits(InvalidArgument):
    """Prefix-cache hits passed to allocate_slots are no longer cached (another
    request reused those blocks in between): look them up again."""

    code = "STALE_HITS"


class RequestTableFull(KvshmError):
    """No free request slot in the shared-memory request table."""

    code = "TABLE_FULL"
    fields = ("capacity",)
    template = ("all {capacity} request slots are in use "
                "(raise max_num_seqs in the pool config)")


class RequestTooLong(KvshmError, ValueError):
    """A request would hold more blocks than its request-table row can."""

    code = "REQUEST_TOO_LONG"
    fields = ("group", "needed", "capacity")
    template = ("group {group}: request needs {needed} blocks, a request-table row "
                "holds {capacity} (max_model_len / max_encoder_len bound it)")


class SegmentError(KvshmError):
    """A shared-memory segment is missing, foreign, or of another layout."""

    code = "BAD_SEGMENT"


class ShmSpaceError(KvshmError):
    """Not enough free space in /dev/shm for a segment."""

    code = "NO_SHM_SPACE"
    fields = ("needed", "available", "path")
    template = ("the pool's shared memory needs {needed:,} bytes but {path} has only "
                "{available:,} free; enlarge it (for example "
                "`mount -o remount,size=8G {path}`, or `docker run --shm-size=8g`) "
                "or lower num_blocks / --kv-memory / max_num_seqs")


class NoFreeBlocks(KvshmError):
    """More blocks were requested from the pool than are free."""

    code = "NO_FREE_BLOCKS"
    fields = ("requested", "available")
    template = "requested {requested} blocks, {available} free"


class PoolRefused(KvshmError):
    """An inference engine and the pool it was pointed at do not fit (shape,
    hashing, size): the message names each difference and the fix."""

    code = "POOL_REFUSED"
