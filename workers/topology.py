"""CPU topology for the worker launcher: which NUMA nodes and CPUs exist, how
workers (and the coordinator) are laid out on them, and pinning with psutil.

`discover()` reads sysfs, `plan()` decides (and explains its decisions in
`Plan.notes`), `pin()` applies one CPU set to a process, `describe()` prints.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

SYS_NODE_ROOT = "/sys/devices/system/node"

_NODE_DIR = re.compile(r"node(\d+)")
_RANGE = re.compile(r"(\d+)(?:-(\d+)(?::(\d+)/(\d+))?)?")


class PinError(OSError):
    """The OS (or psutil) refused to set a process's CPU affinity."""


@dataclass(frozen=True)
class Node:
    """A set of CPUs a worker runs on.

    A real node is a NUMA node (`id` is its kernel number); a virtual node is
    a contiguous slice of a real node's CPUs carved out by `plan()` (`id` is
    its index among the plan's virtual nodes).
    """

    id: int
    cpus: tuple[int, ...]
    virtual: bool


@dataclass(frozen=True)
class Plan:
    """Where each worker and the coordinator run.

    `workers[i]` is worker i's CPU set; `coordinator_cpus` is None when the
    coordinator floats over all allowed CPUs; `notes` explain the decisions.
    """

    workers: list[Node]
    coordinator_cpus: tuple[int, ...] | None
    notes: list[str] = field(default_factory=list)


def parse_cpulist(text: str) -> list[int]:
    """Parse Linux cpulist syntax ("0-3,8-11,15"; also "0-15:2/4" strides).

    Args:
        text: the list as sysfs prints it; surrounding whitespace is ignored
            and an empty list (a memory-only node) is "" or "\\n".
    Returns:
        The CPU numbers, sorted and without duplicates.
    Raises:
        ValueError: a malformed list (the offending part is named), e.g. "3-1",
            "1,,2", "a", or a stride with a zero group or used size.
    """
    if not isinstance(text, str):
        raise ValueError(f"cpulist must be a string, got {type(text).__name__}")
    body = text.strip()
    if not body:
        return []
    cpus: set[int] = set()
    for part in body.split(","):
        m = _RANGE.fullmatch(part)
        if m is None:
            raise ValueError(f"malformed cpulist {body!r}: bad element {part!r}")
        lo = int(m[1])
        hi = lo if m[2] is None else int(m[2])
        if hi < lo:
            raise ValueError(f"malformed cpulist {body!r}: range {lo}-{hi} runs backwards")
        if m[3] is None:
            cpus.update(range(lo, hi + 1))
            continue
        used, group = int(m[3]), int(m[4])
        if used < 1 or group < 1 or used > group:
            raise ValueError(f"malformed cpulist {body!r}: stride {used}/{group} in {part!r} "
                             f"needs 1 <= used <= group")
        for start in range(lo, hi + 1, group):
            cpus.update(range(start, min(start + used, hi + 1)))
    return sorted(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """The inverse of `parse_cpulist`: sorted CPUs as "0-3,8" ("" when none).

    Args:
        cpus: CPU numbers (any order, duplicates allowed).
    Returns:
        The compact cpulist string.
    """
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(_run_text(run))
        run = [c]
    if run:
        out.append(_run_text(run))
    return ",".join(out)


def _run_text(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity), sorted.

    Returns:
        `psutil.Process().cpu_affinity()`, or every CPU where psutil cannot
        report affinity (e.g. macOS).
    """
    try:
        return sorted(psutil.Process().cpu_affinity())
    except AttributeError:  # platform without cpu_affinity
        return list(range(psutil.cpu_count() or 1))


def discover(sys_root: str | Path = SYS_NODE_ROOT, *,
             allowed: Iterable[int] | None = None) -> list[Node]:
    """The real NUMA nodes with CPUs this process may use.

    Args:
        sys_root: the sysfs node directory (a fake tree in tests).
        allowed: the usable CPUs; default this process's affinity.
    Returns:
        Nodes sorted by id, each with its cpulist intersected with `allowed`;
        nodes left without CPUs (memory-only nodes, CPUs outside the
        affinity) are skipped.  If `sys_root` does not exist, or no node has
        an allowed CPU, one node (id 0) holding all allowed CPUs.
    Raises:
        ValueError: a node's cpulist is malformed (the file is named).
        OSError: a cpulist file exists but cannot be read.
    """
    allow = set(allowed_cpus() if allowed is None else allowed)
    root = Path(sys_root)
    nodes: list[Node] = []
    if root.is_dir():
        found = []
        for entry in root.iterdir():
            m = _NODE_DIR.fullmatch(entry.name)
            if m and entry.is_dir():
                found.append((int(m[1]), entry / "cpulist"))
        for node_id, path in sorted(found):
            if not path.exists():
                continue
            try:
                cpus = parse_cpulist(path.read_text())
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
            mine = tuple(c for c in cpus if c in allow)
            if mine:
                nodes.append(Node(node_id, mine, False))
    if not nodes:
        nodes = [Node(0, tuple(sorted(allow)), False)]
    return nodes


def plan(num_workers: int, nodes: list[Node] | None = None,
         reserve_coordinator: bool = True) -> Plan:
    """Lay `num_workers` workers (and the coordinator) out on the CPUs.

    With at least `num_workers` nodes, worker i gets node i whole.  With fewer
    (typically one node), the CPUs are split into `num_workers` virtual nodes
    of contiguous CPUs, as even as possible, each inside one real node (nodes
    get workers in proportion to their CPUs); with fewer CPUs than workers,
    each worker gets one CPU, round-robin (oversubscribed).  If
    `reserve_coordinator` and there are at least num_workers + 2 CPUs, the
    last CPU of the last node is kept for the coordinator; otherwise it
    floats.  Every decision is explained in `Plan.notes`.

    Args:
        num_workers: how many worker processes, >= 1.
        nodes: the topology; default `discover()`.
        reserve_coordinator: try to give the coordinator a CPU of its own.
    Returns:
        The `Plan`.
    Raises:
        ValueError: num_workers < 1, no CPUs at all, or a CPU in two nodes.
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
    if nodes is None:
        nodes = discover()
    seen: dict[int, int] = {}
    for n in nodes:
        for c in n.cpus:
            if c in seen:
                raise ValueError(f"CPU {c} is in node {seen[c]} and node {n.id}")
            seen[c] = n.id
    nodes = [Node(n.id, tuple(sorted(n.cpus)), n.virtual) for n in nodes if n.cpus]
    total = len(seen)
    if total == 0:
        raise ValueError(f"no CPUs to place {num_workers} workers on "
                         f"({len(nodes)} nodes, all without CPUs)")
    real_mode = len(nodes) >= num_workers
    have = f"{_count(len(nodes), 'NUMA node')} with {_count(total, 'CPU')}"

    # The coordinator first: it changes what the workers get.
    last = nodes[-1]
    coordinator: tuple[int, ...] | None = None
    if not reserve_coordinator:
        coord_note = "coordinator floats (reserve_coordinator=False)"
    elif total < num_workers + 2:
        coord_note = (f"coordinator floats: a CPU of its own needs at least {num_workers + 2} "
                      f"CPUs for {_count(num_workers, 'worker')}, there are {total}")
    elif real_mode and len(nodes) == num_workers and len(last.cpus) == 1:
        coord_note = (f"coordinator floats: node {last.id} has only CPU {last.cpus[0]}, "
                      f"which its worker needs")
    else:
        coordinator = (last.cpus[-1],)
        coord_note = f"CPU {last.cpus[-1]} left for the coordinator (last CPU of node {last.id})"
        nodes = nodes[:-1] + ([Node(last.id, last.cpus[:-1], last.virtual)]
                              if len(last.cpus) > 1 else [])
    usable = total - (coordinator is not None)
    if coordinator is not None and not real_mode:
        have += f" ({usable} for workers)"

    notes: list[str] = []
    if real_mode:
        workers = nodes[:num_workers]
        notes.append(f"{have}: one node per worker ("
                     + ", ".join(f"worker {i} on node {n.id}" for i, n in enumerate(workers))
                     + ")")
        idle = nodes[num_workers:]
        if idle:
            notes.append(f"{'node' if len(idle) == 1 else 'nodes'} "
                         f"{', '.join(str(n.id) for n in idle)} left without a worker")
    elif usable < num_workers:
        cpus = [c for n in nodes for c in n.cpus]
        workers = [Node(i, (cpus[i % usable],), True) for i in range(num_workers)]
        most = -(-num_workers // usable)
        notes.append(f"{have}, fewer than the {num_workers} workers")
        notes.append(f"{num_workers} workers share {_count(usable, 'CPU')}: "
                     f"{'' if num_workers % usable == 0 else 'up to '}{most} workers per CPU "
                     f"(oversubscribed), one CPU each, round-robin")
    else:
        counts = _shares(num_workers, [len(n.cpus) for n in nodes])
        workers = []
        per_node = []
        for node, k in zip(nodes, counts):
            if k == 0:
                per_node.append(f"node {node.id} ({_count(len(node.cpus), 'CPU')}) "
                                f"left without a worker")
                continue
            chunks = _split(node.cpus, k)
            sizes = sorted({len(c) for c in chunks})
            size = (_count(sizes[0], "CPU") if len(sizes) == 1
                    else f"{sizes[0]}-{sizes[-1]} CPUs")
            per_node.append(f"{_count(k, 'virtual node')} of {size}{' each' if k > 1 else ''}")
            if len(nodes) > 1:
                per_node[-1] = f"node {node.id}: {per_node[-1]}"
            workers.extend(Node(len(workers), chunk, True) for chunk in chunks)
        if len(nodes) == 1:
            notes.append(f"{have}: split into {per_node[0]}")
        else:
            notes.append(f"{have}, fewer nodes than the {num_workers} workers: each node "
                         f"split into virtual nodes, in proportion to its CPUs")
            notes.extend(per_node)
    notes.append(coord_note)
    return Plan(workers, coordinator, notes)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _shares(k: int, sizes: list[int]) -> list[int]:
    """k workers over nodes of `sizes` CPUs, proportionally (largest remainder).
    k <= sum(sizes) keeps every share within its node's CPU count."""
    total = sum(sizes)
    exact = [k * s / total for s in sizes]
    counts = [int(e) for e in exact]
    order = sorted(range(len(sizes)), key=lambda i: (counts[i] - exact[i], i))
    for i in order[: k - sum(counts)]:
        counts[i] += 1
    return counts


def _split(cpus: tuple[int, ...], k: int) -> list[tuple[int, ...]]:
    """`cpus` in k contiguous chunks whose sizes differ by at most one."""
    q, r = divmod(len(cpus), k)
    out, at = [], 0
    for i in range(k):
        size = q + (1 if i < r else 0)
        out.append(cpus[at:at + size])
        at += size
    return out


def pin(cpus: Iterable[int], pid: int | None = None) -> tuple[int, ...]:
    """Restrict a process to `cpus`.

    Args:
        cpus: the CPU numbers, non-empty (psutil would read [] as "all").
        pid: the process; None for the current one.
    Returns:
        The affinity the process reports afterwards, sorted.
    Raises:
        ValueError: `cpus` is empty or holds something other than ints >= 0.
        PinError: psutil or the OS refused (a CPU that does not exist or is
            not allowed, no such process, no permission), including when the
            OS would silently keep only some of `cpus`; the message names the
            CPUs and the pid, a psutil/OS cause is chained.  The affinity is
            left as it was.
    """
    wanted = list(cpus)
    if not wanted:
        raise ValueError("cannot pin to an empty CPU list")
    bad = [c for c in wanted if isinstance(c, bool) or not isinstance(c, int) or c < 0]
    if bad:
        raise ValueError(f"CPU numbers must be ints >= 0, got {bad!r}")
    who = f"this process (pid {psutil.Process().pid})" if pid is None else f"pid {pid}"
    try:
        proc = psutil.Process(pid)
        before = proc.cpu_affinity()
        proc.cpu_affinity(wanted)
        after = proc.cpu_affinity()
    except (ValueError, OSError, psutil.Error) as e:
        raise PinError(f"cannot pin {who} to CPUs {format_cpulist(wanted)}: {e}") from e
    dropped = sorted(set(wanted) - set(after))
    if dropped:
        # Linux drops CPUs that do not exist (or are outside the cpuset) in
        # silence as long as one requested CPU is usable: undo, and say so.
        try:
            proc.cpu_affinity(before)
        except (ValueError, OSError, psutil.Error) as e:
            raise PinError(f"cannot pin {who} to CPUs {format_cpulist(wanted)}: CPUs "
                           f"{format_cpulist(dropped)} do not exist or are not allowed, and "
                           f"restoring CPUs {format_cpulist(before)} failed: {e}") from e
        raise PinError(f"cannot pin {who} to CPUs {format_cpulist(wanted)}: CPUs "
                       f"{format_cpulist(dropped)} do not exist or are not allowed (the OS kept "
                       f"only {format_cpulist(after)}); affinity left at {format_cpulist(before)}")
    return tuple(sorted(after))


def describe(plan: Plan) -> str:
    """A plan as lines for a terminal.

    Args:
        plan: a `Plan` from `plan()`.
    Returns:
        One line per worker, the coordinator's line, then the notes.
    """
    lines = []
    for i, n in enumerate(plan.workers):
        kind = f"virtual node {n.id}" if n.virtual else f"NUMA node {n.id}"
        lines.append(f"worker {i}: CPUs {format_cpulist(n.cpus)} ({kind})")
    lines.append("coordinator: " + ("floating (any allowed CPU)" if plan.coordinator_cpus is None
                                    else f"CPUs {format_cpulist(plan.coordinator_cpus)}"))
    lines.extend(f"  - {note}" for note in plan.notes)
    return "\n".join(lines)
