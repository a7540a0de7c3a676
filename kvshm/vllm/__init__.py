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

# The vLLM releases whose scheduler, manager interface and KV events the
# plugin speaks (a local label such as "+cpu" is ignored).
SUPPORTED_VLLM = ("0.14.0",)


class UnsupportedVllm(SystemExit):
    """The engine's vLLM is not one the plugin supports.  A SystemExit, so
    that the engine stops with its one-line message and no traceback."""


def refusal(found: str) -> str | None:
    """Why the plugin refuses vLLM `found` (its `__version__`), or None when
    it supports it."""
    from kvshm import __version__
    if found.split("+", 1)[0] in SUPPORTED_VLLM:
        return None
    supported = ", ".join(SUPPORTED_VLLM)
    return (f"kvshm {__version__} supports vLLM {supported}, not the vLLM {found} of this "
            f"engine (KVSHM_POOL={os.environ.get('KVSHM_POOL', '').strip()}): install vLLM "
            f"{supported}, or unset KVSHM_POOL to run on vLLM's own KV-cache manager")


def register() -> None:
    """vLLM's plugin hook (called once per process, before any engine is
    built): with KVSHM_POOL set, refuses an unsupported vLLM
    (`UnsupportedVllm`), then installs kvshm's patches."""
    if not os.environ.get("KVSHM_POOL", "").strip():
        return
    from vllm.version import __version__ as vllm_version
    why = refusal(vllm_version)
    if why is not None:
        raise UnsupportedVllm(why)
    from kvshm.vllm.patches import install
    install()
