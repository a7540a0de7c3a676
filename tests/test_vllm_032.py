"""vLLM 0.32.0, the current CPU release, in its own environment
(./scripts/vllm_env.sh 0.32.0 makes .venv-vllm-0.32.0, or
$KVSHM_VLLM_032_PYTHON): the conformance set recorded from its own
KV-cache manager (tests/data/conformance-0.32.0,
scripts/record_vllm_traces.py).  Its engines on kvshm pools are tested with
0.14's, in tests/test_vllm.py.  Without that environment these tests
skip, unless KVSHM_REQUIRE_VLLM=1 (the test command sets it): then they
fail."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from vllm_engines import PYTHONS, run_python

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = PYTHONS["0.32.0"]
SET = REPO / "tests" / "data" / "conformance-0.32.0" / "traces"
EVENTS = SET.parent / "events"
TIMEOUT = 600

if not VLLM_PYTHON.exists():
    if os.environ.get("KVSHM_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"KVSHM_REQUIRE_VLLM=1 but there is no vLLM 0.32.0 environment at "
                           f"{VLLM_PYTHON} (run ./scripts/vllm_env.sh 0.32.0)")
    pytest.skip(f"no vLLM 0.32.0 environment at {VLLM_PYTHON} "
                "(./scripts/vllm_env.sh 0.32.0 makes one)", allow_module_level=True)


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("KVSHM_POOL", "PYTHONHASHSEED")}
    e.update(extra)
    return e


def test_the_environment_runs_vllm_0_32():
    """A fresh interpreter of the environment (not the tests' fork server)
    imports vLLM, torch and the plugin."""
    proc = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm, torch, kvshm.vllm; "
                           "print(vllm.__version__, torch.__version__)"],
                          capture_output=True, text=True, env=env(), timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-2:] == ["0.32.0", "2.13.0+cpu"]


def test_the_stored_set_is_what_vllm_0_32_s_own_manager_answers(tmp_path):
    """Every op of every stored 0.32 trace, replayed on the release's own
    manager (scripts/vllm_oracle.py), gets its recorded answer, and the
    manager emits the stored KV-event streams."""
    from kvshm.replay import load_events
    index = json.loads((SET / "index.json").read_text())
    assert index["recorded_from"] == "vllm 0.32.0" and index["format_version"] == 2
    assert len(index["traces"]) == 166 and len(index["skipped"]) == 6   # 0.32 cannot build sink
    proc = run_python("0.32.0", [REPO / "scripts" / "vllm_oracle.py", "--events", tmp_path, SET],
                      env=env(), timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "vLLM 0.32.0: passed 166/166"
    stored = sorted(p.name for p in EVENTS.glob("*.events.jsonl.gz"))
    assert sorted(p.name for p in tmp_path.glob("*.events.jsonl.gz")) == stored
    assert len(stored) == 139
    for name in stored:
        assert load_events(tmp_path / name) == load_events(EVENTS / name), name


REFUSALS = r'''
import json, types
import torch
from vllm.v1 import kv_cache_interface as vi
from kvshm.core.errors import ConfigError, PoolRefused
from kvshm.vllm.binding import PoolBinding
from kvshm.vllm.manager import PoolKVCacheManager032

def cfg(*specs):
    return vi.KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        vi.KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)])

full = vi.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
mamba = vi.MambaSpec(block_size=16, shapes=((2, 3),), dtypes=(torch.float32,))
common = dict(max_model_len=64, scheduler_block_size=16, hash_block_size=16)
out = {}
for name, kw in {"lookahead": dict(kv_cache_config=cfg(full), num_prefill_lookahead=2),
                 "checkpoint": dict(kv_cache_config=cfg(full),
                                    enable_mamba_shared_prefix_checkpoint=True),
                 "zeroing": dict(kv_cache_config=cfg(full, mamba)),
                 "sizes": dict(kv_cache_config=cfg(full), scheduler_block_size=32)}.items():
    try:
        PoolKVCacheManager032(**{**common, **kw})
    except ConfigError as e:
        out[name] = str(e)
consumer = types.SimpleNamespace(supports_divergent_local_hybrid_hits=False)
scheduler = types.SimpleNamespace(connector=consumer, vllm_config=types.SimpleNamespace(
    kv_transfer_config=types.SimpleNamespace(is_kv_consumer=True)))
try:
    PoolBinding("embedded").gate_scheduler(scheduler)
except PoolRefused as e:
    out["consumer"] = str(e)
print(json.dumps(out))
'''


def test_the_0_32_manager_refuses_what_kvshm_does_not_reproduce_by_name():
    """Engine configurations whose 0.32 manager would hand the scheduler
    work kvshm does not do (re-prefilled drafts, Mamba checkpoints, blocks
    to zero, a connector's asynchronous loads), or that no engine test has
    run (groups of other block sizes than the hash block), stop at
    start-up, each named, before any pool is opened."""
    proc = run_python("0.32.0", ["-c", REFUSALS], env=env(), timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "re-prefills tokens (num_prefill_lookahead 2)" in out["lookahead"]
    assert "Mamba shared-prefix checkpoints" in out["checkpoint"]
    assert "new blocks must be zeroed" in out["zeroing"]
    assert "other block sizes than the hash block (scheduler 32, hash 16" in out["sizes"]
    assert all("unset KVSHM_POOL" in out[k] for k in ("lookahead", "checkpoint", "zeroing",
                                                        "sizes"))
    assert "KV connector (SimpleNamespace) loads K/V" in out["consumer"]
