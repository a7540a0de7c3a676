"""The vLLM releases the plugin speaks, and the refusal of any other
(kvshm/vllm/__init__.py checks it before patching anything)."""

from __future__ import annotations

import logging
import os

# The plugin's log: a child of vLLM's own logger, so its lines go out with
# vLLM's handler, format and level in every vLLM process (a logger of its
# own would have no handler, and its info lines would be dropped).
log = logging.getLogger("vllm.kvshm")

# The vLLM releases whose scheduler, manager interface and KV events the
# plugin speaks (a local label such as "+cpu" is ignored).
SUPPORTED_VLLM = ("0.14.0", "0.32.0")


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


def vllm_release() -> str:
    """The release of the vLLM this process runs ("0.14.0"; its local
    label dropped), or "" in a process without vLLM (a session that then
    names no release, as kvshm's own clients)."""
    try:
        from vllm.version import __version__
    except ImportError:
        return ""
    return __version__.split("+", 1)[0]


def vllm_cache_root(release: str) -> str:
    """A vLLM cache directory for `release` alone, beside vLLM's default
    one (`VLLM_CACHE_ROOT` for the engines kvshm starts: tests, benchmarks).
    vLLM names its cached model inspections by model class alone, so two
    releases sharing a cache overwrite each other's entry, and an engine
    started after one of the other release inspects its model again in a
    subprocess: about 7 s of its start-up here."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, f"vllm-{release}")
