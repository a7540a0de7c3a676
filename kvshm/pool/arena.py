"""The KV data arena: one shared-memory segment holding the K/V bytes of every
block id, created by the coordinator beside the pool segment and mapped by
every worker as numpy views.

Layout (native byte order):

    header   (4096 bytes) the pool header's leading fields (magic
             b"KVSHMKV\\0", layout version, header size, config fingerprint,
             num_blocks, creator pid: see layout.py) + the shape
    writer   int32[num_blocks]  who last wrote each block (a worker's tag;
             0 = never written): lets a worker tell its own prefix-cache
             hits from blocks another worker computed
    data     of the config's dtype, page aligned, in one of two layouts
             (`KVShape.layout`):
             "blocks": [num_blocks, num_layers, 2, block_size, num_kv_heads,
                        head_size], axis 2 K (0) / V (1): a block's bytes
                        together (kvshm's workers);
             "layers": [num_layers, 2, num_blocks, num_kv_heads, block_size,
                        head_size]: per layer, the contiguous tensor vLLM's
                        CPU attention uses as that layer's KV cache, so an
                        engine maps it instead of allocating its own
                        (`layer_region`).
             A block id belongs to one group at a time; layer l of every
             group shares the same bytes, as in vLLM.

The coordinator never touches the data: it creates the segment (ftruncate:
pages are zero and materialise on first touch, so they land on the NUMA node
of the worker that first writes them), names it in `Welcome`, and unlinks it
on shutdown.  Workers own the bytes of blocks allocated to their requests
and only read blocks they got as prefix-cache hits.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from kvshm.core.errors import ConfigError, SegmentError
from kvshm.core.specs import KV_DTYPES, PoolConfig
from kvshm.pool.layout import ARENA_MAGIC, HEADER_FIELDS, config_fingerprint
from kvshm.pool.shm import OwnedMapping, Shm, create_shm, open_shm

ARENA_LAYOUT_VERSION = 1
HEADER_BYTES = 4096
PAGE = 4096

# Arena-only header fields, after the shared leading ones.
_ARENA_FIELDS = {
    "num_layers": (168, "I"),
    "block_size": (172, "I"),
    "num_kv_heads": (176, "I"),
    "head_size": (180, "I"),
    "dtype": (184, "16s"),
    "writer_offset": (200, "Q"),
    "data_offset": (208, "Q"),
    "kv_layout": (216, "8s"),
}


def arena_name(pool_name: str) -> str:
    """The arena segment's name for pool segment `pool_name`."""
    return f"{pool_name}.kv"


def resolve_dtype(name: str) -> np.dtype:
    """The numpy dtype of a KV dtype name (`KVShape.dtype`: one of
    core.specs.KV_DTYPES), for the arena and the workers alike.  bfloat16
    comes from the ml_dtypes package.  Raises ConfigError (a ValueError) for
    an unknown name, or bfloat16 without ml_dtypes."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ConfigError("kv.dtype", "a bfloat16 KV arena needs the ml_dtypes package "
                              "(pip install ml_dtypes)") from None
        return np.dtype(ml_dtypes.bfloat16)
    if name in KV_DTYPES:
        return np.dtype(name)
    raise ConfigError("kv.dtype", f"unknown KV dtype {name!r}: expected "
                      f"{', '.join(KV_DTYPES)}")


class ArenaLayout:
    """Offsets and shape of the arena for one config (which must have `kv`)."""

    def __init__(self, config: PoolConfig) -> None:
        kv = config.kv
        if kv is None:
            raise SegmentError("the pool config has no `kv` shape: no KV arena to size "
                               "(use a preset or add [kv] to the config)")
        self.config = config
        self.num_blocks = config.num_blocks
        self.kv_layout = kv.layout
        if kv.layout == "layers":
            self.shape = (kv.num_layers, 2, config.num_blocks, kv.num_kv_heads,
                          config.kv_block_size, kv.head_size)
        else:
            self.shape = (config.num_blocks, kv.num_layers, 2, config.kv_block_size,
                          kv.num_kv_heads, kv.head_size)
        self.dtype_name = kv.dtype
        self.block_bytes = config.kv_block_bytes
        self.writer_offset = HEADER_BYTES
        self.data_offset = _align(self.writer_offset + 4 * config.num_blocks, PAGE)
        self.size = self.data_offset + self.block_bytes * config.num_blocks

    def layer_region(self, layer: int) -> tuple[int, int]:
        """(byte offset, byte size) of layer `layer`'s K/V tensor in a
        "layers" arena."""
        if self.kv_layout != "layers":
            raise SegmentError("the arena is laid out by blocks, not as per-layer tensors")
        if not 0 <= layer < self.shape[0]:
            raise SegmentError(f"layer {layer} is not in [0, {self.shape[0]})")
        size = self.block_bytes * self.num_blocks // self.shape[0]
        return self.data_offset + layer * size, size


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def arena_bytes(config: PoolConfig) -> int:
    """Size of the arena segment for `config` (0 without a `kv` shape)."""
    return ArenaLayout(config).size if config.kv is not None else 0


class KVArena(OwnedMapping):
    """An open arena: `kv` (the data, indexed by block id) and `writer`
    views.  `KVArena.create` in the coordinator, `KVArena.attach` elsewhere;
    only the creator unlinks."""

    def __init__(self, shm: Shm, layout: ArenaLayout, owner: bool) -> None:
        self._shm = shm
        self.layout = layout
        self.name = shm.name
        self.owner = owner
        self.closed = False
        self.writer = np.frombuffer(shm.mmap, dtype=np.int32, count=layout.num_blocks,
                                    offset=layout.writer_offset)
        self._kv: np.ndarray | None = None

    @property
    def kv(self) -> np.ndarray:
        """The K/V data as [block, layer, K|V, token, head, dim] ("blocks"
        layout) or [layer, K|V, block, head, token, dim] ("layers").  Made
        on first use: the coordinator, which never reads it, needs no
        bfloat16 support."""
        if self._kv is None:
            if self.closed:
                raise SegmentError(f"arena {self.name!r} is closed")
            lay = self.layout
            self._kv = np.frombuffer(
                self._shm.mmap, dtype=resolve_dtype(lay.dtype_name),
                count=int(np.prod(lay.shape)), offset=lay.data_offset).reshape(lay.shape)
        return self._kv

    @property
    def dtype(self) -> np.dtype:
        return self.kv.dtype

    @property
    def block_size(self) -> int:
        lay = self.layout
        return lay.shape[4] if lay.kv_layout == "layers" else lay.shape[3]

    @property
    def buffer(self) -> memoryview:
        """The whole mapping (for views made by other libraries, e.g. torch
        tensors over `layout.layer_region(l)`); release them before close()."""
        if self.closed:
            raise SegmentError(f"arena {self.name!r} is closed")
        return self._shm.buf

    @classmethod
    def create(cls, config: PoolConfig, name: str, *, check_space: bool = True,
               reserve: bool = False) -> "KVArena":
        """Create the arena for `config` as /dev/shm/`name`, its pages
        allocated now with `reserve` (kvshm.pool.shm.reserve_pages; the
        coordinator's create_pool decides).
        Raises SegmentError (bad or taken name, no `kv` shape) and
        ShmSpaceError."""
        layout = ArenaLayout(config)
        shm = create_shm(name, layout.size, what="arena", check_space=check_space,
                         reserve=reserve)
        try:
            _write_header(shm, layout)
            return cls(shm, layout, owner=True)
        except BaseException:
            shm.close()
            shm.unlink()
            raise

    @classmethod
    def attach(cls, name: str, config: PoolConfig) -> "KVArena":
        """Map an existing arena read/write; checks its magic, version, and
        that it was made for exactly `config` (the pool's, from `Welcome`)."""
        shm = open_shm(name, "KV arena segment")
        try:
            layout = _read_layout(shm, name, config)
            return cls(shm, layout, owner=False)
        except BaseException:
            shm.close()
            raise

    def claim(self) -> None:
        """Record this process as the arena's owner (a coordinator adopting
        it after a restart)."""
        struct.pack_into("Q", self._shm.buf, HEADER_FIELDS["coordinator_pid"][0], os.getpid())

    def close(self) -> None:
        """Drop this process's mapping (idempotent).  Views taken from `kv`
        must be gone first (numpy keeps the mapping alive otherwise)."""
        if self.closed:
            return
        self.closed = True
        self._kv = self.writer = None
        try:
            self._shm.close()
        except BufferError:
            raise SegmentError(f"arena {self.name!r}: views of its data are still "
                               "alive; drop them before close()") from None


def _write_header(shm: Shm, layout: ArenaLayout) -> None:
    buf = shm.buf
    pack = struct.pack_into
    pack("8s", buf, HEADER_FIELDS["magic"][0], ARENA_MAGIC)
    pack("I", buf, HEADER_FIELDS["layout_version"][0], ARENA_LAYOUT_VERSION)
    pack("I", buf, HEADER_FIELDS["header_size"][0], HEADER_BYTES)
    pack("32s", buf, HEADER_FIELDS["config_fingerprint"][0], config_fingerprint(layout.config))
    pack("Q", buf, HEADER_FIELDS["num_blocks"][0], layout.num_blocks)
    pack("Q", buf, HEADER_FIELDS["coordinator_pid"][0], os.getpid())
    kv = layout.config.kv
    for field, value in (("num_layers", kv.num_layers),
                         ("block_size", layout.config.kv_block_size),
                         ("num_kv_heads", kv.num_kv_heads), ("head_size", kv.head_size),
                         ("dtype", layout.dtype_name.encode()),
                         ("writer_offset", layout.writer_offset),
                         ("data_offset", layout.data_offset),
                         ("kv_layout", layout.kv_layout.encode())):
        off, fmt = _ARENA_FIELDS[field]
        pack(fmt, buf, off, value)


def _read_layout(shm: Shm, name: str, expect: PoolConfig) -> ArenaLayout:
    buf = shm.buf
    if len(buf) < HEADER_BYTES or bytes(buf[:8]) != ARENA_MAGIC:
        raise SegmentError(f"segment {name!r} is not a kvshm KV arena")
    version = struct.unpack_from("I", buf, HEADER_FIELDS["layout_version"][0])[0]
    if version != ARENA_LAYOUT_VERSION:
        raise SegmentError(f"arena {name!r} has layout version {version}; this kvshm "
                           f"reads version {ARENA_LAYOUT_VERSION}")
    found = bytes(struct.unpack_from("32s", buf, HEADER_FIELDS["config_fingerprint"][0])[0])
    if found != config_fingerprint(expect):
        raise SegmentError(f"arena {name!r} was made for another pool config")
    layout = ArenaLayout(expect)
    if len(buf) < layout.size:
        raise SegmentError(f"arena {name!r} is {len(buf):,} bytes; its config needs "
                           f"{layout.size:,}")
    return layout
