"""`KVCacheManager`: the allocator on a pool segment in shared memory, one it
creates (embedded mode, or a coordinator's new pool) or one it adopts.

The allocator itself is kvshm/core/kv_cache_manager.py
(`KVCacheManagerCore`), which works on whatever segment it is given; this
class gives it a `PoolSegment`.
"""

from __future__ import annotations

from kvshm.core.errors import InvalidArgument
from kvshm.core.kv_cache_manager import KVCacheManagerCore
from kvshm.core.specs import PoolConfig
from kvshm.pool.segment import PoolSegment


class KVCacheManager(KVCacheManagerCore):
    """The allocator for one pool.

    Args:
        config: the pool config.
        name: the new segment's name (default: a random `kvshm-...` one).
        segment: an existing segment to adopt instead (its config wins;
            `config` may then be None): a frame its last writer left cut off
            is rolled back and the derived arrays rebuilt first
            (`repair_report` says what was done).  Without one, a new segment
            named `name` is created and owned: `close()` unlinks it.
        kv_events, track_ready: as `KVCacheManagerCore` (events for
            `take_events()`; readiness for a pool several engines share).
        reserve: allocate a new segment's pages now (`PoolSegment.create`).

    Raises:
        InvalidArgument: neither a config nor a segment.
        ShmSpaceError, SegmentError: the segment cannot be created.
    """

    def __init__(self, config: PoolConfig | None = None, *, name: str | None = None,
                 segment: PoolSegment | None = None, kv_events: bool = False,
                 track_ready: bool = False, reserve: bool = False) -> None:
        adopt = segment is not None
        if segment is None:
            if config is None:
                raise InvalidArgument("a config or a segment is required")
            segment = PoolSegment.create(config, name, reserve=reserve)
        super().__init__(segment, adopt=adopt, kv_events=kv_events, track_ready=track_ready)
