"""The vLLM engine driver's parts that need no vLLM (kvshm/vllm/engine.py)."""

from __future__ import annotations

import pytest

from kvshm.vllm.engine import PORT_WINDOW, PORT_WINDOWS, rendezvous_port


def port_range(tmp_path, text: str) -> str:
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    return str(path)


def test_engines_started_together_get_disjoint_port_windows_below_the_ephemeral_range(
        tmp_path):
    rng = port_range(tmp_path, "32768\t60999\n")
    ports = [rendezvous_port(pid, rng) for pid in range(4000, 4000 + PORT_WINDOWS)]
    assert len(set(ports)) == PORT_WINDOWS
    assert all(p % PORT_WINDOW == ports[0] % PORT_WINDOW for p in ports)   # whole windows
    assert min(ports) == 32768 - PORT_WINDOWS * PORT_WINDOW
    assert max(ports) + PORT_WINDOW == 32768       # the last window ends where the range starts
    assert rendezvous_port(4000, rng) == rendezvous_port(4000 + PORT_WINDOWS, rng)


@pytest.mark.parametrize("text", ["5000 60999", "", "ports", "1024 65535"])
def test_a_host_with_no_room_below_its_ephemeral_range_keeps_vllm_s_choice(tmp_path, text):
    assert rendezvous_port(4000, port_range(tmp_path, text)) is None


def test_no_port_range_file_keeps_vllm_s_choice(tmp_path):
    assert rendezvous_port(4000, str(tmp_path / "missing")) is None

