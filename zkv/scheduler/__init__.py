"""Scheduler side: pure bookkeeping over block ids (no torch, no cupy).

The core modules in ``NATIVE`` are compiled with mypyc from this very source at install
(``setup.py``; a module's ``.so`` sits beside its ``.py`` and Python imports it first).
The typed source is the reference and the fallback: it runs instead, every one of these
modules alike (compiled modules call each other directly, so it is all or none), when::

    ZKV_PURE_PYTHON=1 ─────────────────────────► source (tests compare the two)
    no compiled core (no compiler, no mypyc) ──► source
    a module's source changed since the build ─► source, and ``native_core()`` says which
                                                 (rebuild: pip install -e .)
    otherwise ─────────────────────────────────► compiled

``native_core()`` is None when the compiled core runs, else why not.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

#: The modules mypyc compiles (setup.py reads this line).
NATIVE = ("block_pool", "eviction", "radix", "running", "ledger", "core", "tiers", "commit", "requests", "external", "invariants")  # noqa: E501

_HERE = os.path.dirname(os.path.abspath(__file__))
_why_not: str | None = None


def native_core() -> str | None:
    """None when the compiled core runs; else why the source runs instead."""
    return _why_not


def _digest(name: str) -> str:
    with open(os.path.join(_HERE, f"{name}.py"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _stale(built: dict[str, str]) -> list[str]:
    return [n for n in NATIVE if built.get(n) != _digest(n)]


def _check() -> str | None:
    if os.environ.get("ZKV_PURE_PYTHON", "") not in ("", "0"):
        return "ZKV_PURE_PYTHON is set"
    spec = importlib.util.find_spec(f"{__name__}._native_stamp")
    if spec is None or not isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
        return "not built (no compiler or no mypyc at install)"
    try:
        stamp = importlib.import_module(f"{__name__}._native_stamp")
    except ImportError as e:
        return f"the compiled core does not load: {e}"
    changed = _stale(stamp.SOURCES)
    if changed:
        return (f"built from other sources of {', '.join(changed)} "
                "(rebuild with: .venv/bin/pip install -e .)")
    return None


class _SourceFirst(importlib.abc.MetaPathFinder):
    """Loads the ``NATIVE`` modules from their ``.py``, past the compiled ``.so``."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        pkg, _, name = fullname.rpartition(".")
        if pkg != __name__ or name not in NATIVE:
            return None
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(_HERE, f"{name}.py"))


_why_not = _check()
if _why_not is not None:
    sys.meta_path.insert(0, _SourceFirst())
