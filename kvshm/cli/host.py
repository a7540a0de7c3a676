"""`kvshm host MODEL`: a host of `vllm serve` engines on one pool, behind a
front door (kvshm/vllm/host.py), in the foreground until Ctrl-C or SIGTERM.

Arguments after `--` go to every `vllm serve` as they are."""

from __future__ import annotations

import argparse
import signal
import sys

from kvshm.config import PoolSource, resolve_config
from kvshm.core.errors import ConfigError
from kvshm.vllm.host import ROUTER_POLICIES, Host, HostError, HostOptions
from kvshm.vllm.release import SUPPORTED_VLLM, vllm_release

# The arguments after `--` go to every `vllm serve` (kvshm/cli/__init__.py).
PASSES_ARGS = True

HELP = ("serve a model with one `vllm serve` per NUMA node on one shared pool, behind a "
        "front door (vllm-router)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.usage = "kvshm host [options] MODEL [-- VLLM_SERVE_ARGS...]"
    p.add_argument("model", help="the model directory every engine serves (arguments "
                   "after -- go to every `vllm serve` as they are)")
    p.add_argument("--engines", type=int, default=0,
                   help="how many engines (default: one per NUMA node, at least 2: a "
                   "single-node host is split into virtual nodes)")
    p.add_argument("--port", type=int, default=8000,
                   help="the front door's port (%(default)s); the engines listen on the "
                   "ports after it, on 127.0.0.1")
    p.add_argument("--host", default="127.0.0.1",
                   help="the front door's address (%(default)s)")
    p.add_argument("--router", choices=ROUTER_POLICIES, default="round_robin",
                   help="the front door's policy (vllm-router's; none: no front door, "
                   "each engine is reached at its own port)")
    p.add_argument("--own-caches", action="store_true",
                   help="run the engines on caches of their own (vLLM's manager, each "
                   "with its share of the blocks) instead of one pool: the baseline")
    p.add_argument("--name", default="kvshm", help="the pool's name (%(default)s)")
    p.add_argument("--kv-memory", default=None,
                   help="the pool's K/V memory, e.g. 2GiB (default 2 GiB)")
    p.add_argument("--block-size", type=int,
                   help="tokens per block, the pool's and the engines' (vLLM's CPU "
                   "default, 128)")
    p.add_argument("--max-model-len", type=int,
                   help="longest request, the pool's and the engines' (default: the model's)")
    p.add_argument("--dtype", help="the KV dtype (default: as vLLM picks it)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="leave the engines on every CPU instead of one node's each")
    p.add_argument("--log-dir",
                   help="the engines' and the front door's logs (default: a temporary "
                   "folder, removed at a clean stop)")


class _Stop(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stop(signum, frame) -> None:
    raise _Stop(signum)


def main(args: argparse.Namespace) -> int:
    release = vllm_release()
    if release not in SUPPORTED_VLLM:
        found = release or "no vLLM"
        raise ConfigError("vllm", f"this environment has {found}; `kvshm host` runs vLLM "
                          f"{', '.join(SUPPORTED_VLLM)} engines from the environment it "
                          "runs in (./scripts/vllm_env.sh makes one)")
    config = resolve_config(PoolSource(
        vllm_model=args.model, kv_memory=args.kv_memory, block_size=args.block_size,
        max_model_len=args.max_model_len, dtype=args.dtype, vllm_version=release))
    opts = HostOptions(model=args.model, config=config, name=args.name, engines=args.engines,
                       host=args.host, port=args.port, router=args.router,
                       mode="own" if args.own_caches else "pool", serve_args=args.passed_args,
                       pin=args.pin, log_dir=args.log_dir)
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    host = None
    try:
        host = Host(opts)
        host.start()
        host.serve_forever()
        return 1                          # it can no longer serve: said above
    except _Stop as stop:
        if host is not None:
            host.say(f"{stop}: stopping")
        return 130 if stop.signum == signal.SIGINT else 0
    except HostError as e:
        print(f"kvshm host: {e}", file=sys.stderr)
        return 1
    finally:
        # (a second signal while stopping must not cut the stop short)
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        if host is not None:
            host.stop()
            host.say("stopped" + ("" if not host.failed else f"; logs in {host.log_dir}"))
        for s, handler in previous.items():
            signal.signal(s, handler)
