"""Free-block pool over ids ``0..num_blocks-1`` (device or host tier).

Invariants:
- every id is exactly one of free / allocated; ``num_free + num_used == num_blocks``;
- freeing a free id or an id outside the pool raises ``ValueError`` and changes nothing.

Complexity: ``allocate(n)`` and ``free(ids)`` are O(n) (a LIFO stack plus a per-id
allocated flag), never a scan of the pool, and the per-id work runs in C (``map`` over
the flag array), not as a Python step per block. ``resize`` is O(num_blocks).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import repeat
from typing import cast

_INT = {int}


@dataclass(frozen=True, slots=True)
class PoolStats:
    name: str
    num_blocks: int
    num_free: int
    num_used: int


class BlockPool:
    """Pool of block ids. Shortage is a return value (``None``), not an exception."""

    __slots__ = ("name", "_free", "_used")

    def __init__(self, num_blocks: int, name: str = "device") -> None:
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        self.name = name
        # Reversed so that allocation hands out low ids first (readable tests and logs).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._used = bytearray(num_blocks)

    @property
    def num_blocks(self) -> int:
        return len(self._used)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used) - len(self._free)

    def is_allocated(self, block_id: int) -> bool:
        return 0 <= block_id < len(self._used) and bool(self._used[block_id])

    def allocate(self, n: int) -> list[int] | None:
        """``n`` ids, or ``None`` (nothing taken) when fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n == 0:
            return []
        free = self._free
        if n > len(free):
            return None
        ids = free[-n:]
        del free[-n:]
        ids.reverse()
        deque(map(self._used.__setitem__, ids, repeat(1)), 0)
        return ids

    def allocate_one(self) -> int | None:
        if not self._free:
            return None
        b = self._free.pop()
        self._used[b] = 1
        return b

    def free(self, ids: Iterable[int]) -> None:
        """Return ids to the pool. All-or-nothing: a foreign or already-free id raises
        ``ValueError`` before any id is freed."""
        given: list[object] = list(ids)  # (anything: the compiled core checks before use)
        if not given:
            return
        used = self._used
        n = len(used)
        # Checked in C (map over the ids); the loop below only names the bad id.
        if not set(map(type, given)) <= _INT:
            for x in given:
                if type(x) is not int:
                    raise ValueError(f"{self.name} pool: block id {x!r} is not in [0, {n})")
        ids = cast("list[int]", given)
        if min(ids) < 0 or max(ids) >= n or not all(map(used.__getitem__, ids)):
            for b in ids:
                if not 0 <= b < n:
                    raise ValueError(f"{self.name} pool: block id {b!r} is not in [0, {n})")
                if not used[b]:
                    raise ValueError(f"{self.name} pool: block {b} is already free (double free)")
        if len(set(ids)) != len(ids):
            raise ValueError(f"{self.name} pool: duplicate ids in one free call")
        deque(map(used.__setitem__, ids, repeat(0)), 0)
        self._free.extend(ids)

    def free_one(self, b: int) -> None:
        used = self._used
        if not 0 <= b < len(used):
            raise ValueError(f"{self.name} pool: block id {b!r} is not in [0, {len(used)})")
        if not used[b]:
            raise ValueError(f"{self.name} pool: block {b} is already free (double free)")
        used[b] = 0
        self._free.append(b)

    def resize(self, num_blocks: int) -> bool:
        """Grow, or shrink when every id past the new size is free. Returns False (and
        changes nothing) when a block past the new size is in use."""
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        old = len(self._used)
        if num_blocks >= old:
            self._used.extend(bytes(num_blocks - old))
            self._free[:0] = range(num_blocks - 1, old - 1, -1)  # new ids handed out last
            return True
        if any(self._used[num_blocks:]):
            return False
        self._free = [b for b in self._free if b < num_blocks]
        del self._used[num_blocks:]
        return True

    def stats(self) -> PoolStats:
        return PoolStats(self.name, self.num_blocks, self.num_free, self.num_used)

    def check(self) -> None:
        """Assert the pool's own invariants (tests call this after every operation)."""
        free = self._free
        assert len(set(free)) == len(free), "an id is twice on the free list"
        assert all(0 <= b < len(self._used) and not self._used[b] for b in free)
        assert sum(self._used) + len(free) == len(self._used), "free + used != total"
