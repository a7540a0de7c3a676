"""The plugin's version gate (kvshm/vllm/__init__.py), without vLLM: a
stand-in `vllm.version` module says which release the engine runs.
tests/test_vllm.py checks the same through vLLM's own plugin loader."""

from __future__ import annotations

import sys
import types

import pytest

import kvshm
from kvshm.vllm import SUPPORTED_VLLM, UnsupportedVllm, refusal, register


@pytest.fixture
def vllm_release(monkeypatch):
    """Make `vllm.version.__version__` the given release."""
    def make(release: str) -> None:
        pkg = types.ModuleType("vllm")
        mod = types.ModuleType("vllm.version")
        mod.__version__ = release
        pkg.version = mod
        monkeypatch.setitem(sys.modules, "vllm", pkg)
        monkeypatch.setitem(sys.modules, "vllm.version", mod)
    return make


def test_an_unsupported_vllm_is_refused_in_one_line_naming_all_three(monkeypatch, vllm_release):
    vllm_release("0.33.0")
    monkeypatch.setenv("KVSHM_POOL", "embedded")
    with pytest.raises(UnsupportedVllm) as err:
        register()
    message = str(err.value)
    assert "\n" not in message
    assert f"kvshm {kvshm.__version__} supports vLLM 0.14.0, 0.32.0" in message
    assert "not the vLLM 0.33.0 of this engine (KVSHM_POOL=embedded)" in message
    assert "unset KVSHM_POOL" in message
    # A SystemExit: the engine stops with the line, not a traceback.
    assert isinstance(err.value, SystemExit)


@pytest.mark.parametrize("release", ["0.13.0", "0.14.1", "0.14.0rc1", "0.14", "0.32.1",
                                     "0.33.0", "1.0.0"])
def test_releases_other_than_the_supported_ones_are_refused(release):
    assert refusal(release) is not None and release in refusal(release)


@pytest.mark.parametrize("release", [*SUPPORTED_VLLM, "0.14.0+cpu"])
def test_supported_releases_pass_with_or_without_a_local_label(release):
    assert refusal(release) is None


def test_without_kvshm_pool_the_plugin_is_silent_on_any_vllm(monkeypatch, vllm_release, capsys):
    vllm_release("0.33.0")
    monkeypatch.delenv("KVSHM_POOL", raising=False)
    assert register() is None
    monkeypatch.setenv("KVSHM_POOL", "  ")          # blank counts as unset
    assert register() is None
    assert capsys.readouterr() == ("", "")
