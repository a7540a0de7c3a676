"""NUMA placement of shared-memory pages (the KV arena's): bind them to
nodes, interleave them over nodes, or leave them to first touch, through
libnuma's mbind(); and where a process's mapping of them lives, from
/proc/PID/numa_maps.

The arena is a POSIX shared-memory (tmpfs) object.  A policy set with
mbind() on one process's mapping of such an object becomes the object's
shared policy for that range, which every process faulting a page of it in
follows; so one process can place the whole arena, and it must do so before
the pages are first touched (the workers' first writes: the coordinator
never touches the data).  "first-touch" is the kernel's default policy: a
page goes to the node of the CPU that first touches it.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvshm.core.errors import KvshmError

POLICIES = ("first-touch", "bind", "interleave")
LIBNUMA = "libnuma.so.1"
_MODES = {"first-touch": 0, "bind": 2, "interleave": 3}   # MPOL_DEFAULT, _BIND, _INTERLEAVE
_WORD_BITS = 8 * ctypes.sizeof(ctypes.c_ulong)


class PlacementError(KvshmError):
    """Pages cannot be placed as asked: no libnuma, a bad policy or node
    list, or the kernel refused (the errno's text is in the message)."""

    code = "PLACEMENT"


class LibNuma:
    """libnuma loaded through ctypes: `available()` and `mbind()`.

    Raises PlacementError, saying how to install it, when `name` cannot be
    loaded."""

    def __init__(self, name: str = LIBNUMA) -> None:
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError as e:
            raise PlacementError(
                f"placing pages on NUMA nodes needs libnuma ({name}; on Debian or Ubuntu: "
                f"apt-get install libnuma1), which could not be loaded: {e}") from None
        lib.numa_available.restype = ctypes.c_int
        lib.numa_available.argtypes = []
        lib.mbind.restype = ctypes.c_long
        lib.mbind.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int,
                              ctypes.POINTER(ctypes.c_ulong), ctypes.c_ulong, ctypes.c_uint]
        self.name = name
        self._lib = lib

    def available(self) -> bool:
        """Whether the kernel supports NUMA policies (numa_available())."""
        return self._lib.numa_available() != -1

    def mbind(self, address: int, length: int, mode: int, nodes: Iterable[int]) -> None:
        """mbind(2) over [address, address + length) with `mode` and the
        node mask of `nodes` (none for MPOL_DEFAULT).  Raises PlacementError
        with the kernel's reason."""
        nodes = sorted(set(nodes))
        words = (nodes[-1] // _WORD_BITS + 1) if nodes else 1
        mask = (ctypes.c_ulong * words)()
        for n in nodes:
            mask[n // _WORD_BITS] |= 1 << (n % _WORD_BITS)
        # NOTE: the kernel reads maxnode - 1 bits of the mask (libnuma passes
        # its mask size + 1 too).
        maxnode = words * _WORD_BITS + 1 if nodes else 0
        if self._lib.mbind(address, length, mode, mask if nodes else None, maxnode, 0) != 0:
            err = ctypes.get_errno()
            raise PlacementError(f"mbind({mode=}, nodes={nodes}) over {length:,} bytes: "
                                 f"{os.strerror(err)}")


def place(buffer, policy: str, nodes: Iterable[int] = (), *, offset: int = 0,
          length: int | None = None, libnuma: LibNuma | None = None) -> None:
    """Set the NUMA policy of bytes [offset, offset + length) of a mapping.

    Args:
        buffer: a writable buffer over the mapping (e.g. `KVArena.buffer`);
            only its address is used, and no reference to it is kept.
        policy: "bind" (allocate only on `nodes`), "interleave" (round-robin
            over `nodes`, page by page) or "first-touch" (the default policy:
            the node of the CPU that touches the page first).
        nodes: NUMA node ids, non-empty for bind and interleave.
        offset, length: the range, page aligned (length None: to the end).
    Raises:
        PlacementError: unknown policy, no nodes for bind / interleave, an
            unaligned range, libnuma missing, or the kernel refusing (e.g. a
            node that does not exist).
    """
    if policy not in POLICIES:
        raise PlacementError(f"unknown page policy {policy!r} (one of {', '.join(POLICIES)})")
    nodes = sorted(set(nodes))
    if policy != "first-touch" and not nodes:
        raise PlacementError(f"policy {policy} needs at least one NUMA node")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in nodes):
        raise PlacementError(f"NUMA nodes must be ints >= 0, got {nodes!r}")
    view = memoryview(buffer)
    try:
        size = view.nbytes
        length = size - offset if length is None else length
        page = os.sysconf("SC_PAGE_SIZE")
        if offset % page or not 0 <= offset <= size or not 0 < length <= size - offset:
            raise PlacementError(f"range [{offset}, {offset + length}) is not a page-aligned "
                                 f"range of the {size:,}-byte mapping")
        holder = ctypes.c_char.from_buffer(view)
        address = ctypes.addressof(holder) + offset
        del holder   # the address stays valid while the caller's mapping does
    finally:
        view.release()
    lib = libnuma or LibNuma()
    if not lib.available():
        raise PlacementError("this kernel has no NUMA support (numa_available() is -1)")
    lib.mbind(address, -(-length // page) * page, _MODES[policy],
              nodes if policy != "first-touch" else ())


@dataclass
class Pages:
    """Where the pages of one file's mappings in one process are (from
    /proc/PID/numa_maps): the policies of its mappings as the kernel prints
    them ("default", "bind:0", "interleave:0-1"), pages per node, and the
    page size in bytes.  Only pages this process has mapped are counted."""

    policies: list[str] = field(default_factory=list)
    pages: dict[int, int] = field(default_factory=dict)
    page_bytes: int = 4096


def parse_numa_maps(text: str, path: str) -> Pages:
    """The `Pages` of the mappings of file `path` in a numa_maps text."""
    out = Pages()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 2 or f"file={path}" not in parts[2:]:
            continue
        out.policies.append(parts[1])
        for part in parts[2:]:
            key, _, value = part.partition("=")
            if len(key) > 1 and key[0] == "N" and key[1:].isdigit() and value.isdigit():
                node = int(key[1:])
                out.pages[node] = out.pages.get(node, 0) + int(value)
            elif key == "kernelpagesize_kB" and value.isdigit():
                out.page_bytes = int(value) * 1024
    return out


def mapped_pages(pid: int | str, path: str) -> Pages | None:
    """The `Pages` of file `path` (e.g. "/dev/shm/NAME.kv") as process
    `pid` ("self" for this one) maps it; None where numa_maps cannot be
    read (no NUMA support in the kernel, the process is gone)."""
    try:
        with open(f"/proc/{pid}/numa_maps") as f:
            text = f.read()
    except OSError:
        return None
    return parse_numa_maps(text, path)
