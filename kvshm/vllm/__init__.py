"""kvshm inside vLLM engines: the plugin vLLM loads from the
`vllm.general_plugins` entry point (docs/vllm.md).

It does nothing unless `KVSHM_POOL` is set: `embedded` puts kvshm's
allocator in the engine process, a socket path or pool name makes the
engine a client of that coordinator, sharing its blocks, prefix cache and
K/V bytes with every other engine on it.  With it set, the plugin first
checks the engine's vLLM against the releases it supports
(`SUPPORTED_VLLM`) and refuses any other at start-up, in one line, before
it patches anything: a release whose manager kvshm does not reproduce
would otherwise fail deep in the scheduler's constructor, or worse, run
with other allocation semantics than the engine's.
"""

from __future__ import annotations

import os

from kvshm.vllm.release import SUPPORTED_VLLM, UnsupportedVllm, refusal, vllm_release

__all__ = ["SUPPORTED_VLLM", "UnsupportedVllm", "refusal", "register", "vllm_release"]


def register() -> None:
    """vLLM's plugin hook (called once per process, before any engine is
    built): with KVSHM_POOL set, refuses an unsupported vLLM
    (`UnsupportedVllm`), then installs kvshm's patches."""
    if not os.environ.get("KVSHM_POOL", "").strip():
        return
    from vllm.version import __version__ as found
    why = refusal(found)
    if why is not None:
        raise UnsupportedVllm(why)
    from kvshm.vllm.patches import install
    install()
