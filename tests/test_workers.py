"""The CPU worker's engine in process, against in-process coordinators:
concurrent engines sharing a pool, detection of corrupted K/V, preemption,
sliding-window groups, half-precision arenas, refused pools, deadlines and
the writer stamps of the arena.  Waits for prefixes in flight:
test_worker_waits.py."""

from __future__ import annotations

import asyncio
import itertools
import re
import time

import numpy as np
import pytest

from kvshm.core.specs import FullSpec, KVShape, MambaSpec, SlidingWindowSpec
from kvshm.workers.engine import Engine, UnsupportedModel, check_supported
from kvshm.workers.engine_types import EngineOptions
from kvshm.workers.turns import assign
from kvshm.workload.items import Item, SyntheticSpec, synthetic
from worker_helpers import (BS, RUN_FOR, assert_no_mismatch, assert_pool_whole, kv_config,
                            open_worker, toks)

__all__ = ["open_worker"]   # the fixture, found by pytest in this module

# A small chat workload: shared system prompts, multi-turn conversations.
SMALL_SPEC = SyntheticSpec(seed=3, num_system_prompts=2, system_len=(48, 96),
                           share_system=1.0, user_len=(4, 48), user_median=16.0,
                           output_len=(2, 24), output_median=8.0, mean_turns=3.0,
                           max_turns=4, max_len=2048, open_conversations=4)


async def cached_prefix_blocks(client, tokens, rid: str) -> list[int]:
    """Block ids (group 0) the pool would serve as prefix-cache hits for
    `tokens`, looked up by a throwaway request that allocates nothing."""
    await client.add_request(rid, list(tokens))
    try:
        blocks, n = await client.get_computed_blocks(rid)
    finally:
        await client.free(rid)
    return list(blocks[0][:n // BS])


# -- sharing -------------------------------------------------------------------------------------
async def test_two_engines_share_one_pool_without_mismatches(coordinator, open_worker):
    coord = await coordinator(kv_config(num_blocks=512))
    items = list(itertools.islice(synthetic(SMALL_SPEC), 40))
    shares = [list(assign(items, i, 2)) for i in range(2)]
    # One request at a time per engine: each share is served to its end
    # (see test_a_finite_workload_is_served_to_the_end for why that matters).
    a = await open_worker(coord, check_decode=1.0, max_running=1)
    b = await open_worker(coord, check_decode=1.0, max_running=1)
    assert a.client.session_id != b.client.session_id
    await asyncio.gather(a.run(shares[0]), b.run(shares[1]))
    assert_no_mismatch(a.stats, b.stats)
    for w, share in ((a, shares[0]), (b, shares[1])):
        assert w.stats.finished == len(share) and w.stats.aborted == 0
        assert w.stats.prompt_tokens == sum(len(it.prompt) for it in share)
        assert w.stats.generated_tokens == sum(len(it.output) for it in share)
        assert w.stats.cross_hit_tokens <= w.stats.hit_tokens <= w.stats.prompt_tokens
    assert a.stats.hit_blocks_checked + b.stats.hit_blocks_checked > 0
    assert a.stats.decode_checks + b.stats.decode_checks > 0
    assert a.stats.cross_hit_tokens + b.stats.cross_hit_tokens > 0
    assert_pool_whole(coord)   # checked while both sessions still live


def history_blocks(items) -> int:
    """Full blocks of the history every follow-up turn repeats: its previous
    turn's prompt and output but the last output token (sampled, never run)."""
    last: dict[str, Item] = {}
    total = 0
    for it in items:
        prev = last.get(it.conversation)
        if prev is not None:
            total += (len(prev.prompt) + len(prev.output) - 1) // BS
        last[it.conversation] = it
    return total


@pytest.mark.parametrize("board", ["shared", "none"])
async def test_a_follow_up_turn_arrives_after_the_answer_it_continues(coordinator, open_worker,
                                                                      board):
    """With the run's TurnBoard a follow-up turn waits for its previous turn,
    served by the other engine, to be over: then it hits all the history in
    the pool.  Without one, turns run together and many histories are not
    computed yet when their follow-up is admitted."""
    from kvshm.workers.turns import TurnBoard
    coord = await coordinator(kv_config(num_blocks=1024))
    spec = SyntheticSpec(seed=5, num_system_prompts=0, share_system=0.0, user_len=(16, 64),
                         user_median=32.0, output_len=(8, 32), output_median=16.0,
                         mean_turns=4.0, max_turns=6, max_len=2048, open_conversations=4)
    items = list(itertools.islice(synthetic(spec), 40))
    with TurnBoard.create() as turns:
        workers = [await open_worker(coord, max_running=8, check_decode=0.0,
                                     turns=turns if board == "shared" else None, index=i)
                   for i in range(2)]
        await asyncio.gather(*(w.run(assign(items, i, 2)) for i, w in enumerate(workers)))
    assert_no_mismatch(*(w.stats for w in workers))
    assert sum(w.stats.finished for w in workers) == 40
    hit_blocks = sum(w.stats.hit_tokens for w in workers) // BS
    if board == "shared":
        assert hit_blocks >= history_blocks(items)
        assert sum(w.stats.cross_hit_tokens for w in workers) > 0
    else:
        assert hit_blocks < 0.9 * history_blocks(items)
    assert_pool_whole(coord)


async def test_a_turn_after_a_dead_worker_s_does_not_wait():
    from kvshm.workers.turns import TurnBoard
    with TurnBoard.create() as turns:
        other = TurnBoard.attach(turns.name)
        assert turns.ready(7, 0, -1) and not turns.ready(7, 1, 0)
        other.done(7, 0)
        assert turns.ready(7, 1, 0) and not turns.ready(7, 2, 1)
        turns.mark_dead(1)
        assert other.ready(7, 2, 1) and not other.ready(8, 2, 0)
        other.close()


async def test_many_concurrent_requests_per_engine(coordinator, open_worker):
    """The way `kvshm run` drives engines: an endless stream, a deadline,
    up to 32 requests running in each engine."""
    coord = await coordinator(kv_config(num_blocks=512))
    a = await open_worker(coord, check_decode=0.5)
    b = await open_worker(coord, check_decode=0.5, sample_seed=1)
    deadline = time.monotonic() + 1.0
    await asyncio.gather(a.run(assign(synthetic(SMALL_SPEC), 0, 2), deadline),
                         b.run(assign(synthetic(SMALL_SPEC), 1, 2), deadline))
    assert_no_mismatch(a.stats, b.stats)
    assert a.stats.finished > 0 and b.stats.finished > 0
    assert a.stats.hit_blocks_checked + b.stats.hit_blocks_checked > 0
    assert a.stats.cross_hit_tokens + b.stats.cross_hit_tokens > 0
    assert_pool_whole(coord)


# -- integrity -----------------------------------------------------------------------------------
async def test_a_corrupted_cached_block_is_detected(coordinator, open_worker):
    coord = await coordinator(kv_config())
    prefix = toks(4 * BS, seed=1)
    a = await open_worker(coord)
    await a.run([Item("a0", prefix + toks(20, seed=2), toks(5, seed=3), "a", 0)])
    assert_no_mismatch(a.stats)
    hits = await cached_prefix_blocks(a.client, prefix + (7,), "probe-a")
    assert len(hits) == 4 and all(a.arena.writer[hits] == a.client.session_id)

    b = await open_worker(coord)
    bad = hits[1]
    b.arena.kv[bad, 1, 1, 5, 0, 3] += 1.0      # one V element of layer 1, slot 5
    await b.run([Item("b0", prefix + toks(30, seed=4), toks(3, seed=5), "b", 0)])
    # Found, reported and healed: the pool uncached it and a's blocks computed
    # after it; b started over, hit only the block before it and computed the rest.
    assert b.stats.corrupt_blocks_found == 1 and b.stats.hit_mismatches == 0
    # (a's blocks after it, and b's own pending ones chained to it)
    assert b.stats.corrupt_blocks_evicted >= 3 and b.stats.corrupt_requeued == 1
    assert [blk for blk, _, _ in b.stats.corrupt_log] == [bad]
    assert b.stats.hit_blocks_checked == 4 + 1
    assert b.stats.cross_hit_tokens == 5 * BS           # a's blocks, both admissions
    assert re.search(rf"\b{bad}\b", b.stats.first_corruption), b.stats.first_corruption
    assert_no_mismatch(b.stats)
    assert b.stats.finished == 1
    now = await cached_prefix_blocks(b.client, prefix + (7,), "probe-b")
    assert now[0] == hits[0] and not set(now[1:]) & set(hits[1:])   # b's own, computed anew

    c = await open_worker(coord)
    await c.run([Item("c0", prefix + toks(25, seed=6), toks(3, seed=7), "c", 0)])
    assert_no_mismatch(c.stats)
    assert c.stats.hit_blocks_checked == 4
    assert_pool_whole(coord)


async def test_the_transformer_shares_hits_and_catches_a_corrupted_block(
        coordinator, open_worker):
    """--model transformer: a second engine's hits are another engine's
    blocks, checked against a recompute within the tolerance (chunking
    differs, so not bit for bit); a corrupted block is still caught, and a
    sampled decode step agrees with attention over its K/V read contiguously
    (a decode that goes wrong is caught)."""
    coord = await coordinator(kv_config())
    prefix = toks(4 * BS, seed=21)
    a = await open_worker(coord, model="transformer", check_decode=1.0)
    await a.run([Item("a0", prefix + toks(20, seed=22), toks(5, seed=23), "a", 0)])
    assert_no_mismatch(a.stats)
    assert a.stats.decode_checks == 4 and a.stats.attention_s > 0 and a.stats.kv_s > 0
    hits = await cached_prefix_blocks(a.client, prefix + (7,), "probe-a")
    assert len(hits) == 4

    b = await open_worker(coord, model="transformer", check_blocks=1000, token_budget=7)
    await b.run([Item("b0", prefix + toks(30, seed=24), toks(3, seed=25), "b", 0)])
    assert_no_mismatch(b.stats)
    assert b.stats.hit_blocks_checked == 4 and b.stats.cross_hit_tokens == 4 * BS
    assert b.stats.computed_blocks_checked == 1      # the 5th full block, computed in chunks
    assert b.engine.model.fingerprint() == a.engine.model.fingerprint()

    bad = hits[2]
    b.arena.kv[bad, 0, 0, 2, 1, 4] += 1.0      # one K element of layer 0, slot 2
    c = await open_worker(coord, model="transformer", check_blocks=1000)
    await c.run([Item("c0", prefix + toks(9, seed=26), toks(2, seed=27), "c", 0)])
    # caught by the check of the step that read it: that step is discarded,
    # the block and the ones after it uncached, and c computes them again
    assert c.stats.corrupt_blocks_found == 1 and c.stats.corrupt_requeued == 1
    assert re.search(rf"\b{bad}\b", c.stats.first_corruption), c.stats.first_corruption
    assert_no_mismatch(c.stats)
    assert c.stats.finished == 1

    d = await open_worker(coord, model="transformer", check_decode=1.0)
    step = d.engine.model.step

    def off_by_a_bit(segments, decode=None):   # the paged decode path goes wrong
        outs, dec = step(segments, decode)
        if dec is not None:
            k, v, hidden = dec
            dec = (k, v, hidden * 1.1)
        return outs, dec
    d.engine.model.step = off_by_a_bit
    await d.run([Item("d0", toks(40, seed=28), toks(3, seed=29), "d", 0)])
    assert d.stats.decode_checks == 2 and d.stats.decode_mismatches == 2
    assert "differs from attention over its contiguous K/V" in d.stats.first_error
    assert_pool_whole(coord)


async def test_the_transformer_checks_as_many_blocks_with_hits_as_without(
        coordinator, open_worker):
    """--model transformer: `check_blocks` of each request's full prompt
    blocks are checked, drawn from its id, whether they were hits or
    computed here, so a shared and an isolated run check the same blocks;
    a block this worker computed wrong is caught too."""
    prefix = toks(4 * BS, seed=31)
    item = Item("r0", prefix + toks(40, seed=32), toks(2, seed=33), "r", 0)
    warm = await coordinator(kv_config())
    a = await open_worker(warm, model="transformer")
    await a.run([Item("w0", prefix + toks(5, seed=34), toks(2, seed=35), "w", 0)])
    hit = await open_worker(warm, model="transformer", check_blocks=3)
    await hit.run([item])
    cold = await open_worker(await coordinator(kv_config()), model="transformer",
                             check_blocks=3)
    await cold.run([item])
    assert_no_mismatch(hit.stats, cold.stats)
    assert hit.stats.hit_tokens == 4 * BS and cold.stats.hit_tokens == 0
    for st in (hit.stats, cold.stats):
        assert st.hit_blocks_checked + st.computed_blocks_checked == 3
    assert cold.stats.hit_blocks_checked == 0
    sample = cold.engine.compute.sampled_blocks("r0", len(item.prompt) // BS)
    assert sample == hit.engine.compute.sampled_blocks("r0", len(item.prompt) // BS)
    assert hit.stats.hit_blocks_checked == sum(1 for i in sample if i < 4)

    bad = await open_worker(await coordinator(kv_config()), model="transformer",
                            check_blocks=1000)
    write = bad.engine.compute.write

    def write_then_corrupt(seq, start, k, v):
        write(seq, start, k, v)
        if start == 0:
            bad.arena.kv[seq.tables[0][1], 1, 1, 3, 0, 5] += 1.0   # a V element, layer 1
    bad.engine.compute.write = write_then_corrupt
    await bad.run([Item("x0", toks(50, seed=36), toks(2, seed=37), "x", 0)])
    assert bad.stats.computed_blocks_checked == 3 and bad.stats.computed_mismatches == 1
    assert bad.stats.integrity_failures == 1
    assert "this worker computed differ from a recompute" in bad.stats.first_error


async def test_the_transformer_runs_on_one_full_attention_group_only(coordinator):
    config = kv_config(groups=(FullSpec(BS), SlidingWindowSpec(BS, 64)))
    with pytest.raises(UnsupportedModel, match="transformer model runs on one full-attention"):
        check_supported(config, "transformer")
    with pytest.raises(UnsupportedModel, match="unknown model 'gpt'"):
        check_supported(kv_config(), "gpt")


async def test_a_sampled_check_recomputes_only_sampled_blocks_and_still_catches(
        coordinator, open_worker):
    coord = await coordinator(kv_config())
    prefix = toks(4 * BS, seed=11)
    a = await open_worker(coord)
    await a.run([Item("a0", prefix + toks(20, seed=12), toks(5, seed=13), "a", 0)])
    hits = await cached_prefix_blocks(a.client, prefix + (7,), "probe-a")
    b = await open_worker(coord, verify_hits=0.5, sample_seed=0)
    originals = b.arena.kv[hits].copy()
    for block in hits:                  # every hit block is wrong: any sample must see it
        b.arena.kv[block, 0, 0, 0, 0, 0] += 1.0
    await b.run([Item("b0", prefix + toks(30, seed=14), toks(3, seed=15), "b", 0)])
    # seed 0 samples blocks 2 and 3 first: their K/V are computed from the
    # context of the tokens before them, not from position 0
    assert [blk for blk, _, _ in b.stats.corrupt_log][:2] == hits[2:]
    assert b.stats.hit_mismatches == 0 and b.stats.finished == 1
    now = await cached_prefix_blocks(b.client, prefix + (7,), "probe-b")
    healed = [blk for blk in hits if blk not in now]         # found and uncached
    assert set(hits[2:]) <= set(healed) and b.stats.corrupt_blocks_found == len(healed)
    for i, blk in enumerate(hits):                           # the ones no sample caught
        if blk in now:
            b.arena.kv[blk] = originals[i]
    c = await open_worker(coord, verify_hits=0.5, sample_seed=0)
    await c.run([Item("c0", prefix + toks(25, seed=16), toks(3, seed=17), "c", 0)])
    assert c.stats.hit_blocks_checked == 2 and c.stats.hit_mismatches == 0
    assert_pool_whole(coord)


# -- scheduling ----------------------------------------------------------------------------------
def endless(tag: str, prompt_len: int, output_len: int, prefix: tuple[int, ...] = ()):
    """Distinct requests of one shape, forever."""
    for i in itertools.count():
        yield Item(f"{tag}-{i}", prefix + toks(prompt_len, seed=f"{tag}-p{i}"),
                   toks(output_len, seed=f"{tag}-o{i}"), f"{tag}-{i}", 0)


async def test_preemption_under_a_small_pool(coordinator, open_worker):
    # 23 usable blocks; each request grows to 5 (40 prompt + 40 output
    # tokens), and one engine alone admits 7 of them: decode must preempt
    # (after the deadline too: admitted requests run to their end).
    coord = await coordinator(kv_config(num_blocks=24))
    a = await open_worker(coord, max_running=16, check_decode=1.0)
    b = await open_worker(coord, max_running=16, check_decode=1.0)
    deadline = time.monotonic() + 1.0
    await asyncio.gather(a.run(endless("a", 40, 40), deadline),
                         b.run(endless("b", 40, 40), deadline))
    assert a.stats.preemptions + b.stats.preemptions > 0
    assert_no_mismatch(a.stats, b.stats)
    assert a.stats.finished + b.stats.finished > 0
    for w in (a, b):
        assert w.stats.generated_tokens >= 40 * w.stats.finished
        assert w.stats.rejected == 0
    assert a.stats.decode_checks + b.stats.decode_checks > 0
    assert_pool_whole(coord)


async def test_a_finite_workload_is_served_to_the_end(coordinator, open_worker):
    # Two requests fit a step's budget; the other four wait, and preempted
    # ones wait again: all six must still run to their end before the deadline.
    coord = await coordinator(kv_config(num_blocks=24))
    items = [Item(f"r{i}", toks(40, seed=i), toks(40, seed=50 + i), f"r{i}", 0)
             for i in range(6)]
    a = await open_worker(coord, token_budget=64)
    sent = []                  # every batch's op count, as the coordinator got them
    batch = a.client.batch

    async def counted(ops, *args, **kw):
        sent.append(len(ops))
        return await batch(ops, *args, **kw)

    a.client.batch = counted
    stats = await a.run(items, deadline=time.monotonic() + RUN_FOR)
    assert_no_mismatch(stats)
    assert (stats.finished, stats.aborted, stats.rejected) == (6, 0, 0)
    assert stats.generated_tokens == 6 * 40
    assert stats.ops == sum(sent) and len(sent) >= stats.steps   # + preemptions, flush
    assert_pool_whole(coord)


async def test_requests_that_can_never_fit_are_rejected_not_retried(coordinator, open_worker):
    coord = await coordinator(kv_config(num_blocks=24, max_model_len=512))
    items = [Item("fits", toks(60, seed=1), toks(8, seed=2), "a", 0),
             Item("too-long-for-the-model", toks(500, seed=3), toks(20, seed=4), "b", 0),
             Item("too-big-for-the-pool", toks(23 * BS, seed=5), toks(8, seed=6), "c", 0),
             Item("fits-too", toks(30, seed=7), toks(8, seed=8), "d", 0)]
    a = await open_worker(coord)
    stats = await a.run(items, deadline=time.monotonic() + RUN_FOR)
    assert (stats.finished, stats.rejected, stats.aborted) == (2, 2, 0)
    assert stats.prompt_tokens == 60 + 30
    assert_pool_whole(coord)


async def test_sliding_window_blocks_are_dropped_and_stay_correct(coordinator, open_worker):
    coord = await coordinator(kv_config((FullSpec(BS), SlidingWindowSpec(BS, 64)),
                                        num_blocks=256))
    prefix = toks(10 * BS, seed=11)
    items = [Item(f"h{i}", prefix + toks(40 + 3 * i, seed=20 + i), toks(24, seed=40 + i),
                  f"h{i}", 0) for i in range(8)]
    # Small budgets: prefills run in chunks, so windows slide during prefill
    # too; one request at a time per engine, so later ones hit earlier ones.
    a = await open_worker(coord, check_decode=1.0, token_budget=48, max_running=1)
    b = await open_worker(coord, check_decode=1.0, token_budget=48, max_running=1)
    dropped = []

    def watch(worker):
        def on_step(_stats) -> None:
            for seq in worker.engine.planner.running:
                if 0 in list(coord.mgr.get_block_ids(seq.rid)[1]):
                    dropped.append(seq.rid)
        return on_step

    await asyncio.gather(a.run(items[0::2], on_step=watch(a)),
                         b.run(items[1::2], on_step=watch(b)))
    assert dropped, "no sliding-window block was ever dropped: the test lost its point"
    assert_no_mismatch(a.stats, b.stats)
    assert a.stats.finished == b.stats.finished == 4
    assert a.stats.decode_checks + b.stats.decode_checks > 0
    assert a.stats.hit_blocks_checked + b.stats.hit_blocks_checked > 0
    assert_pool_whole(coord)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
async def test_half_precision_arenas(coordinator, open_worker, dtype):
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    shape = KVShape(num_layers=2, num_kv_heads=2, head_size=16, dtype=dtype)
    coord = await coordinator(kv_config(kv=shape))
    prefix = toks(5 * BS, seed=7)
    a = await open_worker(coord, check_decode=1.0)
    b = await open_worker(coord, check_decode=1.0)
    assert a.arena.dtype.name == dtype
    await a.run([Item(f"{dtype}-a{i}", prefix + toks(10 + i, seed=i), toks(12, seed=30 + i),
                      f"a{i}", 0) for i in range(3)])
    await b.run([Item(f"{dtype}-b{i}", prefix + toks(9 + i, seed=60 + i), toks(12, seed=90 + i),
                      f"b{i}", 0) for i in range(3)])
    assert_no_mismatch(a.stats, b.stats)
    assert b.stats.cross_hit_tokens >= 5 * BS and b.stats.hit_blocks_checked >= 5
    assert a.stats.decode_checks > 0 and b.stats.decode_checks > 0
    assert_pool_whole(coord)


# -- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize("config,message", [
    (kv_config((FullSpec(BS), MambaSpec(BS))), r"group 1 is MambaSpec"),
    (kv_config(enable_caching=False), r"prefix caching"),
    (kv_config(kv=None), r"no kv shape"),
], ids=["mamba", "no-caching", "no-kv"])
def test_unsupported_pools_are_refused(config, message):
    assert issubclass(UnsupportedModel, ValueError)   # `kvshm run` reports ValueErrors
    with pytest.raises(UnsupportedModel, match=message):
        check_supported(config)
    with pytest.raises(UnsupportedModel, match=message):
        Engine(None, None, config, EngineOptions())   # refused before touching anything
    check_supported(kv_config((FullSpec(BS), SlidingWindowSpec(BS, 64))))


# -- deadlines -----------------------------------------------------------------------------------
async def test_a_past_deadline_admits_nothing(coordinator, open_worker):
    coord = await coordinator(kv_config())
    a = await open_worker(coord)
    stats = await a.run(synthetic(SMALL_SPEC), deadline=time.monotonic() - 1.0)
    assert stats.steps == 0 and stats.prompt_tokens == 0 and stats.finished == 0
    assert_pool_whole(coord)


async def test_the_hard_deadline_aborts_an_endless_stream(coordinator, open_worker):
    coord = await coordinator(kv_config(num_blocks=256))
    a = await open_worker(coord)
    # Outputs of 1500+ tokens, one decode step each: requests are still
    # decoding when the hard deadline comes.
    spec = SyntheticSpec(seed=5, num_system_prompts=1, system_len=(32, 64), user_len=(8, 32),
                         output_len=(1500, 1900), output_median=1700.0, max_len=2048)
    now = time.monotonic()
    stats = await a.run(synthetic(spec), deadline=now + 0.2, hard_deadline=now + 0.4)
    assert stats.steps > 0 and stats.aborted > 0
    assert_no_mismatch(stats)
    assert_pool_whole(coord)


# -- writer stamps -------------------------------------------------------------------------------
async def test_written_blocks_carry_the_writers_session(coordinator, open_worker):
    coord = await coordinator(kv_config())
    prefix = toks(3 * BS, seed=21)
    a = await open_worker(coord)
    b = await open_worker(coord)
    assert (a.arena.writer == 0).all()
    item_a = Item("a0", prefix + toks(2 * BS, seed=22), toks(BS + 1, seed=23), "a", 0)
    item_b = Item("b0", prefix + toks(3 * BS, seed=24), toks(BS + 1, seed=25), "b", 0)
    await a.run([item_a])
    await b.run([item_b])
    # Everything each request computed is cached: prompt + output but the last token.
    full_a = item_a.prompt + item_a.output
    full_b = item_b.prompt + item_b.output
    blocks_a = await cached_prefix_blocks(a.client, full_a, "probe-a")
    blocks_b = await cached_prefix_blocks(b.client, full_b, "probe-b")
    assert len(blocks_a) == (len(full_a) - 1) // BS == 6
    assert len(blocks_b) == (len(full_b) - 1) // BS == 7
    assert blocks_b[:3] == blocks_a[:3]          # b hit a's prefix blocks...
    writer = a.arena.writer.copy()
    assert (writer[blocks_a] == a.client.session_id).all()   # ...and did not restamp them
    assert (writer[blocks_b[3:]] == b.client.session_id).all()
    assert b.stats.cross_hit_tokens == 3 * BS and a.stats.cross_hit_tokens == 0
    # Nothing else was written: every stamped block is one of theirs.
    stamped = set(np.flatnonzero(writer).tolist())
    assert set(blocks_a) | set(blocks_b) <= stamped
    assert set(writer[list(stamped)].tolist()) == {a.client.session_id, b.client.session_id}
    assert_pool_whole(coord)


async def test_a_load_only_engine_sends_the_same_traffic_without_compute(coordinator,
                                                                         open_worker):
    """load_only (the clients of scripts/numa_stress.py): the same batches and
    writer stamps as a computing engine, and no K/V in the arena."""
    prefix = toks(3 * BS, seed=21)
    item_a = Item("a0", prefix + toks(2 * BS, seed=22), toks(BS + 1, seed=23), "a", 0)
    item_b = Item("b0", prefix + toks(3 * BS, seed=24), toks(BS + 1, seed=25), "b", 0)
    figures = []
    for opts in ({}, {"load_only": True, "verify_hits": 0.0, "check_decode": 0.0}):
        coord = await coordinator(kv_config())
        a = await open_worker(coord, **opts)
        b = await open_worker(coord, **opts)
        await a.run([item_a])
        await b.run([item_b])
        assert b.stats.cross_hit_tokens == 3 * BS and a.stats.cross_hit_tokens == 0
        blocks_b = await cached_prefix_blocks(b.client, item_b.prompt + item_b.output, "p")
        writer = b.arena.writer
        assert (writer[blocks_b[:3]] == a.client.session_id).all()
        assert (writer[blocks_b[3:]] == b.client.session_id).all()
        figures.append([(w.stats.ops, w.stats.steps, w.stats.generated_tokens,
                         w.stats.hit_tokens) for w in (a, b)])
        computed = bool(a.arena.kv[blocks_b].any())
        assert computed == (not opts)
        assert (a.stats.attention_s > 0) == (not opts)    # decode attention ran
        assert_pool_whole(coord)
    assert figures[0] == figures[1]
    with pytest.raises(ValueError, match="load_only computes no K/V"):
        Engine(a.client, a.arena, a.client.config, EngineOptions(load_only=True))
