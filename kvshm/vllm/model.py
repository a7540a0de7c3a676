"""Tiny Llamas that need no download, for the vLLM tests, the benchmark and
the demos: a config.json and seeded weights (kvshm/vllm/weights.py).  What
kvshm reads from a model's config.json (the KV-cache shape a pool is sized
from: `kvshm serve --vllm-model`) is `kvshm.config.read_model`.

Pure: reads JSON and writes files with numpy, imports nothing of vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvshm.vllm.weights import write_llama_weights

# A 2-layer Llama small enough for tests and demos (3.4 MB of bfloat16
# weights).
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "torch_dtype": "bfloat16", "hidden_act": "silu",
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}


# A 4-layer Llama whose prefill costs something (about 17M parameters): the
# benchmark's default, so that a prefix-cache hit saves measurable time.
SMALL_LLAMA = {**TINY_LLAMA, "hidden_size": 512, "intermediate_size": 1536,
               "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
               "head_dim": 64, "vocab_size": 4000}
MODELS = {"tiny": TINY_LLAMA, "small": SMALL_LLAMA}


def write_tiny_model(directory: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write the `size` ("tiny" or "small") Llama into `directory`
    (created): its config.json and its weights drawn from `seed`
    (model.safetensors), which vLLM loads with its default load_format."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(MODELS[size], indent=1) + "\n")
    write_llama_weights(d, MODELS[size], seed)
    return d


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m kvshm.vllm.model",
                                 description="write a tiny Llama model directory "
                                 "(config.json and seeded weights, model.safetensors)")
    ap.add_argument("directory")
    ap.add_argument("--size", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--seed", type=int, default=0, help="the weights' seed")
    args = ap.parse_args(argv)
    print(write_tiny_model(args.directory, args.size, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
