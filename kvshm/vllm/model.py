"""vLLM model directories as kvshm sees them: the KV-cache shape a model's
`config.json` gives (what `kvshm serve --vllm-model` sizes a pool and its
arena from), and tiny Llamas that need no download (a config.json and
seeded weights, kvshm/vllm/weights.py).

Pure: reads JSON and writes files with numpy, imports nothing of vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvshm.config import blocks_for_memory
from kvshm.core.errors import ConfigError
from kvshm.core.specs import KV_DTYPES, FullSpec, KVShape, PoolConfig, SlidingWindowSpec
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


# vLLM's CPU backend: its default block size, and what "auto" makes of a
# checkpoint's dtype (float32 checkpoints run in bfloat16).
VLLM_CPU_BLOCK_SIZE = 128
_AUTO_DTYPE = {"float32": "bfloat16", "float": "bfloat16", "bfloat16": "bfloat16",
               "float16": "float16", "half": "float16"}
VLLM_POOL_HASH = ("vllm-sha256", "0")   # vLLM's default algorithm; the seed engines get


@dataclass(frozen=True)
class ModelKV:
    """The KV-cache shape of a decoder model, from its config.json."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    max_model_len: int
    sliding_window: int | None = None


def read_model(directory: str | Path) -> ModelKV:
    """The KV-cache shape of the model in `directory` as vLLM would derive
    it (layers, KV heads, head size, dtype "auto", context length).
    Raises ConfigError for a missing or unreadable config, and for models
    whose layers mix attention types (kvshm sizes one group here)."""
    path = Path(directory) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError("vllm_model", f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError("vllm_model", f"{path} is not JSON: {e}") from None
    cfg = {**cfg.get("text_config", {}), **{k: v for k, v in cfg.items() if k != "text_config"}}

    def need(key: str) -> int:
        value = cfg.get(key)
        if not isinstance(value, int) or value <= 0:
            raise ConfigError("vllm_model", f"{path}: {key} must be a positive integer "
                              f"(got {value!r})")
        return value

    layers = need("num_hidden_layers")
    heads = need("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_size = cfg.get("head_dim") or need("hidden_size") // heads
    raw = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").removeprefix("torch.")
    if raw not in _AUTO_DTYPE:
        raise ConfigError("vllm_model", f"{path}: unsupported torch_dtype {raw!r}")
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    layer_types = set(cfg.get("layer_types") or ())
    if len(layer_types) > 1 or cfg.get("sliding_window_pattern") or cfg.get(
            "interleaved_sliding_window"):
        raise ConfigError("vllm_model", f"{path}: its layers mix attention types "
                          f"({sorted(layer_types) or 'interleaved sliding window'}); "
                          "describe the pool with a config file instead")
    return ModelKV(layers, int(kv_heads), int(head_size), _AUTO_DTYPE[raw],
                   int(cfg.get("max_position_embeddings") or 2048),
                   int(window) if window else None)


def model_pool_config(directory: str | Path, *, kv_memory: int, block_size: int =
                      VLLM_CPU_BLOCK_SIZE, dtype: str = "auto",
                      max_model_len: int | None = None, max_num_seqs: int = 1024,
                      hash_algorithm: str = VLLM_POOL_HASH[0],
                      hash_seed: str = VLLM_POOL_HASH[1]) -> PoolConfig:
    """The pool for vLLM engines serving the model in `directory`:
    one KV-cache group of the model's attention type, `kv_memory` bytes of
    K/V laid out as vLLM's CPU attention expects its per-layer tensors, and
    vLLM's block hashes.  Raises ConfigError."""
    m = read_model(directory)
    dt = m.dtype if dtype == "auto" else dtype
    if dt not in KV_DTYPES:
        raise ConfigError("dtype", f"must be auto, {', '.join(KV_DTYPES)} (got {dtype!r})")
    spec = (SlidingWindowSpec(block_size, m.sliding_window) if m.sliding_window
            else FullSpec(block_size))
    shape = PoolConfig(
        num_blocks=2, hash_block_size=block_size,
        max_model_len=max_model_len or m.max_model_len, groups=(spec,),
        max_num_seqs=max_num_seqs, hash_algorithm=hash_algorithm, hash_seed=hash_seed,
        kv=KVShape(num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
                   head_size=m.head_size, dtype=dt, layout="layers"))
    return shape.replace(num_blocks=blocks_for_memory(shape.kv_block_bytes, kv_memory))


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
