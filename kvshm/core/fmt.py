"""How the command line's human-readable outputs write numbers (`kvshm
stats`, `ls`, `check`, `serve`, `demo`), so that they all read alike."""

from __future__ import annotations


def count(n: float) -> str:
    """A count or a rate, rounded to a whole number, with thousands
    separators: 1234567 -> "1,234,567"."""
    return f"{round(n):,}"


def nbytes(n: int) -> str:
    """A size: 1048576 -> "1,048,576 bytes"."""
    return f"{count(n)} bytes"


def percent(fraction: float) -> str:
    """A share, with one decimal: 0.1234 -> "12.3%"."""
    return f"{fraction:.1%}"
