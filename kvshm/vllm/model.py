"""vLLM model directories as kvshm sees them: the KV-cache shape a model's
`config.json` gives (what `kvshm serve --vllm-model` sizes a pool and its
arena from), and a tiny Llama that needs no download (`load_format="dummy"`).

Pure: reads JSON, imports nothing of vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvshm.core.errors import ConfigError

# A 2-layer Llama small enough for tests and demos: vLLM builds it from this
# config alone with load_format="dummy".
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "torch_dtype": "bfloat16", "hidden_act": "silu",
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}


def write_tiny_model(directory: str | Path) -> Path:
    """Write the tiny Llama's config.json into `directory` (created)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(TINY_LLAMA, indent=1) + "\n")
    return d


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m kvshm.vllm.model",
                                 description="write a tiny Llama model directory "
                                 "(config only: load it with load_format='dummy')")
    ap.add_argument("directory")
    args = ap.parse_args(argv)
    print(write_tiny_model(args.directory))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
