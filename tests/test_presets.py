"""kvshm/config.py: model-shaped presets, sizes, flags -> pool configs, and
`kvshm serve` argument errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from kvshm.config import (
    PRESETS,
    PoolSource,
    parse_size,
    preset_config,
    resolve_config,
)
from kvshm.core.errors import ConfigError
from kvshm.core.specs import CrossAttentionSpec
from kvshm.pool.lifecycle import pool_bytes


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_is_a_valid_pool(name):
    cfg = preset_config(name, num_blocks=128)
    assert cfg.num_blocks == 128
    if any(isinstance(g, CrossAttentionSpec) for g in cfg.groups):
        assert not cfg.enable_caching and cfg.encoder_len == 1500


def test_kv_memory_becomes_blocks():
    # llama-8b: 2 (K,V) x 32 layers x 8 heads x 128 x 2 bytes x 16 tokens = 2 MiB a block
    assert PRESETS["llama-8b"].block_bytes == 2 * 2**20
    assert preset_config("llama-8b", kv_memory=4 * 2**30).num_blocks == 2048
    assert preset_config("llama-8b").num_blocks == 1024  # 2 GiB by default


def test_unknown_preset_and_a_budget_below_two_blocks():
    with pytest.raises(ConfigError, match="unknown preset"):
        preset_config("gpt-17")
    with pytest.raises(ConfigError, match="kv_memory: .* hold 1 block"):
        preset_config("llama-8b", kv_memory=3 * 2**20)


@pytest.mark.parametrize("text,value", [("512M", 512 * 2**20), ("4G", 4 * 2**30),
                                        ("1.5GiB", int(1.5 * 2**30)), ("64k", 64 * 2**10),
                                        ("1000000", 1000000), ("2TB", 2 * 2**40)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1G", "0"])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(ConfigError, match="kv_memory"):
        parse_size(text)


def _serve(*args, timeout=20):
    return subprocess.run([sys.executable, "-m", "kvshm", "serve", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_serve_argument_errors(tmp_path):
    cfg = tmp_path / "pool.json"
    cfg.write_text('{"num_blocks": 64, "hash_block_size": 16, "max_model_len": 256,'
                   ' "groups": [{"type": "full", "block_size": 16}]}')
    res = _serve("--config", str(cfg), "--kv-memory", "1G")
    assert res.returncode == 2 and "--kv-memory needs a KV shape" in res.stderr
    res = _serve("--config", str(cfg), "--token-file", str(tmp_path / "missing"))
    assert res.returncode == 2 and "cannot read" in res.stderr
    res = _serve("--preset", "nope")
    assert res.returncode == 2 and "unknown preset" in res.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("num_blocks = -3\nhash_block_size = 16\nmax_model_len = 256\n"
                   "[[groups]]\ntype = \"full\"\nblock_size = 16\n")
    res = _serve("--config", str(bad))
    assert res.returncode == 2 and "num_blocks: must be a positive integer" in res.stderr
    bad.write_text("num_blocks = 64\n")
    res = _serve("--config", str(bad))
    assert res.returncode == 2 and "missing required field `hash_block_size`" in res.stderr


def test_serve_a_preset_and_stop_it_with_sigint(sockdir):
    sock = sockdir / "p.sock"
    proc = subprocess.Popen([sys.executable, "-m", "kvshm", "serve", "--preset", "gemma-hybrid",
                             "--num-blocks", "24", "--name", "kvshm-test-preset",
                             "--socket", str(sock)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = proc.stdout.readline()
        assert "2 group(s)" in banner and "caching on" in banner, banner + proc.stderr.read()
        arena = proc.stdout.readline()
        assert "KV arena /dev/shm/kvshm-test-preset.kv" in arena and "bfloat16" in arena
        assert proc.stdout.readline().startswith("ready kvshm-test-preset")
        assert os.path.exists("/dev/shm/kvshm-test-preset.kv")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert "segment removed" in out
        assert not sock.exists()
        assert not os.path.exists("/dev/shm/kvshm-test-preset.kv")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


# -- resolve_config: flags -> PoolConfig -----------------------------------------------


def _file(tmp_path, kv: bool):
    cfg = tmp_path / "pool.toml"
    cfg.write_text("num_blocks = 64\nhash_block_size = 16\nmax_model_len = 256\n"
                   "[[groups]]\ntype = \"full\"\nblock_size = 16\n"
                   + ("[kv]\nnum_layers = 2\nnum_kv_heads = 2\nhead_size = 8\n" if kv else ""))
    return str(cfg)


def test_a_preset_is_sized_by_blocks_memory_or_the_callers_default():
    assert resolve_config(PoolSource(preset="llama-8b", num_blocks=10)).num_blocks == 10
    assert resolve_config(PoolSource(preset="tiny", kv_memory="32M")).num_blocks == 512
    assert resolve_config(PoolSource(preset="tiny", kv_memory=32 << 20)).num_blocks == 512
    assert resolve_config(PoolSource(preset="llama-8b")).num_blocks == 1024  # DEFAULT_KV_MEMORY
    assert resolve_config(PoolSource(), default_preset="llama-8b",
                          default_kv_memory="1100M").num_blocks == 550
    assert resolve_config(PoolSource(), default_preset="tiny") == preset_config("tiny")


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_holds_a_full_length_request_by_default(name):
    c = resolve_config(PoolSource(preset=name))
    assert c.num_blocks >= c.blocks_for_request() + 1


def test_a_budget_too_small_for_one_request_is_refused_with_what_it_needs():
    with pytest.raises(ConfigError, match=r"one 8,192-token request needs 513 \(with the "
                       r"null block\): give --kv-memory 1026M or more") as e:
        resolve_config(PoolSource(preset="llama-8b", kv_memory="1G"))
    assert e.value.field == "kv_memory"
    # The memory it names is enough; an explicit block count is the user's call.
    assert resolve_config(PoolSource(preset="llama-8b", kv_memory="1026M")).num_blocks == 513
    assert resolve_config(PoolSource(preset="llama-8b", num_blocks=64)).num_blocks == 64


def test_a_config_file_keeps_its_size_unless_told(tmp_path):
    path = _file(tmp_path, kv=True)
    assert resolve_config(PoolSource(config_file=path)).num_blocks == 64
    assert resolve_config(PoolSource(config_file=path, num_blocks=9)).num_blocks == 9
    # 2 (K,V) x 2 layers x 16 tokens x 2 heads x 8 x 2 bytes = 2 KiB a block
    assert resolve_config(PoolSource(config_file=path, kv_memory="1M")).num_blocks == 512


def test_a_vllm_model_directory(tmp_path):
    from kvshm.vllm.model import write_tiny_model
    model = str(write_tiny_model(tmp_path / "m"))
    c = resolve_config(PoolSource(vllm_model=model, block_size=32, dtype="float32",
                                  max_model_len=1024, kv_memory="8M"))
    assert (c.groups[0].block_size, c.kv.dtype, c.max_model_len) == (32, "float32", 1024)
    assert c.num_blocks == (8 << 20) // c.kv_block_bytes
    assert resolve_config(PoolSource(vllm_model=model, num_blocks=7)).num_blocks == 7


def test_hashing_flags_override_the_shape_and_are_checked():
    c = resolve_config(PoolSource(preset="tiny", num_blocks=8, hash_algorithm="vllm-sha256",
                                  hash_seed="7"))
    assert (c.hash_algorithm, c.hash_seed) == ("vllm-sha256", "7")
    with pytest.raises(ConfigError, match="PYTHONHASHSEED") as e:
        resolve_config(PoolSource(preset="tiny", num_blocks=8, hash_algorithm="vllm-sha256"))
    assert e.value.field == "hash_seed"


@pytest.mark.parametrize("source, kw, field, message", [
    (dict(preset="tiny", config_file="x.toml"), {}, "config_file", "give one of"),
    (dict(preset="tiny", block_size=32), {}, "vllm_model", "--block-size go with"),
    (dict(preset="tiny", num_blocks=8, kv_memory="1G"), {}, "num_blocks", "not both"),
    (dict(), {}, "config", "give a preset"),
    (dict(preset="gpt-17"), {}, "preset", "unknown preset"),
    (dict(preset="tiny", kv_memory="lots"), {}, "kv_memory", "not a size"),
    (dict(preset="tiny", num_blocks=1), {}, "num_blocks", "at least 2"),
], ids=["two-shapes", "vllm-flag", "two-sizes", "nothing", "unknown", "bad-size", "tiny"])
def test_what_resolve_config_refuses(source, kw, field, message):
    with pytest.raises(ConfigError, match=message) as e:
        resolve_config(PoolSource(**source), **kw)
    assert e.value.field == field


def test_a_budget_needs_a_kv_shape_and_workers_need_an_arena(tmp_path):
    path = _file(tmp_path, kv=False)
    with pytest.raises(ConfigError, match="--kv-memory needs a KV shape"):
        resolve_config(PoolSource(config_file=path, kv_memory="1G"))
    assert resolve_config(PoolSource(config_file=path)).kv is None
    with pytest.raises(ConfigError, match="no \\[kv\\] shape: workers need a KV arena"):
        resolve_config(PoolSource(config_file=path), need_kv=True)


def test_pool_source_from_command_line_arguments():
    import argparse
    args = argparse.Namespace(config="p.toml", num_blocks=5, quiet=True)
    assert PoolSource.from_args(args) == PoolSource(config_file="p.toml", num_blocks=5)


def test_pool_bytes_is_what_the_pool_and_its_arena_take(pool_name):
    from kvshm.pool.arena import KVArena, arena_name
    from kvshm.pool.kv_cache_manager import KVCacheManager
    config = preset_config("tiny", num_blocks=64)
    with KVCacheManager(config, name=pool_name) as mgr:
        arena = KVArena.create(config, arena_name(pool_name))
        try:
            taken = sum(os.path.getsize(f"/dev/shm/{n}") for n in (mgr.segment.name, arena.name))
        finally:
            arena.close()
    assert pool_bytes(config) == taken
    plain = config.replace(kv=None)
    with KVCacheManager(plain, name=pool_name) as mgr:
        assert pool_bytes(plain) == os.path.getsize(f"/dev/shm/{mgr.segment.name}") < taken


def test_the_default_preset_of_kvshm_run_has_llama_3_8b_s_cost_profile():
    """Parameters per K/V value within 2x of Llama-3-8B's (8.0B / 65,536), as
    the transformer counts them; `tiny` stays the fast one."""
    from kvshm.workers.run import DEFAULT_PRESET
    from kvshm.workers.transformer import TransformerModel, decoder_profile
    preset = PRESETS[DEFAULT_PRESET]
    prof = decoder_profile(preset.kv, preset.decoder)
    assert 0.5 <= prof["vs_llama3_8b"] <= 2.0, prof
    assert prof["kv_bytes_per_token"] == 2 * 2 * 1 * 64 * 4
    kv = preset.kv
    model = TransformerModel(num_layers=kv.num_layers, num_kv_heads=kv.num_kv_heads,
                             head_size=kv.head_size, dtype="float32", shape=preset.decoder)
    assert model.parameters == prof["parameters"]
    assert decoder_profile(PRESETS["tiny"].kv, PRESETS["tiny"].decoder)["vs_llama3_8b"] < 0.1
