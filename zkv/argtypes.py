"""argparse ``type=`` callables for zkv's commands and the bench scripts: a bad value is
argparse's one ``prog: error: argument --flag: ...`` line and status 2, before anything
starts, instead of a value that fails deep in the run or silently matches nothing."""

from __future__ import annotations

import argparse
import math


def nonempty(s: str) -> str:
    """A value that is not empty (nor only blanks): ``--storage "$URL"`` with URL unset was
    taken as the option not given (a fresh temp-dir L3, the default log root, no metrics)."""
    if not s.strip():
        raise argparse.ArgumentTypeError(f"empty value {s!r} (leave the option out for its "
                                         "default)")
    return s


def integer(s: str) -> int:
    """Any int, written plainly (``1_0`` is refused: Python's ``int()`` reads it as 10);
    the caller checks its range."""
    return _int(s)


def positive_int(s: str) -> int:
    n = _int(s)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {n}")
    return n


def nonneg_int(s: str) -> int:
    n = _int(s)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def positive_ints(s: str) -> list[int]:
    """``1,2,4``: a comma-separated list of ints > 0."""
    return [positive_int(p) for p in _parts(s)]


def nonneg_ints(s: str) -> list[int]:
    """``0,2``: a comma-separated list of ints >= 0."""
    return [nonneg_int(p) for p in _parts(s)]


def _parts(s: str) -> list[str]:
    parts = [p.strip() for p in s.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of ints, got {s!r}")
    return parts


def positive_float(s: str) -> float:
    """A finite number > 0 (NaN and inf are refused)."""
    x = _float(s)
    if not 0 < x < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {s}")
    return x


def nonneg_float(s: str) -> float:
    """A finite number >= 0 (NaN and inf are refused)."""
    x = _float(s)
    if not 0 <= x < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {s}")
    return x


def port(s: str) -> int:
    """A TCP port, or 0 for any free one."""
    n = _int(s)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {n}")
    return n


def _float(s: str) -> float:
    try:  # (Python's float() reads "1_0" as 10: a typo taken for a number)
        if "_" not in s:
            return float(s)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"not a number: {s!r}")


def _int(s: str) -> int:
    try:
        if "_" not in s:
            return int(s)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"not an int: {s!r}")
