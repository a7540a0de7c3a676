"""Crash points, swept: the coordinator `os._exit`s at a chosen point inside
a chosen operation (kvshm/core/faults.py, KVSHM_CRASH), is restarted with
the same command line, adopts and repairs its pool, and the resumed clients
finish their script with exactly the replies of a run without the crash.

Which points each operation reaches is traced in-process first, so the
sweep covers every reachable (operation, point) pair and says how many.
Bounded in CI: `after` at every reachable point, `before` at every third;
KVSHM_CRASH_SWEEP=all runs both sides of every point, and
KVSHM_CRASH_RANDOM=N runs N randomized crashes (default 3), each printing
its seed.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import secrets

import msgspec
import pytest

from helpers import make_config, tokens
from kvshm import FullSpec, SlidingWindowSpec
from kvshm.core.check import check_segment
from kvshm.core.faults import CRASH_EXIT_CODE, ENV, CrashSpec
from kvshm.ops import protocol as p
from kvshm.pool.segment import PoolSegment, remove_segment, segment_info
from kvshm.service.client import connect
from kvshm.service.process import CoordinatorProcess
from kvshm.service.resume import Reconnect
from kvshm.service.server import Coordinator, crash_classes

CFG = make_config(groups=(FullSpec(4), SlidingWindowSpec(4, 8)), num_blocks=96,
                  max_num_seqs=16)
FAST = Reconnect(initial_delay=0.01, max_delay=0.05, timeout=30)
# The ops (handlers) a crash is armed in: every op that writes the segment
# (AddRequest and Advance only touch the coordinator's memory); _free covers
# preemption too, SessionLifecycle.close the end of a session, execute_frame
# what a frame does around its ops (the seq record, the commit).
ARMS = tuple(f"OpExecutor.{m}" for m in ("_hits", "_alloc", "_admit", "_cache", "_free",
                                         "_skip", "_common", "_evict", "_reset",
                                         "execute_frame")) + ("SessionLifecycle.close",)
# The classes a crash spec may name: the coordinator process resolves
# them from the same table.
CLASSES = crash_classes()
# Methods a crash may cut: every writer of pool state, the journal, the
# frame record and the reply.
TARGETS = {
    "BlockPool": ("get_new_blocks", "touch", "free_blocks", "cache_block", "_evict",
                  "evict_blocks", "reset_prefix_cache", "record_lookup", "publish",
                  "_popleft_n", "_remove", "_append_n"),
    "RequestTable": ("slot", "release", "write_blocks", "write_null", "write_num_cached",
                     "drop", "set_owner"),
    "Journal": ("begin", "commit", "row", "ids", "slot_meta", "stats", "session"),
    "KVCacheManager": ("begin_frame", "commit_frame"),
    "SessionTable": ("record_frame", "_keep", "release"),
    "Session": ("_reply",),
}


def _plain(x):
    return msgspec.to_builtins(x)


async def script(c, d, pool_name: str) -> list:
    """Every mutating op type, over two sessions (d ends half-way); the
    replies it saw, as plain data."""
    out: list = []

    def rec(x):
        out.append(msgspec.to_builtins(x))

    await c.add_request("a", tokens(0, 22))
    rec(await c.get_computed_blocks("a"))
    rec(await c.allocate_slots("a", 22, 0, use_computed_blocks=True))
    await c.advance("a", 22, [500])
    rec(await c.allocate_slots("a", 1, delay_cache_blocks=True))
    await c.cache_blocks("a", 23)
    rec(await c.get_num_common_prefix_blocks("a"))
    rec(await c.remove_skipped_blocks("a", 23))
    await c.add_request("b", tokens(0, 22) + [500])
    rec(await c.admit("b", 30))
    rec(await c.batch([p.Advance("b", 23, [501]), p.AllocateSlots("b", 1),
                       p.CacheBlocks("b", 24)]))
    rec(await c.free("b", preempted=True))
    await c.advance("b", 0)
    rec(await c.admit("b", 30))
    rec(await c.free("a"))
    rec(await c.evict_blocks([1, 2]))
    await d.add_request("d1", tokens(200, 215))
    rec(await d.allocate_slots("d1", 15))
    await d.cache_blocks("d1", 12)
    await d.close()                     # the session ends: d1 is freed
    await _until_served_requests(c, 1)
    rec(await c.free("b"))
    rec(await c.reset_prefix_cache())
    await c.add_request("e", tokens(0, 22))
    rec(await c.get_computed_blocks("e"))
    return out


async def _until_served_requests(c, n: int, timeout: float = 15.0) -> None:
    """Until the coordinator (not a torn segment) holds `n` requests (a
    session end cut off by a crash completes when the restart adopts the
    pool)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (await c.stats()).num_requests != n:
        assert loop.time() < deadline, "the coordinator did not settle"
        await asyncio.sleep(0.01)


async def _until_requests(pool_name: str, n: int, timeout: float = 15.0) -> None:
    seg = PoolSegment.attach(pool_name)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while seg.get("num_requests") != n:
            assert loop.time() < deadline, f"{seg.get('num_requests')} requests, want {n}"
            await asyncio.sleep(0.01)
    finally:
        seg.close()


async def _clients(sock):
    kw = dict(hash_algorithm=CFG.hash_algorithm, hash_seed=CFG.hash_seed, reconnect=FAST)
    return (await connect(sock, admin=True, **kw), await connect(sock, **kw))


async def _drive(proc: CoordinatorProcess, body):
    """Run `body(c, d)` while a supervisor restarts the coordinator if it
    crashes; returns (result, whether it crashed)."""
    crashed = []

    async def supervise():
        while True:
            await asyncio.sleep(0.01)
            if proc.proc.poll() is not None:
                crashed.append(proc.proc.returncode)
                proc.restart(wait=False)
                await asyncio.to_thread(proc.wait_ready)
                return

    sup = asyncio.ensure_future(supervise())
    c, d = await _clients(proc.socket)
    try:
        result = await body(c, d)
        await c.close()
        await _until_requests(proc.name, 0)
    finally:
        sup.cancel()
        await c.close()
        await d.close()
    assert crashed in ([], [CRASH_EXIT_CODE]), crashed
    return result, bool(crashed)


def _run_case(spec: CrashSpec | None, body) -> tuple[list, bool]:
    name = f"kvshm-test-{secrets.token_hex(5)}"
    env = dict(os.environ)
    if spec is not None:
        env[ENV] = str(spec)
    try:
        # The grace a restarted coordinator gives a session to resume is
        # long: no case waits for it.  A client reconnects within ~50 ms, but
        # a loaded CI machine has delayed it past 3 s; and a session whose
        # end the crash cut short has no record left, so the restart ends it at
        # once (a case would time out below if it waited for the grace).
        with CoordinatorProcess(CFG, name=name, env=env,
                                extra_args=("--resume-grace", "60")) as proc:
            res, crashed = asyncio.run(_drive(proc, lambda c, d: body(c, d, name)))
            seg = PoolSegment.attach(name)
            try:
                report = check_segment(seg)
            finally:
                seg.close()
            assert report.clean, report.problems
            assert report.num_requests == 0 and report.num_free_blocks == CFG.num_blocks - 1
        assert segment_info(name) is None
        return res, crashed
    finally:
        if segment_info(name) is not None:
            remove_segment(name, force=True)


# -- which points each op reaches ------------------------------------------------------------------
def _trace_reachable() -> list[tuple[str, str]]:
    """(arm, point) pairs the script reaches, from an in-process run with
    recording wrappers (installed before the executor binds its handlers)."""
    seen: set[tuple[str, str]] = set()
    current: list[str] = []
    saved = []

    # Points are named as a crash spec names them: by the table's key
    # (the core's manager is "KVCacheManager", as users know it).
    def wrap(cls_name, name, fn):
        @functools.wraps(fn)
        def w(*a, **k):
            if current:
                seen.add((current[-1], f"{cls_name}.{name}"))
            return fn(*a, **k)
        return w

    def arm(cls_name, name, fn):
        @functools.wraps(fn)
        def w(*a, **k):
            current.append(f"{cls_name}.{name}")
            try:
                return fn(*a, **k)
            finally:
                current.pop()
        return w

    for cls_name, methods in TARGETS.items():
        cls = CLASSES[cls_name]
        for m in methods:
            saved.append((cls, m, getattr(cls, m)))
            setattr(cls, m, wrap(cls_name, m, getattr(cls, m)))
    for a in ARMS:
        cls_name, m = a.split(".")
        cls = CLASSES[cls_name]
        saved.append((cls, m, getattr(cls, m)))
        setattr(cls, m, arm(cls_name, m, getattr(cls, m)))
    try:
        async def run():
            import tempfile
            d = tempfile.mkdtemp(prefix="kvshm-t-")
            name = f"kvshm-test-{secrets.token_hex(5)}"
            coord = Coordinator(CFG, name=name, socket_path=f"{d}/s.sock")
            await coord.start()
            try:
                c, dd = await _clients(coord.socket_path)
                await script(c, dd, name)
                await c.close()
            finally:
                await coord.stop()
        asyncio.run(run())
    finally:
        for cls, m, fn in saved:
            setattr(cls, m, fn)
    return sorted(seen)


REACHABLE = _trace_reachable()
SIDES = [(arm, point, side) for arm, point in REACHABLE for side in ("after", "before")]
if os.environ.get("KVSHM_CRASH_SWEEP") != "all":
    SIDES = [(a, pt, s) for i, (a, pt, s) in enumerate(SIDES) if s == "after" or i % 6 == 1]


@pytest.fixture(scope="module")
def reference():
    res, crashed = _run_case(None, script)
    assert not crashed
    return res


def test_the_sweep_covers_every_op_type():
    arms = {a for a, _ in REACHABLE}
    assert arms == set(ARMS), set(ARMS) - arms
    print(f"\ncrash sweep: {len(REACHABLE)} reachable (op, point) pairs, "
          f"{len(SIDES)} crash cases in this run")


@pytest.mark.parametrize("arm,point,side", SIDES,
                         ids=[f"{a.split('.')[1]}-{pt}-{s}" for a, pt, s in SIDES])
def test_crash_point(reference, arm, point, side):
    spec = CrashSpec(f"{point}:{side}", arm, 1)
    res, crashed = _run_case(spec, script)
    assert crashed, f"{spec} was traced as reachable but never fired"
    assert res == reference


@pytest.mark.parametrize("nth", (3, 9, 16))
def test_a_crash_between_a_frames_commit_and_its_reply(reference, nth):
    """The frame took effect but its reply never left: the resumed client
    gets the kept reply, and the call is not applied twice."""
    res, crashed = _run_case(CrashSpec("Session._reply:before", "Session._answer", nth),
                             script)
    assert crashed and res == reference


# -- randomized: a random workload, a crash at a random mutation -----------------------------------
async def random_script(c, d, pool_name: str, seed: int) -> list:
    rng = random.Random(seed)
    out: list = []
    live: dict[str, int] = {}
    n = 0
    for _ in range(40):
        choice = rng.random()
        if choice < 0.3 or not live:
            rid = f"r{n}"
            n += 1
            prompt = tokens(0, rng.choice((8, 12, 20))) + tokens(1000 + n, 1000 + n + rng.randint(1, 9))
            await c.add_request(rid, prompt)
            r = await c.admit(rid, 64)
            out.append(_plain(r))
            if r.new_block_ids is None:
                await c.free(rid)
            else:
                live[rid] = len(prompt)
        elif choice < 0.7:
            rid = rng.choice(sorted(live))
            ln = live[rid]
            if ln + 1 < CFG.max_model_len:
                await c.advance(rid, ln, [rng.randrange(100)])
                out.append(_plain(await c.batch([p.AllocateSlots(rid, 1, delay_cache_blocks=True),
                                                 p.CacheBlocks(rid, ln)])))
                live[rid] = ln + 1
        elif choice < 0.85:
            rid = rng.choice(sorted(live))
            out.append(await c.free(rid))
            del live[rid]
        else:
            rid = rng.choice(sorted(live))
            out.append(await c.free(rid, preempted=True))
            await c.advance(rid, 0)
            await c.free(rid)
            del live[rid]
    return out


@pytest.mark.parametrize("k", range(int(os.environ.get("KVSHM_CRASH_RANDOM", "3"))))
def test_a_random_crash_in_a_random_workload(k):
    seed = int(os.environ.get("KVSHM_CRASH_SEED", random.randrange(2**31))) + k
    print(f"\nrandom crash seed {seed} (KVSHM_CRASH_SEED={seed - k} repeats it)")
    _random_case(seed)


# Seeds that once diverged, kept as fixed cases.  Both crashed a pool where
# a request hit blocks another request of its session had cached pending;
# adoption gave the blocks to the wrong request (the segment now keeps the
# writer: core/state.py).  (What a seed draws follows REACHABLE, so a
# change to the traced points makes these different cases.)
@pytest.mark.parametrize("seed", [842998843, 270893616])
def test_a_random_crash_that_once_diverged(seed):
    _random_case(seed)


def _random_case(seed: int) -> None:
    rng = random.Random(seed)
    targets = [pt for _, pt in REACHABLE]
    spec = CrashSpec(f"{rng.choice(targets)}:{rng.choice(('before', 'after'))}",
                     "OpExecutor.execute_frame", rng.randint(1, 60))
    body = functools.partial(_random_body, seed=seed)
    want, _ = _run_case(None, body)
    got, crashed = _run_case(spec, body)
    assert got == want, (seed, str(spec), crashed)


async def _random_body(c, d, name, seed):
    return await random_script(c, d, name, seed)
