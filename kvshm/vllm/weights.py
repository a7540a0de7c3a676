"""Seeded Llama weights in a safetensors file, so that a tiny model's greedy
output depends on the K/V of its context (vLLM's dummy weights give near-zero
K/V, and then a wrong or stale block changes nothing).

numpy only (no torch, no safetensors package): the file is an 8-byte
little-endian header length, a JSON header, then the raw tensor bytes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

# Standard deviations, as multiples of 1/sqrt(fan_in).  Large q/k make the
# attention scores spread (std about Q_K_SCALE**2), so a query weighs a few
# earlier tokens far more than the rest; v/o at unit gain make what attention
# gathers as large as the token's own embedding in the residual stream; the
# lm_head scale sets how peaked the final logits are.
Q_K_SCALE = 1.6
V_O_SCALE = 1.0
MLP_SCALE = 1.0
LM_HEAD_SCALE = 6.0

WEIGHTS_FILE = "model.safetensors"


def llama_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...], float]]:
    """The (name, shape, std) of every tensor vLLM's LlamaForCausalLM loads
    for the config `cfg` (std 0 marks a norm weight: all ones)."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    vocab = cfg["vocab_size"]
    out = [("model.embed_tokens.weight", (vocab, hidden), 1.0)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (hidden,), 0.0),
            (p + "self_attn.q_proj.weight", (heads * head_dim, hidden), Q_K_SCALE / hidden**.5),
            (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden),
             Q_K_SCALE / hidden**.5),
            (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden),
             V_O_SCALE / hidden**.5),
            (p + "self_attn.o_proj.weight", (hidden, heads * head_dim),
             V_O_SCALE / (heads * head_dim)**.5),
            (p + "post_attention_layernorm.weight", (hidden,), 0.0),
            (p + "mlp.gate_proj.weight", (inter, hidden), MLP_SCALE / hidden**.5),
            (p + "mlp.up_proj.weight", (inter, hidden), MLP_SCALE / hidden**.5),
            (p + "mlp.down_proj.weight", (hidden, inter), MLP_SCALE / inter**.5),
        ]
    out += [("model.norm.weight", (hidden,), 0.0),
            ("lm_head.weight", (vocab, hidden), LM_HEAD_SCALE / hidden**.5)]
    return out


def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> the bfloat16 bit patterns (uint16), rounded to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def write_safetensors(path: str | Path, tensors: dict[str, tuple[str, tuple[int, ...],
                                                                bytes]]) -> Path:
    """Write `tensors` ({name: (safetensors dtype, shape, raw bytes)}) to
    `path` in the safetensors format."""
    header, offset = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)          # the data starts 8-byte aligned
    path = Path(path)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for _, _, data in tensors.values():
            f.write(data)
    return path


def write_llama_weights(directory: str | Path, cfg: dict, seed: int = 0) -> Path:
    """Write `directory`/model.safetensors: normal weights drawn from `seed`
    (the same file for the same config and seed), in bfloat16."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape, std in llama_tensors(cfg):
        w = (np.ones(shape, np.float32) if std == 0.0
             else rng.standard_normal(shape, dtype=np.float32) * np.float32(std))
        tensors[name] = ("BF16", shape, to_bfloat16_bits(w).tobytes())
    return write_safetensors(Path(directory) / WEIGHTS_FILE, tensors)


def read_safetensors_header(path: str | Path) -> dict:
    """The JSON header of a safetensors file (name -> dtype, shape, offsets)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))
