"""Model-shaped presets, sizes, and `kvshm serve` argument errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from kvshm.core.errors import ConfigError
from kvshm.core.specs import CrossAttentionSpec
from kvshm.service.presets import PRESETS, parse_size, preset_config


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
    assert preset_config("llama-8b").num_blocks == 512  # 1 GiB by default


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
                             "--kv-memory", "64M", "--name", "kvshm-test-preset",
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
