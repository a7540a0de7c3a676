"""The event loop every asyncio part of kvshm runs on (the coordinator, the
workers, `kvshm run`, the benchmarks): uvloop."""

from __future__ import annotations


def run_async(coro):
    """Run `coro` to completion on a new uvloop event loop; returns its result."""
    import uvloop
    return uvloop.run(coro)
