"""Per-rank worker actor: executes batches of copy ops and acks them.

Its names load on first use (PEP 562), so ``python -m zkv.worker`` reads its parent's pid
before torch and the kernels load (a second or more): a launcher that dies meanwhile is
still seen as gone (see ``__main__``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zkv.worker.actor import WorkerActor
    from zkv.worker.layers import LayerDoneCounter
    from zkv.worker.sidecar import Sidecar

__all__ = ["LayerDoneCounter", "Sidecar", "WorkerActor"]

_HOMES = {"WorkerActor": "zkv.worker.actor", "LayerDoneCounter": "zkv.worker.layers",
          "Sidecar": "zkv.worker.sidecar"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(home), name)
