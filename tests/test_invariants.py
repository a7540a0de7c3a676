"""Stateful invariant tests: drive a KVCacheManager as a scheduler would and
check the pool segment after every step.

Two drivers share one simulated scheduler (`Sim`, in invariant_sim.py):

* a hypothesis `RuleBasedStateMachine` (shrinks failures to a short op list);
* a seeded-random fallback that runs longer op sequences and names its seed
  in the failure message (rerun with KVSHM_SEED=<seed>).

KVSHM_STRESS_EXAMPLES=<n> raises both the hypothesis max_examples and the
number of random sequences per config (default: small enough for the whole
file to run in well under a minute on two cores).

Besides `check_segment(seg, pool).clean`, every step checks what the
checker cannot see: the managers' Python lists agree with the request-table
rows, a block is referenced from one group only, a cached block a request
holds is cached under that request's hash for its position, prefix hits are
such blocks, get_computed_blocks and evict_blocks move nothing, an
allocation covers the slots it was asked for with exactly the out-of-window
blocks null, and bad calls raise a typed error and change nothing.

Then: a second KVCacheManager attached to a live segment rebuilds the
owner's state and carries on exactly like it; a Request owns its token
list; and a regression test for a vLLM 0.14.0 bug kvshm does not reproduce.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from invariant_sim import CONFIGS, CREATED, ENC_MAX, SYSTEM_PROMPTS, Sim, random_op
from kvshm import (
    FullSpec,
    KVCacheManager,
    PoolConfig,
    PoolSegment,
    Request,
    SlidingWindowSpec,
    check_segment,
)
from kvshm.core.state import SEQ_WORD

STRESS = int(os.environ.get("KVSHM_STRESS_EXAMPLES", "0") or 0)
HYP_EXAMPLES = STRESS or 8
HYP_STEPS = 50 if not STRESS else 120
RANDOM_SEQUENCES = STRESS or 2
RANDOM_STEPS = 150 if not STRESS else 400


# -- hypothesis driver --------------------------------------------------------------

TOKENS = st.lists(st.integers(0, 7), min_size=1, max_size=14)


class SchedulerMachine(RuleBasedStateMachine):
    CONFIG: PoolConfig = CONFIGS["full"]

    def __init__(self) -> None:
        super().__init__()
        self.sim = Sim(self.CONFIG)

    def teardown(self) -> None:
        self.sim.close()

    @initialize(suffix=TOKENS)
    def first_request(self, suffix):
        self.sim.add_request(0, 1.0, suffix, None, None, -1, 8, False)

    @rule(sys_idx=st.integers(0, len(SYSTEM_PROMPTS)), share=st.sampled_from([0.3, 0.7, 1.0]),
          suffix=TOKENS, salt=st.sampled_from([None, None, None, "salt-a"]),
          lora=st.sampled_from([None, None, None, "lora-x"]),
          history=st.integers(-3, 4), enc=st.integers(1, ENC_MAX),
          skip_read=st.sampled_from([False] * 7 + [True]))
    def add_request(self, sys_idx, share, suffix, salt, lora, history, enc, skip_read):
        self.sim.add_request(sys_idx, share, suffix, salt, lora, history, enc, skip_read)

    @precondition(lambda self: self.sim.waiting)
    @rule(idx=st.integers(0, 7), chunk=st.sampled_from([5, 16, 64, 200]),
          lookahead=st.sampled_from([0, 0, 0, 3]), delay=st.sampled_from([False] * 5 + [True]),
          external=st.sampled_from([False] * 5 + [True]))
    def schedule(self, idx, chunk, lookahead, delay, external):
        self.sim.schedule(idx, chunk, lookahead, delay, external)

    @precondition(lambda self: self.sim.running)
    @rule(idx=st.integers(0, 7), chunk=st.sampled_from([3, 8, 64]), drafts=st.integers(0, 3),
          accepted=st.integers(0, 3), lookahead=st.sampled_from([0, 0, 2, 4]))
    def step(self, idx, chunk, drafts, accepted, lookahead):
        self.sim.step(idx, chunk, drafts, accepted, lookahead)

    @precondition(lambda self: self.sim.running)
    @rule(idx=st.integers(0, 7))
    def remove_skipped(self, idx):
        self.sim.remove_skipped(idx)

    @precondition(lambda self: self.sim.running)
    @rule(idx=st.integers(0, 7))
    def cache(self, idx):
        self.sim.cache(idx)

    @precondition(lambda self: self.sim.running or self.sim.waiting)
    @rule(idx=st.integers(0, 7), from_waiting=st.booleans())
    def finish(self, idx, from_waiting):
        self.sim.finish(idx, from_waiting)

    @precondition(lambda self: self.sim.running)
    @rule(idx=st.integers(0, 7))
    def preempt(self, idx):
        self.sim.preempt(idx)

    @rule(ids=st.lists(st.integers(0, 200), max_size=6))
    def evict(self, ids):
        self.sim.evict([b % self.CONFIG.num_blocks for b in ids])

    @rule(kind=st.integers(0, 12), idx=st.integers(0, 7))
    def bad_call(self, kind, idx):
        self.sim.bad_call(kind, idx)

    @rule()
    def reset(self):
        self.sim.reset()

    @rule()
    def common_prefix(self):
        self.sim.common_prefix()

    @invariant()
    def segment_is_consistent(self):
        self.sim.check()


def _leaked(since: int) -> list[str]:
    return [n for n in CREATED[since:] if os.path.exists(f"/dev/shm/{n}")]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_state_machine(name):
    since = len(CREATED)
    machine = type(f"Machine_{name}", (SchedulerMachine,), {"CONFIG": CONFIGS[name]})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=HYP_EXAMPLES, stateful_step_count=HYP_STEPS, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        print_blob=True))
    assert len(CREATED) > since
    assert not _leaked(since), "hypothesis examples leaked segments"




@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_sequences(name):
    base = int(os.environ.get("KVSHM_SEED") or random.randrange(2**32))
    for k in range(RANDOM_SEQUENCES):
        seed = base + k
        rnd = random.Random(seed)
        with _sim(CONFIGS[name]) as sim:
            step = -1
            try:
                for step in range(RANDOM_STEPS):
                    random_op(sim, rnd)
                    sim.check()
                # Drain: finish everything; every block but null/sink is free.
                for rid in list(sim.running) + list(sim.waiting):
                    sim.finish_rid(rid)
                    sim.check()
                expect = sim.cfg.num_blocks - 1 - sim.cfg.num_sink_blocks
                assert sim.m.num_free_blocks == expect, \
                    f"{sim.m.num_free_blocks} blocks free after freeing everything, want {expect}"
            except Exception as e:
                raise AssertionError(
                    f"config {name}: failed at step {step} with KVSHM_SEED={seed} "
                    f"(rerun: KVSHM_SEED={seed} pytest {__file__} -k '{name}'): "
                    f"{type(e).__name__}: {e}\nlast ops:\n  " + "\n  ".join(sim.log)) from e


@contextmanager
def _sim(cfg: PoolConfig):
    sim = Sim(cfg)
    try:
        yield sim
    finally:
        sim.close()


def test_workload_exercises_the_interesting_paths():
    """The random driver is not degenerate: with fixed seeds it produces
    prefix hits, failed allocations, preemptions, window trimming, evictions
    of cached blocks, successful resets and external loads."""
    def run(name: str, seeds=range(3)) -> collections.Counter:
        total: collections.Counter = collections.Counter()
        for seed in seeds:
            rnd = random.Random(seed)
            with _sim(CONFIGS[name]) as sim:
                for _ in range(RANDOM_STEPS):
                    random_op(sim, rnd)
                total += sim.stats
        return total

    full = run("full")
    for key in ("prefix_hit", "new_request_no_room", "decode_no_room", "evicted_cached",
                "reset_ok", "external_load"):
        assert full[key] > 0, (key, full)
    for name in ("sliding_window", "mamba", "hybrid_full_sw", "hybrid_full8_sw4"):
        got = run(name)
        for key in ("prefix_hit", "hit_with_nulls", "trimmed"):
            assert got[key] > 0, (name, key, got)


# -- attaching a second manager to a live segment ---------------------------------------

ATTACH_TIMEOUT = 2.0


@contextmanager
def _deadline(seconds: float, what: str):
    """Raise TimeoutError in this (main) thread if the body runs too long."""
    def expired(signum, frame):
        raise TimeoutError(f"{what} did not return within {seconds} s")
    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _attach(name: str) -> KVCacheManager:
    """KVCacheManager(segment=PoolSegment.attach(name)), failing (instead of
    hanging the run) if construction does not return promptly."""
    seg = PoolSegment.attach(name)
    assert not seg.owner
    try:
        with _deadline(ATTACH_TIMEOUT, "KVCacheManager(segment=PoolSegment.attach(name))"):
            return KVCacheManager(segment=seg)
    except TimeoutError as e:
        seg.close()
        pytest.fail(str(e))


def _index(pool) -> list[dict]:
    return [dict(pool.hash_to_block(g).entries())
            for g in range(len(pool.segment.config.groups))]


def _run_workload(sim: Sim, seed: int, steps: int) -> None:
    rnd = random.Random(seed)
    for _ in range(steps):
        random_op(sim, rnd)
    sim.check()


ATTACH_CONFIGS = ["full", "sink_full", "sliding_window", "mamba_spec2", "hybrid_full_sw",
                  "hybrid_full_mamba", "encdec_nocache"]


@pytest.mark.parametrize("name", ATTACH_CONFIGS)
def test_attached_manager_rebuilds_the_same_state(name):
    with _sim(CONFIGS[name]) as sim:
        _run_workload(sim, seed=7, steps=120)
        m = sim.m
        seg_name = m.segment.name
        assert sim.running or sim.waiting, "the workload should leave live requests"
        live = sorted(m.table.slot_of)
        probe = SYSTEM_PROMPTS[0] + [1, 2, 3, 4, 5, 6, 7]
        want_hits = m.get_computed_blocks(Request("probe", probe, m.make_hasher()))
        generation = m.segment.get("generation")
        stats = m.prefix_cache_stats
        m2 = _attach(seg_name)
        try:
            assert m.segment.get("generation") == generation + 1
            assert m.segment.get("coordinator_pid") == os.getpid()
            assert m2.prefix_cache_stats == stats
            assert not m.segment.words[SEQ_WORD] & 1, \
                "attaching left the mutation counter odd (readers would spin, " \
                "check_segment reports a torn segment)"
            p1, p2 = m.block_pool, m2.block_pool
            assert p2.num_free_blocks == p1.num_free_blocks
            assert p2.free_queue() == p1.free_queue()
            assert sorted(m2.table.slot_of) == live
            for rid in live:
                assert m2.get_block_ids(rid) == m.get_block_ids(rid), rid
            for g, (a, b) in enumerate(zip(m.groups.managers, m2.groups.managers)):
                assert b.num_cached_block == a.num_cached_block, g
                assert b.req_to_blocks == a.req_to_blocks, g
            assert _index(p2) == _index(p1)
            got_hits = m2.get_computed_blocks(Request("probe", probe, m2.make_hasher()))
            assert got_hits == want_hits
            rep = check_segment(m2.segment, p2)
            assert rep.clean, rep.summary()
        finally:
            m2.close()
        # The attacher does not unlink: the segment is still there and usable.
        assert os.path.exists(f"/dev/shm/{seg_name}")
        PoolSegment.attach(seg_name).close()
        _run_workload(sim, seed=8, steps=30)  # the owner carries on
    assert not os.path.exists(f"/dev/shm/{seg_name}")


@pytest.mark.parametrize("name", ["full", "sliding_window", "hybrid_full_sw", "mamba_spec2",
                                  "encdec_nocache"])
def test_attached_manager_continues_like_the_original(name):
    """A coordinator restart: pool B is taken over mid-run by a manager
    attached to its segment; it must go on exactly like pool A, which kept
    its original manager (same block ids, same LRU order, same hits)."""
    cfg = CONFIGS[name]
    seed = 11
    with _sim(cfg) as a, _sim(cfg) as b:
        ra, rb = random.Random(seed), random.Random(seed)
        for _ in range(80):
            random_op(a, ra)
            random_op(b, rb)
        assert a.log == b.log
        owner = b.m
        b.m = _attach(owner.segment.name)
        b.hasher = b.m.make_hasher()
        try:
            for i in range(120):
                random_op(a, ra)
                random_op(b, rb)
                assert b.log[-5:] == a.log[-5:], f"diverged after {i} steps"
                assert b.stats == a.stats
                assert b.m.block_pool.free_queue() == a.m.block_pool.free_queue()
                b.check()
        finally:
            b.m.close()
            b.m = owner


_CHILD = textwrap.dedent("""
    import json, sys
    from kvshm import KVCacheManager, PoolSegment, Request
    args = json.loads(sys.stdin.read())
    m = KVCacheManager(segment=PoolSegment.attach(args["name"]))
    out = {
        "free_queue": m.block_pool.free_queue(),
        "block_ids": {rid: [list(g) for g in m.get_block_ids(rid)] for rid in args["rids"]},
    }
    hits, n = m.get_computed_blocks(Request("probe", args["probe"], m.make_hasher()))
    out["hits"] = [[list(g) for g in hits], n]
    m.close()
    print(json.dumps(out))
""")


def test_attach_from_another_process():
    with _sim(CONFIGS["hybrid_full_sw"]) as sim:
        _run_workload(sim, seed=5, steps=120)
        m = sim.m
        rids = sorted(m.table.slot_of)
        probe = SYSTEM_PROMPTS[1] + [3, 1, 4, 1, 5]
        hits, n = m.get_computed_blocks(Request("probe", probe, m.make_hasher()))
        want = {"free_queue": m.block_pool.free_queue(),
                "block_ids": {rid: [list(g) for g in m.get_block_ids(rid)] for rid in rids},
                "hits": [[list(g) for g in hits], n]}
        try:
            proc = subprocess.run([sys.executable, "-c", _CHILD],
                                  input=json.dumps({"name": m.segment.name, "rids": rids,
                                                    "probe": probe}),
                                  capture_output=True, text=True, timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail("KVCacheManager(segment=PoolSegment.attach(name)) hung in a second "
                        f"process (mutation_seq now {m.segment.get('mutation_seq')})")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == want
        assert os.path.exists(f"/dev/shm/{m.segment.name}"), "the attacher unlinked the segment"
        assert not m.segment.words[SEQ_WORD] & 1
        sim.check()


def test_attach_after_a_writer_died_mid_mutation():
    """A writer that died inside a mutation leaves the counter odd; a new
    manager adopting the segment takes over and leaves it even and clean."""
    with _sim(CONFIGS["hybrid_full_sw"]) as sim:
        _run_workload(sim, seed=3, steps=60)
        m = sim.m
        free = m.block_pool.free_queue()
        m.segment.begin_mutation()  # the "dead" writer
        assert "odd mutation counter" in " ".join(
            check_segment(m.segment, timeout=0.01).problems)
        m2 = _attach(m.segment.name)
        try:
            assert not m.segment.words[SEQ_WORD] & 1
            assert m2.block_pool.free_queue() == free
            rep = check_segment(m2.segment, m2.block_pool, timeout=0.5)
            assert rep.clean, rep.summary()
        finally:
            m2.close()


# -- request state integrity ----------------------------------------------------------

def test_request_does_not_alias_the_callers_token_list():
    """A Request owns its token list (vLLM copies the prompt too): appending
    tokens must not grow the caller's list, and later edits of the caller's
    list must not change the request behind its block hashes' back."""
    cfg = CONFIGS["full"]
    with KVCacheManager(cfg) as m:
        prompt = list(range(10))
        r = Request("a", prompt, m.make_hasher())
        r.append_token_ids([7, 7, 7])
        assert prompt == list(range(10)), "append_token_ids grew the caller's prompt list"
        prompt.extend([1, 2, 3, 4, 5])
        assert r.num_tokens == 13, "the caller's edit changed the request"
        assert len(r.block_hashes) == 13 // cfg.hash_block_size


def test_replaying_a_trace_leaves_its_ops_unchanged():
    """replay_trace must not modify the ops it is given: bench_trace (and
    `kvshm replay --bench`) replays the same ops again and must match again."""
    import copy
    from pathlib import Path

    from kvshm.replay import bench_trace, load_trace, replay_trace

    path = Path(__file__).parent / "data/conformance/traces/chunked32-tiny-chat-s1632.jsonl.gz"
    cfg, ops = load_trace(path)
    pristine = copy.deepcopy(ops)
    assert replay_trace(cfg, ops) is None
    changed = [i for i, (a, b) in enumerate(zip(pristine, ops)) if a != b]
    assert not changed, f"the replay modified {len(changed)} ops (first: line {changed[0] + 2})"
    mismatch, _ = bench_trace(cfg, ops, runs=2)
    assert mismatch is None, f"second replay of the same ops: {mismatch}"


def test_external_tokens_do_not_steal_another_groups_hits():
    """Hybrid pool, local prefix hit plus external (P/D) tokens.  vLLM 0.14.0
    allocates group 0's block for the external token before group 1 touches
    its hits, and so hands out block 12, which is also group 1's (free,
    cached) hit: one block in two groups.  kvshm touches every group's hits
    first (regression test for that vLLM bug)."""
    cfg = PoolConfig(num_blocks=15, hash_block_size=4, max_model_len=64, max_num_seqs=4,
                     groups=(FullSpec(4), SlidingWindowSpec(4, sliding_window=8)))
    with KVCacheManager(cfg) as m:
        h = m.make_hasher()
        a = Request("a", list(range(28)), h)
        assert m.allocate_slots(a, 28) == ([1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14])
        a.num_computed_tokens = 28
        m.remove_skipped_blocks("a", 28)  # window blocks 8..12 go back, still cached
        assert m.block_pool.free_queue() == [12, 11, 10, 9, 8]
        c = Request("c", list(range(24)) + [99], h)
        hits, n = m.get_computed_blocks(c)
        assert ([list(g) for g in hits], n) == ([[1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 12, 13]], 24)
        assert m.allocate_slots(c, 0, n, hits, num_external_computed_tokens=1,
                                delay_cache_blocks=True) is not None
        full, window = m.get_block_ids("c")
        shared = set(full) & set(window) - {0}
        assert not shared, f"blocks {sorted(shared)} are held by both groups: {full} / {window}"
