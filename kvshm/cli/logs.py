"""Logging of the coordinator (`kvshm serve --log-level --log-json`).

At info level the coordinator logs sessions connecting, resuming and ending
(with pid, NUMA node, tenant and how they ended), refused handshakes,
adoption and repair, and errors; never one line per op.  `--log-json`
writes one JSON object a line (`ts`, `level`, `logger`, `message`, and
`error` with the traceback when there is one), for log shippers.
"""

from __future__ import annotations

import json
import logging
import sys

LEVELS = ("debug", "info", "warning", "error")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6), "level": record.levelname.lower(),
               "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(level: str = "info", json_lines: bool = False,
                  prefix: str = "kvshm coordinator: ") -> None:
    """Log records at `level` and above to stderr, as text or JSON lines."""
    if level not in LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LEVELS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines
                         else logging.Formatter(prefix + "%(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
