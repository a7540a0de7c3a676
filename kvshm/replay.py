"""Conformance-trace replay in embedded mode (the core, in-process).

A trace (tests/data/conformance/FORMAT.md) is a config line followed by ops
recorded from vLLM's own KVCacheManager; replaying it executes every op on a
fresh kvshm pool and compares each recorded `expect` with what kvshm returned.
"""

from __future__ import annotations

import gzip
import json
import statistics
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvshm.core.errors import DuplicateRequest, UnknownRequest
from kvshm.core.manager import KVCacheManager
from kvshm.core.request import Request
from kvshm.core.specs import CrossAttentionSpec, PoolConfig

FREE_HEAD_LEN = 64


def expand_paths(paths: Iterable[str | Path]) -> Iterator[Path]:
    """Files as given; directories searched for *.jsonl.gz and *.jsonl."""
    for p in map(Path, paths):
        if p.is_dir():
            yield from sorted([*p.rglob("*.jsonl.gz"), *p.rglob("*.jsonl")])
        else:
            yield p


def load_trace(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or lines[0].get("kind") != "config":
        raise ValueError(f"{path}: line 1 is not a config line")
    return lines[0], lines[1:]


def trace_pool_config(cfg: dict[str, Any], ops: list[dict[str, Any]]) -> PoolConfig:
    """The pool config for a trace: its config line, with a request table
    sized for its requests and its encoder lengths."""
    num_requests = sum(1 for op in ops if op["op"] == "add_request")
    config = PoolConfig.from_dict(cfg, max_num_seqs=max(1, num_requests))
    if any(isinstance(g, CrossAttentionSpec) for g in config.groups):
        enc = max((op.get("num_encoder_tokens", 0) for op in ops), default=0)
        config = config.replace(max_encoder_len=max(enc, config.max_model_len)).validate()
    return config


class EmbeddedReplayer:
    """Executes trace ops on a `KVCacheManager`, keeping request state as a
    scheduler would."""

    def __init__(self, config: PoolConfig) -> None:
        self.mgr = KVCacheManager(config)
        self.hasher = self.mgr.make_hasher()
        self.reqs: dict[str, Request] = {}
        self.last_computed: dict[str, Any] = {}
        self._dispatch = {name[3:]: getattr(self, name) for name in dir(self)
                          if name.startswith("op_")}

    def close(self) -> None:
        self.mgr.close()

    def apply(self, op: dict[str, Any]) -> dict[str, Any] | None:
        fn = self._dispatch.get(op["op"])
        if fn is None:
            raise ValueError(f"unknown op {op['op']!r}")
        return fn(op)

    def _req(self, rid: str) -> Request:
        req = self.reqs.get(rid)
        if req is None:
            raise UnknownRequest(rid)
        return req

    def op_add_request(self, op):
        rid = op["req"]
        if rid in self.reqs:
            raise DuplicateRequest(rid)
        prompt = op["prompt"]
        prefix = op.get("prefix")
        if prefix:
            prompt = self._req(prefix["req"]).all_token_ids[:prefix["len"]] + prompt
        self.reqs[rid] = Request(
            rid, prompt, self.hasher,
            lora_name=op.get("lora_name"), cache_salt=op.get("cache_salt"),
            skip_reading_prefix_cache=bool(op.get("skip_prefix_cache_read", False)))
        return None

    def op_get_computed_blocks(self, op):
        req = self._req(op["req"])
        blocks, n = self.mgr.get_computed_blocks(req)
        self.last_computed[req.request_id] = blocks
        return {"block_ids": [list(g) for g in blocks], "num_computed_tokens": n}

    def op_allocate_slots(self, op):
        req = self._req(op["req"])
        get = op.get
        res = self.mgr.allocate_slots(
            req, op["num_new_tokens"],
            num_new_computed_tokens=get("num_new_computed_tokens", 0),
            new_computed_blocks=(self.last_computed[req.request_id]
                                 if get("use_computed_blocks") else None),
            num_lookahead_tokens=get("num_lookahead_tokens", 0),
            num_external_computed_tokens=get("num_external_computed_tokens", 0),
            delay_cache_blocks=get("delay_cache_blocks", False),
            num_encoder_tokens=get("num_encoder_tokens", 0))
        return {"new_block_ids": None if res is None else list(res),
                "num_free_blocks": self.mgr.num_free_blocks}

    def op_advance(self, op):
        req = self._req(op["req"])
        req.num_computed_tokens = op["num_computed_tokens"]
        append = op.get("append")
        if append:
            req.append_token_ids(append)
        return None

    def op_cache_blocks(self, op):
        self.mgr.cache_blocks(self._req(op["req"]), op["num_computed_tokens"])
        return None

    def op_remove_skipped_blocks(self, op):
        self.mgr.remove_skipped_blocks(op["req"], op["total_computed_tokens"])
        return {"num_free_blocks": self.mgr.num_free_blocks}

    def op_free(self, op):
        req = self._req(op["req"])
        self.mgr.free(req)
        if op.get("reason") == "preempt":
            req.num_preemptions += 1
        return {"num_free_blocks": self.mgr.num_free_blocks}

    def op_get_block_ids(self, op):
        return {"block_ids": list(self.mgr.get_block_ids(op["req"]))}

    def op_num_common_prefix_blocks(self, op):
        return {"num_blocks": self.mgr.get_num_common_prefix_blocks(op["req"])}

    def op_reset_prefix_cache(self, op):
        return {"ok": self.mgr.reset_prefix_cache()}

    def op_evict_blocks(self, op):
        self.mgr.evict_blocks(op["block_ids"])
        return {"num_free_blocks": self.mgr.num_free_blocks}

    def op_usage(self, op):
        return {"usage": self.mgr.usage}

    def op_check(self, op):
        pool = self.mgr.block_pool
        return {"num_free_blocks": pool.num_free_blocks,
                "free_head": pool.free_queue(FREE_HEAD_LEN)}


@dataclass
class Mismatch:
    line: int
    op: str
    request: str
    expected: Any
    got: Any

    def __str__(self) -> str:
        who = f" {self.request}" if self.request else ""
        return (f"line {self.line} ({self.op}{who}): expected {self.expected!r}, "
                f"got {self.got!r}")


def differs(op: dict[str, Any], got: dict[str, Any] | None) -> bool:
    want = op.get("expect")
    if want is None:
        return False
    if op["op"] == "usage":
        return got is None or abs(want["usage"] - got["usage"]) > 1e-9
    return want != got


def replay_ops(replayer: EmbeddedReplayer, ops: list[dict[str, Any]]) -> Mismatch | None:
    """Run every op; the first mismatch (line numbers count the config line
    as line 1), or None.  An exception from kvshm counts as a mismatch."""
    apply = replayer.apply
    for i, op in enumerate(ops):
        try:
            got = apply(op)
        except Exception as e:  # noqa: BLE001 - reported as the mismatch
            return Mismatch(i + 2, op["op"], op.get("req", ""), op.get("expect"),
                            f"raised {type(e).__name__}: {e}")
        if differs(op, got):
            return Mismatch(i + 2, op["op"], op.get("req", ""), op.get("expect"), got)
    return None


def replay_trace(cfg: dict[str, Any], ops: list[dict[str, Any]],
                 after=None) -> Mismatch | None:
    """Replay on a fresh pool; `after(manager)` runs before the pool closes
    (e.g. an invariant check)."""
    r = EmbeddedReplayer(trace_pool_config(cfg, ops))
    try:
        mismatch = replay_ops(r, ops)
        if after is not None:
            after(r.mgr)
        return mismatch
    finally:
        r.close()


def bench_trace(cfg: dict[str, Any], ops: list[dict[str, Any]],
                runs: int = 3) -> tuple[Mismatch | None, list[float]]:
    """Time full replays (a fresh pool each, parsing excluded, every expect
    checked), as the reference runner does.  Returns (mismatch, seconds)."""
    config = trace_pool_config(cfg, ops)
    times = []
    mismatch = None
    for _ in range(runs):
        t0 = time.perf_counter()
        r = EmbeddedReplayer(config)
        mismatch = replay_ops(r, ops)
        times.append(time.perf_counter() - t0)
        r.close()
        if mismatch:
            break
    return mismatch, times


def median_ops_per_second(num_ops: int, times: list[float]) -> float:
    return num_ops / statistics.median(times)
