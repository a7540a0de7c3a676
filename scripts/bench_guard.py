"""The regression guard the benchmarks share (`--against REV`): this
checkout and an earlier revision measured by the same benchmark in one run,
rounds alternating between the two (this tree first in odd rounds, the
other first in even ones), so both see the same machine load.

Each side runs as its own process, its own tree first on `sys.path`
(bench_common.py puts a script's checkout first): this checkout as it is,
uncommitted changes included, and REV from a temporary `git worktree`
(removed afterwards).  Both get the same arguments and the same input
files; the figures come from the JSON each run writes.  A figure is
reported as the median over rounds on each side and the median of the
per-round ratios (this tree / REV, or REV / this tree where lower is
better), so a slowdown shows as a ratio below 1.  docs/hot-path.md says
when to run it.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from bench_common import REPO

# A figure whose median per-round ratio falls below this is flagged.
SLOWER = 0.95


class GuardError(Exception):
    """The revision could not be checked out, or its benchmark failed."""


@contextlib.contextmanager
def revision_tree(rev: str) -> Iterator[Path]:
    """A temporary work tree of `rev` (any git revision of this checkout)."""
    resolved = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify",
                               f"{rev}^{{commit}}"], capture_output=True, text=True)
    if resolved.returncode != 0:
        raise GuardError(f"--against {rev}: not a revision of this checkout "
                         f"({resolved.stderr.strip()})")
    parent = Path(tempfile.mkdtemp(prefix="kvshm-against-"))
    tree = parent / resolved.stdout.strip()[:12]
    added = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree),
                            resolved.stdout.strip()], capture_output=True, text=True)
    if added.returncode != 0:
        parent.rmdir()
        raise GuardError(f"git worktree add {rev}: {added.stderr.strip()}")
    try:
        # An installed kvshm maps the top-level workers/ folder to
        # kvshm.workers (pyproject.toml); a bare tree on sys.path needs the link.
        link = tree / "kvshm" / "workers"
        if (tree / "workers").is_dir() and not link.exists():
            link.symlink_to(Path("..") / "workers")
        yield tree
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                       capture_output=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], capture_output=True)
        with contextlib.suppress(OSError):
            parent.rmdir()


def run_benchmark(tree: Path, script: str, args: list[str], timeout: float) -> dict:
    """Run `tree`'s scripts/`script` with `args` (plus --json) and return the
    JSON it wrote.  Raises GuardError if it fails or writes none."""
    with tempfile.TemporaryDirectory(prefix="kvshm-guard-") as tmp:
        out = Path(tmp) / "figures.json"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        try:
            proc = subprocess.run([sys.executable, str(tree / "scripts" / script), *args,
                                   "--json", str(out)], cwd=tree, env=env,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise GuardError(f"{tree}: {script} took over {timeout:.0f}s") from None
        if proc.returncode != 0 or not out.exists():
            tail = "".join((proc.stdout + proc.stderr).splitlines(keepends=True)[-30:])
            raise GuardError(f"{tree}: {script} {' '.join(args)} exited {proc.returncode}:\n"
                             f"{tail}")
        return json.loads(out.read_text())


def alternate(rev: str, rounds: int, script: str, args: list[str],
              figures: Callable[[dict], dict[str, float]], *, timeout: float = 1800,
              ) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """Run `script args` `rounds` times in this checkout and in `rev`,
    alternating; `figures(doc)` picks the figures (name -> value) from a
    run's JSON.  Returns (ours per round, theirs per round)."""
    ours: list[dict[str, float]] = []
    theirs: list[dict[str, float]] = []
    with revision_tree(rev) as tree:
        for rnd in range(rounds):
            order = [(REPO, ours), (tree, theirs)]
            if rnd % 2:
                order.reverse()
            for where, into in order:
                into.append(figures(run_benchmark(where, script, args, timeout)))
            print(f"  round {rnd + 1}/{rounds}: " + "; ".join(
                f"{k} {ours[-1].get(k, float('nan')):,.3g} vs {theirs[-1].get(k, float('nan')):,.3g}"
                for k in list(ours[-1])[:3]), flush=True)
    return ours, theirs


def compare(rev: str, ours: list[dict[str, float]], theirs: list[dict[str, float]],
            lower_is_better: Callable[[str], bool] = lambda name: False) -> dict:
    """The comparison table (printed) and its JSON: per figure both medians
    and the median of per-round ratios, oriented so that > 1 is better for
    this checkout; figures one side lacks are listed as missing."""
    names = list(dict.fromkeys(k for r in ours + theirs for k in r))
    rows = []
    print(f"\n== this checkout vs {rev} (median of {len(ours)} alternating rounds; "
          "ratio > 1: this checkout is better)")
    print(f"  {'figure':52s} {'this':>12s} {rev[:12]:>12s}  ratio")
    for name in names:
        a = [r[name] for r in ours if name in r]
        b = [r[name] for r in theirs if name in r]
        if not a or not b:
            rows.append({"figure": name, "missing": "this checkout" if not a else rev})
            print(f"  {name:52s} (only in {'the other' if not a else 'this'} tree)")
            continue
        low = lower_is_better(name)
        per = [(y / x if low else x / y) for x, y in zip(a, b) if x and y]
        ratio = statistics.median(per) if per else float("nan")
        flag = "  SLOWER" if ratio < SLOWER else ""
        rows.append({"figure": name, "this": statistics.median(a), "against": statistics.median(b),
                     "ratio": ratio, "rounds_this": a, "rounds_against": b,
                     "lower_is_better": low})
        print(f"  {name:52s} {statistics.median(a):12,.4g} {statistics.median(b):12,.4g}  "
              f"{ratio:5.2f}x{flag}")
    slower = [r["figure"] for r in rows if r.get("ratio", 1) < SLOWER]
    print(f"  {len(slower)} figure(s) more than {1 - SLOWER:.0%} worse" +
          (f": {', '.join(slower)}" if slower else ""))
    return {"against": rev, "rounds": len(ours), "figures": rows, "slower": slower}


def forwarded_args(argv: list[str], drop: tuple[str, ...]) -> list[str]:
    """`argv` without the options in `drop` (each taking one value, given as
    `--opt V` or `--opt=V`): what both sides of the comparison are run with."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in drop:
            skip = True
        elif not arg.startswith(tuple(f"{d}=" for d in drop)):
            out.append(arg)
    return out


def service_figures(doc: dict) -> dict[str, float]:
    """The figures of scripts/bench_service.py's JSON the guard compares."""
    out = {}
    if "embedded" in doc:
        out["embedded core ops/s"] = doc["embedded"]["ops_per_s"]
    for r in doc.get("throughput", []):
        key = f"{r['clients']} client(s), {r['batch']}-op frames"
        out[f"{key}: ops/s"] = r["ops_per_s"]
        if "coordinator_cpu_us_per_op" in r:
            out[f"{key}: coordinator CPU us/op"] = r["coordinator_cpu_us_per_op"]
    for name, s in doc.get("latency", {}).items():
        out[f"round trip p50 us: {name}"] = s["p50_us"]
    return out


def service_lower_is_better(name: str) -> bool:
    return "us/op" in name or name.startswith("round trip")
