"""Small helpers shared by the allocator tests (imported as `helpers`)."""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
import time
from pathlib import Path

from kvshm import BlockHasher, FullSpec, KVCacheManager, PoolConfig, Request
from kvshm.core.check import check_segment
from kvshm.pool.segment import SHM_DIR, PoolSegment, segment_info


def make_config(groups=(FullSpec(4),), num_blocks: int = 10, **changes) -> PoolConfig:
    """A tiny validated pool: 4-token hash blocks, max_model_len 64."""
    base = dict(num_blocks=num_blocks, hash_block_size=4, max_model_len=64,
                groups=tuple(groups))
    base.update(changes)
    return PoolConfig(**base)


def replay_case(case: dict) -> list[list[str]]:
    """The block hashes kvshm's Request gives a case recorded by
    scripts/record_vllm_hashes.py, step by step."""
    h = BlockHasher(case["algorithm"], case["seed"], case["block_size"],
                    tagged=case.get("vllm_version", "0.14.0") == "0.32.0")
    embeds = bytes.fromhex(case["prompt_embeds"]) if case["prompt_embeds"] else None
    prompt = case["prompt"] if case["prompt"] is not None else [0] * case["prompt_len"]
    r = Request("r", prompt, h, lora_name=case["lora_name"], cache_salt=case["cache_salt"],
                mm_features=case["mm_features"], prompt_embeds=embeds,
                lora_path=case.get("lora_path"))
    steps = [[x.hex() for x in r.block_hashes]]
    for chunk in case["appends"]:
        n = len(r.block_hashes)
        r.append_token_ids(chunk)
        steps.append([x.hex() for x in r.block_hashes[n:]])
    return steps


def tokens(start: int, stop: int) -> list[int]:
    return list(range(start, stop))


def step(r: Request, num_computed_tokens: int, append=()) -> None:
    """What the scheduler does between two steps."""
    r.num_computed_tokens = num_computed_tokens
    if append:
        r.append_token_ids(list(append))


def ids(blocks) -> list[list[int]] | None:
    """Block ids per group as plain lists (None stays None)."""
    return None if blocks is None else [list(g) for g in blocks]


def lookup(m: KVCacheManager, r: Request):
    """get_computed_blocks with the hit lists as plain lists."""
    blocks, n = m.get_computed_blocks(r)
    return ids(blocks), n


def assert_clean(m: KVCacheManager) -> None:
    report = check_segment(m.segment, m.block_pool)
    assert report.clean, report.problems


async def until(cond, timeout: float = 2.0) -> None:
    """Let the event loop run until cond() holds (fail after `timeout` s)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def fully_allocated(name: str) -> bool:
    """Whether every page of /dev/shm/`name` is allocated (not sparse)."""
    st = os.stat(f"{SHM_DIR}/{name}")
    return st.st_blocks * 512 >= st.st_size


def kvshm_segments() -> set[str]:
    """Names of the kvshm-looking segments in /dev/shm now."""
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith("kvshm")}
    except OSError:
        return set()


def cmdline(p) -> str:
    """A psutil process's command line as one string ("" once it is gone)."""
    import psutil
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def descendants_when(proc, ready, timeout: float = 30.0) -> list:
    """The descendants (psutil processes) of subprocess `proc` once their
    command lines satisfy `ready` (a predicate on the list of them); fails
    if `proc` exits or `timeout` passes first."""
    import psutil
    me = psutil.Process(proc.pid)
    deadline = time.monotonic() + timeout
    while True:
        children = me.children(recursive=True)
        cmds = [cmdline(c) for c in children]
        if ready(cmds):
            return children
        assert proc.poll() is None and time.monotonic() < deadline, cmds
        time.sleep(0.1)


def kill_all(proc, children) -> None:
    """What a failed test leaves: kill subprocess `proc` and `children`
    (psutil checks each is still the same process)."""
    import psutil
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass


def leftovers(before: set[str]) -> list[str]:
    """Segments that appeared since `before` and were left by this run: owned
    by this process or by a process that died (a live segment of another
    program on the host is not ours to judge)."""
    def left(name: str) -> bool:
        info = segment_info(name)
        return info is None or info["pid"] == os.getpid() or not info["alive"]

    found = [name for name in sorted(kvshm_segments() - before) if left(name)]
    if found:
        # A test running beside this one may be creating a segment (no header
        # yet) or restarting the coordinator it killed (which adopts the
        # segment in a moment): a leftover is one that stays so.
        time.sleep(LEFTOVER_GRACE)
        found = [name for name in found if name in kvshm_segments() and left(name)]
    return found


# Seconds a segment must stay without a live owner to be a leftover.
LEFTOVER_GRACE = 3.0


def check_pool(name: str):
    """`kvshm check` of pool `name` from outside its coordinator."""
    seg = PoolSegment.attach(name)
    try:
        return check_segment(seg)
    finally:
        seg.close()


SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def import_script(name: str):
    """The module of scripts/NAME.py, imported as the scripts import one
    another (scripts/ on sys.path for the import only)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPTS))
