"""What `pip install .` puts into site-packages: kvshm only (the repository's
workers/ folder becomes kvshm.workers), and a `kvshm run` that works from
that install alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _package_dirs() -> dict[str, Path]:
    """Every package in the source tree, named as installed."""
    mapping = PYPROJECT["tool"]["setuptools"]["package-dir"]
    roots = {"kvshm": REPO / "kvshm", **{name: REPO / d for name, d in mapping.items()}}
    found = {}
    for root_name, root in roots.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            found[".".join((root_name, *rel.parts))] = init.parent
    return found


def test_every_package_in_the_tree_is_installed():
    assert sorted(PYPROJECT["tool"]["setuptools"]["packages"]) == sorted(_package_dirs())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """kvshm's wheel, built offline from a copy of the sources."""
    pytest.importorskip("setuptools", minversion="70.1")   # bdist_wheel without `wheel`
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for item in ("pyproject.toml", "README.md", "kvshm", "workers"):
        if (REPO / item).is_dir():
            shutil.copytree(REPO / item, src / item,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / item, src / item)
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from setuptools import build_meta; "
         "print(build_meta.build_wheel(sys.argv[1]))", str(tmp)],
        cwd=src, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return tmp / out.stdout.strip().splitlines()[-1]


def test_the_wheel_has_no_top_level_workers_module(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"kvshm"}
    assert "kvshm/workers/engine.py" in names and "kvshm/workers/__main__.py" in names
    info = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(info).decode().split() == ["kvshm"]


def test_kvshm_run_works_from_the_installed_wheel(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--disable-pip-version-check", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=120)
    assert not (site / "workers").exists()
    # Outside the repository and with the install first on the path, nothing
    # can come from the source tree.
    env = {**os.environ, "PYTHONPATH": str(site)}
    probe = subprocess.run([sys.executable, "-c", "import kvshm.workers, importlib.util; "
                            "print(kvshm.workers.__file__, importlib.util.find_spec('workers'))"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.split() == [str(site / "kvshm/workers/__init__.py"), "None"]
    # A fixed amount of work (a 2 s run on a loaded CI host finished none).
    run = subprocess.run([sys.executable, "-m", "kvshm", "run", "--requests", "4",
                          "--duration", "120", "--grace", "10", "--kv-memory", "64M",
                          "--workers", "2", "--quiet", "--no-pin"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "result: OK" in run.stdout
