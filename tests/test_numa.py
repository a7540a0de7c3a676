"""NUMA page placement (kvshm/pool/numa.py): a policy set on one mapping of a
shared-memory object is what another process's mapping follows, as
numa_maps shows; the errors for a missing libnuma, a bad policy, range or
node; reading numa_maps."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

from kvshm.pool.numa import LibNuma, PlacementError, mapped_pages, parse_numa_maps, place
from kvshm.pool.shm import Shm

HAVE_NUMA = (ctypes.util.find_library("numa") is not None
             and os.path.exists("/proc/self/numa_maps"))
needs_numa = pytest.mark.skipif(not HAVE_NUMA, reason="no libnuma or no numa_maps here")
PAGE = os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def shm():
    s = Shm.create(None, 64 * PAGE)
    yield s
    s.close()
    s.unlink()


@needs_numa
@pytest.mark.parametrize("policy, shown", [("bind", "bind:0"), ("interleave", "interleave:0"),
                                           ("first-touch", "default")])
def test_a_policy_set_here_is_the_objects_for_every_process(shm, policy, shown):
    place(shm.buf, policy, [0] if policy != "first-touch" else [])
    path = f"/dev/shm/{shm.name}"
    assert mapped_pages("self", path).policies == [shown]
    code = ("import sys; from kvshm.pool.shm import Shm; from kvshm.pool.numa import mapped_pages\n"
            f"t = Shm.open({shm.name!r}); t.buf[:] = bytes(len(t.buf))\n"
            f"p = mapped_pages('self', {path!r}); print(p.policies[0], sum(p.pages.values()))\n"
            "t.buf.release(); t.close()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [shown, "64"]   # touched there, all 64 pages on node 0


@needs_numa
def test_part_of_a_mapping_gets_its_own_policy(shm):
    place(shm.buf, "bind", [0], offset=4 * PAGE, length=8 * PAGE)
    assert mapped_pages("self", f"/dev/shm/{shm.name}").policies == ["default", "bind:0",
                                                                    "default"]


@needs_numa
def test_the_kernel_refuses_a_node_that_does_not_exist(shm):
    with pytest.raises(PlacementError, match=r"mbind\(mode=2, nodes=\[63\]\).*Invalid argument"):
        place(shm.buf, "bind", [63])


def test_without_libnuma_the_message_says_what_to_install():
    with pytest.raises(PlacementError, match=r"needs libnuma \(libnuma-nope\.so\.9; on "
                                             r"Debian or Ubuntu: apt-get install libnuma1\)"):
        LibNuma("libnuma-nope.so.9")


@pytest.mark.parametrize("policy, nodes, kw, message", [
    ("spread", [0], {}, "unknown page policy 'spread'"),
    ("bind", [], {}, "policy bind needs at least one NUMA node"),
    ("interleave", [-1], {}, "NUMA nodes must be ints >= 0"),
    ("bind", [0], {"offset": 100}, "is not a page-aligned range"),
    ("bind", [0], {"offset": 0, "length": 65 * PAGE}, "is not a page-aligned range"),
])
def test_bad_placements_are_refused_before_any_call(shm, policy, nodes, kw, message):
    class NoLib:   # nothing may reach the kernel
        def available(self):
            raise AssertionError("called")

    with pytest.raises(PlacementError, match=message):
        place(shm.buf, policy, nodes, libnuma=NoLib(), **kw)


def test_numa_maps_lines_of_one_file_are_summed():
    text = ("7f0000000000 default file=/dev/shm/p.kv mapped=3 N0=2 N1=1 kernelpagesize_kB=4\n"
            "7f0000004000 interleave:0-1 file=/dev/shm/p.kv dirty=4 N0=2 N1=2 "
            "kernelpagesize_kB=4\n"
            "7f0000100000 default file=/dev/shm/other N0=50 kernelpagesize_kB=4\n"
            "7f0000200000 default anon=5 dirty=5 N0=5 kernelpagesize_kB=4\n")
    pages = parse_numa_maps(text, "/dev/shm/p.kv")
    assert pages.policies == ["default", "interleave:0-1"]
    assert pages.pages == {0: 4, 1: 3} and pages.page_bytes == 4096
    assert parse_numa_maps(text, "/dev/shm/none").pages == {}
    assert mapped_pages(2**22 + 12345, "/x") is None      # no such process
