"""`kvshm top`: one frame (`--once`), and the live view driven in a real
terminal (tmux) against a coordinator under load."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time

import pytest

from helpers import make_config, tokens
from kvshm.service.process import CoordinatorProcess
from kvshm.service.sync_client import connect_sync

pytestmark = pytest.mark.serial   # the live view is read at timed refreshes

CFG = make_config(num_blocks=64, max_num_seqs=16)
KVSHM = [sys.executable, "-m", "kvshm"]


class Load:
    """Two sessions (tenants team-a and the default, nodes 0 and 1) running
    lookups, allocations and frees until stopped."""

    def __init__(self, proc) -> None:
        self.proc = proc
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=a)
                        for a in (("team-a", 0), ("", 1))]

    def _run(self, tenant: str, node: int) -> None:
        try:
            with connect_sync(self.proc.socket, hash_algorithm=CFG.hash_algorithm,
                              hash_seed=CFG.hash_seed, tenant=tenant, node=node) as c:
                c.add_request("held", tokens(500, 512))
                c.allocate_slots("held", 12)
                i = 0
                while not self.stop.is_set():
                    rid = f"r{i}"
                    c.add_request(rid, tokens(0, 16) + [i % 5] * 8)
                    c.admit(rid, 24)          # lookup + allocation, atomically
                    c.free(rid)
                    i += 1
        except BaseException as e:  # noqa: BLE001
            self.errors.append(e)

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)
        assert not self.errors, self.errors


def check_frame(text: str, name: str) -> None:
    assert f"kvshm top: pool {name}" in text and "alive" in text
    assert "usage" in text and "hit rate" in text and "evictions/s" in text
    rows = {ln.split()[0]: ln.split() for ln in text.splitlines() if ln.strip()}
    for op in ("add", "admit", "free"):
        assert op in rows and int(rows[op][1].replace(",", "")) > 0, text
    assert "team-a" in text and "(default)" in text      # the sessions, by tenant


def test_once_prints_one_frame_of_a_pool_under_load(pool_name):
    with CoordinatorProcess(CFG, name=pool_name) as proc, Load(proc):
        time.sleep(0.3)
        out = subprocess.run([*KVSHM, "top", pool_name, "--once", "--interval", "0.5"],
                             capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    check_frame(out.stdout, pool_name)
    assert "\x1b" not in out.stdout                       # no escape codes in a pipe


def test_once_refuses_a_missing_pool_and_a_bad_interval():
    out = subprocess.run([*KVSHM, "top", "kvshm-no-such-pool", "--once"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 2 and "kvshm-no-such-pool" in out.stderr
    out = subprocess.run([*KVSHM, "top", "--interval", "0"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2 and "--interval must be > 0" in out.stderr


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
@pytest.mark.parametrize("width", [100, 44])
def test_live_view_in_a_terminal_refreshes_and_q_quits(pool_name, width, tmp_path):
    session = f"kvshm-top-{pool_name}-{width}"
    done = tmp_path / "exit"
    # (pytest's COLUMNS would override the pane's width)
    cmd = (f"env -u COLUMNS -u LINES {sys.executable} -m kvshm top {pool_name} "
           f"--interval 0.5; echo $? > {done}; sleep 30")

    def pane() -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", session],
                              capture_output=True, text=True).stdout

    with CoordinatorProcess(CFG, name=pool_name) as proc, Load(proc):
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", str(width),
                        "-y", "30", cmd], check=True)
        try:
            deadline = time.monotonic() + 20
            while "(q quits)" not in pane() or "admit" not in pane():
                assert time.monotonic() < deadline, pane()
                time.sleep(0.2)
            time.sleep(1.2)                                # a later frame, not the first
            frame = pane()
            lines = frame.splitlines()
            assert all(len(ln) <= width for ln in lines)
            if width >= 60:
                check_frame(frame, pool_name)
                assert "p99 us" in frame
            else:
                assert "p99 us" not in frame and "admit" in frame
            subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)
            deadline = time.monotonic() + 10
            while not done.exists():
                assert time.monotonic() < deadline, pane()
                time.sleep(0.1)
            assert done.read_text().strip() == "0"
        finally:
            subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
