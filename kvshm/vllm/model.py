"""Tiny Llamas that need no download, for the vLLM tests, the benchmark and
the demos: a config.json, seeded weights (kvshm/vllm/weights.py) and a
word-level tokenizer (`vllm serve` and vLLM's load generator need one).  What
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


# The special tokens, at the ids the configs name (unk, bos, eos).
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def vocabulary(vocab_size: int) -> list[str]:
    """The tokenizer's tokens by id: the special tokens, then made-up
    words of two or three syllables ("baba", "babe", ...), each a whole
    whitespace-separated word, so that any sequence of ids decodes to text
    that encodes back to the same ids (vLLM's load generator makes its
    prompts that way)."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    words = [a + b for a in syllables for b in syllables]
    words += [a + b + c for a in syllables for b in syllables for c in syllables]
    need = vocab_size - len(SPECIAL_TOKENS)
    if need > len(words):
        raise ValueError(f"a vocabulary of {vocab_size} tokens is more than this "
                         f"tokenizer makes ({len(words) + len(SPECIAL_TOKENS)})")
    return [*SPECIAL_TOKENS, *words[:need]]


def tokenizer_files(config: dict) -> dict[str, dict]:
    """tokenizer.json (the `tokenizers` library's format: a word-level model
    over whitespace-split words, unknown words as <unk>, no BOS added) and
    tokenizer_config.json (Hugging Face's fast tokenizer, and a chat
    template) for a model `config`."""
    tokens = vocabulary(config["vocab_size"])
    special = [{"id": i, "content": t, "single_word": False, "lstrip": False,
                "rstrip": False, "normalized": False, "special": True}
               for i, t in enumerate(SPECIAL_TOKENS)]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": special,
        "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {t: i for i, t in enumerate(tokens)},
                  "unk_token": SPECIAL_TOKENS[0]},
    }
    unk, bos, eos = SPECIAL_TOKENS
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": unk, "bos_token": bos,
        "eos_token": eos, "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": ("{% for m in messages %}{{ m['content'] }} {% endfor %}"),
    }
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": tokenizer_config}


def write_tiny_model(directory: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write the `size` ("tiny" or "small") Llama into `directory`
    (created): its config.json, its weights drawn from `seed`
    (model.safetensors), which vLLM loads with its default load_format, and
    its tokenizer (`tokenizer_files`)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    config = MODELS[size]
    (d / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    for name, content in tokenizer_files(config).items():
        (d / name).write_text(json.dumps(content) + "\n")
    write_llama_weights(d, config, seed)
    return d


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m kvshm.vllm.model",
                                 description="write a tiny Llama model directory "
                                 "(config.json, seeded weights in model.safetensors, and a "
                                 "word-level tokenizer)")
    ap.add_argument("directory")
    ap.add_argument("--size", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--seed", type=int, default=0, help="the weights' seed")
    args = ap.parse_args(argv)
    print(write_tiny_model(args.directory, args.size, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
