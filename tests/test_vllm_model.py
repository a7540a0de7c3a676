"""Pools for vLLM engines, without vLLM: model directories and their seeded
weights, the "layers" arena layout, vLLM-hashed pool configs and `kvshm
serve --vllm-model`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kvshm.config import model_pool_config, read_model
from kvshm.core.errors import ConfigError, SegmentError
from kvshm.core.specs import FullSpec, KVShape, PoolConfig, SlidingWindowSpec, check_engine_hash_seed
from kvshm.pool.arena import ArenaLayout
from kvshm.vllm.model import SMALL_LLAMA, TINY_LLAMA, write_tiny_model
from kvshm.vllm.weights import WEIGHTS_FILE, read_safetensors_header, to_bfloat16_bits
from kvshm.workers.engine import UnsupportedModel, check_supported


def model(tmp_path, **changes):
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**TINY_LLAMA, **changes}))
    return d


def test_the_tiny_model_as_vllm_sees_it(tmp_path):
    m = read_model(write_tiny_model(tmp_path / "t"))
    assert (m.num_layers, m.num_kv_heads, m.head_size, m.dtype) == (2, 2, 64, "bfloat16")
    assert m.max_model_len == 4096 and m.sliding_window is None
    assert read_model(write_tiny_model(tmp_path / "s", "small")).num_layers == \
        SMALL_LLAMA["num_hidden_layers"]


def test_the_tiny_model_s_weights_are_the_tensors_vllm_s_llama_loads(tmp_path):
    d = write_tiny_model(tmp_path / "t")
    path = d / WEIGHTS_FILE
    header = read_safetensors_header(path)
    per_layer = ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                 "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj"]
    assert set(header) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                           *(f"model.layers.{i}.{t}.weight" for i in range(2) for t in per_layer)}
    assert {h["dtype"] for h in header.values()} == {"BF16"}
    assert header["model.layers.1.self_attn.k_proj.weight"]["shape"] == [2 * 64, 256]
    assert header["lm_head.weight"]["shape"] == [1000, 256]
    spans = sorted(tuple(h["data_offsets"]) for h in header.values())
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    raw = path.read_bytes()
    start = 8 + int.from_bytes(raw[:8], "little")
    assert start % 8 == 0 and len(raw) == start + spans[-1][1]

    def tensor(name):
        a, b = header[name]["data_offsets"]
        bits = np.frombuffer(raw[start + a:start + b], np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(header[name]["shape"])

    assert (tensor("model.norm.weight") == 1).all()
    # q/k far above the 1/sqrt(fan_in) of an initialization: attention is peaked.
    assert tensor("model.layers.0.self_attn.q_proj.weight").std() == pytest.approx(
        1.6 / 16, rel=0.02)
    # The seed, and only the seed, decides the bytes.
    assert (write_tiny_model(tmp_path / "again") / WEIGHTS_FILE).read_bytes() == raw
    assert (write_tiny_model(tmp_path / "other", seed=1) / WEIGHTS_FILE).read_bytes() != raw


def test_bfloat16_bits_round_to_nearest_even():
    import ml_dtypes
    x = np.random.default_rng(3).standard_normal(10_000).astype(np.float32)
    x[:4] = [1 + 2**-8, 1 + 3 * 2**-8, -0.0, 3.0e38]     # ties to even, a zero, a large one
    assert (to_bfloat16_bits(x) == x.astype(ml_dtypes.bfloat16).view(np.uint16)).all()


def test_dtype_auto_and_defaults(tmp_path):
    assert read_model(model(tmp_path, torch_dtype="float32")).dtype == "bfloat16"
    assert read_model(model(tmp_path, torch_dtype="float16")).dtype == "float16"
    no_kv = {k: v for k, v in TINY_LLAMA.items() if k not in ("num_key_value_heads", "head_dim")}
    d = tmp_path / "n"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(no_kv))
    m = read_model(d)
    assert m.num_kv_heads == 4 and m.head_size == 256 // 4


def test_a_pool_for_a_model(tmp_path):
    c = model_pool_config(model(tmp_path), kv_memory=8 << 20, block_size=32, max_model_len=2048)
    per_block = 2 * 2 * 32 * 2 * 64 * 2
    assert c.num_blocks == (8 << 20) // per_block and c.kv_block_bytes == per_block
    assert c.groups == (FullSpec(32),) and c.kv.layout == "layers"
    assert (c.hash_algorithm, c.hash_seed) == ("vllm-sha256", "0")
    w = model_pool_config(model(tmp_path, sliding_window=256), kv_memory=8 << 20,
                          block_size=32, dtype="float32")
    assert w.groups == (SlidingWindowSpec(32, 256),) and w.kv.dtype == "float32"


@pytest.mark.parametrize("changes, message", [
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
    ({"num_attention_heads": "x"}, "num_attention_heads must be a positive integer"),
    ({"torch_dtype": "int8"}, "unsupported torch_dtype"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "mix attention types"),
])
def test_models_kvshm_cannot_size_are_refused(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        read_model(model(tmp_path, **changes))


def test_unreadable_model_directories(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        read_model(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not JSON"):
        read_model(tmp_path)


def test_pool_sizes_and_dtypes_that_do_not_work(tmp_path):
    with pytest.raises(ConfigError, match="at least 2 are needed"):
        model_pool_config(model(tmp_path), kv_memory=1000, block_size=32)
    with pytest.raises(ConfigError, match="must be auto, float32"):
        model_pool_config(model(tmp_path), kv_memory=8 << 20, dtype="int4")


def test_vllm_hash_seeds_of_pools_for_engines_must_be_valid_pythonhashseeds():
    """A pool may hash with any seed (a replay of the oracle's traces uses
    'kvshm-oracle-0'); one served for engines needs a PYTHONHASHSEED."""
    base = dict(num_blocks=8, hash_block_size=4, max_model_len=64, groups=(FullSpec(4),),
                hash_algorithm="vllm-sha256")
    check_engine_hash_seed(PoolConfig(**base, hash_seed="4294967295"))
    for bad in ("kvshm-0", "-1", "4294967296", "", "١"):
        config = PoolConfig(**base, hash_seed=bad)
        with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
            check_engine_hash_seed(config)
    check_engine_hash_seed(PoolConfig(**{**base, "hash_algorithm": "sha256"},
                                      hash_seed="kvshm-0"))


def test_the_layers_layout(tmp_path):
    kv = KVShape(num_layers=3, num_kv_heads=2, head_size=8, dtype="float32", layout="layers")
    c = PoolConfig(num_blocks=10, hash_block_size=4, max_model_len=64, groups=(FullSpec(4),),
                   kv=kv)
    lay = ArenaLayout(c)
    assert lay.shape == (3, 2, 10, 2, 4, 8)
    offsets = [lay.layer_region(i) for i in range(3)]
    assert [s for _, s in offsets] == [2 * 10 * 2 * 4 * 8 * 4] * 3
    assert offsets[1][0] - offsets[0][0] == offsets[0][1]
    assert offsets[2][0] + offsets[2][1] == lay.size
    with pytest.raises(SegmentError, match="not in"):
        lay.layer_region(3)
    blocks = ArenaLayout(c.replace(kv=KVShape(num_layers=3, num_kv_heads=2, head_size=8)))
    with pytest.raises(SegmentError, match="laid out by blocks"):
        blocks.layer_region(0)
    with pytest.raises(UnsupportedModel, match="laid out by layers"):
        check_supported(c)
    with pytest.raises(ConfigError, match="kv.layout"):
        c.replace(kv=KVShape(num_layers=1, num_kv_heads=1, head_size=8, layout="rows"))


def test_the_default_layout_keeps_config_encodings_and_fingerprints():
    kv = KVShape(num_layers=1, num_kv_heads=1, head_size=8)
    assert b"layout" not in PoolConfig(num_blocks=8, hash_block_size=4, max_model_len=64,
                                       groups=(FullSpec(4),), kv=kv).to_json()


def kvshm(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "kvshm", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["--preset", "tiny", "--block-size", "32"], "--block-size go with --vllm-model"),
    (["--preset", "tiny", "--dtype", "float32", "--max-model-len", "9"],
     "--dtype, --max-model-len go with --vllm-model"),
    (["--vllm-model", "/nonexistent"], "cannot read /nonexistent/config.json"),
    (["--preset", "tiny", "--hash-algorithm", "vllm-sha256"], "PYTHONHASHSEED"),
])
def test_serve_refuses_bad_vllm_flags(args, message, sockdir):
    r = kvshm("serve", *args, "--socket", str(sockdir / "s.sock"), "--name", "kvshm-t-bad")
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_serve_a_pool_for_a_vllm_model(tmp_path, sockdir):
    d = write_tiny_model(tmp_path / "tiny")
    proc = subprocess.Popen([sys.executable, "-m", "kvshm", "serve", "--vllm-model", str(d),
                             "--block-size", "32", "--kv-memory", "4M", "--max-model-len", "2048", "--name",
                             f"kvshm-t-{sockdir.name[-8:]}", "--socket",
                             str(sockdir / "s.sock")], stdout=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline() for _ in range(3)]
        assert "hash vllm-sha256" in lines[0] and "128 blocks" in lines[0]
        assert "layers layout" in lines[1] and lines[2].startswith("ready")
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()
