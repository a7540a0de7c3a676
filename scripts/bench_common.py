"""What the benchmarks in scripts/ share (a module they import, not a
benchmark of its own): importing it puts this checkout first on sys.path, so
a script measures the tree it sits in even where another kvshm is
installed; where results go and how they are written; where vLLM's
reference runner is (`../shared/oracle`, or $KVSHM_ORACLE and its Python
$KVSHM_ORACLE_PY)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if sys.path[:1] != [str(REPO)]:
    sys.path.insert(0, str(REPO))

RESULTS = REPO / "bench-results"
ORACLE = Path(os.environ.get("KVSHM_ORACLE", REPO.parent / "shared" / "oracle"))
ORACLE_PY = Path(os.environ.get("KVSHM_ORACLE_PY", "/tmp/kvshm-oracle/venv/bin/python"))


def add_json_argument(ap: argparse.ArgumentParser, name: str) -> None:
    """--json PATH, by default bench-results/NAME.json in the checkout."""
    ap.add_argument("--json", default=str(RESULTS / f"{name}.json"),
                    help=f"where to write the figures (default bench-results/{name}.json)")


def write_results(path: str | Path, doc: dict, *, indent: int = 2) -> Path:
    """Write a benchmark's figures as JSON (parents made, sets and tuples as
    lists) and say where, relative to the working directory when inside it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent, default=list))
    try:
        shown = path.resolve().relative_to(Path.cwd())
    except ValueError:
        shown = path
    print(f"wrote {shown}")
    return path


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
