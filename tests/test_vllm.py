"""Real vLLM CPU engines on kvshm (the plugin in kvshm/vllm/).

The engines run in the vLLM environments that ./scripts/vllm_env.sh makes
(.venv-vllm for vLLM 0.14.0, or $KVSHM_VLLM_PYTHON; .venv-vllm-0.32.0 for
0.32.0, or $KVSHM_VLLM_032_PYTHON), one process per engine, through
`python -m kvshm.vllm.engine`, forked from a server that has imported vLLM
once (vllm_engines.py; KVSHM_VLLM_FORK=0 starts fresh interpreters); the
engine tests run on both releases (the `release` fixture).  Without an
environment its tests skip, unless KVSHM_REQUIRE_VLLM=1 (the test command
sets it): then they fail.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from helpers import kvshm_segments
from vllm_engines import (ENGINE_TIMEOUT, PYTHONS, finish, release, run_engine,  # noqa: F401
                          run_python, start_engine)  # (release: a fixture)
from kvshm.vllm.engine import in_phases, workload_json
from kvshm.workload.items import shared_prefix
from kvshm.vllm.model import write_tiny_model
from kvshm.vllm.release import vllm_cache_root

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = PYTHONS["0.14.0"]

if not VLLM_PYTHON.exists():
    if os.environ.get("KVSHM_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"KVSHM_REQUIRE_VLLM=1 but there is no vLLM environment at "
                           f"{VLLM_PYTHON} (run ./scripts/vllm_env.sh)")
    pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (./scripts/vllm_env.sh makes one)",
                allow_module_level=True)




@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


MANAGER = {"0.14.0": "kvshm.vllm.manager.PoolKVCacheManager",
           "0.32.0": "kvshm.vllm.manager.PoolKVCacheManager032"}


def event_kind(event) -> str:
    """An event's type as the stream names it (0.14: a tagged array; 0.32:
    a map with "type")."""
    return event["type"] if isinstance(event, dict) else event[0]


def outputs(report: dict) -> dict[str, tuple[list[int], int]]:
    return {r["id"]: (r["token_ids"], r["num_cached_tokens"]) for r in report["requests"]}


def test_embedded_pool_generates_what_vllm_s_own_manager_does(model_dir, tmp_path, release):
    # 16 requests over two shared prefixes, two exact duplicates, and a
    # 24-block pool: the engine preempts (a context of 512 tokens fits it).
    from kvshm.vllm.binding import embedded_pool_name
    workload = workload_json(in_phases(shared_prefix(), 2))
    args = ("--num-blocks", "24", "--max-model-len", "512")
    # Both publish their KV events (one hash seed: the same block hashes).
    seed = {"PYTHONHASHSEED": "0"}
    own = start_engine(model_dir, workload, tmp_path, "own", pool=None, env=seed,
                       release=release,
                       extra=(*args, "--kv-events", f"ipc://{tmp_path}/own.events"))
    emb_proc = start_engine(model_dir, workload, tmp_path, "embedded", pool="embedded",
                            env=seed, release=release,
                            extra=(*args, "--kv-events", f"ipc://{tmp_path}/emb.events"))
    emb = finish(emb_proc)
    own = finish(own)
    assert own["manager"] == "vllm.v1.core.kv_cache_manager.KVCacheManager"
    assert emb["manager"] == MANAGER[release]
    assert len(own["requests"]) == 16
    assert own["counters"]["num_preemptions"] > 0
    assert own["counters"]["prefix_cache_hits"] > 0
    assert outputs(emb) == outputs(own)
    assert emb["counters"] == own["counters"]
    # The plugin's take_events() gave the engine's publisher vLLM's events,
    # in the release's own form.
    kinds = {event_kind(e) for e in own["kv_events"]}
    assert kinds == {"BlockStored", "BlockRemoved"}, kinds       # it evicted, too
    assert emb["kv_events"] == own["kv_events"]
    assert emb["kv_event_seqs"] == own["kv_event_seqs"] == list(range(len(own["kv_event_seqs"])))
    # Distinct outputs: the weights make generation depend on the context.
    assert len({tuple(t) for t, _ in outputs(own).values()}) >= 14
    # The embedded segment went with the engine.
    assert embedded_pool_name(emb_proc.pid) not in kvshm_segments()


# -- shared pools ---------------------------------------------------------------------
BLOCK = 32


def prefix_workloads(seed: int = 5, n_b: int = 3):
    """A: one prompt; B: prompts that share its 200-token prefix."""
    import random
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 1000) for _ in range(200)]
    a = {"phases": [[{"id": "a0", "prompt_ids": prefix + [5, 6, 7], "max_tokens": 16}]]}
    b = {"phases": [[{"id": f"b{i}", "prompt_ids": prefix + [rng.randrange(3, 1000)
                                                            for _ in range(20)],
                      "max_tokens": 16} for i in range(n_b)]]}
    return a, b


def serve(model_dir: Path, release: str):
    """A coordinator serving a pool of vLLM `release`'s semantics for the
    tiny model (2048 blocks of 32)."""
    from kvshm.config import model_pool_config
    from kvshm.service.process import CoordinatorProcess
    config = model_pool_config(model_dir, kv_memory=64 << 20, block_size=BLOCK,
                               max_model_len=2048).replace(vllm_version=release)
    return CoordinatorProcess(config)


@pytest.fixture
def pool(model_dir, release):
    with serve(model_dir, release) as proc:
        yield proc


def pool_stats(proc) -> dict:
    from kvshm.pool.segment import PoolSegment
    from kvshm.pool.stats import read_stats
    seg = PoolSegment.attach(proc.name)
    try:
        return read_stats(seg)
    finally:
        seg.close()


def stored(report: dict) -> list[tuple[list[int], int | None]]:
    """The (block hashes, parent hash) of an engine's BlockStored events."""
    return [(e["block_hashes"], e["parent_block_hash"]) if isinstance(e, dict) else (e[1], e[2])
            for e in report["kv_events"] if event_kind(e) == "BlockStored"]


def test_engines_share_the_pool_the_prefix_cache_and_the_kv_bytes(model_dir, tmp_path, pool,
                                                                   release):
    a_wl, b_wl = prefix_workloads(n_b=10)
    # Four engines start together (most of an engine's time is its start);
    # B generates once A is done, C once the arena is scrambled (below).
    go_b, go_c = tmp_path / "go-b", tmp_path / "go-c"
    procs = [start_engine(model_dir, b_wl, tmp_path, "alone", pool=None, release=release),
             start_engine(model_dir, a_wl, tmp_path, "a", pool=str(pool.socket),
                          release=release, extra=("--kv-events", f"ipc://{tmp_path}/a.events")),
             start_engine(model_dir, b_wl, tmp_path, "b", pool=str(pool.socket),
                          release=release, extra=("--kv-events", f"ipc://{tmp_path}/b.events",
                                                  "--go-file", str(go_b))),
             start_engine(model_dir, b_wl, tmp_path, "c", pool=str(pool.socket),  # B's again
                          release=release, extra=("--go-file", str(go_c)))]
    try:
        a = finish(procs[1])
        go_b.touch()
        b = finish(procs[2])
        alone = finish(procs[0])
        _engines_shared_the_prefix(a, b, alone, pool, release)
        go_c.touch()
        c = finish(procs[3])
    finally:
        for proc in procs:   # (after a failure: none is left waiting for its turn)
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert [r["num_cached_tokens"] for r in c["requests"]] == [6 * BLOCK] * 10
    changed = [r["id"] for r, own in zip(c["requests"], alone["requests"])
               if r["token_ids"] != own["token_ids"]]
    assert len(changed) >= 8, changed


def _engines_shared_the_prefix(a: dict, b: dict, alone: dict, pool, release: str) -> None:
    """The checks of the test above between B's run and C's: A's and B's
    events and hits, and A's last prefix block scrambled in the arena."""
    import numpy as np

    from kvshm.pool.arena import KVArena, arena_name
    from kvshm.core.state import FLAG_CACHED
    from kvshm.pool.segment import PoolSegment
    assert a["manager"] == b["manager"] == MANAGER[release]
    # Each engine publishes the events of its own calls (TakeEvents): A
    # stored the prefix; B's first block past it has A's last as parent.
    a_stored, b_stored = stored(a), stored(b)
    assert len(a_stored[0][0]) == 6 and a_stored[0][1] is None
    assert b_stored[0][1] == a_stored[0][0][5]
    assert not set(a_stored[0][0]) & {h for e in b_stored for h in e[0]}   # not stored twice
    # B's first request hits the 6 full blocks A computed (another process).
    first = b["requests"][0]
    assert first["num_cached_tokens"] == 6 * BLOCK
    assert alone["requests"][0]["num_cached_tokens"] == 0
    # ... and generates what it generates on its own.
    assert [r["token_ids"] for r in b["requests"]] == [r["token_ids"] for r in alone["requests"]]
    st = pool_stats(pool)
    assert st["num_requests"] == 0 and st["num_used_blocks"] == 0   # engines gone, blocks back
    assert st["hit_tokens"] >= 3 * 6 * BLOCK

    # The bytes themselves are shared: scramble one block of the prefix in
    # the arena (layer 0's K of its last block) and a third engine whose
    # requests hit it generates something else for (nearly) every one.
    seg = PoolSegment.attach(pool.name)
    cached = [blk for blk in range(seg.config.num_blocks) if seg.flags[blk] & FLAG_CACHED]
    # A's blocks came first off the free queue: 1..6 hold the prefix.
    prefix_blocks = sorted(cached)[:6]
    assert prefix_blocks == list(range(1, 7))
    arena = KVArena.attach(arena_name(pool.name), seg.config)
    try:
        kv = arena.kv                       # (0.14) [layer, K|V, block, head, token, dim]
        if release == "0.14.0":
            kv[0, 0, prefix_blocks[-1]] = kv[0, 0, prefix_blocks[-1]][..., ::-1]
        else:                               # 0.32: a layer's block is one page
            offset, size = arena.layout.layer_region(0)
            page = size // seg.config.num_blocks
            block = np.frombuffer(arena.buffer, dtype=kv.dtype, count=page // kv.itemsize,
                                  offset=offset + prefix_blocks[-1] * page)
            block[:] = block[::-1].copy()
            del block
        del kv
    finally:
        arena.close()
        seg.close()


def test_an_engine_alone_on_a_pool_gets_vllm_s_hits(model_dir, tmp_path, pool, release):
    # Requests over two shared prefixes in two phases, two of them exact
    # duplicates: within a phase the requests sharing a prefix are scheduled
    # in one step, and all but the first hit blocks that step caches.  A
    # third phase sends phase 0 again open loop (bench_vllm --rate), one
    # request every 0.2 s.
    wl = workload_json(in_phases(shared_prefix(seed=11), 2))
    paced = [dict(r, id=f"o-{r['id']}", at=0.2 * i) for i, r in enumerate(wl["phases"][0])]
    wl["phases"].append(paced)
    own = start_engine(model_dir, wl, tmp_path, "own", pool=None, release=release,
                       extra=("--num-blocks", str(pool_stats(pool)["num_blocks"])))
    alone = run_engine(model_dir, wl, tmp_path, "alone", pool=str(pool.socket),
                       release=release)
    own = finish(own)
    assert own["manager"] == "vllm.v1.core.kv_cache_manager.KVCacheManager"
    same_step = [r["id"] for r in own["requests"] if r["phase"] == 0 and r["num_cached_tokens"]]
    assert len(same_step) >= 4, same_step
    # Token for token and hit for hit what vLLM's own manager gives.
    assert outputs(alone) == outputs(own)
    assert alone["counters"] == own["counters"]
    # The pool's own figures count the same lookups (a fresh pool: this
    # engine's alone).
    st = pool_stats(pool)
    assert (st["query_tokens"], st["hit_tokens"]) == (
        own["counters"]["prefix_cache_queries"], own["counters"]["prefix_cache_hits"])
    # Open loop: the same tokens as in the burst, each first token timed
    # from the request's own arrival, not from the phase's start.
    for report in (own, alone):
        got = {r["id"]: r for r in report["requests"]}
        assert all(got[r["id"]]["token_ids"] == got[r["id"][2:]]["token_ids"] for r in paced)
        assert paced[-1]["at"] >= 1.0 and report["elapsed_s"] > paced[-1]["at"]
        assert 0 < got[paced[-1]["id"]]["ttft_s"] < paced[-1]["at"] / 2
    # Most decode steps needed no round trip for their allocation.
    assert alone["plugin"]["local_allocations"] > alone["steps"] // 2
    assert pool_stats(pool)["num_requests"] == 0


def test_a_request_waiting_for_a_prefix_in_flight_lets_the_requests_behind_run(
        model_dir, tmp_path, pool, release):
    """A session of this process holds a 320-token prompt's blocks cached
    but not ready (its K/V never come).  Engine B gets that prompt first and
    another behind it: the plugin's connector skips the waiting one, so the
    other runs at once; the waiting one computes the prompt itself at its
    deadline; both generate what vLLM's own manager does."""
    import random

    from kvshm.service.sync_client import connect_sync
    rng = random.Random(3)
    held = [rng.randrange(3, 1000) for _ in range(10 * BLOCK)]
    other = [rng.randrange(3, 1000) for _ in range(100)]
    wl = {"phases": [[{"id": "held", "prompt_ids": held + [5, 6], "max_tokens": 8},
                      {"id": "other", "prompt_ids": other, "max_tokens": 8}]]}
    own = start_engine(model_dir, wl, tmp_path, "own", pool=None, release=release)
    with connect_sync(pool.socket, hash_algorithm=None) as writer:   # the pool's hashing
        writer.add_request("w", held)
        assert writer.allocate_slots("w", len(held)) is not None
        b = run_engine(model_dir, wl, tmp_path, "b", pool=str(pool.socket), release=release,
                       env={"KVSHM_IN_FLIGHT_DEADLINE": "3"})
        writer.free("w")
    own = finish(own)
    ttft = {r["id"]: r["ttft_s"] for r in b["requests"]}
    assert ttft["other"] < 2.0 and ttft["held"] >= 2.9, ttft
    assert b["plugin"]["skips_waiting"] and b["plugin"]["in_flight_waits"] == 1
    assert b["plugin"]["in_flight_skips"] > 0
    assert outputs(b) == outputs(own)
    # The held request is counted once, although it was looked up at every
    # step it waited: the engine's counters are its own cache's, and the
    # pool's (a fresh pool: engine B's lookups alone) the same.
    assert b["counters"] == own["counters"]
    assert own["counters"]["prefix_cache_queries"] == len(held) + 2 + len(other)
    st = pool_stats(pool)
    assert (st["query_tokens"], st["hit_tokens"]) == (
        own["counters"]["prefix_cache_queries"], own["counters"]["prefix_cache_hits"])
    assert pool_stats(pool)["num_requests"] == 0


@pytest.fixture
def pool_014(model_dir):
    with serve(model_dir, "0.14.0") as proc:
        yield proc


def test_an_engine_that_does_not_fit_the_pool_is_refused(model_dir, tmp_path, pool_014):
    pool = pool_014
    a_wl, _ = prefix_workloads()
    runs = [start_engine(model_dir, a_wl, tmp_path, name, pool=target, extra=extra, env=env)
            for name, target, extra, env in (
                ("bs16", str(pool.socket), ("--block-size", "16"), None),
                ("seed", str(pool.socket), (), {"PYTHONHASHSEED": "7"}),
                ("nopool", str(tmp_path / "none.sock"), (), {"KVSHM_CONNECT_TIMEOUT": "0.5"}))]
    bs16, seed, nopool = (finish(p, check=False) for p in runs)
    assert bs16.returncode != 0
    assert "does not fit the kvshm pool" in bs16.stderr_text
    assert "block_size: pool 32, engine 16" in bs16.stderr_text
    assert seed.returncode != 0
    assert "PYTHONHASHSEED is '7', the pool's hash seed '0'" in seed.stderr_text
    assert nopool.returncode != 0 and "no coordinator listening" in nopool.stderr_text
    assert pool_stats(pool)["num_requests"] == 0


def test_an_engine_rides_through_a_coordinator_restart(model_dir, tmp_path, pool, release):
    import threading
    import time
    wl = workload_json(in_phases(shared_prefix(seed=9, num_requests=12), 3))
    alone = start_engine(model_dir, wl, tmp_path, "alone", pool=None, release=release)
    marker = tmp_path / "phase"

    def kill_mid_run():
        deadline = time.monotonic() + ENGINE_TIMEOUT
        while not Path(f"{marker}.0").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        pool.kill()
        time.sleep(0.3)
        pool.restart()

    t = threading.Thread(target=kill_mid_run)
    t.start()
    shared = run_engine(model_dir, wl, tmp_path, "shared", pool=str(pool.socket),
                        release=release, extra=("--phase-done", str(marker)))
    t.join()
    alone = finish(alone)
    assert pool.restarts == 1
    assert [r["token_ids"] for r in shared["requests"]] == \
        [r["token_ids"] for r in alone["requests"]]
    assert pool_stats(pool)["num_requests"] == 0


def readme_blocks(heading: str) -> list[tuple[str, str]]:
    """The fenced code blocks (language, text) of a README section."""
    text = (REPO / "README.md").read_text()
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end > 0 else None]
    return re.findall(r"```(\w+)\n(.*?)```", section, re.S)


def test_the_readme_s_vllm_commands_run_as_written(tmp_path):
    """The section's engine.py and shell block, run from a directory that
    looks like the repository (scripts, the vLLM environment).  The
    coordinator it stops must leave neither its socket (checked here) nor
    its segments: its pool has a random name, so the run's leak guard
    (conftest.py, once every test is done) checks those, and this test
    runs beside others."""
    blocks = readme_blocks("vLLM engines on one pool")
    first = [lang for lang, _ in blocks].index("python")   # (after the serving quickstart)
    (python, engine), (sh, commands) = blocks[first:first + 2]
    assert (python, sh) == ("python", "sh")
    (tmp_path / "engine.py").write_text(engine)
    for name in ("scripts", ".venv-vllm", "pyproject.toml", "kvshm"):
        (tmp_path / name).symlink_to(REPO / name)
    env = {k: v for k, v in os.environ.items() if k not in ("KVSHM_POOL", "PYTHONHASHSEED")}
    env.setdefault("VLLM_CACHE_ROOT", vllm_cache_root("0.14.0"))   # as kvshm's engines have it
    socket_path = Path(re.search(r"--socket (\S+)", commands).group(1))
    proc = subprocess.run(["bash", "-e", "-c", commands], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=2 * ENGINE_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("generated")]
    assert len(lines) == 2, proc.stdout
    assert lines[0].endswith("cached tokens 0") and lines[1].endswith("cached tokens 288")
    assert lines[0].split(" cached")[0] == lines[1].split(" cached")[0]   # same tokens
    assert not socket_path.exists()


VLLM_SIDE = r'''
import json, os, types
import torch
from vllm.v1 import kv_cache_interface as vi
from kvshm.core.errors import ConfigError, PoolRefused
from kvshm.vllm.binding import PoolBinding
from kvshm.vllm.specs import group_spec, pool_hash_algorithm

def attn(cls, **kw):
    return cls(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16, **kw)

out = {"specs": [repr(group_spec(s)) for s in (
    attn(vi.FullAttentionSpec), attn(vi.MLAAttentionSpec),
    attn(vi.SinkFullAttentionSpec, sink_len=32),
    attn(vi.SlidingWindowSpec, sliding_window=64),
    attn(vi.ChunkedLocalAttentionSpec, attention_chunk_size=128), attn(vi.CrossAttentionSpec),
    vi.MambaSpec(block_size=16, shapes=((2, 3),), dtypes=(torch.float32,)))]}
try:
    pool_hash_algorithm("xxhash")
except ConfigError as e:
    out["xxhash"] = str(e)
cfg = lambda algo: types.SimpleNamespace(cache_config=types.SimpleNamespace(
    prefix_caching_hash_algo=algo))
b = PoolBinding("embedded")
for name, args in (("engine_xxhash", (cfg("xxhash"), None, None)),
                   ("kvshm_pool", (cfg("sha256"), "sha256", "kvshm-0")),
                   ("cbor_pool", (cfg("sha256"), "vllm-sha256-cbor", "0")),
                   ("oracle_seed", (cfg("sha256"), "vllm-sha256", "kvshm-oracle-0"))):
    try:
        b.engine_hashing(*args)
    except PoolRefused as e:
        out[name] = str(e)
os.environ.pop("PYTHONHASHSEED", None)
out["given_seed"] = b.engine_hashing(cfg("sha256_cbor"), "vllm-sha256-cbor", "42")
out["env_seed"] = os.environ["PYTHONHASHSEED"]
print(json.dumps(out))
'''


@pytest.mark.parametrize("release", list(PYTHONS))
def test_a_forked_interpreter_runs_a_command_line_as_a_fresh_one_would(release, tmp_path,
                                                                       monkeypatch):
    """The fork server the engines and scripts of these tests run on
    (vllm_engines.py): its child gets the command line, environment and
    directory asked for, and its exit status, output and traceback come
    back as from a fresh interpreter."""
    code = ("import os, sys, vllm; print(sys.argv, os.environ.get('X'), os.getcwd(), "
            "'HOME' in os.environ); sys.stdout.flush(); sys.exit(int(sys.argv[1]))")
    env = {"X": "x", "PATH": os.environ["PATH"]}
    monkeypatch.chdir(tmp_path)
    proc = run_python(release, ["-c", code, "3"], env=env)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stdout.strip() == f"['-c', '3'] x {tmp_path} False"
    (tmp_path / "boom.py").write_text("import sys\nprint(sys.argv[1:])\nraise ValueError('boom')\n")
    proc = run_python(release, ["boom.py", "a"], env=env)
    assert proc.returncode == 1 and proc.stdout.strip() == "['a']"
    assert proc.stderr.rstrip().endswith("ValueError: boom") and "Traceback" in proc.stderr
    proc = run_python(release, ["-c", "import os; os.kill(os.getpid(), 9)"], env=env)
    assert proc.returncode == -9


def test_vllm_specs_and_hashing_refusals_inside_vllm():
    env = {k: v for k, v in os.environ.items() if k not in ("KVSHM_POOL", "PYTHONHASHSEED")}
    proc = run_python("0.14.0", ["-c", VLLM_SIDE], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["specs"] == [
        "FullSpec(block_size=16)", "MLASpec(block_size=16)",
        "SinkFullSpec(block_size=16, sink_len=32)",
        "SlidingWindowSpec(block_size=16, sliding_window=64)",
        "ChunkedLocalSpec(block_size=16, attention_chunk_size=128)",
        "CrossAttentionSpec(block_size=16)",
        "MambaSpec(block_size=16, num_speculative_blocks=0)"]
    assert "not 'xxhash'" in out["xxhash"]
    assert "kvshm reproduces vLLM's 'sha256' and 'sha256_cbor'" in out["engine_xxhash"]
    assert "serve the pool with --hash-algorithm vllm-sha256" in out["kvshm_pool"]
    assert "prefix_caching_hash_algo='sha256_cbor'" in out["cbor_pool"]
    assert "seed 'kvshm-oracle-0', which no vLLM engine can use" in out["oracle_seed"]
    assert out["given_seed"] == ["vllm-sha256-cbor", "42"] and out["env_seed"] == "42"


def test_kvshm_hashes_fresh_multimodal_requests_as_vllm_does(tmp_path, release):
    """Beside the stored vectors: new random requests (items, embeds, LoRA,
    salt, appends), hashed by the release's own code in its environment
    now (0.32's tagged keys on pools of its semantics)."""
    from helpers import replay_case
    seed = int.from_bytes(os.urandom(4), "big")
    out = tmp_path / "vectors.json"
    proc = run_python(release, [REPO / "scripts" / "record_vllm_hashes.py", out, "--seed", seed,
                                "--random", "60"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) > 200 and {c["vllm_version"] for c in cases} == {release}
    wrong = [c["name"] for c in cases if replay_case(c) != c["block_hashes"]]
    assert not wrong, f"seed {seed}: {wrong}"


PLUGIN_LOAD = r'''
import sys
import vllm.version
vllm.version.__version__ = sys.argv[1]
from vllm.plugins import load_general_plugins
from vllm.v1.core.sched import scheduler
load_general_plugins()
print("started", scheduler.KVCacheManager.__module__)
'''


@pytest.mark.parametrize("release,pool,ends", [
    ("0.33.0", "embedded", None),
    ("0.33.0", None, "started vllm.v1.core.kv_cache_manager"),
    ("0.14.0+cpu", "embedded", "started kvshm.vllm.manager")])
def test_vllm_s_plugin_loader_refuses_an_unsupported_release_in_one_line(release, pool, ends):
    """Through vLLM's own entry-point loader: with KVSHM_POOL set, an
    engine whose vLLM says it is 0.33.0 (no release kvshm speaks) stops
    with one line on stderr and nothing patched; without KVSHM_POOL it
    starts on vLLM's own manager."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVSHM_POOL", "PYTHONHASHSEED")}
    if pool is not None:
        env["KVSHM_POOL"] = pool
    proc = run_python("0.14.0", ["-c", PLUGIN_LOAD, release], env=env)
    if ends is not None:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip().splitlines()[-1].startswith(ends), proc.stdout[-3000:]
        return
    assert proc.returncode == 1 and "started" not in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kvshm ") and "supports vLLM 0.14.0, 0.32.0, not the vLLM 0.33.0" in last


def test_the_trace_recorder_s_0_14_traces_replay_on_kvshm(tmp_path):
    """scripts/record_vllm_traces.py on vLLM 0.14.0 (the release kvshm
    reproduces): its simulation's traces, one shape of each family, replay
    on kvshm op for op, so traces it records from another release differ
    only where that release does."""
    from kvshm.replay import expand_paths, load_trace, replay_trace
    families = ["full16-tiny-chat-s1000", "pd-full16-small-oob-*", "eagle-hyb-*-tiny-chat*",
                "encdec-enc200-small-sys*", "hyb3-full-sw-mamba-tiny-chat*",
                "mamba16-specblk1-tiny-chat*",
                "sink32-tiny-chat*", "dcp2-full16-tiny-chat*", "spec-full16-small-sys*"]
    proc = run_python("0.14.0", [REPO / "scripts" / "record_vllm_traces.py", tmp_path, "--only",
                                 *families])
    assert proc.returncode == 0, proc.stderr[-3000:]
    paths = list(expand_paths([tmp_path]))
    import fnmatch
    for family in families:
        assert any(fnmatch.fnmatch(p.name, family + ".jsonl.gz") for p in paths), family
    for path in paths:
        cfg, ops = load_trace(path)
        assert cfg["meta"]["recorded_from"] == "vllm 0.14.0" and cfg["version"] == 1
        mismatch = replay_trace(cfg, ops)
        assert mismatch is None, f"{path.name}: {mismatch}"


def test_an_engine_on_a_pool_of_another_release_is_refused_naming_both(model_dir, tmp_path,
                                                                       release):
    """An engine pointed at a pool that reproduces the other release's
    semantics is refused at the handshake, both releases named, and the
    pool is left as it was."""
    other = next(r for r in PYTHONS if r != release)
    with serve(model_dir, other) as proc:
        a_wl, _ = prefix_workloads()
        run = run_engine(model_dir, a_wl, tmp_path, "old", pool=str(proc.socket), check=False,
                         release=release)
        assert run.returncode != 0
        assert (f"this pool reproduces vLLM {other}'s allocation semantics, not vLLM "
                f"{release}'s, the engine's") in run.stderr_text
        stats = pool_stats(proc)
        assert stats["num_requests"] == 0
