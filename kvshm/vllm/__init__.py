"""kvshm inside vLLM engines: the plugin vLLM loads from the
`vllm.general_plugins` entry point (docs/vllm.md).

It does nothing unless `KVSHM_POOL` is set: `embedded` puts kvshm's
allocator in the engine process, a socket path or pool name makes the
engine a client of that coordinator, sharing its blocks, prefix cache and
K/V bytes with every other engine on it.
"""

from __future__ import annotations

import os


def register() -> None:
    """vLLM's plugin hook (called once per process, before any engine is
    built): installs kvshm's patches when KVSHM_POOL is set."""
    if not os.environ.get("KVSHM_POOL", "").strip():
        return
    from kvshm.vllm.patches import install
    install()
