"""The shared-memory pool: what lies where in a pool's segment (layout.py),
the segment itself (segment.py) over POSIX shared memory (shm.py: every OS
refusal to open one becomes a SegmentError), the KV data arena (arena.py)
and where its pages go (numa.py), the allocator on a segment
(kv_cache_manager.py: `KVCacheManager`), a pool's statistics read from its segment
(stats.py), and a coordinator's pool lifecycle: create, adopt, remove, and
what a pool takes in /dev/shm (lifecycle.py).

It sits on the allocator core (kvshm/core/, which works on the segment it
is given) and under the ops layer; docs/layers.md shows the floors."""
