"""Suite-wide hooks and fixtures: the /dev/shm leak guard and in-process
coordinators."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest

from kvshm.pool.segment import SHM_DIR
from kvshm.service.server import Coordinator

# The simulator's checks and raw_wire's are plain asserts: keep pytest's
# detailed messages for them, as when they lived in test_invariants.py and
# test_service_faults.py.
pytest.register_assert_rewrite("invariant_sim", "raw_wire")


# The /dev/shm leak guard: what appeared during the run and was left by it
# (helpers.leftovers).  Under pytest-xdist the controller checks, once every
# worker is done: a worker's own check would judge the segments of the tests
# that the other worker is still running (a coordinator it just killed looks
# leaked until its restart adopts the pool).
_BEFORE = pytest.StashKey[set]()


def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_sessionstart(session):
    if not _is_xdist_worker(session.config):
        from helpers import kvshm_segments
        session.config.stash[_BEFORE] = kvshm_segments()


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if _is_xdist_worker(config) or _BEFORE not in config.stash:
        return
    from helpers import leftovers
    leaked = leftovers(config.stash[_BEFORE])
    if leaked:
        tw = config.get_terminal_writer()
        tw.line()
        tw.line(f"segments left in {SHM_DIR}: {leaked}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def pool_name():
    """A fresh pool name; its segments (pool and arena) are removed after
    the test, whatever it left."""
    from kvshm.pool.segment import remove_segment, segment_info
    name = f"kvshm-test-{secrets.token_hex(5)}"
    yield name
    for n in (name, f"{name}.kv"):
        if segment_info(n) is not None:
            remove_segment(n, force=True)


@pytest.fixture
def sockdir():
    """A short private directory for sockets (tmp_path can exceed the 108-byte
    limit of a Unix socket path)."""
    d = Path(tempfile.mkdtemp(prefix="kvshm-t-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def coordinator_config():
    """The config `coordinator()` uses when given none (override per module)."""
    from helpers import make_config
    return make_config(num_blocks=64, max_num_seqs=32)


@pytest.fixture
async def coordinator(sockdir, coordinator_config):
    """Factory of started in-process coordinators; each is stopped at
    teardown, which must remove its segment and socket."""
    made: list[Coordinator] = []

    async def make(config=None, **kw) -> Coordinator:
        kw.setdefault("socket_path", sockdir / f"c{len(made)}.sock")
        coord = Coordinator(config or coordinator_config,
                            name=f"kvshm-test-{secrets.token_hex(5)}", **kw)
        made.append(coord)
        await coord.start()
        return coord

    yield make
    errors = []
    for coord in made:   # stop every one, even if another fails to
        try:
            await coord.stop()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    assert not errors, errors
    for coord in made:
        assert not os.path.exists(f"{SHM_DIR}/{coord.name}")
