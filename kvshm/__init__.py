"""kvshm: a host-wide KV-cache block manager with vLLM v1's allocation semantics.

The public API, re-exported here (pinned by tests/test_public_api.py):

- `PoolConfig` and the group specs (`FullSpec`, `MLASpec`, `SinkFullSpec`,
  `SlidingWindowSpec`, `ChunkedLocalSpec`, `MambaSpec`, `CrossAttentionSpec`),
  `KVShape` (the KV arena's shape; the arena itself is `kvshm.pool.arena.KVArena`,
  not imported here so that `import kvshm` needs no numpy)
- `KVCacheManager` (embedded mode), `Request`, `BlockHasher`,
  `MultiModalFeature` (a prompt's multimodal item, for `Request` and the
  clients' `add_request`)
- `PoolSegment` (the shared-memory pool state) and `check_segment`
- the coordinator's clients: `connect` / `Client` (asyncio) and
  `connect_sync` / `SyncClient` (blocking)
- the error classes, the core's and the service's
"""

from kvshm.core.check import CheckReport, check_segment
from kvshm.core.errors import (BadMultimodalInput, ConfigError, DuplicateRequest,
    InvalidArgument, KvshmError, NoFreeBlocks, PoolRefused, RequestTableFull,
    RequestTooLong, SegmentError, ShmSpaceError, UnknownRequest)
from kvshm.core.extra_keys import MultiModalFeature
from kvshm.core.hashing import BlockHasher, hash_fingerprint
from kvshm.core.request import Request
from kvshm.core.specs import (
    ChunkedLocalSpec,
    CrossAttentionSpec,
    FullSpec,
    KVShape,
    MambaSpec,
    MLASpec,
    PoolConfig,
    SinkFullSpec,
    SlidingWindowSpec,
)
from kvshm.pool.kv_cache_manager import KVCacheManager
from kvshm.pool.segment import PoolSegment
# The clients and the service's errors load on first use (PEP 562), so that
# `import kvshm` stays quick for processes that start often (every
# coordinator and worker begins with it).
_SERVICE = {
    **dict.fromkeys(("Client", "connect"), "kvshm.service.client"),
    **dict.fromkeys(("SyncClient", "connect_sync"), "kvshm.service.sync_client"),
    **dict.fromkeys((
        "BatchTooLarge", "ConnectionClosed", "ConnectionLost", "Forbidden", "FrameTooLarge",
        "HandshakeError", "HandshakeRequired", "HashMismatch", "InternalError", "NotOwner",
        "PoolInUse", "ProtocolError", "ReplyLost", "RequestTimeout", "ResumeFailed",
        "SocketInUse", "VersionMismatch"), "kvshm.ops.errors"),
}


def __getattr__(name: str):
    module = _SERVICE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvshm' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "BadMultimodalInput",
    "BatchTooLarge",
    "BlockHasher",
    "CheckReport",
    "ChunkedLocalSpec",
    "Client",
    "ConfigError",
    "ConnectionClosed",
    "ConnectionLost",
    "CrossAttentionSpec",
    "DuplicateRequest",
    "Forbidden",
    "FrameTooLarge",
    "FullSpec",
    "HandshakeError",
    "HandshakeRequired",
    "HashMismatch",
    "InternalError",
    "InvalidArgument",
    "KVCacheManager",
    "KVShape",
    "KvshmError",
    "MLASpec",
    "MultiModalFeature",
    "MambaSpec",
    "NoFreeBlocks",
    "NotOwner",
    "PoolConfig",
    "PoolInUse",
    "PoolRefused",
    "PoolSegment",
    "ProtocolError",
    "ReplyLost",
    "Request",
    "RequestTableFull",
    "RequestTimeout",
    "RequestTooLong",
    "ResumeFailed",
    "SegmentError",
    "ShmSpaceError",
    "SinkFullSpec",
    "SlidingWindowSpec",
    "SocketInUse",
    "SyncClient",
    "UnknownRequest",
    "VersionMismatch",
    "check_segment",
    "connect",
    "connect_sync",
    "hash_fingerprint",
]
