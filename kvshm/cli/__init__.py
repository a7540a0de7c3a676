"""The `kvshm` command line, one module per command, each with `HELP`,
`add_arguments(parser)` and `main(args) -> int`.

Exit status: 0 success; 1 the command did its work and found a problem (a
check, a replay or a run that failed); 2 it could not do what it was asked
(a usage error, something not found, a refusal); 130 interrupted
(README.md, "Exit codes").

This package is the top floor (docs/layers.md): nothing below imports it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvshm import __version__
from kvshm.core.errors import KvshmError

# The commands in the order `kvshm --help` lists them: command -> module.
COMMANDS = ("run", "host", "replay", "events", "serve", "metrics", "top", "stats", "check",
            "ls", "rm", "demo")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvshm", description="Host-wide KV-cache block manager",
        epilog="exit status: 0 success; 1 the command found a problem (a check, replay or "
        "run that failed); 2 a usage error, something not found, or a refusal; 130 "
        "interrupted")
    ap.add_argument("--version", action="version", version=f"kvshm {__version__}")
    sub = ap.add_subparsers(dest="command")   # none: main() prints the help
    for command in COMMANDS:
        module = _module(command)
        p = sub.add_parser(command, help=module.HELP)
        module.add_arguments(p)
        p.set_defaults(fn=module.main)
    return ap


def _module(command: str):
    """The module of `command` (None for a word that is not one).
    Imported here, not at the top: `main` defers stop signals before a
    coordinator's start-up imports (kvshm serve)."""
    if command not in COMMANDS:
        return None
    return importlib.import_module(f"kvshm.cli.{command}")


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] == ["serve"]:
        # A coordinator: a stop signal from now on stops it cleanly once up.
        from kvshm.service.process import defer_stop_signals   # before the heavy imports
        defer_stop_signals()
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # A command whose module says PASSES_ARGS takes the arguments after `--`
    # as they are, for the program it starts (`kvshm host ... -- VLLM_ARGS`).
    passed: list[str] = []
    if "--" in argv and getattr(_module(argv[0]), "PASSES_ARGS", False):
        cut = argv.index("--")
        argv, passed = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    args.passed_args = passed
    if args.command is None:   # a usage error: the help, on stderr, exit 2
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.fn(args)
    except KvshmError as e:
        print(f"kvshm {args.command}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `kvshm replay ... | head`
        return 0
