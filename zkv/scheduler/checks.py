"""Arguments of the cache manager's public calls, checked before anything changes.

A call that changed state and then met a bad argument left the pools and the tree
disagreeing (a float token count after a swap-in was planned, a float ``done`` after its
op left the ledger, engine ids that were not ints after a node was added). Each check
raises ``TypeError`` / ``ValueError`` naming the argument; the caller's state is as it
was. The costs stay off the per-block path: O(1) for counts, O(n) in C for lists (a
``join`` and a ``set`` of the hashes, a ``set`` and the ``min`` of the ids), and a step's
``block_hashes`` and engine ids are checked where they are new, not the whole context
each step (a hash that repeats one of the earlier blocks' is not caught there).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from zkv.protocol import OpResult, result_claim_error
from zkv.scheduler.hashing import DIGEST_SIZE

_MAX_ID = 2**31 - 1  # engine block ids go on the wire as int32
_BYTES = {bytes}

H = TypeVar("H", bound=Sequence[bytes])


#: The longest wait a timeout may name (a longer one is a typo or an unbounded wait).
MAX_TIMEOUT_S = 86400.0


def timeout(name: str, value: Any) -> float:
    """Seconds: a finite number in (0, ``MAX_TIMEOUT_S``]. (NaN passed every comparison as
    false: a frozen rank was never lost, its batch never completed.)"""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r:.40}")
    if not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"{name} must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {value}")
    return float(value)


def count(name: str, value: Any) -> int:
    """A token or block count: an ``int`` >= 0 (``bool`` is none)."""
    if type(value) is not int:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r:.40}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def integer(name: str, value: Any) -> int:
    """Any integer (numpy's too; ``bool`` is none), as a plain ``int``."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r:.40}")
    return operator.index(value)


def hashes(name: str, block_hashes: H) -> H:
    """Block hashes: ``bytes`` of ``DIGEST_SIZE``, no two equal (a hash twice in one chain
    made the index and the tree disagree)."""
    if isinstance(block_hashes, (bytes, str)):  # (iterated, it is ints or characters)
        raise TypeError(f"{name} must be a sequence of {DIGEST_SIZE}-byte hashes, got "
                        f"{type(block_hashes).__name__}")
    if not block_hashes:
        return block_hashes
    # (three passes in C, ~3 us for 135 hashes: a match's and a finish's, once each; bytes
    # exactly: the compiled core refuses a memoryview or a bytearray half-way through)
    if not set(map(type, block_hashes)) <= _BYTES:
        bad = next(h for h in block_hashes if type(h) is not bytes)
        raise TypeError(f"{name} must hold bytes, got {type(bad).__name__} {bad!r:.40}")
    size = len(b"".join(block_hashes))
    unique = len(set(block_hashes))
    if size != DIGEST_SIZE * len(block_hashes):
        raise ValueError(f"{name} must hold {DIGEST_SIZE}-byte hashes, got lengths "
                         f"{sorted(set(map(len, block_hashes)))[:4]}")
    if unique != len(block_hashes):
        raise ValueError(f"{name} holds a hash twice (a block's hash names its whole "
                         f"prefix: a chain never repeats one)")
    return block_hashes


def block_ids(name: str, ids: Sequence[int]) -> list[int]:
    """Engine block ids: integers (numpy's too) in ``[0, 2**31)`` (int32 on the wire),
    no two equal; as a new list of ints."""
    try:
        out = list(map(operator.index, ids))
    except TypeError:
        bad = next(i for i in ids if not hasattr(type(i), "__index__"))
        raise TypeError(f"{name} must hold ints, got {type(bad).__name__} {bad!r:.40}") from None
    if out and min(out) < 0:
        raise ValueError(f"{name} must hold ids >= 0, got {min(out)}")
    if out and max(out) > _MAX_ID:  # (before, take_ops' int32 arrays raised OverflowError
        # with the op already pending: its node busy and its host block held for good)
        raise ValueError(f"{name} must hold ids < 2**31 (int32 on the wire), got {max(out)}")
    if len(set(out)) != len(out):
        raise ValueError(f"{name} holds an id twice")
    return out


def results(pending: dict[int, Any], given: Iterable[OpResult]) -> list[OpResult]:
    """Acks of ops: each an ``OpResult`` with int ``id`` and ``done``, ``done`` within
    ``[0, blocks]`` of its op when pending, and ``ok`` true only with every block done.
    All are checked before any is committed: a refused call commits none of them."""
    out = list(given)
    for r in out:
        if not isinstance(r, OpResult):
            raise TypeError(f"op results must be OpResult, got {type(r).__name__} {r!r:.60}")
        if type(r.id) is not int or type(r.done) is not int:
            raise TypeError(f"op result {r.id!r}: id and done must be ints, got "
                            f"{type(r.id).__name__} and {type(r.done).__name__}")
        p = pending.get(r.id)
        if p is None:
            continue  # (not pending: the caller is told, nothing else)
        why = result_claim_error(r, sum(p.counts))
        if why is not None:
            raise ValueError(f"op result {r.id}: {why}")
    return out
