"""A coordinator process that is stopped: SIGTERM under load or with a client
that stopped reading, SIGKILL (its segments removed or kept for adoption),
and `kvshm serve` refusing to start (or adopting a dead coordinator's pool).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import make_config, tokens
from kvshm.core.errors import KvshmError
from kvshm.ops import protocol as p
from kvshm.ops.errors import ConnectionLost
from kvshm.ops.protocol import encode_frame
from kvshm.pool.segment import SHM_DIR, remove_segment, segment_info
from kvshm.service.client import connect
from kvshm.service.process import CoordinatorProcess
from raw_wire import CONFIG, Raw


@pytest.fixture
def coordinator_config():
    return CONFIG


# -- SIGTERM of a coordinator process under load ---------------------------------------------------
def test_sigterm_mid_load_closes_clients_and_removes_the_segment():
    cfg = make_config(num_blocks=256, max_num_seqs=64)

    async def run(proc):
        started = asyncio.Event()
        counts = [0] * 4

        async def worker(i):
            async with await connect(proc.socket) as c:
                n = 0
                try:
                    while True:
                        rid = f"w{i}-{n}"
                        await c.add_request(rid, tokens(i * 100, i * 100 + 9 + n % 5))
                        await c.get_computed_blocks(rid)
                        await c.allocate_slots(rid, 9 + n % 5, use_computed_blocks=False)
                        if n >= 5:                  # keep 5 requests, free the rest
                            await c.free(rid)
                        n += 1
                        counts[i] = n
                        if min(counts) >= 10:
                            started.set()
                except ConnectionLost as e:
                    return e

        tasks = [asyncio.create_task(worker(i)) for i in range(4)]
        await asyncio.wait_for(started.wait(), 20)
        proc.proc.send_signal(signal.SIGTERM)
        errors = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert all(isinstance(e, ConnectionLost) for e in errors), errors
        assert all("shut down" in str(e) for e in errors), errors
        with pytest.raises(ConnectionLost):
            await connect(proc.socket, timeout=2)

    with CoordinatorProcess(cfg) as proc:
        name, sock = proc.name, proc.socket
        assert os.path.exists(f"{SHM_DIR}/{name}")
        asyncio.run(run(proc))
        assert proc.proc.wait(10) == 0
        err = proc.stderr
        assert proc.stop() == 0
    assert not os.path.exists(f"{SHM_DIR}/{name}"), "segment left behind"
    assert not sock.exists()
    assert "Traceback" not in err, err


def test_a_coordinator_that_must_be_killed_leaves_no_segments():
    """CoordinatorProcess.stop(): a coordinator that does not stop within the
    timeout (here: stopped with SIGSTOP) is SIGKILLed and its pool and arena
    are removed for it; one that was already dead keeps them for adoption."""
    from kvshm.config import preset_config
    cfg = preset_config("tiny", num_blocks=64)
    with CoordinatorProcess(cfg) as proc:
        name = proc.name
        assert os.path.exists(f"{SHM_DIR}/{name}") and os.path.exists(f"{SHM_DIR}/{name}.kv")
        proc.proc.send_signal(signal.SIGSTOP)
        assert proc.stop(timeout=0.5) == -signal.SIGKILL
    assert not os.path.exists(f"{SHM_DIR}/{name}")
    assert not os.path.exists(f"{SHM_DIR}/{name}.kv")
    with CoordinatorProcess(cfg) as dead:
        dead.kill()
        assert dead.stop() == -signal.SIGKILL
    assert os.path.exists(f"{SHM_DIR}/{dead.name}")     # adoptable
    from kvshm.pool.lifecycle import remove_pool
    remove_pool(dead.name)


def test_sigterm_with_a_client_that_stopped_reading():
    cfg = make_config(num_blocks=256)

    async def run(proc):
        raw = await Raw.open(proc.socket)
        await raw.hello()
        raw.w.transport.pause_reading()
        raw.send(encode_frame(p.GetStats(100)) * 20_000)
        await asyncio.sleep(0.3)
        proc.proc.send_signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        rc = await loop.run_in_executor(None, proc.proc.wait, 10)
        await raw.close()
        return rc

    with CoordinatorProcess(cfg) as proc:
        name = proc.name
        assert asyncio.run(run(proc)) == 0
    assert not os.path.exists(f"{SHM_DIR}/{name}")


# -- `kvshm serve` refusing to start ----------------------------------------------------------------
def _serve(config_path: Path, name: str, sock: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvshm", "serve", "--config", str(config_path), "--name", name,
         "--socket", str(sock), "--quiet"], capture_output=True, text=True, timeout=30)


def test_serve_refuses_a_name_owned_by_a_live_coordinator(tmp_path, sockdir):
    cfg = make_config()
    cfg_path = tmp_path / "pool.json"
    cfg_path.write_bytes(cfg.to_json())
    with CoordinatorProcess(cfg) as live:
        for sock in (sockdir / "other.sock", live.socket):   # even on the live one's socket
            res = _serve(cfg_path, live.name, sock)
            assert res.returncode == 2, res
            assert "ready" not in res.stdout
            assert f"pool {live.name!r} is served by live process {live.proc.pid}" in res.stderr
        assert not (sockdir / "other.sock").exists()

        async def still_serving():
            async with await connect(live.socket) as c:
                return (await c.stats()).num_blocks
        assert asyncio.run(still_serving()) == 10
        assert segment_info(live.name)["pid"] == live.proc.pid


async def test_a_live_coordinators_socket_is_not_taken_over(coordinator, sockdir):
    """BUG: start() unlinks whatever socket is at socket_path ("a stale
    socket: the pool segment name is the lock"), but two pools of different
    names can be given the same --socket: the second silently takes the
    socket over and the first, still running, becomes unreachable (and
    stays so after the second stops and unlinks it)."""
    shared = sockdir / "shared.sock"
    first = await coordinator(socket_path=shared)
    with pytest.raises(KvshmError):
        await coordinator(make_config(num_blocks=20), socket_path=shared)
    async with await connect(shared) as c:
        assert c.pool_segment == first.name


def test_serve_adopts_the_pool_of_a_dead_coordinator(tmp_path):
    """`kvshm serve` with the same name takes over a SIGKILLed coordinator's
    pool instead of refusing; its clean shutdown then removes it."""
    cfg = make_config()
    name = f"kvshm-test-{secrets.token_hex(5)}"
    try:
        with CoordinatorProcess(cfg, name=name) as dead:
            dead.proc.kill()
            dead.proc.wait()
        info = segment_info(name)
        assert info is not None and not info["alive"]
        with CoordinatorProcess(cfg, name=name) as again:
            info = segment_info(name)
            assert info["alive"] and info["pid"] == again.proc.pid
            assert "adopted the pool" in again.stderr
        assert again.proc.returncode == 0
        assert segment_info(name) is None
    finally:
        if segment_info(name) is not None:
            remove_segment(name, force=True)


def test_serve_refuses_a_socket_path_that_is_a_regular_file(tmp_path, sockdir):
    """BUG: `kvshm serve --socket FILE` says FILE "exists and is not a
    socket", exits 2 ... and deletes FILE (serve() runs Coordinator.stop(),
    which unlinks socket_path unconditionally)."""
    cfg_path = tmp_path / "pool.json"
    cfg_path.write_bytes(make_config().to_json())
    victim = sockdir / "notes.txt"
    victim.write_text("precious")
    name = f"kvshm-test-{secrets.token_hex(5)}"
    res = _serve(cfg_path, name, victim)
    assert res.returncode == 2, res
    assert "exists and is not a socket" in res.stderr
    assert segment_info(name) is None
    assert victim.exists() and victim.read_text() == "precious", "kvshm serve deleted it"
