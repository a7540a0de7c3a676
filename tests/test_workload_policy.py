"""The scheduling policy (kvshm/workload/policy.py), sans-IO: each step's
batch and what the replies do, with replies written by hand; then the
compute-free scheduler (kvshm/workload/scheduler.py) that drives it on an
embedded pool."""

from __future__ import annotations

import dataclasses

import pytest

from helpers import make_config
from kvshm import KVCacheManager
from kvshm.core.check import check_segment
from kvshm.ops import protocol as p
from kvshm.workload.items import Item, SystemPromptSpec, system_prompts
from kvshm.workload.policy import Planner, Seq, fits
from kvshm.workload.scheduler import (EmbeddedBackend, Scheduler, WorkloadResult, drive,
                                      run_workload, system_workload)
from kvshm.workload.spec import WorkloadSpec

BS = 4


def _item(rid: str, prompt_len: int, output: int = 2) -> Item:
    return Item(rid, tuple(range(prompt_len)), tuple(range(100, 100 + output)), rid, 0)


def _planner(free: int = 100, **kw) -> Planner:
    opts = dict(token_budget=16, max_running=4)
    opts.update(kw)
    return Planner([BS], free, WorkloadResult(), **opts)


def _admitted(hit: int, new: list[int], n: int | None = None, free: int = 50) -> p.Admitted:
    """Admit's reply: `hit` tokens hit, `n` new tokens (default: `new`'s
    blocks full) in blocks `new`."""
    hits = list(range(1, hit // BS + 1))
    return p.Admitted([hits], hit, len(new) * BS if n is None else n, [new], free)


def _refused(hit: int = 0, in_flight: int = 0) -> p.Admitted:
    return p.Admitted([[]], hit, 0, None, 50, in_flight)


def _kinds(ops) -> list[str]:
    return [type(op).__name__ for op in ops]


def test_a_step_is_bookkeeping_then_allocations_then_admissions():
    pl = _planner()
    a, b = Seq(_item("a", 10)), Seq(_item("b", 8))
    pl.waiting.extend([a, b])
    step = pl.plan()
    assert _kinds(step.ops) == ["AddRequest", "Admit", "AddRequest", "Admit"]
    assert [op.max_new_tokens for op in step.ops[1::2]] == [10, 6]   # the budget is 16
    assert [s.rid for s, _ in step.admits] == ["a", "b"] and not pl.waiting
    replies = [None, _admitted(0, [10, 11, 12], 10), None, _admitted(0, [13, 14], 6)]
    allocated, admitted, failed = pl.settle(step, replies, now=1.0)
    assert (allocated, failed) == ([], [])
    assert [s.rid for s, _ in admitted] == ["a", "b"] and pl.running == [a, b]
    assert a.tables == [[10, 11, 12]] and b.scheduled == 6
    ran = pl.computed(now=2.0)
    assert ran == [a, b]
    # a's prompt is done: it samples its first output token; b's is not.
    assert a.tokens[-1] == 100 and a.append == [100] and a.num_computed == 10
    assert b.num_computed == 6 and b.generated == 0
    # Next step: the Advances first (their K/V are in the arena now), then
    # the running requests' allocations (a decodes, b finishes its prompt).
    step = pl.plan()
    assert _kinds(step.ops) == ["Advance", "Advance", "AllocateSlots", "AllocateSlots"]
    assert step.ops[:2] == [p.Advance("a", 10, [100]), p.Advance("b", 6, [])]
    assert [op.num_new_tokens for op in step.ops[2:]] == [1, 2]
    assert pl.stats.ttft_ms == [2000] and pl.stats.queue_ms == [1000, 1000]


def test_a_finished_request_is_freed_by_the_next_batch():
    pl = _planner()
    a = Seq(_item("a", 4, output=1))
    pl.waiting.append(a)
    step = pl.plan()
    pl.settle(step, [None, _admitted(0, [7])], now=0.0)
    pl.computed(now=0.0)          # its one output token is sampled: it is done
    assert pl.finishing == [a] and pl.stats.finished == 1 and pl.busy
    step = pl.plan()
    assert step.ops == [p.Advance("a", 4, [100]), p.Free("a")] and step.released == [a]
    assert not pl.busy


def test_refused_admissions_go_back_to_the_head_in_order():
    pl = _planner()
    seqs = [Seq(_item(r, 4)) for r in "abc"]
    pl.waiting.extend(seqs)
    step = pl.plan()
    replies = [None, _refused(), None, _refused(), None, _refused()]
    pl.settle(step, replies, now=0.0)
    assert list(pl.waiting) == seqs
    # Known to the pool now: no second AddRequest.
    assert _kinds(pl.plan().ops) == ["Admit", "Admit", "Admit"]


def test_admission_stops_at_the_estimated_free_blocks_while_others_run():
    pl = _planner(free=3, token_budget=64)
    a, b = Seq(_item("a", 8)), Seq(_item("b", 8))
    pl.waiting.extend([a, b])
    step = pl.plan()
    # a needs 2 blocks, b 2 more: only a is sent (nothing ran before it).
    assert [s.rid for s, _ in step.admits] == ["a"] and list(pl.waiting) == [b]


def test_a_failed_allocation_preempts_the_newest_and_retries():
    pl = _planner(token_budget=64)
    seqs = [Seq(_item(r, 4, output=3)) for r in "abc"]
    pl.waiting.extend(seqs)
    step = pl.plan()
    pl.settle(step, [x for i, s in enumerate(seqs)
                     for x in (None, _admitted(0, [10 + i]))], now=0.0)
    pl.computed(now=0.0)
    step = pl.plan()                       # 3 Advances, 3 decode allocations
    replies = [None] * 3 + [p.Allocated([[20]], 5), p.Allocated(None, 0),
                            p.Allocated(None, 0)]
    allocated, _, failed = pl.settle(step, replies, now=0.0)
    assert [s.rid for s in allocated] == ["a"] and [s.rid for s in failed] == ["b", "c"]
    batches = pl.preemption(failed)
    ops = next(batches)
    # c, the newest, is preempted (and so needs no retry); b is retried.
    assert ops == [p.Free("c", True), p.Advance("c", 0, []), p.AllocateSlots("b", 1)]
    ops = batches.send([p.Done(), p.Done(), p.Allocated(None, 0)])
    assert ops == [p.Free("b", True), p.Advance("b", 0, [])]
    with pytest.raises(StopIteration):
        batches.send([p.Done(), p.Done()])
    assert [s.rid for s in pl.running] == ["a"] and [s.rid for s in pl.waiting] == ["b", "c"]
    assert pl.stats.preemptions == 2
    b = pl.waiting[0]
    assert (b.num_computed, b.tables, b.to_advance) == (0, [], False)
    assert b.tokens == [0, 1, 2, 3, 100]   # what it sampled stays (recomputed later)


def test_a_prefix_in_flight_is_waited_for_and_the_wait_ends():
    pl = _planner(wait_in_flight=8, in_flight_deadline=2.0, token_budget=32)
    a, b = Seq(_item("a", 20)), Seq(_item("b", 4))
    pl.waiting.extend([a, b])
    step = pl.plan()
    assert step.ops[1].wait_in_flight == 8
    pl.settle(step, [None, _refused(hit=4, in_flight=12), None, _admitted(0, [9], 4)], now=10.0)
    assert a.wait_until == 12.0 and pl.stats.in_flight_waits == 1 and list(pl.waiting) == [a]
    # It keeps its place but takes no budget: probed instead.
    step = pl.plan()
    assert _kinds(step.ops) == ["AllocateSlots", "GetComputedBlocks"]
    probe = step.ops.index(p.GetComputedBlocks("a"))
    replies = [p.Allocated([[]], 50)] * len(step.ops)
    replies[probe] = p.ComputedBlocks([[1, 2]], 8, 12)     # its hit grew: the deadline moves
    pl.settle(step, replies, now=11.0)
    assert a.wait_until == 13.0
    step = pl.plan()
    replies = [p.Allocated([[]], 50)] * len(step.ops)
    replies[-1] = p.ComputedBlocks([[1, 2]], 8, 12)        # no progress, deadline passed
    pl.settle(step, replies, now=13.5)
    assert a.wait_until == -1.0 and pl.stats.in_flight_timeouts == 1
    step = pl.plan()                                       # it computes the rest now
    assert step.admits and step.ops[step.admits[0][1]] == p.Admit("a", 20, wait_in_flight=0)


def test_requests_a_restart_lost_start_over():
    pl = _planner()
    a, b, c = (Seq(_item(r, 4)) for r in "abc")
    pl.waiting.extend([a, b])
    pl.settle(pl.plan(), [None, _admitted(0, [5]), None, _admitted(0, [6])], now=0.0)
    c.added = True
    pl.waiting.append(c)
    assert pl.requeue_lost({"a"}) == (1, 0)
    assert pl.running == [a] and list(pl.waiting) == [b, c]
    assert not b.added and not c.added and b.tables == []


def test_fits_says_whether_the_model_and_the_pool_can_ever_hold_an_item():
    cfg = make_config(num_blocks=5, max_model_len=64)      # 4 usable blocks of 4 tokens
    assert fits(cfg, _item("a", 14, output=2))
    assert not fits(cfg, _item("a", 16, output=2))         # 5 blocks: more than the pool
    assert not fits(make_config(num_blocks=100, max_model_len=16), _item("a", 16, output=2))


# -- the compute-free scheduler --------------------------------------------------------------
CFG = make_config(num_blocks=64, max_model_len=256, max_num_seqs=32)


class Recording(EmbeddedBackend):
    def __init__(self, mgr) -> None:
        super().__init__(mgr)
        self.frames_sent: list[list] = []

    def run_frame(self, ops):
        self.frames_sent.append(list(ops))
        return super().run_frame(ops)


def _scheduler(**kw) -> Scheduler:
    spec = dict(num_requests=30, system_len=(20, 60), user_len=(4, 40), output_len=(1, 12),
                max_len=CFG.max_model_len)
    spec.update(kw)
    return Scheduler(WorkloadSpec(kind="system", system=SystemPromptSpec(**spec)),
                     token_budget=64, max_running=8)


def test_the_scheduler_serves_every_request_and_leaves_the_pool_clean():
    with KVCacheManager(CFG) as mgr:
        res = run_workload(mgr, _scheduler())
        assert res.finished == 30 and res.rejected == 0
        assert res.preemptions > 0                # the pool is small: it preempts
        assert 0 < res.hit_tokens < res.prompt_tokens
        assert res.frames > res.steps             # a follow-up frame per preemption
        assert len(mgr.table) == 0 and check_segment(mgr.segment, mgr.block_pool).clean


def test_the_scheduler_s_op_stream_depends_on_its_spec_only():
    streams = []
    for _ in range(2):
        with KVCacheManager(CFG) as mgr:
            backend = Recording(mgr)
            drive(backend, _scheduler())
            streams.append(backend.frames_sent)
    assert streams[0] == streams[1]
    with KVCacheManager(CFG) as mgr:
        backend = Recording(mgr)
        drive(backend, _scheduler(seed=1))
        assert backend.frames_sent != streams[0]


def test_the_scheduler_rejects_what_can_never_fit():
    small = make_config(num_blocks=12, max_model_len=256, max_num_seqs=8)   # 44 tokens
    sched = _scheduler(num_requests=20, system_len=(10, 50))
    never = [it for it in system_prompts(sched.workload.system) if not fits(small, it)]
    assert 0 < len(never) < 20
    with KVCacheManager(small) as mgr:
        res = run_workload(mgr, sched)
        assert (res.rejected, res.finished) == (len(never), 20 - len(never))
        assert check_segment(mgr.segment, mgr.block_pool).clean


def test_the_scheduler_refuses_bad_options():
    for kw in ({"token_budget": 0}, {"max_running": -1}, {"arrivals_per_step": 1.5}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            Scheduler(**kw)


def test_system_prompt_requests_are_deterministic_and_fit():
    spec = SystemPromptSpec(num_requests=20, max_len=128, system_len=(50, 120))
    items = list(system_prompts(spec))
    assert items == list(system_prompts(spec)) and len(items) == 20
    assert all(len(it.prompt) <= 127 and len(it.prompt) + len(it.output) <= 128 for it in items)
    assert [it.rid for it in items] == [str(i) for i in range(20)]
    assert items != list(system_prompts(dataclasses.replace(spec, seed=1)))
    assert list(system_workload(5).system.__dict__.values()) == list(
        SystemPromptSpec(num_requests=5).__dict__.values())


@pytest.mark.parametrize("field, value, message", [
    ("num_requests", -1, "num_requests must be an int >= 0"),
    ("num_system_prompts", 0, "num_system_prompts must be an int >= 1"),
    ("max_len", 1, "max_len must be an int >= 2"),
    ("user_len", (5, 4), r"user_len must be \(lo, hi\)"),
])
def test_a_bad_system_prompt_spec_is_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        system_prompts(dataclasses.replace(SystemPromptSpec(), **{field: value}))
