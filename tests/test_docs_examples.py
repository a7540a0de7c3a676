"""Every fenced code block of README.md and docs/*.md runs, so the examples
cannot rot.  New blocks are picked up by themselves.

Conventions (README.md's "Tests" section says them in short):

- The blocks of one file run in order, in one fresh temporary directory
  that looks like a checkout: the repository's top-level entries are
  symlinked there, `.venv` is the environment running the tests (and
  `.venv-vllm` the repository's, if it has one).  `.venv/bin` comes first
  on PATH and the repository first on PYTHONPATH, so `kvshm`, `python` and
  `import kvshm` are this checkout's.  What a block writes is there for the
  blocks after it.
- A ```sh (or ```bash) block runs with `bash -e`; a ```python block runs as
  a script (`python file.py`, in that directory).  A block in any other
  language, or none, must be marked.
- A marker is an HTML comment on the nearest non-blank line above the
  opening fence (a rendered page does not show it):

      <!-- example: file NAME -->   the block is the file NAME (a relative
                                    path): written for the blocks after it,
                                    not run; a .toml, .json or .jsonl file
                                    must parse
      <!-- example: stdout -->      the block is what the block before it
                                    printed: compared with that, line by line
                                    (unless that one is slow and did not run)
      <!-- example: output -->      output shown but neither run nor
                                    compared (figures that vary)
      <!-- example: slow -->        a benchmark or a minutes-long run: runs
                                    only with KVSHM_SLOW_EXAMPLES=1
      <!-- example: covered: tests/test_x.py::test_name REASON -->
                                    another test runs it (that test must
                                    exist), e.g. blocks that need the vLLM
                                    environment
      <!-- example: skip: REASON -->  not run; the reason is required.
                                    Rare: prefer making the block runnable

- A block must leave no process behind (each runs in a process group of
  its own, which must be empty once it is done) and no kvshm segment in
  /dev/shm, and gets BLOCK_TIMEOUT seconds (a slow one SLOW_TIMEOUT).
  Without the slow blocks the whole file takes seconds; with them
  (KVSHM_SLOW_EXAMPLES=1) tens of minutes, and some need what their
  documents say they need (.venv-vllm, ../shared/oracle).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from helpers import kvshm_segments, leftovers
from kvshm.pool.segment import remove_segment

pytestmark = pytest.mark.serial   # each block's leftovers are read off /dev/shm

REPO = Path(__file__).resolve().parent.parent
SLOW = os.environ.get("KVSHM_SLOW_EXAMPLES") == "1"
BLOCK_TIMEOUT = 180
SLOW_TIMEOUT = 3600
LANGUAGES = {"sh": "bash", "bash": "bash", "python": "python"}   # what runs unmarked
KINDS = ("file", "stdout", "output", "slow", "covered", "skip")
FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w+-]*)")   # indent, fence, language (info string)
MARKER = re.compile(r"^<!--\s*example:(.*?)-->$")
LOOKS_LIKE_MARKER = re.compile(r"^<!--\s*example\b")


def documents(repo: Path = REPO) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


@dataclass
class Block:
    path: Path
    line: int           # of the opening fence, from 1
    lang: str
    text: str
    kind: str = "run"   # "run" or one of KINDS
    arg: str = ""       # the file name, the covering test, the reason

    def where(self) -> str:
        try:
            return f"{self.path.relative_to(REPO)}:{self.line}"
        except ValueError:
            return f"{self.path}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.kind == "run" or (self.kind == "slow" and SLOW)


def parse(path: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of a markdown file, with their markers, and the
    problems found (unclosed fences, bad or missing markers)."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    used: set[int] = set()      # lines of markers that belong to a block
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence)
                                      and not lines[j].strip().strip("`")):
            j += 1
        if j == len(lines):
            problems.append(f"{path}:{i + 1}: the fence opened here is never closed")
            break
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip()
                for ln in lines[i + 1:j]]
        block = Block(path, i + 1, lang.lower(), "".join(ln + "\n" for ln in body))
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER.match(lines[k].strip()) if k >= 0 else None
        if marker:
            used.add(k)
        problem = _mark(block, marker.group(1).strip() if marker else None, blocks)
        if problem:
            problems.append(f"{block.where()}: {problem}")
        blocks.append(block)
        i = j + 1
    for n, ln in enumerate(lines):
        if LOOKS_LIKE_MARKER.match(ln.strip()) and n not in used:
            problems.append(f"{path}:{n + 1}: a marker must be <!-- example: KIND ... --> on "
                            "the nearest non-blank line above a block's opening fence")
    return blocks, problems


def _mark(block: Block, marker: str | None, before: list[Block]) -> str | None:
    """Set the block's kind from its marker; a problem with it, or None."""
    if marker is None:
        if block.lang not in LANGUAGES:
            return (f"a ```{block.lang} block cannot run as it is: mark it (file NAME, "
                    "stdout, output, covered: TEST REASON, skip: REASON)")
        return None
    first = marker.split()[0].rstrip(":") if marker else ""
    kind, _, arg = marker.partition(":" if first in ("covered", "skip") else " ")
    kind, arg = kind.strip(), arg.strip()
    if kind not in KINDS:
        return f"unknown example marker {marker!r} (one of {', '.join(KINDS)})"
    block.kind, block.arg = kind, arg
    if kind == "file":
        name = Path(arg)
        if not arg or name.is_absolute() or ".." in name.parts:
            return f"`file` needs a relative file name, got {arg!r}"
        return _check_file(block)
    if kind in ("stdout", "output", "slow") and arg:
        return f"`{kind}` takes no argument, got {arg!r}"
    if kind == "slow" and block.lang not in LANGUAGES:
        return f"a slow block must be one that runs (sh, python), not ```{block.lang}"
    if kind == "stdout" and not (before and before[-1].kind in ("run", "slow")):
        return "a `stdout` block must come right after the block that prints it"
    if kind == "skip" and not arg:
        return "`skip:` needs a reason"
    if kind == "covered":
        return _check_covered(arg)
    return None


def _check_file(block: Block) -> str | None:
    suffix = Path(block.arg).suffix
    try:
        if suffix == ".toml":
            tomllib.loads(block.text)
        elif suffix == ".json":
            json.loads(block.text)
        elif suffix == ".jsonl":
            for ln in block.text.splitlines():
                if ln.strip():
                    json.loads(ln)
    except ValueError as e:
        return f"{block.arg} does not parse: {e}"
    return None


def _check_covered(arg: str) -> str | None:
    target, _, reason = arg.partition(" ")
    file, _, name = target.partition("::")
    if not reason.strip():
        return "`covered:` needs the covering test and a reason"
    path = REPO / file
    if not path.is_file():
        return f"the covering test file {file} does not exist"
    if name and not re.search(rf"^def {re.escape(name)}\(", path.read_text(), re.M):
        return f"{file} has no test {name}"
    return None


class ExampleFailed(Exception):
    pass


def _venv() -> Path:
    """The virtual environment running the tests (blocks say `.venv/bin/...`)."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix)
    if (REPO / ".venv" / "bin" / "python").exists():
        return REPO / ".venv"
    raise ExampleFailed("run the tests from the project's virtual environment "
                        "(./scripts/test.sh makes .venv)")


def _group_members(pgid: int) -> list[str]:
    out = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(f"{proc.pid}: {' '.join(proc.info['cmdline'] or [])}")
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def _wait_empty(pgid: int, timeout: float) -> list[str]:
    """The members of process group `pgid` still there after `timeout` s."""
    deadline = time.monotonic() + timeout
    while (left := _group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _tail(path: Path, n: int = 3000) -> str:
    text = path.read_text(errors="replace")
    return text if len(text) <= n else "..." + text[-n:]


class Runner:
    """Runs the blocks of one file in order in one fresh directory."""

    def __init__(self, repo: Path = REPO, *, grace: float = 3.0,
                 timeout: float = BLOCK_TIMEOUT) -> None:
        self.grace = grace          # for a block's processes to end once it is done
        self.timeout = timeout      # a slow block's is SLOW_TIMEOUT
        self.work = Path(tempfile.mkdtemp(prefix="kvshm-doc-"))   # short: socket paths
        for entry in repo.iterdir():
            if not entry.name.startswith("."):
                (self.work / entry.name).symlink_to(entry)
        (self.work / ".venv").symlink_to(_venv())
        if (repo / ".venv-vllm").exists():
            (self.work / ".venv-vllm").symlink_to(repo / ".venv-vllm")
        env = {k: v for k, v in os.environ.items() if k not in ("KVSHM_POOL", "PYTHONHASHSEED")}
        env["PATH"] = f"{self.work / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(repo), env.get("PYTHONPATH"))))
        self.env = env
        self.count = 0
        self.stdout: str | None = None    # of the block before, if it ran
        self.timings: list[tuple[str, float]] = []

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def do(self, block: Block) -> None:
        """What the block's kind says: run it, write it, compare it."""
        if block.kind == "stdout":
            if self.stdout is not None:   # (None: a slow block that did not run)
                self._compare(block)
            return
        self.stdout = None
        if block.kind == "file":
            if (self.work / Path(block.arg).parts[0]).is_symlink():
                raise ExampleFailed(f"{block.where()}: {block.arg} would be written into "
                                    "the repository (through its symlink)")
            path = self.work / block.arg
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block.text)
        elif block.runs:
            self._run(block, SLOW_TIMEOUT if block.kind == "slow" else self.timeout)

    def _compare(self, block: Block) -> None:
        assert self.stdout is not None
        want = [ln.rstrip() for ln in block.text.splitlines()]
        got = [ln.rstrip() for ln in self.stdout.rstrip("\n").splitlines()]
        if want != got:
            diff = "\n".join(difflib.unified_diff(want, got, "the document", "printed",
                                                  lineterm=""))
            raise ExampleFailed(f"{block.where()}: the block before printed something else:\n"
                                f"{diff}")

    def _run(self, block: Block, timeout: float) -> None:
        self.count += 1
        lang = LANGUAGES[block.lang]
        script = self.work / f".example-{self.count}.{'py' if lang == 'python' else 'sh'}"
        script.write_text(block.text)
        argv = (["bash", "-e", script.name] if lang == "bash"
                else [str(self.work / ".venv" / "bin" / "python"), script.name])
        out, err = script.with_suffix(".out"), script.with_suffix(".err")
        segments = kvshm_segments()
        t0 = time.monotonic()
        with open(out, "w") as fo, open(err, "w") as fe:
            proc = subprocess.Popen(argv, cwd=self.work, env=self.env, stdin=subprocess.DEVNULL,
                                    stdout=fo, stderr=fe, start_new_session=True)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                code = None
        self.timings.append((block.where(), time.monotonic() - t0))
        left = self._reap(proc.pid, self.grace if code is not None else 0)
        proc.wait()
        stale = leftovers(segments)
        for name in stale:
            remove_segment(name, force=True)
        self.stdout = out.read_text(errors="replace")
        problems = []
        if code is None:
            problems.append(f"did not finish within {timeout:g}s (killed: {'; '.join(left)})")
        else:
            if code != 0:
                problems.append(f"exited with status {code}")
            if left:
                problems.append("left processes running (killed now): " + "; ".join(left))
        if stale:
            problems.append(f"left segments in /dev/shm (removed now): {stale}")
        if problems:
            raise ExampleFailed(f"{block.where()}: the ```{block.lang} block "
                                f"{' and '.join(problems)}\n--- stdout:\n{_tail(out)}"
                                f"\n--- stderr:\n{_tail(err)}")

    @staticmethod
    def _reap(pgid: int, grace: float) -> list[str]:
        """The processes the block left in its group (given `grace` seconds
        to end), killed: SIGTERM, then SIGKILL after 2 s."""
        left = _wait_empty(pgid, grace)
        if left:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
                if not _wait_empty(pgid, 2.0):
                    break
        return left


def run_document(path: Path, repo: Path = REPO) -> Runner:
    """Run every block of `path` as its marker says; raises ExampleFailed."""
    blocks, problems = parse(path)
    if problems:
        raise ExampleFailed("\n".join(problems))
    with Runner(repo) as runner:
        for block in blocks:
            runner.do(block)
    return runner


# -- the documents --------------------------------------------------------------------------
def test_every_block_runs_or_is_marked():
    problems = []
    for path in documents():
        problems += parse(path)[1]
    assert not problems, "\n".join(problems)


def _doc_id(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("path", [d for d in documents() if parse(d)[0]], ids=_doc_id)
def test_the_examples_run(path):
    blocks, problems = parse(path)
    assert not problems, "\n".join(problems)
    if not any(b.runs for b in blocks):
        kinds = sorted({b.kind for b in blocks})
        pytest.skip(f"no block of {_doc_id(path)} runs here ({', '.join(kinds)}"
                    + ("; KVSHM_SLOW_EXAMPLES=1 runs the slow ones" if "slow" in kinds else "")
                    + ")")
    try:
        runner = run_document(path)
    except ExampleFailed as e:
        pytest.fail(str(e), pytrace=False)
    for where, seconds in runner.timings:
        print(f"{where}: {seconds:.1f}s")


# -- the runner itself -------------------------------------------------------------------------
def _doc(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "doc.md"
    path.write_text(text)
    return path


def test_blocks_share_a_directory_in_order_and_stdout_is_compared(tmp_path):
    path = _doc(tmp_path, """
<!-- example: file data/greeting.txt -->
```text
hello
```

```sh
cat data/greeting.txt
echo two > two.txt
```
<!-- example: stdout -->
```
hello
```
```python
import os, kvshm
print(open("two.txt").read().strip(), __name__, os.path.realpath(kvshm.__file__).startswith(%r))
```

<!-- example: stdout -->
```text
two __main__ True
```
<!-- example: output -->
```text
anything at all
```
<!-- example: skip: not meant to run -->
```sh
exit 1
```
""" % str(REPO))
    runner = run_document(path)
    assert [w.rsplit(":", 1)[1] for w, _ in runner.timings] == ["7", "15"]
    assert not runner.work.exists()


def test_a_file_block_cannot_write_into_the_repository(tmp_path):
    path = _doc(tmp_path, "<!-- example: file docs/sub/new.md -->\n```\nx\n```\n")
    with pytest.raises(ExampleFailed, match="docs/sub/new.md would be written into the "
                       "repository"):
        run_document(path)
    assert not (REPO / "docs" / "sub").exists()


def test_a_failing_block_says_where_and_what_it_printed(tmp_path):
    path = _doc(tmp_path, "text\n\n```sh\necho started\nfalse\necho not reached\n```\n")
    with pytest.raises(ExampleFailed, match=r"doc.md:3: the ```sh block exited with status 1"
                       r"\n--- stdout:\nstarted\n\n--- stderr:\n$"):
        run_document(path)


def test_printing_something_else_than_the_document_says_fails(tmp_path):
    path = _doc(tmp_path, "```python\nprint(6 * 7)\n```\n<!-- example: stdout -->\n```\n41\n```\n")
    with pytest.raises(ExampleFailed, match=r"doc.md:5: the block before printed something "
                       r"else:\n(.|\n)*-41\n\+42"):
        run_document(path)


def test_a_block_that_leaves_a_process_behind_fails_and_the_process_is_killed(tmp_path):
    path = _doc(tmp_path, "```sh\nsleep 300 &\necho $! > pid\n```\n")
    runner = Runner(grace=0.2)
    try:
        block = parse(path)[0][0]
        with pytest.raises(ExampleFailed, match="left processes running .*sleep 300"):
            runner.do(block)
        pid = int((runner.work / "pid").read_text())
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        runner.close()


def test_a_block_that_does_not_finish_in_time_is_killed(tmp_path):
    path = _doc(tmp_path, "```sh\necho $$ > pid\nsleep 300\n```\n")
    runner = Runner(timeout=0.5, grace=0.2)
    try:
        with pytest.raises(ExampleFailed, match=r"did not finish within 0.5s \(killed: "
                           r".*sleep 300"):
            runner.do(parse(path)[0][0])
        assert not psutil.pid_exists(int((runner.work / "pid").read_text()))
    finally:
        runner.close()


def test_bad_and_missing_markers_are_problems(tmp_path):
    path = _doc(tmp_path, """
```toml
a = 1
```
<!-- example: sometimes -->
```sh
true
```
<!-- example: skip -->
```sh
true
```
<!-- example: file ../outside.txt -->
```text
x
```
<!-- example: file pool.toml -->
```toml
[[groups]
```
<!-- example: covered: tests/test_vllm.py::no_such_test needs vLLM -->
```sh
true
```
<!-- example: stdout -->
```
x
```
<!-- example skip: no colon -->
```sh title="spaces"
true
```
<!-- example: output -->

Not a block.
""")
    blocks, problems = parse(path)
    assert len(blocks) == 8
    assert blocks[-1].lang == "sh" and blocks[-1].text == "true\n"
    assert [p.split(": ", 1)[0].rsplit(":", 1)[1] for p in problems] == [
        "2", "6", "10", "14", "18", "22", "26", "29", "33"]
    for problem, words in zip(problems, ("```toml block cannot run", "unknown example marker",
                                         "needs a reason", "relative file name",
                                         "pool.toml does not parse", "has no test no_such_test",
                                         "right after the block", "a marker must be",
                                         "a marker must be")):
        assert words in problem, problem


def test_slow_blocks_run_only_when_asked(tmp_path, monkeypatch):
    path = _doc(tmp_path, "<!-- example: slow -->\n```sh\necho slow\n```\n")
    [block] = parse(path)[0]
    assert block.kind == "slow"
    monkeypatch.setattr(sys.modules[__name__], "SLOW", False)
    assert not block.runs
    monkeypatch.setattr(sys.modules[__name__], "SLOW", True)
    assert block.runs
