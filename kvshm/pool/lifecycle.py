"""Opening a coordinator's pool: create it, or adopt the one a dead
coordinator left (docs/recovery.md).

Adoption takes the segments' writer lock, checks that the pool holds the
config asked for (naming the fields that differ), dry-runs the repair and
the full invariant check on a private copy (so a pool that cannot be made
consistent is refused untouched), then repairs the real segment, rebuilds
the indexes and checks again.  The KV arena is adopted as it is: its bytes
are the K/V of the cached blocks, which is why they survive.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvshm.core.check import CheckReport, check_segment
from kvshm.core.errors import SegmentError
from kvshm.core.recovery import RepairReport, repair
from kvshm.core.specs import PoolConfig
from kvshm.pool.layout import Layout
from kvshm.pool.kv_cache_manager import KVCacheManager
from kvshm.pool.segment import PoolSegment, remove_segment, segment_info
from kvshm.pool.shm import check_shm_space, lock_segment, reserve_existing, share_with_group


@dataclass
class Adoption:
    """What adopting a pool found and did."""

    generation: int
    repair: RepairReport
    check: CheckReport
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [f"adopted the pool left by a dead coordinator (generation {self.generation})",
                f"repair: {self.repair.summary()}",
                f"check: {self.check.summary()}", *self.notes]


@dataclass
class OpenPool:
    """A pool this process now owns: manager, arena (or None), writer lock,
    and the adoption report (None for a new pool)."""

    mgr: KVCacheManager
    arena: object | None
    lock_fd: int
    adoption: Adoption | None = None

    def close(self, unlink: bool = True) -> None:
        """Release everything; unlink the segments unless `unlink` is off."""
        seg = self.mgr.segment
        seg.owner = unlink
        self.mgr.close()
        if self.arena is not None:
            self.arena.close()
            if unlink:
                self.arena.unlink()
            self.arena = None
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1


def config_differences(have: PoolConfig, want: PoolConfig) -> list[str]:
    """`field: have -> want` for every top-level field that differs."""
    return [f"{name}: {getattr(have, name)!r} -> {getattr(want, name)!r}"
            for name in want.__struct_fields__ if getattr(have, name) != getattr(want, name)]


def fresh_hint(name: str) -> str:
    return (f"start with --fresh to discard pool {name!r} and its KV arena, or remove "
            f"them with `kvshm rm {name}`")


def pool_bytes(config: PoolConfig) -> int:
    """Bytes of /dev/shm a pool of `config` takes: its segment and, with a
    `kv` shape, its KV arena."""
    from kvshm.pool.arena import arena_bytes   # loaded on use (numpy), as below
    return Layout(config).size + arena_bytes(config)


def _share(pool: OpenPool, group: int | None) -> OpenPool:
    """With `group`: the pool's segments become 0660 to that group (closed,
    not unlinked, when the OS refuses: the caller says whether to keep them)."""
    if group is not None:
        names = [pool.mgr.segment.name] + ([pool.arena.name] if pool.arena is not None else [])
        for n in names:
            share_with_group(n, group)
    return pool


def create_pool(config: PoolConfig, name: str, *, group: int | None = None,
                reserve_arena: bool = True) -> OpenPool:
    """A new pool named `name` (and its arena when the config has a KV
    shape); both must fit in /dev/shm, and their pages are allocated now
    (the arena's with `reserve_arena`: kvshm.pool.shm.reserve_pages).
    `group`: both are 0660 to that group (share_with_group), else 0600.
    Raises ShmSpaceError, SegmentError."""
    # Loaded on use (numpy): `kvshm rm` and `kvshm ls` need no arena mapped.
    from kvshm.pool.arena import KVArena, arena_name
    check_shm_space(pool_bytes(config))
    mgr = KVCacheManager(config, name=name, track_ready=True, reserve=True)
    try:
        lock = lock_segment(mgr.segment.name)
    except BaseException:
        mgr.close()
        raise
    pool = OpenPool(mgr, None, lock)
    if config.kv is not None:
        try:
            pool.arena = KVArena.create(mgr.config, arena_name(name), check_space=False,
                                        reserve=reserve_arena)
        except BaseException:
            pool.close()
            raise
    try:
        return _share(pool, group)
    except BaseException:
        pool.close()
        raise


def adopt_pool(config: PoolConfig, name: str, *, group: int | None = None,
               reserve_arena: bool = True) -> OpenPool:
    """Take over pool `name` left by a dead coordinator.  Raises
    SegmentError (locked by a live coordinator, another config, the arena
    missing, a state repair cannot make consistent), leaving it untouched.
    Its segments keep their modes; `group` makes them 0660 to that group.
    Pages the segments lack (made sparse) are allocated, the arena's only
    with `reserve_arena`; where /dev/shm cannot hold them, the adoption
    says so in its notes and goes on (`reserve_existing`)."""
    from kvshm.pool.arena import KVArena, arena_name   # loaded on use (numpy), as above
    lock = lock_segment(name)
    seg = arena = None
    try:
        seg = PoolSegment.attach(name)
        if seg.config != config:
            diff = "; ".join(config_differences(seg.config, config))
            raise SegmentError(f"pool {name!r} holds another config ({diff}): "
                               + fresh_hint(name))
        if config.kv is not None:
            try:
                arena = KVArena.attach(arena_name(name), config)
            except SegmentError as e:
                raise SegmentError(f"pool {name!r}: its KV arena cannot be adopted ({e}), "
                                   "so its cached blocks have no data: "
                                   + fresh_hint(name)) from None
        dry = seg.private_copy()
        try:
            repair(dry)
            report = check_segment(dry)
        finally:
            dry.close()
        if not report.clean:
            raise SegmentError(f"pool {name!r} cannot be repaired ({report.summary()}): "
                               + fresh_hint(name))
        mgr = KVCacheManager(segment=seg, track_ready=True)
    except BaseException:
        if arena is not None:
            arena.close()
        if seg is not None:
            seg.close()
        os.close(lock)
        raise
    seg.owner = True   # this process unlinks the segments from now on
    if arena is not None:
        arena.owner = True
        arena.claim()
    check = check_segment(seg, mgr.block_pool)
    pool = OpenPool(mgr, arena, lock, Adoption(seg.get("generation"), mgr.repair_report, check))
    if not check.clean:   # the dry run passed, so this is a bug: keep the pool for study
        pool.close(unlink=False)
        raise SegmentError(f"pool {name!r}: the check after repair failed "
                           f"({check.summary()}); the segments are kept")
    try:
        for n in [name] + ([arena.name] if arena is not None and reserve_arena else []):
            short = reserve_existing(n)
            if short:
                pool.adoption.notes.append(
                    f"/dev/shm/{n}: {short:,} bytes of it are not allocated and /dev/shm "
                    "cannot hold them now; a first write to one of those pages will fail "
                    "(SIGBUS): free space in /dev/shm and restart the coordinator")
        return _share(pool, group)
    except BaseException:
        pool.close(unlink=False)   # adopted, not ours to remove
        raise


def remove_pool(name: str, *, force: bool = False) -> list[str]:
    """Remove pool `name` and its KV arena as one unit (refused while their
    owner lives unless `force`); returns the names removed.  Raises
    SegmentError when neither exists."""
    from kvshm.pool.arena import arena_name   # loaded on use (numpy): `kvshm rm` maps no arena
    names = [n for n in (name, arena_name(name)) if segment_info(n) is not None]
    if not names:
        raise SegmentError(f"no kvshm pool or arena named {name!r}")
    for n in names:   # check both before removing either
        info = segment_info(n)
        if info["alive"] and not force:
            raise SegmentError(f"{n!r} belongs to live process {info['pid']}; stop it first "
                               "(or pass --force)")
    for n in names:
        remove_segment(n, force=True)
    return names
