"""An offline vLLM engine on a token workload, reporting what kvshm users
check: the tokens each request generated, its prefix-cache hit tokens, its
time to first token, and the engine's prefix-cache counters.

    python -m kvshm.vllm.engine MODEL_DIR WORKLOAD.json [--out OUT.json] ...

WORKLOAD.json: {"phases": [[{"id": "a", "prompt_ids": [...], "max_tokens": 8},
...], ...]} (`workload_json` writes it from kvshm.workload.items); each
phase is one `generate()` call, phases run in order
(`--pause-file F`: before each phase after the first, wait until F exists).
A phase whose requests carry "at" (seconds after the phase starts) is
served open loop instead: each request is added to the engine at its time,
whatever the engine is doing, and its time to first token counts from
then (a server's queue, not the client, holds a request the engine is too
busy to take).
The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with greedy
sampling; with KVSHM_POOL set the kvshm plugin gives it its KV-cache
manager.  MODEL_DIR holds safetensors weights (`python -m kvshm.vllm.model
DIR` writes seeded ones whose greedy output depends on the whole context,
so a wrong K/V block changes what is generated).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import resource
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvshm.vllm.release import vllm_cache_root, vllm_release
from kvshm.workload.items import Item


def in_phases(items: Sequence[Item], phases: int) -> list[list[Item]]:
    """`items` cut into `phases` runs in order, each one `generate()` call
    (all but the last of ceil(len / phases) items)."""
    step = -(-len(items) // phases)
    return [list(items[i:i + step]) for i in range(0, len(items), step)]


def workload_json(phases: Sequence[Sequence[Item]], max_tokens: int | None = None,
                  arrivals: Mapping[str, float] | None = None) -> dict:
    """WORKLOAD.json's content for `phases` of kvshm.workload.items `Item`s:
    each request generates `max_tokens` tokens, or as many as its output;
    with `arrivals` (request id -> seconds after its phase starts), every
    request carries its "at" and its phase is served open loop."""
    def entry(it: Item) -> dict:
        e = {"id": it.rid, "prompt_ids": list(it.prompt),
             "max_tokens": len(it.output) if max_tokens is None else max_tokens}
        if arrivals is not None:
            e["at"] = arrivals[it.rid]
        return e
    return {"phases": [[entry(it) for it in phase] for phase in phases]}


def build_llm(args):
    from vllm import LLM
    kw = dict(model=args.model, load_format="safetensors", skip_tokenizer_init=True,
              enforce_eager=True, enable_prefix_caching=True, block_size=args.block_size,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, seed=0,
              disable_log_stats=False, dtype=args.dtype)
    if args.num_blocks:
        kw["num_gpu_blocks_override"] = args.num_blocks
    if args.kv_events:
        from vllm.config import KVEventsConfig
        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                endpoint=args.kv_events)
    return LLM(**kw)


def counters(llm) -> dict[str, float]:
    """The engine's prefix-cache and preemption counters (Prometheus names)."""
    want = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions")
    out = {}
    for m in llm.get_metrics():
        if m.name in want:
            out[m.name.split(":", 1)[1]] = out.get(m.name.split(":", 1)[1], 0) + m.value
    return out


def manager_name(llm) -> str:
    """The class of the engine's KV-cache manager (module.qualname), when
    the engine core runs in this process."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        return ""
    m = type(core.scheduler.kv_cache_manager)
    return f"{m.__module__}.{m.__qualname__}"


def count_steps(llm) -> list[int]:
    """Count the engine's steps (one scheduler step each) from now on: the
    returned one-item list holds the count."""
    engine, count = llm.llm_engine, [0]
    step = engine.step

    def counted_step(*a, **kw):
        count[0] += 1
        return step(*a, **kw)

    engine.step = counted_step
    return count


def plugin_counters() -> dict:
    """The kvshm backend's counters (allocations answered without a round
    trip, stale hits, waits for tokens in flight, the steps that skipped a
    waiting request, whether the scheduler skips them: the plugin's
    connector is installed, and the measured seconds per token that bound a
    wait), when this process has a shared pool's backend; else {}."""
    if not os.environ.get("KVSHM_POOL", "").strip():
        return {}
    from kvshm.vllm.binding import current_binding
    backend = current_binding().backend
    names = ("local_allocations", "stale_hits", "in_flight_waits", "in_flight_skips",
             "skips_waiting", "token_cost")
    return {n: getattr(backend, n) for n in names if hasattr(backend, n)}


def open_loop(llm, phase: list[dict], prompts: list, params: list) -> list:
    """Serve `phase` open loop: request i is added to the engine at
    `phase[i]["at"]` seconds from now (a request without one at 0), with
    that moment as its arrival time, between the engine's steps; the
    engine steps while it has requests and sleeps until the next arrival
    when it has none.  Returns the finished outputs in `phase`'s order."""
    engine = llm.llm_engine
    order = sorted(range(len(phase)), key=lambda i: phase[i].get("at", 0.0))
    wall0, t0 = time.time(), time.perf_counter()
    done: dict[str, object] = {}
    nxt = 0
    while nxt < len(order) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < len(order) and phase[order[nxt]].get("at", 0.0) <= now:
            i = order[nxt]
            engine.add_request(phase[i]["id"], prompts[i], params[i],
                               arrival_time=wall0 + phase[i].get("at", 0.0))
            nxt += 1
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        else:
            time.sleep(max(0.0, phase[order[nxt]].get("at", 0.0) - now))
    return [done[r["id"]] for r in phase]   # (outputs carry the caller's ids)


def run(args) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    workload = json.loads(Path(args.workload).read_text())
    t0 = time.perf_counter()
    llm = build_llm(args)
    startup = time.perf_counter() - t0
    if args.ready_file:
        Path(args.ready_file).touch()
    if args.go_file:
        while not os.path.exists(args.go_file):
            time.sleep(0.005)
    listener = None
    if args.kv_events:
        from kvshm.service.events import EventCollector
        listener = EventCollector(args.kv_events)
        time.sleep(0.5)          # the subscription reaches the engine's publisher
    results = []
    steps = count_steps(llm)
    t1, cpu1 = time.perf_counter(), time.process_time()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i, phase in enumerate(workload["phases"]):
        if i and args.pause_file:
            while not os.path.exists(args.pause_file):
                time.sleep(0.02)
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in phase]
        params = [SamplingParams(max_tokens=r.get("max_tokens", 8), temperature=0.0,
                                 ignore_eos=True, detokenize=False) for r in phase]
        if any("at" in r for r in phase):
            outs = open_loop(llm, phase, prompts, params)
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        for r, o in zip(phase, outs):
            m = o.metrics
            results.append({"id": r["id"], "phase": i, "token_ids": list(o.outputs[0].token_ids),
                            "num_cached_tokens": o.num_cached_tokens,
                            "ttft_s": getattr(m, "first_token_latency", None)})
        if args.phase_done:
            Path(f"{args.phase_done}.{i}").touch()
    report = {"pool": os.environ.get("KVSHM_POOL", ""), "startup_s": startup,
              "elapsed_s": time.perf_counter() - t1, "cpu_s": time.process_time() - cpu1,
              "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
              "steps": steps[0], "requests": results, "counters": counters(llm),
              "manager": manager_name(llm), "plugin": plugin_counters()}
    if listener is not None:
        time.sleep(0.5)          # the last step's batch is on its way
        listener.stop()
        report["kv_events"], report["kv_event_seqs"] = listener.events, listener.seqs
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvshm.vllm.engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("workload")
    ap.add_argument("--out", help="write the report here (default: stdout)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--num-blocks", type=int, default=0,
                    help="vLLM's num_gpu_blocks_override (a kvshm pool's own count wins)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--pause-file", help="wait for this file before each later phase")
    ap.add_argument("--ready-file", help="touch this file once the engine is built")
    ap.add_argument("--go-file", help="then wait for this file before the first phase")
    ap.add_argument("--phase-done", help="touch PREFIX.<phase> after each phase")
    ap.add_argument("--kv-events", metavar="ENDPOINT",
                    help="turn the engine's KV events on, published (bound) at ENDPOINT, "
                    "and report what it sent")
    args = ap.parse_args(argv)
    atexit.register(_end_after_exit_handlers)
    os.environ.setdefault("VLLM_CACHE_ROOT", vllm_cache_root(vllm_release()))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    port = rendezvous_port(os.getpid())
    if port is not None:
        os.environ.setdefault("VLLM_PORT", str(port))
    report = run(args)
    text = json.dumps(report)
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text + "\n")
    _reported.append(True)
    return 0


_reported: list[bool] = []

PORT_WINDOWS, PORT_WINDOW = 1000, 10


def rendezvous_port(pid: int, port_range: str = "/proc/sys/net/ipv4/ip_local_port_range"
                    ) -> int | None:
    """The first port of this engine's window for vLLM's TCP rendezvous
    (VLLM_PORT), or None to leave vLLM its own choice.

    An in-process vLLM engine asks the kernel for a free port, closes it,
    and binds it again a moment later for torch.distributed's store.
    Engines started together (bench_vllm.py's, the tests') can be handed
    the same port in between, and one then fails with EADDRINUSE.  With
    VLLM_PORT set, vLLM tries that port and the ones after it instead; so
    each engine gets a window of PORT_WINDOW ports by its pid, PORT_WINDOWS
    windows just below the kernel's ephemeral range, where no connection's
    local port lands.  A host whose ephemeral range leaves no room for them
    keeps vLLM's choice."""
    try:
        low = int(Path(port_range).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    first = low - PORT_WINDOWS * PORT_WINDOW
    if first < 1024:
        return None
    return first + (pid % PORT_WINDOWS) * PORT_WINDOW


def _end_after_exit_handlers() -> None:
    """The last exit handler (registered before vLLM and the plugin
    register theirs: the plugin's when it opens its backend, weakref's,
    which shuts vLLM's engine down, when vLLM makes its first finalizer):
    once the report is out, end the process here, after every other
    handler, without the interpreter's finalization, which frees torch's
    and vLLM's objects one by one: about 3 s for a 0.32 engine here, and
    part of every measured wall time."""
    if _reported:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
