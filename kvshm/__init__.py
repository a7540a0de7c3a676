"""kvshm: a host-wide KV-cache block manager with vLLM v1's allocation semantics.

The public API, re-exported here (pinned by tests/test_public_api.py):

- `PoolConfig` and the group specs (`FullSpec`, `MLASpec`, `SinkFullSpec`,
  `SlidingWindowSpec`, `ChunkedLocalSpec`, `MambaSpec`, `CrossAttentionSpec`),
  `KVShape` (the KV arena's shape; the arena itself is `kvshm.arena.KVArena`,
  not imported here so that `import kvshm` needs no numpy)
- `KVCacheManager` (embedded mode), `Request`, `BlockHasher`
- `PoolSegment` (the shared-memory pool state) and `check_segment`
- the error classes
"""

from kvshm.core.check import CheckReport, check_segment
from kvshm.core.errors import (
    ConfigError,
    DuplicateRequest,
    InvalidArgument,
    KvshmError,
    NoFreeBlocks,
    PoolRefused,
    RequestTableFull,
    RequestTooLong,
    SegmentError,
    ShmSpaceError,
    UnknownRequest,
)
from kvshm.core.hashing import BlockHasher, hash_fingerprint
from kvshm.core.manager import KVCacheManager
from kvshm.core.request import Request
from kvshm.core.segment import PoolSegment
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

__version__ = "0.1.0"

__all__ = [
    "BlockHasher",
    "CheckReport",
    "ChunkedLocalSpec",
    "ConfigError",
    "CrossAttentionSpec",
    "DuplicateRequest",
    "FullSpec",
    "InvalidArgument",
    "KVCacheManager",
    "KVShape",
    "KvshmError",
    "MLASpec",
    "MambaSpec",
    "NoFreeBlocks",
    "PoolConfig",
    "PoolRefused",
    "PoolSegment",
    "Request",
    "RequestTableFull",
    "RequestTooLong",
    "SegmentError",
    "ShmSpaceError",
    "SinkFullSpec",
    "SlidingWindowSpec",
    "UnknownRequest",
    "check_segment",
    "hash_fingerprint",
]
