"""Block readiness in the CPU worker: a same-step hit is computed after its
writer, and a request whose prefix another session is computing waits for
it (holding nothing), computes it itself when the writer dies or at its
deadline, and never waits with `wait_in_flight=0`."""

from __future__ import annotations

import asyncio
import time

from helpers import until
from kvshm.service.client import connect
from kvshm.workload.items import Item
from worker_helpers import (BS, assert_no_mismatch, assert_pool_whole, kv_config,
                            open_worker, toks)

__all__ = ["open_worker"]   # the fixture, found by pytest in this module


async def test_a_same_step_hit_is_computed_after_its_writer(coordinator, open_worker):
    """Two requests with one prefix admitted in one step: the second hits
    the first's blocks while they are being computed, as in vLLM, and is
    computed after it (its checked hits hold the right K/V)."""
    coord = await coordinator(kv_config())
    prefix = toks(5 * BS, seed=11)
    a = await open_worker(coord, token_budget=4096)
    items = [Item(f"r{i}", prefix + toks(7, seed=20 + i), toks(3, seed=30 + i), f"r{i}", 0)
             for i in range(2)]
    await a.run(items)
    assert_no_mismatch(a.stats)
    assert a.stats.finished == 2 and a.stats.steps <= 5       # admitted together
    assert a.stats.hit_tokens == 5 * BS and a.stats.hit_blocks_checked == 5
    assert_pool_whole(coord)


async def _writer_holding_pending_blocks(coord, prompt):
    """A session that allocated (so cached, pending) `prompt` and never
    reports it computed."""
    w = await connect(coord.socket_path)
    await w.add_request("writer", list(prompt))
    await w.allocate_slots("writer", len(prompt))
    return w


async def test_a_waiter_whose_writer_dies_computes_the_prefix(coordinator, open_worker):
    coord = await coordinator(kv_config())
    prefix = toks(12 * BS, seed=12)
    writer = await _writer_holding_pending_blocks(coord, prefix + (1,))
    b = await open_worker(coord, in_flight_deadline=30.0)
    item = Item("b0", prefix + toks(9, seed=13), toks(2, seed=14), "b0", 0)
    run = asyncio.create_task(b.run([item]))
    for _ in range(500):                      # it waits, holding nothing
        if b.stats.in_flight_waits:
            break
        await asyncio.sleep(0.01)
    assert b.stats.in_flight_waits == 1 and not run.done() and b.stats.finished == 0
    t0 = time.monotonic()
    await writer.close()                      # the writer dies: its blocks are uncached
    await run
    assert time.monotonic() - t0 < 5.0        # long before its 30 s deadline
    assert b.stats.finished == 1 and b.stats.hit_tokens == 0
    assert b.stats.in_flight_timeouts == 0
    assert_no_mismatch(b.stats)
    assert_pool_whole(coord)


async def test_a_waiter_computes_the_prefix_itself_at_its_deadline(coordinator, open_worker):
    coord = await coordinator(kv_config())
    prefix = toks(12 * BS, seed=15)
    writer = await _writer_holding_pending_blocks(coord, prefix + (1,))   # stalls, alive
    b = await open_worker(coord, in_flight_deadline=0.3)
    t0 = time.monotonic()
    await b.run([Item("b0", prefix + toks(9, seed=16), toks(2, seed=17), "b0", 0)])
    assert 0.3 <= time.monotonic() - t0 < 10.0
    assert (b.stats.in_flight_waits, b.stats.in_flight_timeouts) == (1, 1)
    assert b.stats.finished == 1 and b.stats.hit_tokens == 0   # never hit the pending blocks
    assert_no_mismatch(b.stats)
    await writer.close()
    await until(lambda: not coord.executor.requests)
    assert_pool_whole(coord)


async def test_wait_in_flight_zero_never_waits(coordinator, open_worker):
    coord = await coordinator(kv_config())
    prefix = toks(12 * BS, seed=18)
    writer = await _writer_holding_pending_blocks(coord, prefix + (1,))
    b = await open_worker(coord, wait_in_flight=0)
    await b.run([Item("b0", prefix + toks(9, seed=19), toks(2, seed=20), "b0", 0)])
    assert b.stats.in_flight_waits == 0 and b.stats.finished == 1
    await writer.close()
    await until(lambda: not coord.executor.requests)
    assert_pool_whole(coord)
