"""Real vLLM CPU engines on kvshm (the plugin in kvshm/vllm/).

The engines run in the vLLM environment that ./scripts/vllm_env.sh makes
(.venv-vllm, or $KVSHM_VLLM_PYTHON), one process per engine, through
`python -m kvshm.vllm.engine`.  Without that environment these tests skip,
unless KVSHM_REQUIRE_VLLM=1 (the test command sets it): then they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from helpers import kvshm_segments
from kvshm.vllm.engine import shared_prefix_workload
from kvshm.vllm.model import write_tiny_model

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = Path(os.environ.get("KVSHM_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
ENGINE_TIMEOUT = 300

if not VLLM_PYTHON.exists():
    if os.environ.get("KVSHM_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"KVSHM_REQUIRE_VLLM=1 but there is no vLLM environment at "
                           f"{VLLM_PYTHON} (run ./scripts/vllm_env.sh)")
    pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (./scripts/vllm_env.sh makes one)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def run_engine(model: Path, workload: dict, tmp: Path, name: str, *, pool: str | None,
               extra: tuple[str, ...] = (), env: dict | None = None,
               check: bool = True) -> dict | subprocess.CompletedProcess:
    """Run one engine process on `workload`; its report (or, with
    check=False, the finished process)."""
    wl = tmp / f"{name}.workload.json"
    wl.write_text(json.dumps(workload))
    out = tmp / f"{name}.json"
    e = {k: v for k, v in os.environ.items() if k not in ("KVSHM_POOL", "PYTHONHASHSEED")}
    e["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    e["VLLM_CPU_KVCACHE_SPACE"] = "1"
    if pool is not None:
        e["KVSHM_POOL"] = pool
    e.update(env or {})
    proc = subprocess.run([str(VLLM_PYTHON), "-m", "kvshm.vllm.engine", str(model), str(wl),
                           "--out", str(out), *extra], env=e, capture_output=True, text=True,
                          timeout=ENGINE_TIMEOUT)
    if not check:
        return proc
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def outputs(report: dict) -> dict[str, tuple[list[int], int]]:
    return {r["id"]: (r["token_ids"], r["num_cached_tokens"]) for r in report["requests"]}


def test_embedded_pool_generates_what_vllm_s_own_manager_does(model_dir, tmp_path):
    # 16 requests over two shared prefixes, two exact duplicates, and a
    # 24-block pool: the engine preempts.
    workload = shared_prefix_workload()
    before = kvshm_segments()
    args = ("--num-blocks", "24")
    own = run_engine(model_dir, workload, tmp_path, "own", pool=None, extra=args)
    emb = run_engine(model_dir, workload, tmp_path, "embedded", pool="embedded", extra=args)
    assert own["manager"] == "vllm.v1.core.kv_cache_manager.KVCacheManager"
    assert emb["manager"] == "kvshm.vllm.manager.PoolKVCacheManager"
    assert len(own["requests"]) == 16
    assert own["counters"]["num_preemptions"] > 0
    assert own["counters"]["prefix_cache_hits"] > 0
    assert outputs(emb) == outputs(own)
    assert emb["counters"] == own["counters"]
    # Distinct outputs: the weights make generation depend on the context.
    assert len({tuple(t) for t, _ in outputs(own).values()}) >= 14
    assert kvshm_segments() == before   # the embedded segment went with the engine
