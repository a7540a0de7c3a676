"""The pool segment: layout, lifecycle, attach validation, /dev/shm checks."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys

import pytest

from kvshm import FullSpec, KVCacheManager, PoolConfig, PoolSegment, Request
from kvshm.core.errors import SegmentError, ShmSpaceError
from kvshm.core.state import FLAG_NULL, HEADER_WORDS, SEQ_WORD
from kvshm.pool.layout import HEADER_FIELDS, MAGIC, Layout
from kvshm.pool.segment import list_segments, remove_segment
from kvshm.pool.shm import SHM_DIR
from kvshm.pool.stats import read_stats

CFG = PoolConfig(num_blocks=16, hash_block_size=4, max_model_len=32,
                 groups=(FullSpec(4),), max_num_seqs=4)


def shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def test_create_initialises_the_free_queue_and_null_block():
    with KVCacheManager(CFG, name="kvshm-test-init") as m:
        seg = m.segment
        assert os.path.exists(shm_path("kvshm-test-init"))
        assert m.block_pool.free_queue() == list(range(1, 16))
        assert seg.flags[0] == FLAG_NULL
        assert seg.get("num_free_blocks") == 15
        assert seg.get("magic") == MAGIC
        assert oct(os.stat(shm_path("kvshm-test-init")).st_mode & 0o777) == "0o600"
    assert not os.path.exists(shm_path("kvshm-test-init"))


def test_attach_sees_the_owners_state_and_never_unlinks():
    with KVCacheManager(CFG, name="kvshm-test-attach") as m:
        req = Request("r", list(range(10)), m.make_hasher())
        m.allocate_slots(req, 10)
        seg = PoolSegment.attach("kvshm-test-attach", expect_config=CFG)
        assert not seg.owner
        assert seg.read_counters()["num_free_blocks"] == m.num_free_blocks == 12
        with pytest.raises(SegmentError, match="only the process that created"):
            seg.unlink()
        seg.close()
        seg.close()  # idempotent
        assert os.path.exists(shm_path("kvshm-test-attach"))


def test_attach_in_a_child_process_that_exits_leaves_the_segment():
    # Python 3.11's resource tracker would unlink a SharedMemory segment when
    # an attaching process exits; kvshm's segments must survive that.
    with KVCacheManager(CFG, name="kvshm-test-child"):
        code = ("from kvshm import PoolSegment\n"
                "s = PoolSegment.attach('kvshm-test-child')\n"
                "print(s.config.num_blocks)\n"
                "s.close()\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True)
        assert out.stdout.strip() == "16"
        assert os.path.exists(shm_path("kvshm-test-child"))


def test_attach_errors_are_clear():
    with pytest.raises(SegmentError, match="no shared-memory segment named"):
        PoolSegment.attach("kvshm-test-missing")
    other = CFG.replace(num_blocks=17)
    with KVCacheManager(CFG, name="kvshm-test-mismatch"):
        with pytest.raises(SegmentError, match="another pool config"):
            PoolSegment.attach("kvshm-test-mismatch", expect_config=other)


def _make_raw(name: str, payload: bytes) -> None:
    fd = os.open(shm_path(name), os.O_CREAT | os.O_RDWR, 0o600)
    os.write(fd, payload)
    os.close(fd)


def test_attach_refuses_foreign_and_other_version_segments():
    _make_raw("kvshm-test-foreign", b"not a pool" + bytes(400))
    try:
        with pytest.raises(SegmentError, match="bad magic"):
            PoolSegment.attach("kvshm-test-foreign")
    finally:
        os.unlink(shm_path("kvshm-test-foreign"))
    with KVCacheManager(CFG, name="kvshm-test-version") as m:
        m.segment.set("layout_version", 99)
        with pytest.raises(SegmentError, match="layout version 99"):
            PoolSegment.attach("kvshm-test-version")


def test_existing_name_and_bad_names_are_refused():
    with KVCacheManager(CFG, name="kvshm-test-dup"):
        with pytest.raises(SegmentError, match="already exists"):
            KVCacheManager(CFG, name="kvshm-test-dup")
    with pytest.raises(SegmentError, match="segment name"):
        KVCacheManager(CFG, name="bad/name")


def test_short_dev_shm_fails_with_the_fix_in_the_message(monkeypatch):
    class Usage:
        free = 1000
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage)
    with pytest.raises(ShmSpaceError) as e:
        KVCacheManager(CFG, name="kvshm-test-space")
    assert "shm-size" in str(e.value) and e.value.available == 1000
    assert not os.path.exists(shm_path("kvshm-test-space"))


def test_layout_per_block_bytes_and_alignment():
    lay = Layout(PoolConfig(num_blocks=1_000_000, hash_block_size=16, max_model_len=4096,
                            groups=(FullSpec(16),)))
    # 71 bytes: ref count, two links, two stamps, group, flags, the writer
    # of a pending block, the parent in its chain, a 32-byte hash slot.
    assert lay.block_bytes / 1_000_000 < 72
    assert all(off % 64 == 0 for off, _ in lay.offsets.values())


def test_the_cores_header_words_are_where_the_layout_puts_them():
    # core/state.py names the header words the allocator keeps by index;
    # pool/layout.py lays the header out in bytes. The two must agree.
    for field, word in HEADER_WORDS.items():
        offset, fmt = HEADER_FIELDS[field]
        assert (offset, fmt) == (word * 8, "Q"), field


def test_mutation_counter_is_even_between_operations():
    with KVCacheManager(CFG) as m:
        seq = m.segment.words[SEQ_WORD]
        assert seq % 2 == 0
        m.allocate_slots(Request("r", [1, 2, 3], m.make_hasher()), 3)
        assert m.segment.words[SEQ_WORD] > seq
        assert m.segment.words[SEQ_WORD] % 2 == 0


def test_ls_and_rm_handle_stale_segments():
    seg = PoolSegment.create(CFG, "kvshm-test-stale")
    seg.set("coordinator_pid", 2**31 - 5)  # a pid that is not running
    seg.close()
    try:
        rows = {r["name"]: r for r in list_segments()}
        assert rows["kvshm-test-stale"]["alive"] is False
        remove_segment("kvshm-test-stale")
        assert not os.path.exists(shm_path("kvshm-test-stale"))
    finally:
        if os.path.exists(shm_path("kvshm-test-stale")):
            os.unlink(shm_path("kvshm-test-stale"))


def test_rm_refuses_a_live_owner_and_foreign_segments():
    with KVCacheManager(CFG, name="kvshm-test-live"):
        with pytest.raises(SegmentError, match="live process"):
            remove_segment("kvshm-test-live")
    with pytest.raises(SegmentError, match="not a kvshm segment"):
        remove_segment("kvshm-test-nothing-here")


def test_header_is_native_words():
    with KVCacheManager(CFG) as m:
        raw = bytes(m.segment.header[:256])
        assert struct.unpack_from("Q", raw, 64)[0] == 16


# -- the consistent read over the mutation counter -------------------------------------

def test_consistent_read_takes_one_attempt_when_nothing_mutates():
    with KVCacheManager(CFG) as m:
        calls = []
        result, consistent = m.segment.read_consistent(lambda: calls.append(1) or "x")
        assert (result, consistent, len(calls)) == ("x", True, 1)


def test_consistent_read_retries_while_the_counter_changes_or_is_odd():
    with KVCacheManager(CFG) as m:
        seg, words, seq = m.segment, m.segment.words, SEQ_WORD
        calls = []

        def read():
            calls.append(words[seq])
            if len(calls) == 1:
                words[seq] += 2          # a whole mutation overlapped this read
            elif len(calls) == 2:
                seg.begin_mutation()     # a writer is in the middle of one
            elif len(calls) == 3:
                m.block_pool.publish()   # ... and finishes it during this read
            return len(calls)

        assert seg.read_consistent(read) == (4, True)
        assert calls[1] == calls[0] + 2 and calls[2] & 1 and calls[3] == calls[1] + 2


def test_consistent_read_gives_up_after_the_timeout():
    with KVCacheManager(CFG) as m:
        seg = m.segment
        seg.begin_mutation()  # a writer that died mid-mutation
        calls = []
        with pytest.raises(SegmentError, match=r"a mutation has been in progress for "
                                               r"0\.02s \(its writer may have died"):
            seg.read_consistent(lambda: calls.append(1), timeout=0.02)
        assert len(calls) > 1
        with pytest.raises(SegmentError, match="in progress for 0.02s"):
            seg.read_counters(timeout=0.02)
        assert seg.read_consistent(lambda: len(calls), 0.02, torn_ok=True) \
            == (len(calls), False)
        st = read_stats(seg, timeout=0.02)
        assert st["consistent"] is False and st["num_free_blocks"] == 15
        m.block_pool.publish()
        assert seg.read_counters(timeout=0.02)["num_free_blocks"] == 15
        assert read_stats(seg, timeout=0.02)["consistent"] is True
