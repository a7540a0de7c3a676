#!/usr/bin/env python3
"""The installed vLLM's own KV-cache manager, driven by conformance-trace
ops: the recorder's engine (scripts/record_vllm_traces.py) and a replayer
for debugging a kvshm mismatch against the release that recorded a trace.

    .venv-vllm-0.32.0/bin/python scripts/vllm_oracle.py tests/data/conformance-0.32.0/traces
    .venv-vllm/bin/python scripts/vllm_oracle.py TRACE.jsonl.gz        # 0.14.0's traces
    .venv-vllm-0.32.0/bin/python scripts/vllm_oracle.py --events OUT TRACES   # + KV events

Runs in a vLLM environment (./scripts/vllm_env.sh [VERSION]), on the
release's code as installed: nothing is patched.  `Release` builds a
manager for a trace's config line the way that release's scheduler does
(0.32.0 takes the scheduler block size, the in-flight token bound, the
prefill lookahead and the watermark from the line); `Driver` runs one op on
it and returns what the release answered in the trace's `expect` shape.
Replaying prints the first op whose answer differs from the trace's; a
trace replays on the release that recorded it, so a difference there is a
bug of the recorder.  `--events DIR` also writes, per trace whose pool
caches, the KV events the release's manager emitted (`take_events()` after
every op, as a subscriber decodes them) in the event-stream format of
tests/data/conformance/EVENTS.md.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from pathlib import Path

HASH_SEED = "kvshm-oracle-0"   # PYTHONHASHSEED for the parent of block 0, as the stored set
FREE_HEAD_LEN = 64


class Release:
    """The installed vLLM: its version, and a manager built for a trace's
    config the way that release's scheduler builds one."""

    def __init__(self) -> None:
        os.environ["PYTHONHASHSEED"] = HASH_SEED
        import torch
        from vllm import version
        from vllm.utils.hashing import sha256
        from vllm.v1 import kv_cache_interface as ki
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.request import Request, RequestStatus

        self.version = version.__version__.split("+", 1)[0]
        if self.version not in ("0.14.0", "0.32.0"):
            sys.exit(f"record_vllm_traces.py records vLLM 0.14.0 or 0.32.0, not {self.version}")
        self.v32 = self.version == "0.32.0"
        kv_cache_utils.init_none_hash(sha256)
        self.torch, self.ki, self.utils = torch, ki, kv_cache_utils
        self.sha256, self.Manager, self.Request = sha256, KVCacheManager, Request
        self.RequestStatus = RequestStatus
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import SamplingParams
        self.LoRARequest = LoRARequest
        self.params = SamplingParams(max_tokens=1)   # the manager reads none of it

    def spec(self, g: dict):
        ki, attn = self.ki, dict(num_kv_heads=8, head_size=64, dtype=self.torch.float16)
        t, bs = g["type"], g["block_size"]
        if t == "mamba":
            extra = {"mamba_cache_mode": g.get("mamba_cache_mode", "none")} if self.v32 else {}
            return ki.MambaSpec(block_size=bs, shapes=((4, 64),), dtypes=(self.torch.float16,),
                                num_speculative_blocks=g.get("num_speculative_blocks", 0), **extra)
        cls, fields = {
            "full": (ki.FullAttentionSpec, ()), "mla": (ki.MLAAttentionSpec, ()),
            "sliding_window": (ki.SlidingWindowSpec, ("sliding_window",)),
            "chunked_local": (ki.ChunkedLocalAttentionSpec, ("attention_chunk_size",)),
            "sink_full": (ki.SinkFullAttentionSpec, ("sink_len",)),
            "cross_attention": (ki.CrossAttentionSpec, ()),
        }[t]
        return cls(block_size=bs, **attn, **{f: g[f] for f in fields})

    def manager(self, cfg: dict, events: bool = False):
        ki = self.ki
        groups = [ki.KVCacheGroupSpec(layer_names=[f"model.layers.{i}"], kv_cache_spec=self.spec(g))
                  for i, g in enumerate(cfg["groups"])]
        common = dict(max_model_len=cfg["max_model_len"], hash_block_size=cfg["hash_block_size"],
                      enable_caching=cfg["enable_caching"], use_eagle=cfg["use_eagle"],
                      log_stats=False, enable_kv_cache_events=events,
                      dcp_world_size=cfg["dcp_world_size"], pcp_world_size=1,
                      metrics_collector=None)
        if not self.v32:
            kv = ki.KVCacheConfig(num_blocks=cfg["num_blocks"], kv_cache_tensors=[],
                                  kv_cache_groups=groups)
            return self.Manager(kv_cache_config=kv, **common)
        kv = ki.KVCacheConfig(num_blocks=cfg["num_blocks"], kv_cache_tensors=[],
                              kv_cache_groups=groups,
                              prefix_cache_retention_interval=cfg["prefix_cache_retention_interval"])
        return self.Manager(kv_cache_config=kv, scheduler_block_size=cfg["scheduler_block_size"],
                            max_in_flight_tokens=cfg["max_in_flight_tokens"],
                            num_prefill_lookahead=cfg["num_prefill_lookahead"],
                            watermark=cfg["watermark"], **common)


class Driver:
    """One manager and the request objects a scheduler holds; `apply` runs a
    trace op on them and returns (and keeps) the op with its expect."""

    def __init__(self, release: Release, cfg: dict, events: bool = False) -> None:
        self.r, self.cfg = release, cfg
        self.mgr = release.manager(cfg, events)
        self.pool = self.mgr.block_pool
        self.hasher = (release.utils.get_request_block_hasher(cfg["hash_block_size"], release.sha256)
                       if cfg["enable_caching"] else None)
        self.reqs: dict = {}
        self.hits: dict = {}
        self.lora_ids: dict[str, int] = {}
        self.lines: list[dict] = []

    def apply(self, op: dict):
        expect = getattr(self, "op_" + op["op"])(op)
        if expect is not None:
            op["expect"] = expect
        self.lines.append(op)
        return expect

    def free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def op_add_request(self, op):
        prompt = list(op["prompt"])
        if "prefix" in op:
            prompt = list(self.reqs[op["prefix"]["req"]].all_token_ids[:op["prefix"]["len"]]) + prompt
        lora = None
        if op.get("lora_name"):
            lid = self.lora_ids.setdefault(op["lora_name"], len(self.lora_ids) + 1)
            lora = self.r.LoRARequest(op["lora_name"], lid, op.get("lora_path", ""))
        positional = (self.r.params, None) + (() if self.r.v32 else (None,))  # 0.14: eos_token_id
        req = self.r.Request(op["req"], prompt, *positional, lora_request=lora,
                             cache_salt=op.get("cache_salt"), block_hasher=self.hasher)
        req.skip_reading_prefix_cache = bool(op.get("skip_prefix_cache_read", False))
        self.reqs[op["req"]] = req

    def op_new_step_starts(self, op):
        self.mgr.new_step_starts()

    def op_get_computed_blocks(self, op):
        req = self.reqs[op["req"]]
        out = self.mgr.get_computed_blocks(req)
        self.hits[op["req"]] = out[0]
        expect = {"block_ids": [list(g) for g in out[0].get_block_ids()],
                  "num_computed_tokens": out[1]}
        if self.r.v32:
            expect["shared_prefix_boundary"] = out[2]
            req.shared_prefix_boundary = out[2]     # as 0.32's scheduler does with it
        return expect

    def op_allocate_slots(self, op):
        req = self.reqs[op["req"]]
        kw = dict(num_new_computed_tokens=op.get("num_new_computed_tokens", 0),
                  new_computed_blocks=self.hits[op["req"]] if op.get("use_computed_blocks") else None,
                  num_lookahead_tokens=op.get("num_lookahead_tokens", 0),
                  num_external_computed_tokens=op.get("num_external_computed_tokens", 0),
                  delay_cache_blocks=op.get("delay_cache_blocks", False),
                  num_encoder_tokens=op.get("num_encoder_tokens", 0))
        if self.r.v32:
            kw.update(full_sequence_must_fit=op.get("full_sequence_must_fit", False),
                      has_scheduled_reqs=op.get("has_scheduled_reqs", True),
                      reserved_blocks=op.get("reserved_blocks", 0))
            status = self.r.RequestStatus
            req.status = status.WAITING if op.get("waiting") else status.RUNNING
        res = self.mgr.allocate_slots(req, op["num_new_tokens"], **kw)
        return {"new_block_ids": None if res is None else [list(g) for g in res.get_block_ids()],
                "num_free_blocks": self.free_blocks()}

    def op_advance(self, op):
        req = self.reqs[op["req"]]
        req.num_computed_tokens = op["num_computed_tokens"]
        if op.get("append"):
            req.append_output_token_ids(list(op["append"]))

    def op_cache_blocks(self, op):
        self.mgr.cache_blocks(self.reqs[op["req"]], op["num_computed_tokens"])

    def op_remove_skipped_blocks(self, op):
        self.mgr.remove_skipped_blocks(op["req"], op["total_computed_tokens"])
        return {"num_free_blocks": self.free_blocks()}

    def op_free(self, op):
        req = self.reqs[op["req"]]
        self.mgr.free(req)
        if op.get("reason") == "preempt":
            req.num_preemptions += 1
        return {"num_free_blocks": self.free_blocks()}

    def op_get_block_ids(self, op):
        return {"block_ids": [list(g) for g in self.mgr.get_block_ids(op["req"])]}

    def op_num_common_prefix_blocks(self, op):
        return {"num_blocks": list(self.mgr.get_num_common_prefix_blocks(op["req"]))}

    def op_estimate_cached_tokens(self, op):
        return {"num_tokens": self.mgr.estimate_cached_tokens(self.reqs[op["req"]])}

    def op_reset_prefix_cache(self, op):
        return {"ok": bool(self.mgr.reset_prefix_cache())}

    def op_evict_blocks(self, op):
        self.mgr.evict_blocks(set(op["block_ids"]))
        return {"num_free_blocks": self.free_blocks()}

    def op_usage(self, op):
        return {"usage": float(self.mgr.usage)}

    def op_check(self, op):
        q, out = self.pool.free_block_queue, []
        blk = q.fake_free_list_head.next_free_block
        while blk is not None and blk is not q.fake_free_list_tail and len(out) < FREE_HEAD_LEN:
            out.append(blk.block_id)
            blk = blk.next_free_block
        return {"num_free_blocks": self.free_blocks(), "free_head": out}


def load(path: Path) -> tuple[dict, list[dict]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return lines[0], lines[1:]


def replay(release: Release, path: Path, events: Path | None = None) -> str | None:
    """None when every op of the trace at `path` gets its recorded answer,
    else the first difference.  `events`: write the manager's KV events
    (of a pool that caches) to this directory."""
    import msgspec
    cfg, ops = load(path)
    if cfg.get("vllm_version", "0.14.0") != release.version:
        return f"recorded from vLLM {cfg.get('vllm_version', '0.14.0')}, this is {release.version}"
    events = events if events is not None and cfg["enable_caching"] else None
    driver = Driver(release, cfg, events is not None)
    stream = []
    for n, op in enumerate(ops, start=2):
        want = op.get("expect")
        got = driver.apply({k: v for k, v in op.items() if k != "expect"})
        same = (want == got if op["op"] != "usage"
                else abs(want["usage"] - got["usage"]) <= 1e-9)
        if not same:
            return f"line {n} ({op['op']} {op.get('req', '')}): recorded {want}, now {got}"
        if events is not None:
            got_events = driver.mgr.take_events()
            if got_events:
                stream.append({"line": n, "events": msgspec.msgpack.decode(
                    msgspec.msgpack.encode(got_events))})
    if events is not None:
        name = path.name.split(".")[0]
        header = {"kind": "events", "trace": name, "recorded_from": f"vllm {release.version}",
                  "int_block_hashes": True, "num_groups": len(cfg["groups"]),
                  "num_events": sum(len(row["events"]) for row in stream)}
        with gzip.open(events / f"{name}.events.jsonl.gz", "wt", encoding="utf-8") as f:
            for row in [header, *stream]:
                f.write(json.dumps(row, separators=(",", ":")) + "\n")
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", type=Path, help="trace files or directories")
    ap.add_argument("--events", type=Path, metavar="DIR",
                    help="write each caching trace's KV events here (EVENTS.md's format)")
    args = ap.parse_args(argv)
    if args.events is not None:
        args.events.mkdir(parents=True, exist_ok=True)
    paths = [q for p in args.traces for q in (sorted(p.glob("*.jsonl.gz")) if p.is_dir() else [p])]
    release, failed = Release(), 0
    for path in paths:
        why = replay(release, path, args.events)
        if why is not None:
            failed += 1
            print(f"{path.name}: {why}")
    print(f"vLLM {release.version}: passed {len(paths) - failed}/{len(paths)}")
    return 1 if failed or not paths else 0


if __name__ == "__main__":
    sys.exit(main())
