"""Crash points for fault-injection tests: make this process `os._exit` at a
chosen point inside a chosen operation.

A crash point is `Class.method:before` or `Class.method:after` for a method
of a registered class (the core's block pool, request table, journal and
manager; the service adds its own).  `install(spec, classes)` wraps that one
method so that its `nth` call while `arm` is running ends the process on
the spot, as a SIGKILL would: no `finally`, no flush, no clean-up.  Nothing
is wrapped unless a spec is installed, so production code pays nothing.

The coordinator installs the spec of the environment variable KVSHM_CRASH
(tests only), for example::

    KVSHM_CRASH="arm=OpExecutor._alloc point=RequestTable.write_blocks:after nth=1"
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from kvshm.core.block_pool import BlockPool
from kvshm.core.journal import Journal
from kvshm.core.kv_cache_manager import KVCacheManagerCore
from kvshm.core.table import RequestTable

CRASH_EXIT_CODE = 86
ENV = "KVSHM_CRASH"


@dataclass(frozen=True)
class CrashSpec:
    point: str                 # "Class.method:before|after"
    arm: str | None = None     # "Class.method": count only calls made inside it
    nth: int = 1

    @classmethod
    def parse(cls, text: str) -> "CrashSpec":
        """From "point=C.m:after arm=C.m nth=2" (ValueError if malformed)."""
        fields = dict(part.split("=", 1) for part in text.split())
        unknown = set(fields) - {"point", "arm", "nth"}
        if unknown or "point" not in fields:
            raise ValueError(f"bad crash spec {text!r}: want point=C.m:before|after "
                             "[arm=C.m] [nth=N]")
        spec = cls(fields["point"], fields.get("arm"), int(fields.get("nth", 1)))
        _split_point(spec.point)
        return spec

    def __str__(self) -> str:
        arm = f" arm={self.arm}" if self.arm else ""
        return f"point={self.point}{arm} nth={self.nth}"


def _split_point(point: str) -> tuple[str, str, str]:
    target, _, when = point.partition(":")
    cls_name, _, method = target.partition(".")
    if when not in ("before", "after") or not cls_name or not method:
        raise ValueError(f"bad crash point {point!r}: want Class.method:before|after")
    return cls_name, method, when


def _resolve(classes: dict[str, type], target: str) -> tuple[type, str]:
    cls_name, _, method = target.partition(".")
    cls = classes.get(cls_name)
    if cls is None or not callable(getattr(cls, method, None)):
        raise ValueError(f"no crash target {target!r} (classes: {', '.join(sorted(classes))})")
    return cls, method


def core_classes() -> dict[str, type]:
    """The core's classes that crash points may name."""
    # A spec names the manager as users know it: kvshm.KVCacheManager only
    # adds how its segment is made, so its methods are the core's.
    return {"KVCacheManager": KVCacheManagerCore,
            **{c.__name__: c for c in (BlockPool, RequestTable, Journal)}}


def install(spec: CrashSpec, classes: dict[str, type]) -> None:
    """Wrap the spec's method (and its arming method) in place."""
    cls_name, method, when = _split_point(spec.point)
    cls, method = _resolve(classes, f"{cls_name}.{method}")
    state = {"armed": spec.arm is None, "calls": 0}

    def crash() -> None:
        os._exit(CRASH_EXIT_CODE)

    original = getattr(cls, method)

    @functools.wraps(original)
    def point(*args, **kw):
        if state["armed"]:
            state["calls"] += 1
            if state["calls"] == spec.nth and when == "before":
                crash()
            result = original(*args, **kw)
            if state["calls"] == spec.nth:
                crash()
            return result
        return original(*args, **kw)

    setattr(cls, method, point)
    if spec.arm is not None:
        arm_cls, arm_method = _resolve(classes, spec.arm)
        arm_original = getattr(arm_cls, arm_method)

        @functools.wraps(arm_original)
        def armed(*args, **kw):
            state["armed"] = True
            try:
                return arm_original(*args, **kw)
            finally:
                state["armed"] = False

        setattr(arm_cls, arm_method, armed)


def install_from_env(classes: dict[str, type]) -> CrashSpec | None:
    """Install the spec in $KVSHM_CRASH, if any (ValueError if malformed)."""
    text = os.environ.get(ENV)
    if not text:
        return None
    spec = CrashSpec.parse(text)
    install(spec, classes)
    return spec
