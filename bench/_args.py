"""Flag types the bench scripts share (the generic ones from ``zkv.argtypes``): a bad value
is argparse's one ``prog: error: ...`` line and status 2 before anything starts (a server,
a worker, a model build), never a traceback from deep inside the run or a silent fallback
to a default."""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from collections.abc import Callable

from zkv.argtypes import nonneg_int, positive_float, positive_int, positive_ints
from zkv.config import CacheLayout
from zkv.errors import ConfigError
from zkv.storage.url import parse_url

__all__ = ["DEFAULT_TRACE", "choices", "directory", "dtype", "existing_file", "nonneg_int",
           "positive_float", "positive_int", "positive_ints", "store_url"]

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TRACE_HEAD = os.path.join(_REPO, "tests", "data", "mooncake_trace_head800.jsonl")
#: ``--trace``'s default: the bundled trace beside the checkout, else its first 800
#: requests in tests/data (a clean clone has no ../shared).
DEFAULT_TRACE = next(
    (p for p in (os.path.join(_REPO, "..", "shared", "traces", "mooncake_synthetic_trace.jsonl"),
                 _TRACE_HEAD) if os.path.isfile(p)), _TRACE_HEAD)


def choices(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    """A comma-separated list of names out of ``allowed``."""
    def parse(s: str) -> list[str]:
        names = [p.strip() for p in s.split(",")]
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, bad or names))}; choose from {', '.join(allowed)}")
        return names
    parse.__name__ = "names"
    return parse


def dtype(s: str) -> str:
    """A dtype zkv's layouts take (as ``CacheLayout`` checks it)."""
    try:
        CacheLayout(1, 1, 1, 1, s)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def store_url(s: str) -> str:
    """A store URL zkv can parse (the server is reached later, by the run)."""
    try:
        parse_url(s)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def store_url_of(*schemes: str) -> Callable[[str], str]:
    """:func:`store_url` of one of ``schemes`` (a flag that names its kind of store)."""
    def check(s: str) -> str:
        scheme, _ = parse_url(store_url(s))
        if scheme not in schemes:
            raise argparse.ArgumentTypeError(
                f"expected a {' or '.join(f'{x}://' for x in schemes)} URL, got a {scheme}:// "
                "one")
        return s

    return check


def existing_file(s: str) -> str:
    if not os.path.isfile(s):
        raise argparse.ArgumentTypeError(f"no such file: {s}")
    if not os.access(s, os.R_OK):
        raise argparse.ArgumentTypeError(f"not readable: {s}")
    return s


def directory(s: str) -> str:
    """A directory the bench can write in (a folder made and removed there: ``/proc`` and
    a read-only ``/sys`` pass ``os.access`` as root, then failed with a traceback)."""
    if not os.path.isdir(s):
        raise argparse.ArgumentTypeError(f"no such directory: {s}")
    try:
        tempfile.TemporaryDirectory(dir=s).cleanup()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write in {s}: {e.strerror}") from None
    return s


def redis_memory(s: str) -> str:
    """A redis-server ``maxmemory`` above 0 (0 is no limit: an eviction bench that never
    evicts): an integer of bytes, or with a unit (``48mb``, ``1gb``, ``512k``)."""
    m = re.fullmatch(r"([0-9]+)(b|k|kb|m|mb|g|gb)?", s.strip().lower())
    if m is None or s != s.strip():
        raise argparse.ArgumentTypeError(f"must be bytes or a size like 48mb, got {s!r}")
    if int(m.group(1)) == 0:
        raise argparse.ArgumentTypeError("must be > 0 (0 is no limit: nothing is evicted)")
    return s
