"""One group's prefix-cache index: `BlockHashMap`."""

from __future__ import annotations

from collections.abc import Iterator


class BlockHashMap(dict):
    """Block hash -> the earliest cached block id under it, as a plain dict
    (a lookup is `m.get(block_hash)`, the hot path of every prefix-cache
    hit), with the later blocks cached under the same hash kept apart.

    Several blocks share a hash when requests computed the same block at
    once (or one skipped reading the cache): they are all cached, a lookup
    takes the earliest, and when it is evicted the next one takes its place.
    `blocks(h)` lists them in the order they were cached.

    Change it only through `add`, `remove` and `clear` (kvshm.core.block_pool
    does); the dict methods that write would leave the later blocks behind.
    """

    __slots__ = ("_all",)

    def __init__(self) -> None:
        super().__init__()
        # Hashes with two or more blocks: all of them, in cache order (an
        # insertion-ordered dict, so that a removal is O(1)).
        self._all: dict[bytes, dict[int, None]] = {}

    def add(self, block_hash: bytes, block: int) -> None:
        """Record `block` as the latest cached under `block_hash`."""
        first = self.get(block_hash)
        if first is None:
            self[block_hash] = block
            return
        shared = self._all.get(block_hash)
        if shared is None:
            self._all[block_hash] = {first: None, block: None}
        else:
            shared[block] = None

    def remove(self, block_hash: bytes, block: int) -> None:
        """Drop `block` from under `block_hash` (it is there)."""
        shared = self._all.get(block_hash)
        if shared is None:
            del self[block_hash]
            return
        del shared[block]
        self[block_hash] = next(iter(shared))
        if len(shared) == 1:
            del self._all[block_hash]

    def blocks(self, block_hash: bytes) -> list[int]:
        """The blocks cached under `block_hash`, earliest first."""
        shared = self._all.get(block_hash)
        if shared is not None:
            return list(shared)
        first = self.get(block_hash)
        return [] if first is None else [first]

    def shared(self, block_hash: bytes) -> dict[int, None] | None:
        """The blocks under `block_hash` in cache order when there are
        several (do not change it), else None: one block, or none."""
        return self._all.get(block_hash)

    def entries(self) -> Iterator[tuple[bytes, list[int]]]:
        """(hash, its blocks earliest first) for every hash."""
        for block_hash in self:
            yield block_hash, self.blocks(block_hash)

    def clear(self) -> None:
        super().clear()
        self._all.clear()

    def __repr__(self) -> str:
        return f"BlockHashMap({dict(self.entries())!r})"
