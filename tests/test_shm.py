"""The shared-memory primitive under the pool segment and the KV arena."""

from __future__ import annotations

import errno
import os
import secrets
import shutil

import pytest

from helpers import fully_allocated
from kvshm.core.errors import SegmentError, ShmSpaceError
from kvshm.pool.shm import (
    SHM_DIR,
    Shm,
    check_shm_space,
    create_shm,
    lock_segment,
    open_shm,
    unlink_shm,
    valid_name,
)


def _name() -> str:
    return f"kvshm-test-shm-{secrets.token_hex(4)}"


def test_create_open_share_bytes_and_only_unlink_removes_the_name():
    name = _name()
    a = create_shm(name, 4096)
    try:
        assert oct(os.stat(f"{SHM_DIR}/{name}").st_mode & 0o777) == "0o600"
        assert len(a.buf) == 4096 and bytes(a.buf[:4]) == bytes(4)
        a.buf[:4] = b"kvsh"
        b = open_shm(name)
        assert bytes(b.buf[:4]) == b"kvsh" and len(b.mmap) == 4096
        b.close()
        assert os.path.exists(f"{SHM_DIR}/{name}")
    finally:
        a.close()
        a.unlink()
    assert not os.path.exists(f"{SHM_DIR}/{name}")
    a.unlink()  # already gone: a no-op
    with pytest.raises(FileNotFoundError):
        unlink_shm(name)


def test_create_without_a_name_picks_a_fresh_one():
    shm = create_shm(None, 64)
    try:
        assert shm.name.startswith("kvshm-") and valid_name(shm.name)
    finally:
        shm.close()
        shm.unlink()


def test_names_are_checked_before_anything_is_created():
    assert not valid_name("..") and not valid_name("a/b") and not valid_name("x" * 201)
    with pytest.raises(SegmentError, match=r"arena name 'a/b': use 1-200 letters"):
        create_shm("a/b", 64, what="arena")


def test_a_taken_or_missing_name_is_a_segment_error():
    name = _name()
    shm = create_shm(name, 64)
    try:
        with pytest.raises(SegmentError, match="already exists.*kvshm rm"):
            create_shm(name, 64)
    finally:
        shm.close()
        shm.unlink()
    with pytest.raises(SegmentError, match=f"no KV arena segment named '{name}'"):
        open_shm(name, "KV arena segment")
    with pytest.raises(FileNotFoundError):
        Shm.open(name)


def test_space_check(monkeypatch):
    class Usage:
        free = 1000
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage)
    check_shm_space(1000)
    with pytest.raises(ShmSpaceError) as e:
        check_shm_space(1001)
    assert (e.value.needed, e.value.available) == (1001, 1000)
    name = _name()
    with pytest.raises(ShmSpaceError):
        create_shm(name, 4096)
    assert not os.path.exists(f"{SHM_DIR}/{name}")
    create_shm(name, 4096, check_space=False).close()
    unlink_shm(name)


def test_one_lock_holder_per_segment():
    name = _name()
    with pytest.raises(SegmentError, match="no segment named"):
        lock_segment(name)
    shm = create_shm(name, 64)
    try:
        fd = lock_segment(name)
        with pytest.raises(SegmentError, match="locked by another coordinator"):
            lock_segment(name)
        os.close(fd)
        os.close(lock_segment(name))  # free again once released
    finally:
        shm.close()
        shm.unlink()


def _target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:   # (the listing's own descriptor, closed since)
        return ""


def test_a_segment_s_pages_are_allocated_when_it_is_made_if_asked():
    name, sparse = _name(), _name()
    size = 1 << 20
    a = create_shm(name, size, reserve=True)
    b = create_shm(sparse, size)
    try:
        assert fully_allocated(name)           # /dev/shm's space is taken now ...
        assert not fully_allocated(sparse)     # ... or at first touch
        assert bytes(a.buf[:16]) == bytes(16) and bytes(a.buf[-16:]) == bytes(16)
    finally:
        for shm, n in ((a, name), (b, sparse)):
            shm.close()
            unlink_shm(n)


@pytest.mark.parametrize("err,raised,message", [
    # /dev/shm filled since the free-space check: the space error, with what is free now
    (errno.ENOSPC, ShmSpaceError, "needs 65,536 bytes"),
    (errno.EIO, SegmentError, "cannot create a 65,536-byte segment in /dev/shm: "),
])
def test_an_allocation_that_fails_leaves_nothing(monkeypatch, err, raised, message):
    def refuse(fd, offset, length):
        raise OSError(err, os.strerror(err))
    monkeypatch.setattr(os, "posix_fallocate", refuse)
    before = set(os.listdir(SHM_DIR))
    name = _name()
    with pytest.raises(raised, match=message):
        create_shm(name, 1 << 16, reserve=True)
    assert set(os.listdir(SHM_DIR)) == before
    # the descriptor was closed too: no leak of one per refused pool
    assert not [fd for fd in os.listdir("/proc/self/fd") if name in _target(fd)]


def test_a_file_system_that_cannot_allocate_ahead_gives_a_sparse_segment(monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    name = _name()
    shm = create_shm(name, 1 << 16, reserve=True)
    assert not fully_allocated(name)
    shm.close()
    unlink_shm(name)
