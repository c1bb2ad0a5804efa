"""The zkv exception tree.

::

    ZkvError
    ├── ProtocolError        malformed / unknown-version / out-of-range message (refused, logged)
    ├── ConfigError          incompatible configuration or layout (refused at start or hello)
    ├── TransferError        a copy op failed on a worker (becomes an error ack)
    │   └── DeviceFault      a sticky CUDA error: the device context is lost, the rank must die
    ├── StorageError         the L3 store failed or is unreachable
    └── WorkerDead           an actor that must die says so, so pending ops fail at once
        └── RankLost         the dispatcher declared a rank lost (missed heartbeat / ack deadline)

Broken invariants raise ``AssertionError`` / ``RuntimeError``; caller misuse raises
``ValueError``. Ordinary shortage (no free blocks) is a return value, not an exception.
"""

from __future__ import annotations


class ZkvError(Exception):
    """Base class of every error zkv raises on purpose."""


class ProtocolError(ZkvError, ValueError):
    """A message that cannot be decoded or does not fit the receiver's limits."""


class ConfigError(ZkvError, ValueError):
    """Incompatible configuration (e.g. a worker's cache layout differs from the scheduler's)."""


class TransferError(ZkvError):
    """A block copy failed on a worker."""


class DeviceFault(TransferError):
    """A sticky CUDA error (illegal address, launch failure, ECC, ...): the context is
    unusable, every later CUDA call fails, and no enqueued work will run. Not an op
    failure: the worker stops and says so (``Bye``), so the scheduler fails its ops."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class StorageError(ZkvError):
    """The L3 store failed, timed out, or is unreachable."""


class WorkerDead(ZkvError):
    """An actor is gone; its pending ops must fail now rather than time out."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"rank {rank} is dead: {reason}")
        self.rank = rank
        self.reason = reason


class RankLost(WorkerDead):
    """The dispatcher declared a rank lost (missed heartbeats, ack deadline, or a seq gap)."""
