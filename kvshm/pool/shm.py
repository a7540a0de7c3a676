"""POSIX shared memory under kvshm's segments: name rules, create / open / map
/ close / unlink, the /dev/shm space check and the single-writer lock.

The pool segment (`segment.py`) and the KV arena (`arena.py`) are both
a `Shm`; what their bytes mean is theirs.  No resource tracker: see `Shm`.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import shutil

import _posixshmem  # the stdlib's shm_open / shm_unlink (what SharedMemory uses)

from kvshm.core.errors import SegmentError, ShmSpaceError

SHM_DIR = "/dev/shm"

_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,200}")


def valid_name(name: str) -> bool:
    """Whether `name` may name a segment: 1-200 letters, digits, '.', '_'
    or '-', and not '.' or '..'."""
    return bool(_NAME_RE.fullmatch(name)) and name not in (".", "..")


class Shm:
    """A POSIX shared-memory object mapped read-write: `name`, `buf` (a
    memoryview of the whole mapping) and `mmap` (the mapping itself, for
    numpy views that must keep it alive).

    Deliberately not multiprocessing.shared_memory.SharedMemory: on Python
    3.11 that registers every attach with the resource tracker, which unlinks
    the segment when an attaching process exits, and the tracker process
    itself costs tens of milliseconds to start.  kvshm owns the lifecycle:
    the creator unlinks, nobody else does.

    `create` and `open` let OSErrors through; `create_shm` and `open_shm`
    are the checked entry points with kvshm's error messages.
    """

    def __init__(self, name: str, fd: int) -> None:
        """Map `fd` (which this call always closes)."""
        self.name = name
        try:
            self.mmap = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.buf = memoryview(self.mmap)

    @classmethod
    def create(cls, name: str | None, size: int, *, reserve: bool = False) -> "Shm":
        """A new object of `size` zero bytes, mode 0600, named `name` (None: a
        fresh `kvshm-<random>` name).  With `reserve`, its pages are
        allocated now (`reserve_pages`).  Raises FileExistsError if it
        exists, and the OSError of a reservation /dev/shm cannot hold
        (nothing is left behind)."""
        name = name or f"kvshm-{secrets.token_hex(6)}"
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, size)
            if reserve:
                reserve_pages(fd, size)
        except BaseException:
            os.close(fd)
            _posixshmem.shm_unlink("/" + name)
            raise
        try:
            return cls(name, fd)  # closes fd
        except BaseException:
            _posixshmem.shm_unlink("/" + name)
            raise

    @classmethod
    def open(cls, name: str) -> "Shm":
        """Map the existing object `name`.  Raises FileNotFoundError if there
        is none (and ValueError if it is empty: nothing to map)."""
        return cls(name, _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600))

    def close(self) -> None:
        """Drop this process's mapping.  Raises BufferError while views made
        from `mmap` are alive."""
        self.buf.release()
        self.mmap.close()

    def unlink(self) -> None:
        """Remove the name (a no-op if it is already gone); mappings stay
        valid until closed."""
        try:
            unlink_shm(self.name)
        except FileNotFoundError:
            pass


def reserve_pages(fd: int, size: int) -> None:
    """Allocate the first `size` bytes of shared-memory object `fd` now.

    A tmpfs object is sparse: a page gets its memory when it is first
    touched, and a process that touches one while /dev/shm is full dies of
    SIGBUS (numpy, torch and the stdlib cannot catch it).  Another program
    may fill /dev/shm at any time after a pool was created, so a
    coordinator's segments are allocated whole when it makes them
    (kvshm.pool.lifecycle.create_pool): then a full /dev/shm is refused at
    creation (ENOSPC, with nothing left behind) and cannot hurt a pool that
    exists.  The pages are allocated under the calling process's memory
    policy (`numactl --interleave=all kvshm serve` spreads them over the
    NUMA nodes).  Where the file system cannot
    allocate ahead (EOPNOTSUPP, EINVAL), the object stays sparse."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def reserve_existing(name: str) -> int:
    """Allocate the pages shared-memory object `name` lacks (one made
    sparse: by an older kvshm, or with `--no-reserve-arena`).  Returns the
    bytes still unallocated: 0, or, when /dev/shm cannot hold them, all it
    lacked (tmpfs undoes a partial allocation; the object is as it was)."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        st = os.fstat(fd)
        missing = max(0, st.st_size - st.st_blocks * 512)
        if missing:
            try:
                reserve_pages(fd, st.st_size)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                return missing
        return 0
    finally:
        os.close(fd)


def unlink_shm(name: str) -> None:
    """Remove shared-memory object `name`.  Raises FileNotFoundError if
    there is none."""
    _posixshmem.shm_unlink("/" + name)


class OwnedMapping:
    """Lifecycle shared by the pool segment and the KV arena: only the
    process that created a segment unlinks it, and leaving a `with` block
    closes the mapping (and, in the creator, unlinks the segment).
    Subclasses set `owner` and `_shm` and define `close()`."""

    owner: bool
    _shm: Shm

    def close(self) -> None:
        raise NotImplementedError

    def unlink(self) -> None:
        """Remove the segment name; only the creator may."""
        if not self.owner:
            raise SegmentError("only the process that created a segment unlinks it")
        self._shm.unlink()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if self.owner:
            self.unlink()


def create_shm(name: str | None, size: int, *, what: str = "segment",
               check_space: bool = True, reserve: bool = False) -> Shm:
    """A new segment of `size` bytes named `name` (None: a fresh random name)
    for the pool or the arena, its pages allocated now with `reserve`
    (`reserve_pages`).  Raises SegmentError for a bad or taken name and
    ShmSpaceError when /dev/shm is short: checked first unless `check_space`
    is off, and always when the allocation finds it full (another program
    may have taken the space since the check)."""
    if name is not None and not valid_name(name):
        raise SegmentError(f"{what} name {name!r}: use 1-200 letters, digits, '.', '_' or '-'")
    if check_space:
        check_shm_space(size)
    try:
        return Shm.create(name, size, reserve=reserve)
    except FileExistsError:
        raise SegmentError(
            f"shared-memory segment {name!r} already exists; a live coordinator "
            f"may own it, or remove a stale one with `kvshm rm {name}`") from None
    except OSError as e:
        if e.errno == errno.ENOSPC:
            free = _free_bytes()
            raise ShmSpaceError(size, 0 if free is None else free, SHM_DIR) from None
        raise SegmentError(f"cannot create a {size:,}-byte {what} in {SHM_DIR}: "
                           f"{e.strerror}") from None


def open_shm(name: str, what: str = "shared-memory segment",
             expected: str | None = None) -> Shm:
    """An existing segment.  Every refusal of the OS is a SegmentError, here
    and nowhere else: there is none called `name` ("no {what} named ..."),
    or the entry cannot be opened (a directory, no permission) or is empty
    (nothing to map), said as not being the `expected` thing (default
    `what`)."""
    path = f"{SHM_DIR}/{name}"
    try:
        return Shm.open(name)
    except FileNotFoundError:
        raise SegmentError(f"no {what} named {name!r}") from None
    except OSError as e:
        raise SegmentError(f"cannot open {path} as a {expected or what}: {e.strerror}") \
            from None
    except ValueError:   # mmap of an empty file
        raise SegmentError(f"{path} is empty: not a {expected or what}") from None


def share_with_group(name: str, gid: int) -> None:
    """Make segment `name` readable and writable by group `gid` too (mode
    0660, that group): `kvshm serve --group`, on its pool and its arena, so
    that engines of several users share them.  Raises SegmentError when the
    OS refuses (a user other than root may give its files only to a group
    it belongs to)."""
    path = f"{SHM_DIR}/{name}"
    try:
        os.chown(path, -1, gid)   # the group first: the mode then opens it to that group only
        os.chmod(path, 0o660)
    except OSError as e:
        raise SegmentError(f"cannot give {path} to group {gid}: {e.strerror}") from None


def check_shm_space(needed: int, path: str = SHM_DIR) -> None:
    """Raise ShmSpaceError if `path` has fewer than `needed` free bytes."""
    free = _free_bytes(path)
    if free is not None and free < needed:
        raise ShmSpaceError(needed, free, path)


def _free_bytes(path: str = SHM_DIR) -> int | None:
    """Free bytes in `path`'s file system (None: nothing to inspect, not
    Linux: the OS decides)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def lock_segment(name: str) -> int:
    """Take the exclusive lock that marks segment `name`'s one writer; the
    kernel drops it when this process dies.  Returns the lock's fd (close
    it to release).  Raises SegmentError if another process holds it."""
    import fcntl
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    except FileNotFoundError:
        raise SegmentError(f"no segment named {name!r}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SegmentError(f"segment {name!r} is locked by another coordinator (it is "
                           "serving or taking over this pool)") from None
    return fd
