"""The layering of docs/layers.md, read from the code's own imports.

Every `import` and `from ... import` of kvshm/, workers/ and scripts/ is
parsed, the ones inside functions included, and resolved to the project
module it names.  A module's room is its subpackage (`kvshm.core`,
`kvshm.ops`, ...) or, at kvshm's top level, the module itself; each room has
a floor (ROOMS).  The test fails on an import that goes up a floor, on a
cycle between modules and on a cycle between rooms, naming the imports.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Floor of each room, lowest first (docs/layers.md shows the same picture).
ROOMS = {
    "kvshm.core": 0,                                          # the allocator engine
    "kvshm.pool": 1, "kvshm.config": 1,                       # shared memory; configs
    "kvshm.ops": 2, "kvshm.replay": 2, "kvshm.workload": 2,   # sans-IO ops and harnesses
    "kvshm.service": 3,                                       # the transport
    "kvshm": 4,                                               # the public API (__init__)
    "kvshm.cli": 5,
    "kvshm.__main__": 5, "kvshm.vllm": 5, "workers": 5, "scripts": 5,
}


def project_modules() -> dict[str, Path]:
    mods = {}
    for base in ("kvshm", "workers", "scripts"):
        for path in (ROOT / base).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


def _canonical(name: str) -> str:
    # The wheel installs workers/ as kvshm.workers (pyproject.toml).
    if name == "kvshm.workers" or name.startswith("kvshm.workers."):
        return "workers" + name[len("kvshm.workers"):]
    return name


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> list[tuple[str, int]]:
    """(module imported, line) for every import in `path` of a project module."""
    out = []
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".") if is_pkg else name.split(".")[:-1]
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" for a in node.names]
            targets = [t if _canonical(t) in mods else base for t in targets]
        else:
            continue
        for t in targets:
            t = _canonical(t)
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.append((t, node.lineno))
    return out


def room_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "kvshm":
        return parts[0]
    return ".".join(parts[:2])


def import_graph() -> dict[str, dict[str, int]]:
    mods = project_modules()
    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for name, path in mods.items():
        for target, line in imports_of(name, path, mods):
            graph[name].setdefault(target, line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path(module: str) -> str:
    return str(project_modules()[module].relative_to(ROOT))


def test_every_module_has_a_room_with_a_floor():
    rooms = {room_of(m) for m in project_modules()}
    assert rooms <= set(ROOMS), (
        f"rooms without a floor in ROOMS (add them, and to docs/layers.md): "
        f"{sorted(rooms - set(ROOMS))}")


def test_no_import_goes_up_a_floor():
    graph = import_graph()
    upward = [f"{_path(a)}:{line} imports {b} ({room_of(a)}, floor {ROOMS[room_of(a)]} -> "
              f"{room_of(b)}, floor {ROOMS[room_of(b)]})"
              for a, targets in sorted(graph.items()) for b, line in targets.items()
              if ROOMS[room_of(b)] > ROOMS[room_of(a)]]
    assert not upward, "imports that go up a floor (docs/layers.md):\n  " + "\n  ".join(upward)


def test_no_cycle_between_modules():
    graph = import_graph()
    found = cycles(graph)
    lines = [" <-> ".join(c) + ": " + ", ".join(
        f"{_path(a)}:{graph[a][b]} imports {b}" for a in c for b in graph[a] if b in c)
        for c in found]
    assert not found, "module import cycles:\n  " + "\n  ".join(lines)


def test_no_cycle_between_rooms():
    graph = import_graph()
    rooms: dict[str, dict[str, str]] = defaultdict(dict)
    for a, targets in graph.items():
        for b, line in targets.items():
            ra, rb = room_of(a), room_of(b)
            if ra != rb:
                rooms[ra].setdefault(rb, f"{_path(a)}:{line} imports {b}")
    found = cycles({r: dict.fromkeys(t, 0) for r, t in rooms.items()})
    lines = [" <-> ".join(c) + ": " + ", ".join(
        rooms[a][b] for a in c for b in rooms[a] if b in c) for c in found]
    assert not found, "cycles between rooms:\n  " + "\n  ".join(lines)


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "kvshm" / "x"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n    import kvshm.workers.w\n")
    mods = {"kvshm.x": pkg / "__init__.py", "kvshm.x.a": pkg / "a.py",
            "kvshm.x.b": pkg / "b.py", "workers.w": tmp_path / "w.py"}
    assert imports_of("kvshm.x.a", pkg / "a.py", mods) == [("kvshm.x.b", 2), ("workers.w", 3)]
    assert cycles({"a": {"b": 1}, "b": {"a": 1}, "c": {"a": 1}}) == [["a", "b"]]
