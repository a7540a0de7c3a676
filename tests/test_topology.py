"""workers.topology: cpulist parsing, NUMA discovery on fake sysfs trees,
worker/coordinator layout plans, and pinning real processes with psutil."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from kvshm.workers.topology import (Node, PinError, describe, discover, format_cpulist,
                              parse_cpulist, pin, plan)


def real(node_id: int, cpus) -> Node:
    return Node(node_id, tuple(cpus), False)


def all_cpus(p) -> list[int]:
    return sorted(c for n in p.workers for c in n.cpus)


# -- parse_cpulist ----------------------------------------------------------

@pytest.mark.parametrize("text, cpus", [
    ("0", [0]),
    ("0-3", [0, 1, 2, 3]),
    ("0-3,8-11,15", [0, 1, 2, 3, 8, 9, 10, 11, 15]),
    ("0-1\n", [0, 1]),
    ("  7 ", [7]),
    ("", []),
    ("\n", []),
    ("3,1,2,1", [1, 2, 3]),
    ("5-5", [5]),
    ("0-9:2/5", [0, 1, 5, 6]),
])
def test_parse_cpulist(text, cpus):
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("text, part", [
    ("a", "'a'"),
    ("1,,2", "''"),
    ("1,", "''"),
    ("-1", "'-1'"),
    ("1-", "'1-'"),
    ("0-3 ,5", "'0-3 '"),
    ("1.5", "'1.5'"),
    ("3-1", "3-1 runs backwards"),
    ("0-7:0/4", "stride 0/4"),
    ("0-7:5/4", "stride 5/4"),
])
def test_parse_cpulist_rejects_malformed(text, part):
    with pytest.raises(ValueError, match="malformed cpulist") as e:
        parse_cpulist(text)
    assert part in str(e.value)


def test_parse_cpulist_rejects_non_strings():
    with pytest.raises(ValueError, match="must be a string, got int"):
        parse_cpulist(3)


def test_format_cpulist_inverts_parse():
    assert format_cpulist([15, 0, 1, 2, 3, 8, 9, 10, 11, 3]) == "0-3,8-11,15"
    assert format_cpulist([]) == ""
    for text in ("0", "0-3,8-11,15", "1,3,5"):
        assert format_cpulist(parse_cpulist(text)) == text


# -- discover ---------------------------------------------------------------

def fake_sysfs(root: Path, cpulists: dict[str, str | None]) -> Path:
    """node dirs under root; a None cpulist means the file is missing."""
    root.mkdir(parents=True, exist_ok=True)
    for name, text in cpulists.items():
        (root / name).mkdir()
        if text is not None:
            (root / name / "cpulist").write_text(text)
    # sysfs also has files next to the node dirs
    (root / "online").write_text("0-1\n")
    (root / "possible").write_text("0-3\n")
    return root


def test_discover_two_nodes(tmp_path):
    root = fake_sysfs(tmp_path / "node", {"node0": "0-3\n", "node1": "4-7\n"})
    assert discover(root, allowed=range(8)) == [real(0, range(4)), real(1, range(4, 8))]


def test_discover_orders_nodes_numerically(tmp_path):
    root = fake_sysfs(tmp_path / "node", {"node10": "2\n", "node2": "1\n", "node0": "0\n"})
    assert [n.id for n in discover(root, allowed=range(3))] == [0, 2, 10]


def test_discover_intersects_with_allowed_cpus(tmp_path):
    root = fake_sysfs(tmp_path / "node", {"node0": "0-3\n", "node1": "4-7\n"})
    assert discover(root, allowed=[1, 2, 6]) == [real(0, [1, 2]), real(1, [6])]
    # a node whose CPUs are all outside the affinity is skipped
    assert discover(root, allowed=[5]) == [real(1, [5])]


def test_discover_skips_memory_only_nodes(tmp_path):
    root = fake_sysfs(tmp_path / "node",
                      {"node0": "0-3\n", "node1": "\n", "node2": "4-7\n", "node3": None})
    assert [n.id for n in discover(root, allowed=range(8))] == [0, 2]


def test_discover_without_sysfs_is_one_node_of_allowed_cpus(tmp_path):
    assert discover(tmp_path / "missing", allowed=[3, 1]) == [real(0, [1, 3])]
    mine = sorted(psutil.Process().cpu_affinity())
    assert discover(tmp_path / "missing") == [real(0, mine)]


def test_discover_defaults_to_this_process_affinity(tmp_path):
    mine = sorted(psutil.Process().cpu_affinity())
    root = fake_sysfs(tmp_path / "node", {"node0": format_cpulist(mine) + "\n"})
    assert discover(root) == [real(0, mine)]


def test_discover_names_the_file_with_a_malformed_cpulist(tmp_path):
    root = fake_sysfs(tmp_path / "node", {"node0": "0-x\n"})
    with pytest.raises(ValueError, match=r"node0/cpulist: malformed cpulist '0-x'"):
        discover(root, allowed=range(4))


def test_discover_on_this_machine():
    nodes = discover()
    mine = set(psutil.Process().cpu_affinity())
    assert nodes and all(n.cpus and not n.virtual for n in nodes)
    assert {c for n in nodes for c in n.cpus} <= mine


# -- plan -------------------------------------------------------------------

def test_plan_one_node_two_cpus_two_workers():
    p = plan(2, [real(0, [0, 1])])
    assert p.workers == [Node(0, (0,), True), Node(1, (1,), True)]
    assert p.coordinator_cpus is None
    assert "1 NUMA node with 2 CPUs: split into 2 virtual nodes of 1 CPU each" in p.notes
    assert any("coordinator floats" in n and "at least 4 CPUs" in n for n in p.notes)


def test_plan_one_node_two_cpus_four_workers_is_oversubscribed():
    p = plan(4, [real(0, [0, 1])])
    assert [n.cpus for n in p.workers] == [(0,), (1,), (0,), (1,)]
    assert all(n.virtual for n in p.workers)
    assert p.coordinator_cpus is None
    assert any("4 workers share 2 CPUs: 2 workers per CPU (oversubscribed)" in n
               for n in p.notes)


def test_plan_two_real_nodes_reserves_a_coordinator_cpu():
    p = plan(2, [real(0, range(8)), real(1, range(8, 16))])
    assert p.workers == [real(0, range(8)), real(1, range(8, 15))]
    assert p.coordinator_cpus == (15,)
    assert any("CPU 15 left for the coordinator" in n for n in p.notes)
    assert any("one node per worker" in n for n in p.notes)


def test_plan_more_nodes_than_workers_uses_the_first_nodes():
    nodes = [real(i, range(4 * i, 4 * i + 4)) for i in range(4)]
    p = plan(2, nodes)
    assert p.workers == nodes[:2]
    assert p.coordinator_cpus == (15,)   # from the last node, which no worker uses
    assert any("nodes 2, 3 left without a worker" in n for n in p.notes)


def test_plan_one_cpu_three_workers():
    p = plan(3, [real(0, [5])])
    assert [n.cpus for n in p.workers] == [(5,), (5,), (5,)]
    assert [n.id for n in p.workers] == [0, 1, 2]
    assert p.coordinator_cpus is None
    assert any("3 workers share 1 CPU: 3 workers per CPU (oversubscribed)" in n
               for n in p.notes)


def test_plan_uneven_split_is_contiguous_and_even():
    p = plan(3, [real(0, range(12))])
    # 12 CPUs >= 3 + 2: CPU 11 for the coordinator, 11 left in chunks of 4, 4, 3
    assert p.coordinator_cpus == (11,)
    assert [n.cpus for n in p.workers] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10)]
    assert any("split into 3 virtual nodes of 3-4 CPUs each" in n for n in p.notes)


def test_plan_reservation_threshold_is_workers_plus_two():
    assert plan(2, [real(0, range(3))]).coordinator_cpus is None
    assert plan(2, [real(0, range(4))]).coordinator_cpus == (3,)
    p = plan(2, [real(0, range(4))], reserve_coordinator=False)
    assert p.coordinator_cpus is None and all_cpus(p) == [0, 1, 2, 3]
    assert any("reserve_coordinator=False" in n for n in p.notes)


def test_plan_never_leaves_a_worker_node_empty_for_the_coordinator():
    p = plan(2, [real(0, range(8)), real(1, [8])])
    assert p.coordinator_cpus is None
    assert p.workers == [real(0, range(8)), real(1, [8])]
    assert any("node 1 has only CPU 8" in n for n in p.notes)


def test_plan_split_over_several_nodes_keeps_virtual_nodes_inside_one():
    nodes = [real(0, range(8)), real(1, range(8, 16))]
    p = plan(4, nodes, reserve_coordinator=False)
    assert [n.cpus for n in p.workers] == [(0, 1, 2, 3), (4, 5, 6, 7),
                                           (8, 9, 10, 11), (12, 13, 14, 15)]
    p = plan(3, nodes)
    assert p.coordinator_cpus == (15,)
    for w in p.workers:
        assert {c // 8 for c in w.cpus} in ({0}, {1})
    assert sorted(all_cpus(p) + [15]) == list(range(16))


@pytest.mark.parametrize("num_workers", range(1, 10))
@pytest.mark.parametrize("sizes", [[1], [2], [7], [4, 4], [3, 1], [2, 2, 2, 2], [16, 16]])
def test_plan_invariants(num_workers, sizes):
    nodes, start = [], 0
    for i, size in enumerate(sizes):
        nodes.append(real(i, range(start, start + size)))
        start += size
    p = plan(num_workers, nodes)
    assert len(p.workers) == num_workers
    assert all(w.cpus for w in p.workers)
    if p.coordinator_cpus is not None:
        assert start >= num_workers + 2
        assert not set(p.coordinator_cpus) & set(all_cpus(p))
    used = all_cpus(p)
    if start >= num_workers:   # no CPU shared between workers
        assert len(used) == len(set(used))
    assert p.notes


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="num_workers must be an int >= 1, got 0"):
        plan(0, [real(0, [0])])
    with pytest.raises(ValueError, match="got True"):
        plan(True, [real(0, [0])])
    with pytest.raises(ValueError, match="no CPUs to place 2 workers"):
        plan(2, [real(0, [])])
    with pytest.raises(ValueError, match="CPU 3 is in node 0 and node 1"):
        plan(2, [real(0, [2, 3]), real(1, [3, 4])])


def test_plan_defaults_to_discovered_topology():
    p = plan(2)
    mine = set(psutil.Process().cpu_affinity())
    assert len(p.workers) == 2
    assert set(all_cpus(p)) | set(p.coordinator_cpus or ()) <= mine


def test_describe():
    text = describe(plan(2, [real(0, range(8)), real(1, range(8, 16))]))
    assert text.splitlines()[:3] == ["worker 0: CPUs 0-7 (NUMA node 0)",
                                     "worker 1: CPUs 8-14 (NUMA node 1)",
                                     "coordinator: CPUs 15"]
    assert "  - CPU 15 left for the coordinator" in text
    text = describe(plan(2, [real(0, [0, 1])]))
    assert "worker 1: CPUs 1 (virtual node 1)" in text
    assert "coordinator: floating" in text


# -- pin --------------------------------------------------------------------

@pytest.fixture
def restore_affinity():
    me = psutil.Process()
    before = me.cpu_affinity()
    yield sorted(before)
    me.cpu_affinity(before)
    assert me.cpu_affinity() == before


def test_pin_current_process(restore_affinity):
    allowed = restore_affinity
    subset = allowed[:1]
    assert pin(subset) == tuple(subset)
    assert psutil.Process().cpu_affinity() == subset
    assert pin(allowed) == tuple(allowed)
    assert sorted(psutil.Process().cpu_affinity()) == allowed


@pytest.fixture
def sleeper():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield child
    child.kill()
    child.wait()


def test_pin_child_process(sleeper, restore_affinity):
    cpu = restore_affinity[-1]
    assert pin([cpu], pid=sleeper.pid) == (cpu,)
    assert psutil.Process(sleeper.pid).cpu_affinity() == [cpu]
    assert sorted(psutil.Process().cpu_affinity()) == restore_affinity   # not us


def test_pin_to_a_nonexistent_cpu_fails_clearly_and_changes_nothing(sleeper, restore_affinity):
    with pytest.raises(PinError) as e:
        pin([100000])
    msg = str(e.value)
    assert "to CPUs 100000" in msg and f"pid {psutil.Process().pid}" in msg
    assert isinstance(e.value.__cause__, (ValueError, OSError))
    assert sorted(psutil.Process().cpu_affinity()) == restore_affinity

    child_before = psutil.Process(sleeper.pid).cpu_affinity()
    with pytest.raises(PinError, match=rf"cannot pin pid {sleeper.pid} to CPUs 100000: "):
        pin([100000], pid=sleeper.pid)
    assert psutil.Process(sleeper.pid).cpu_affinity() == child_before


def test_pin_refuses_a_partial_pin_the_os_would_accept(restore_affinity):
    # Linux keeps the usable CPUs of a mask in silence: pin() undoes and raises.
    cpu = restore_affinity[0]
    with pytest.raises(PinError) as e:
        pin([cpu, 100000])
    msg = str(e.value)
    assert f"to CPUs {cpu},100000" in msg and "CPUs 100000 do not exist" in msg
    assert f"pid {psutil.Process().pid}" in msg
    assert sorted(psutil.Process().cpu_affinity()) == restore_affinity


def test_pin_to_a_missing_process():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()   # reaped: the pid no longer exists (until reused)
    with pytest.raises(PinError, match=rf"cannot pin pid {child.pid} to CPUs 0"):
        pin([0], pid=child.pid)


def test_pin_rejects_bad_cpu_lists(restore_affinity):
    with pytest.raises(ValueError, match="empty CPU list"):
        pin([])
    with pytest.raises(ValueError, match=r"ints >= 0, got \[-1\]"):
        pin([0, -1])
    with pytest.raises(ValueError, match=r"got \['1'\]"):
        pin(["1"])
    assert sorted(psutil.Process().cpu_affinity()) == restore_affinity
