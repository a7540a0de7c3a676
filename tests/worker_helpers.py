"""What the CPU-worker tests share: a small pool's config, token lists, and
`open_worker`, a fixture that opens engines (a client, its mapped arena and
an `Engine`) against in-process coordinators and closes them at teardown."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from helpers import make_config
from kvshm.core.check import check_segment
from kvshm.core.errors import SegmentError
from kvshm.core.specs import FullSpec, KVShape
from kvshm.service.client import connect
from kvshm.workers.engine import Engine
from kvshm.workers.engine_types import EngineOptions

BS = 16
SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_size=16, dtype="float32")
RUN_FOR = 60.0   # deadline for finite workloads: they end when their items are done


def kv_config(groups=(FullSpec(BS),), num_blocks: int = 256, kv: KVShape = SHAPE, **changes):
    changes.setdefault("max_model_len", 2048)
    return make_config(tuple(groups), num_blocks=num_blocks, hash_block_size=BS, kv=kv,
                       **changes)


def toks(n: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(32000) for _ in range(n))


class Worker:
    """A connected client, its mapped arena and an engine over them."""

    def __init__(self, client, arena, engine: Engine) -> None:
        self.client = client
        self.arena = arena
        self.engine = engine
        self.stats = engine.stats

    async def run(self, items, deadline: float | None = None, **kw):
        deadline = time.monotonic() + RUN_FOR if deadline is None else deadline
        return await asyncio.wait_for(self.engine.run(items, deadline, **kw), RUN_FOR + 30)

    async def close(self) -> None:
        if self.client is None:
            return
        self.engine = None        # its numpy views keep the arena mapped
        try:
            self.arena.close()
        except SegmentError:
            # Views still alive: only after a failure, whose traceback holds
            # the engine's frames.  The mapping goes with this process.
            pass
        finally:
            await self.client.close()
            self.client = None


@pytest.fixture
async def open_worker(coordinator):
    """open_worker(coord, **EngineOptions fields) -> Worker; closed at teardown
    (before the coordinators stop)."""
    opened: list[Worker] = []

    async def make(coord, turns=None, index=None, **opts) -> Worker:
        client = await connect(coord.socket_path)
        try:
            arena = client.attach_arena()
        except BaseException:
            await client.close()
            raise
        w = Worker(client, arena, Engine(client, arena, client.config, EngineOptions(**opts),
                                         turns=turns, worker=index))
        opened.append(w)
        return w

    yield make
    for w in opened:
        await w.close()


def assert_pool_whole(coord) -> None:
    """No request left and every block free (cached ones count as free)."""
    pool = coord.mgr.block_pool
    assert not coord.executor.requests and len(coord.mgr.table) == 0
    assert pool.num_free_blocks == coord.config.num_blocks - 1
    report = check_segment(coord.mgr.segment, pool)
    assert report.clean, report.problems


def assert_no_mismatch(*stats) -> None:
    for st in stats:
        assert st.hit_mismatches == 0 and st.decode_mismatches == 0, st.first_error
        assert st.first_error == ""
