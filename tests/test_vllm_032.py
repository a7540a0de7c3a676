"""vLLM 0.32.0, the current CPU release, in its own environment
(./scripts/vllm_env.sh 0.32.0 makes .venv-vllm-0.32.0, or
$KVSHM_VLLM_032_PYTHON): the plugin's refusal of it, and the conformance set
recorded from its own KV-cache manager (tests/data/conformance-0.32.0,
scripts/record_vllm_traces.py).  Without that environment these tests
skip, unless KVSHM_REQUIRE_VLLM=1 (the test command sets it): then they
fail."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = Path(os.environ.get("KVSHM_VLLM_032_PYTHON",
                                  REPO / ".venv-vllm-0.32.0" / "bin" / "python"))
SET = REPO / "tests" / "data" / "conformance-0.32.0" / "traces"
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
    proc = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm, torch, kvshm.vllm; "
                           "print(vllm.__version__, torch.__version__)"],
                          capture_output=True, text=True, env=env(), timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-2:] == ["0.32.0", "2.13.0+cpu"]


ENGINE = r'''
from vllm import LLM
LLM(model="unused", skip_tokenizer_init=True)
print("started")
'''


def test_an_engine_on_a_kvshm_pool_is_refused_in_one_line():
    """A real 0.32 engine with KVSHM_POOL set stops at start-up, before it
    loads anything, with kvshm's one line; without it, the plugin says
    nothing (the engine then fails on its own, on the missing model)."""
    refused = subprocess.run([str(VLLM_PYTHON), "-c", ENGINE], capture_output=True, text=True,
                             env=env(KVSHM_POOL="embedded"), timeout=TIMEOUT)
    assert refused.returncode == 1 and "started" not in refused.stdout
    assert "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines()[-1].endswith(
        "supports vLLM 0.14.0, not the vLLM 0.32.0 of this engine (KVSHM_POOL=embedded): "
        "install vLLM 0.14.0, or unset KVSHM_POOL to run on vLLM's own KV-cache manager")
    silent = subprocess.run([str(VLLM_PYTHON), "-c", ENGINE], capture_output=True, text=True,
                            env=env(), timeout=TIMEOUT)
    assert silent.returncode != 0 and "kvshm" not in silent.stdout + silent.stderr


def test_the_stored_set_is_what_vllm_0_32_s_own_manager_answers():
    """Every op of every stored 0.32 trace, replayed on the release's own
    manager (scripts/vllm_oracle.py), gets its recorded answer."""
    index = json.loads((SET / "index.json").read_text())
    assert index["recorded_from"] == "vllm 0.32.0" and index["format_version"] == 2
    assert len(index["traces"]) == 160 and len(index["skipped"]) == 6   # 0.32 cannot build sink
    proc = subprocess.run([str(VLLM_PYTHON), str(REPO / "scripts" / "vllm_oracle.py"), str(SET)],
                          capture_output=True, text=True, env=env(), timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "vLLM 0.32.0: passed 160/160"
