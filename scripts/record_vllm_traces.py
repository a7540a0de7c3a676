#!/usr/bin/env python3
"""Record conformance traces from a vLLM release's own KV-cache manager.

    .venv-vllm-0.32.0/bin/python scripts/record_vllm_traces.py OUT_DIR [--only GLOB ...]
    .venv-vllm/bin/python scripts/record_vllm_traces.py OUT_DIR     # the same shapes on 0.14.0

Runs in a vLLM environment (./scripts/vllm_env.sh [VERSION]) and drives the
installed release's `KVCacheManager`, unmodified, with a seeded scheduler
simulation (`Simulation`): requests arrive, wait, are looked up in the
prefix cache, admitted under a token budget, run chunked prefills and
decode steps (with speculative tokens, encoder inputs or a KV connector's
external tokens where the shape says so), are preempted when an allocation
fails, finish, abort; now and then the prefix cache is reset or blocks
are evicted.  Every manager call becomes one trace line with what the
release answered as its `expect` (tests/data/conformance/FORMAT.md), run
by scripts/vllm_oracle.py's `Driver`, which also replays a trace on the
release to check it.

The shapes (pool size, KV-cache groups, caching, EAGLE, DCP, workload
knobs, seed) are those of an existing set's index.json, by default the set
recorded from vLLM 0.14.0 (tests/data/conformance/traces), so the two
releases' sets hold the same workloads.  A trace records the release's
scheduler as well as its manager: a 0.32.0 trace admits waiting requests
with `full_sequence_must_fit` and `has_scheduled_reqs`, starts each step
with `new_step_starts` and asks `estimate_cached_tokens` at a request's
first output, as 0.32's scheduler does; traces of 0.14.0 do none of that
(format version 1 there, 2 for 0.32.0: FORMAT.md, "Version 2").

Recording 0.14.0's shapes on 0.14.0 itself checks the simulation: kvshm
replays those traces as it does the stored set.

Shapes of one release only (what 0.32 does that 0.14 has no trace for)
are listed in a shapes file of their own, entries like an index's (name,
seed, file, groups, pool and caching fields, optional `meta`) whose trace
files do not exist yet; tests/data/conformance-0.32.0/shapes-0.32.json
holds 0.32's:

    .venv-vllm-0.32.0/bin/python scripts/record_vllm_traces.py \
        tests/data/conformance-0.32.0/traces \
        --shapes tests/data/conformance-0.32.0/shapes-0.32.json

The traces recorded join OUT_DIR's index.json (an entry of the same name is
replaced, the others kept).
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import json
import math
import random
import sys
from collections import Counter, deque
from pathlib import Path

from vllm_oracle import Driver, Release

REPO = Path(__file__).resolve().parent.parent
SHAPES = REPO / "tests" / "data" / "conformance" / "traces" / "index.json"

# Workload knobs by the preset named in a trace's name (".../full16-small-sys-s1001"),
# then the trace's own `meta.workload` on top.
PRESETS = {
    "tiny": dict(n_requests=40, arrival_max=4, token_budget=64, max_running=256,
                 sys_len=[1, 4], user_len=[1, 40], out_len=[5, 80]),
    "small": dict(n_requests=40, arrival_max=4, token_budget=256, max_running=256,
                  sys_len=[100, 600], user_len=[1, 80], out_len=[1, 80]),
    "medium": dict(n_requests=40, arrival_max=5, token_budget=512, max_running=256,
                   sys_len=[100, 600], user_len=[1, 120], out_len=[1, 80]),
    "large": dict(n_requests=80, arrival_max=6, token_budget=128, max_running=256,
                  sys_len=[4, 40], user_len=[1, 40], out_len=[1, 30]),
}
KINDS = {
    "chat": dict(n_sys_prompts=1, sys_p=0.5, followup_p=0.2),
    "sys": dict(n_sys_prompts=2, sys_p=0.95, followup_p=0.2),
    "multi": dict(n_sys_prompts=1, sys_p=0.5, followup_p=0.8),
    "short": dict(n_sys_prompts=2, sys_p=0.5, followup_p=0.1),
    "chunk": dict(n_sys_prompts=1, sys_p=0.5, followup_p=0.2, long_prefill=64),
    "oob": dict(n_sys_prompts=1, sys_p=0.5, followup_p=0.2, reset_p=0.03, force_reset_p=0.02,
                evict_p=0.1, abort_p=0.04),
}
VOCAB = 1000


def workload_knobs(name: str, meta: dict) -> dict:
    """A trace's knobs: its size and kind presets, then its meta.workload."""
    parts = name.rsplit("-s", 1)[0].split("-")
    knobs = dict(lora_p=0.03, salt_p=0.03, skip_p=0.01)
    knobs.update(next((PRESETS[p] for p in parts if p in PRESETS), PRESETS["small"]))
    knobs.update(next((KINDS[p] for p in parts if p in KINDS), KINDS["chat"]))
    knobs.update(meta.get("workload") or {})
    return knobs


def config_line(release: Release, shape: dict, knobs: dict) -> dict:
    """The trace's config line: the shape's, plus what 0.32's manager is
    built with (format version 2)."""
    cfg = {k: shape[k] for k in ("num_blocks", "hash_block_size", "max_model_len",
                                 "enable_caching", "use_eagle", "dcp_world_size")}
    groups = [dict(g) for g in shape["groups"]]
    cfg = {"kind": "config", "version": 1, **cfg, "groups": groups}
    if release.v32:
        # Block sizes as 0.32's engine resolves them: DCP scales attention
        # groups; several groups hash at the gcd of their sizes, unless
        # caching is off or a Mamba group is not in "align" mode.
        dcp = cfg["dcp_world_size"]
        sizes = [g["block_size"] * (dcp if g["type"] != "mamba" else 1) for g in groups]
        scheduler = math.lcm(*sizes)
        hashed = scheduler
        if len(groups) == 1:
            hashed = sizes[0]
        elif cfg["enable_caching"] and all(g["type"] != "mamba" for g in groups):
            hashed = math.gcd(*sizes)
        cfg.update(version=2, vllm_version="0.32.0", hash_block_size=hashed,
                   scheduler_block_size=scheduler,
                   max_in_flight_tokens=knobs["token_budget"],
                   num_prefill_lookahead=1 if cfg["use_eagle"] else 0,
                   watermark=knobs.get("watermark", 0.0),
                   prefix_cache_retention_interval=0)
        for g in groups:
            if g["type"] == "mamba":
                g["mamba_cache_mode"] = "none"
    return cfg


class Seq:
    """The simulation's view of one request."""

    __slots__ = ("id", "out_len", "generated", "enc", "computed", "state", "load", "connected",
                 "reported", "decoding")

    def __init__(self, rid: str, out_len: int, enc: int) -> None:
        self.id, self.out_len, self.enc = rid, out_len, enc
        self.generated = self.computed = 0
        self.state = "waiting"          # running, loading (an async KV load), done
        self.load = None                # (steps left, fails, tokens it brings)
        self.connected = False          # the connector was asked (once per request)
        self.reported = False           # estimate_cached_tokens asked (0.32)
        self.decoding = False           # its last step sampled: the next one decodes


class Simulation:
    """A seeded scheduler over one manager (module doc): `run()` records the
    trace's ops through the driver."""

    MAX_STEPS = 20_000

    def __init__(self, driver: Driver, knobs: dict, seed: int) -> None:
        self.d, self.k, self.rng = driver, knobs, random.Random(seed)
        self.cfg, self.v32 = driver.cfg, driver.r.v32
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.loading: list[Seq] = []
        self.seqs: list[Seq] = []
        self.sys_prompts = [self.tokens(*knobs["sys_len"])
                            for _ in range(knobs.get("n_sys_prompts", 1))]
        groups = self.cfg["groups"]
        sink = sum(g.get("sink_len", 0) // g["block_size"] for g in groups)
        room = (self.cfg["num_blocks"] - 1 - sink) * 0.7 / len(groups)
        block = max(g["block_size"] for g in groups if g["type"] != "mamba") if any(
            g["type"] != "mamba" for g in groups) else self.cfg["max_model_len"]
        # A request must fit the pool (and the model) with room to spare, or it
        # would wait forever at the head of the queue.
        self.max_tokens = max(2, min(self.cfg["max_model_len"], int(room) * block))
        self.spec = knobs.get("spec", 0)
        self.connector = knobs.get("connector")
        self.enc_tokens = knobs.get("enc_tokens", 0)

    # -- helpers ----------------------------------------------------------------
    def tokens(self, lo: int, hi: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(lo, hi))]

    def op(self, name: str, **fields):
        return self.d.apply({"op": name, **fields})

    def num_tokens(self, s: Seq) -> int:
        return self.d.reqs[s.id].num_tokens

    # -- arrivals ---------------------------------------------------------------
    def arrive(self) -> None:
        k, rng = self.k, self.rng
        for _ in range(rng.randint(0, k["arrival_max"])):
            if len(self.seqs) >= k["n_requests"]:
                return
            rid = f"r{len(self.seqs)}"
            fields: dict = {}
            done = [s for s in self.seqs if s.state == "done" and s.generated]
            if done and rng.random() < k.get("followup_p", 0.2):
                src = rng.choice(done)
                fields["prefix"] = {"req": src.id, "len": self.num_tokens(src)}
                prompt = self.tokens(*k["user_len"])
            else:
                head = rng.choice(self.sys_prompts) if rng.random() < k.get("sys_p", 0.5) else []
                prompt = head + self.tokens(*k["user_len"])
            base = fields["prefix"]["len"] if fields else 0
            room = self.max_tokens - base - 1
            if room < 1:
                fields.pop("prefix", None)
                base, room = 0, self.max_tokens - 1
            prompt = prompt[:max(1, room - 1)] or [1]
            if rng.random() < k.get("lora_p", 0):
                fields["lora_name"] = name = f"lora{rng.randrange(2)}"
                fields["lora_path"] = f"/loras/{name}"
            if rng.random() < k.get("salt_p", 0):
                fields["cache_salt"] = f"salt{rng.randrange(2)}"
            if rng.random() < k.get("skip_p", 0):
                fields["skip_prefix_cache_read"] = True
            self.op("add_request", req=rid, prompt=prompt, **fields)
            out = min(rng.randint(*k["out_len"]), max(1, self.max_tokens - base - len(prompt)))
            s = Seq(rid, out, self.enc_tokens)    # the model's encoder length, as vLLM passes it
            self.seqs.append(s)
            self.waiting.append(s)

    # -- one step ----------------------------------------------------------------
    # allocate_slots' optional fields at their defaults (FORMAT.md): left out of a line.
    DEFAULTS = dict(num_new_computed_tokens=0, use_computed_blocks=False, num_lookahead_tokens=0,
                    num_external_computed_tokens=0, delay_cache_blocks=False,
                    num_encoder_tokens=0, waiting=False, full_sequence_must_fit=False,
                    has_scheduled_reqs=True)

    def allocate(self, s: Seq, num_new: int, **fields):
        fields.setdefault("num_lookahead_tokens", self.spec)
        res = self.op("allocate_slots", req=s.id, num_new_tokens=num_new,
                      **{k: v for k, v in fields.items() if v != self.DEFAULTS[k]})
        return res["new_block_ids"]

    def preempt(self, s: Seq, reason: str = "preempt") -> None:
        self.op("free", req=s.id, reason=reason)
        self.op("advance", req=s.id, num_computed_tokens=0)
        s.computed, s.state, s.decoding = 0, "waiting", False
        self.waiting.appendleft(s)

    def schedule_running(self, budget: int, scheduled: dict) -> tuple[int, bool]:
        preempted, i = False, 0
        limit = self.k.get("long_prefill") or budget
        while i < len(self.running) and budget > 0:
            s = self.running[i]
            remaining = self.num_tokens(s) - s.computed
            num_new = 1 + self.spec if s.decoding else min(remaining, budget, limit)
            if num_new > budget:
                i += 1
                continue
            while True:
                if self.allocate(s, num_new) is not None:
                    scheduled[s.id] = (s, num_new)
                    budget -= num_new
                    i += 1
                    break
                victim = self.running.pop()
                scheduled.pop(victim.id, None)
                self.preempt(victim)
                preempted = True
                if victim is s:
                    break
        return budget, preempted

    def schedule_waiting(self, budget: int, scheduled: dict) -> None:
        k, rng, caching = self.k, self.rng, self.cfg["enable_caching"]
        limit = k.get("long_prefill") or budget
        while self.waiting and budget > 0 and len(self.running) < k["max_running"]:
            s = self.waiting[0]
            total = self.num_tokens(s)
            hits = 0
            fresh = s.computed == 0
            if fresh and caching:
                hits = self.op("get_computed_blocks", req=s.id)["num_computed_tokens"]
            ext, async_load = 0, False
            if fresh and self.connector and not s.connected and total - hits > 1:
                s.connected = True
                roll = rng.random()
                c = self.connector
                if roll < c["sync_p"] + c["async_p"]:
                    ext = rng.randint(1, total - hits - 1)
                    async_load = roll >= c["sync_p"]
            start = s.computed + hits + ext
            num_new = 0 if async_load else min(total - start, budget, limit)
            fields = dict(num_new_computed_tokens=hits, use_computed_blocks=fresh and caching,
                          num_external_computed_tokens=ext, delay_cache_blocks=async_load,
                          num_encoder_tokens=s.enc, waiting=self.v32)
            if self.v32:
                fields.update(full_sequence_must_fit=True, has_scheduled_reqs=bool(self.running))
                if async_load:
                    fields["num_lookahead_tokens"] = 0
            elif fresh:
                fields["num_lookahead_tokens"] = 0     # 0.14 gives fresh admissions none
            if self.allocate(s, num_new, **fields) is None:
                return
            self.waiting.popleft()
            if async_load:
                s.state, s.computed = "loading", hits
                s.load = (rng.randint(1, 3), rng.random() < self.connector["fail_p"], start)
                self.loading.append(s)
                continue
            s.computed, s.state = start, "running"
            self.running.append(s)
            scheduled[s.id] = (s, num_new)
            budget -= num_new

    def finish_step(self, scheduled: dict) -> None:
        rng = self.rng
        for s, num_new in scheduled.values():
            total = self.num_tokens(s)
            reached = s.computed + num_new >= total
            if not reached:
                s.computed += num_new
                self.op("advance", req=s.id, num_computed_tokens=s.computed)
                continue
            # A decode step verifies its drafts: 1 + the accepted ones are kept,
            # the rejected ones are not computed.
            accepted = rng.randint(0, self.spec) if s.decoding else 0
            new = [rng.randrange(VOCAB) for _ in range(1 + accepted)]
            new = new[:max(1, s.out_len - s.generated)]
            s.computed = total + len(new) - 1 if s.decoding else total
            self.op("advance", req=s.id, num_computed_tokens=s.computed, append=new)
            s.generated += len(new)
            s.decoding = True
            if self.v32 and not s.reported:
                s.reported = True
                self.op("estimate_cached_tokens", req=s.id)
            if s.generated >= s.out_len:
                self.running.remove(s)
                self.op("free", req=s.id, reason="finish")
                s.state = "done"

    def finish_loads(self) -> None:
        for s in list(self.loading):
            steps, fails, tokens = s.load
            if steps > 1:
                s.load = (steps - 1, fails, tokens)
                continue
            self.loading.remove(s)
            if fails:
                self.preempt(s, "kv_load_failed")
                continue
            s.computed, s.state = tokens, "waiting"
            self.op("advance", req=s.id, num_computed_tokens=tokens)
            self.op("cache_blocks", req=s.id, num_computed_tokens=tokens)
            self.waiting.appendleft(s)

    def probes(self) -> None:
        k, rng = self.k, self.rng
        if rng.random() < 0.3:
            self.op("check")
        if rng.random() < 0.1:
            self.op("usage")
        if self.running and rng.random() < 0.15:
            self.op("get_block_ids", req=rng.choice(self.running).id)
        if self.running and rng.random() < 0.3:
            self.op("num_common_prefix_blocks", req=self.running[0].id)
        if rng.random() < k.get("evict_p", 0):
            ids = sorted({rng.randrange(self.cfg["num_blocks"]) for _ in range(rng.randint(1, 4))})
            self.op("evict_blocks", block_ids=ids)
        if rng.random() < k.get("abort_p", 0):
            live = self.running + list(self.waiting)
            if live:
                s = rng.choice(live)
                (self.running if s in self.running else self.waiting).remove(s)
                self.op("free", req=s.id, reason="abort")
                s.state = "done"
        if rng.random() < k.get("force_reset_p", 0):
            while self.running:
                self.preempt(self.running.pop())
            self.op("reset_prefix_cache")
        elif rng.random() < k.get("reset_p", 0):
            self.op("reset_prefix_cache")

    def run(self) -> None:
        stalled = 0
        for _ in range(self.MAX_STEPS):
            self.arrive()
            if self.v32:
                self.op("new_step_starts")
            scheduled: dict = {}
            budget, preempted = self.schedule_running(self.k["token_budget"], scheduled)
            if not preempted:
                self.schedule_waiting(budget, scheduled)
            self.finish_step(scheduled)
            self.finish_loads()
            self.probes()
            if not (self.waiting or self.running or self.loading):
                if len(self.seqs) >= self.k["n_requests"]:
                    break
            stalled = 0 if scheduled or self.loading else stalled + 1
            if stalled > 50 and self.waiting:     # the head can never be admitted
                s = self.waiting.popleft()
                self.op("free", req=s.id, reason="abort")
                s.state, stalled = "done", 0
        else:
            raise RuntimeError("the simulation did not finish")
        self.op("check")


class UnbuildableShape(Exception):
    """The release cannot build a manager for this shape (0.32.0's sink
    attention manager does not take the arguments its coordinator passes)."""


def record(release: Release, shape: dict, meta: dict) -> tuple[dict, list[dict]]:
    knobs = workload_knobs(shape["name"], meta)
    cfg = config_line(release, shape, knobs)
    cfg["meta"] = {"name": shape["name"], "seed": shape["seed"],
                   "recorded_from": f"vllm {release.version}", "workload": knobs}
    try:
        driver = Driver(release, cfg)
    except TypeError as e:      # raised inside the release's own constructors
        raise UnbuildableShape(f"vLLM {release.version} cannot build its manager: {e}") from None
    Simulation(driver, knobs, shape["seed"]).run()
    return cfg, driver.lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shapes", type=Path, default=SHAPES,
                    help="index.json of the set whose shapes to record (default: 0.14.0's)")
    ap.add_argument("--only", nargs="*", default=["*"], metavar="GLOB",
                    help="trace names to record (fnmatch patterns)")
    args = ap.parse_args(argv)
    release = Release()
    shapes = [t for t in json.loads(args.shapes.read_text())["traces"]
              if any(fnmatch.fnmatch(t["name"], g) for g in args.only)]
    if not shapes:
        print(f"no trace of {args.shapes} matches {args.only}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    index, skipped = [], []
    for shape in shapes:
        source = args.shapes.parent / shape["file"]
        if source.exists():
            with gzip.open(source, "rt") as f:
                meta = json.loads(f.readline()).get("meta", {})
        else:                       # a shape of this release only: nothing recorded yet
            meta = shape.get("meta", {})
        try:
            cfg, lines = record(release, shape, meta)
        except UnbuildableShape as e:
            skipped.append(shape["name"])
            print(f"{shape['name']}: skipped: {e}", file=sys.stderr)
            continue
        path = args.out / shape["file"]
        with gzip.open(path, "wt", encoding="utf-8", compresslevel=9) as f:
            for line in [cfg, *lines]:
                f.write(json.dumps(line, separators=(",", ":")) + "\n")
        ops = Counter(op["op"] for op in lines)
        fails = sum(1 for op in lines if op["op"] == "allocate_slots"
                    and op["expect"]["new_block_ids"] is None)
        index.append({"file": shape["file"], "name": shape["name"], "seed": shape["seed"],
                      "num_ops": len(lines), **{k: cfg[k] for k in (
                          "groups", "num_blocks", "hash_block_size", "max_model_len",
                          "enable_caching", "use_eagle", "dcp_world_size")},
                      "num_requests": ops["add_request"], "allocation_failures": fails,
                      "ops": dict(sorted(ops.items())), "bytes": path.stat().st_size})
        print(f"{shape['name']}: {len(lines)} ops, {ops['add_request']} requests, "
              f"{fails} failed allocations", file=sys.stderr)
    write_index(args.out / "index.json", release, index, skipped)
    return 0


def write_index(path: Path, release: Release, index: list[dict], skipped: list[str]) -> None:
    """`path` lists the traces recorded now, beside those it listed before
    under other names."""
    old = json.loads(path.read_text()) if path.exists() else {"traces": [], "skipped": []}
    names = {t["name"] for t in index} | set(skipped)
    traces = [t for t in old["traces"] if t["name"] not in names] + index
    skipped = [n for n in old["skipped"] if n not in names] + skipped
    path.write_text(json.dumps(
        {"format_version": 2 if release.v32 else 1, "recorded_from": f"vllm {release.version}",
         "skipped": skipped, "traces": traces}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
