"""Eviction policies: which evictable entry of one tier goes next, in O(1).

The tree (``radix.py``) decides *whether* an entry is evictable in a tier and tells the
policy (``push`` when it becomes evictable, ``remove`` when it stops being); the policy
decides only the *order*. Two rules make every victim a chain tail without a scan:

1. Closed subtrees (the tree's rule): an entry is pushed only when everything below it in
   that tier is already evictable, so an entry's children in the tier are all in the
   policy whenever the entry is.
2. Children first (the policy's rule): each queue is ordered oldest → youngest with every
   entry older than its ancestors in the same queue (entries are pushed at the young end,
   children before parents), and an entry's class is never above its parent's class.

Then the oldest entry of the lowest non-empty class has no child in the tier: it is a
chain tail. ``pop`` is O(1) (``OrderedDict.popitem``), never a rotation or a rescan::

    LRU    one queue                     victim = oldest
    SLRU   probation ─────────────────►  victim = oldest of probation, else of protected
           protected (hit again, or came back soon after an eviction: ghost memory)
              │ over its share of the tier: its oldest is demoted to probation's young end
              └─────────────────────────►

SLRU's class comes from the node: protected when ``hits >= 2`` (matched again after it was
cached) or ``reused`` (set by the ghost when a block that this tier evicted recently is
inserted again, and only under a protected parent or the root). Hits never decrease and
a parent is hit whenever its child is, so classes are monotone along every chain.
Demotion takes protected's oldest entry, whose protected descendants (older) are gone
already, and no ancestor of it is in probation: the two rules still hold.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zkv.scheduler.radix import Node

LRU_NAME = "lru"
SLRU_NAME = "slru"
POLICIES = (LRU_NAME, SLRU_NAME)


class EvictionPolicy(ABC):
    """Order of one tier's evictable entries. Every method is O(1).

    ``probes`` counts entries looked at to choose victims: one per ``pop`` (tests assert
    it, to show that no eviction scans or rotates).
    """

    name = "?"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.probes = 0

    @abstractmethod
    def push(self, n: Node) -> None:
        """``n`` became evictable: it enters at the young end of its class."""

    @abstractmethod
    def remove(self, n: Node) -> None:
        """``n`` (in the policy) stopped being evictable."""

    @abstractmethod
    def pop(self) -> Node | None:
        """The next victim, removed from the policy; None when empty."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def nodes(self) -> list[Node]:
        """Entries in eviction order (tests and invariant checks; O(n))."""

    def __contains__(self, n: Node) -> bool:
        return any(n is m for m in self.nodes())

    def note_evicted(self, n: Node) -> None:
        """``n`` left this tier (a victim). Policies with a memory of victims use this."""

    def note_inserted(self, n: Node) -> None:
        """``n`` is new in the tree, under ``n.parent``."""

    def resize(self, capacity: int) -> None:
        self.capacity = capacity

    def class_of(self, n: Node) -> int:
        """Eviction class (lower goes first); monotone along chains. Tests check it."""
        return 0


class LRU(EvictionPolicy):
    """Least recently released first: one ``OrderedDict`` as the queue."""

    name = LRU_NAME

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._q: OrderedDict[Node, None] = OrderedDict()

    def push(self, n: Node) -> None:
        self._q[n] = None

    def remove(self, n: Node) -> None:
        del self._q[n]

    def pop(self) -> Node | None:
        if not self._q:
            return None
        self.probes += 1
        return self._q.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._q)

    def __contains__(self, n: Node) -> bool:
        return n in self._q

    def nodes(self) -> list[Node]:
        return list(self._q)


class SLRU(EvictionPolicy):
    """Segmented LRU with a ghost memory (see the module docstring).

    ``protected_fraction`` of the tier may be protected; the ghost remembers the hashes of
    the last ``ghost_factor × capacity`` victims (FIFO), so a block recomputed soon after
    its eviction comes back protected. It keeps blocks that are hit again over blocks seen
    once, where LRU lets a burst of one-off prompts flush them. The defaults were chosen on
    the bundled Mooncake trace (0.3-0.5 and 0.25-2x all beat LRU there at 1k and 10k
    blocks; these gave the best of both).
    """

    name = SLRU_NAME

    def __init__(self, capacity: int, protected_fraction: float = 0.5,
                 ghost_factor: float = 2.0) -> None:
        super().__init__(capacity)
        if not 0.0 <= protected_fraction <= 1.0 or ghost_factor < 0:
            raise ValueError("protected_fraction must be in [0, 1] and ghost_factor >= 0")
        self.protected_fraction = protected_fraction
        self.ghost_factor = ghost_factor
        self._max_ghost = int(capacity * ghost_factor)
        self._prob: OrderedDict[Node, None] = OrderedDict()
        self._prot: OrderedDict[Node, None] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._max_prot = int(capacity * protected_fraction)

    def class_of(self, n: Node) -> int:
        return 1 if n.hits >= 2 or n.reused else 0

    def push(self, n: Node) -> None:
        if n.hits >= 2 or n.reused:
            prot = self._prot
            prot[n] = None
            if len(prot) > self._max_prot:
                self._prob[prot.popitem(last=False)[0]] = None  # demote the oldest
        else:
            self._prob[n] = None

    def remove(self, n: Node) -> None:
        if self._prob.pop(n, _ABSENT) is _ABSENT:
            del self._prot[n]

    def pop(self) -> Node | None:
        q = self._prob or self._prot
        if not q:
            return None
        self.probes += 1
        return q.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._prob) + len(self._prot)

    def __contains__(self, n: Node) -> bool:
        return n in self._prob or n in self._prot

    def nodes(self) -> list[Node]:
        return list(self._prob) + list(self._prot)

    def queues(self) -> tuple[list[Node], list[Node]]:
        """(probation, protected), each oldest first (tests)."""
        return list(self._prob), list(self._prot)

    def note_evicted(self, n: Node) -> None:
        ghost = self._ghost
        ghost[n.hash] = None
        if len(ghost) > self._max_ghost:
            ghost.popitem(last=False)

    def note_inserted(self, n: Node) -> None:
        if self._ghost.pop(n.hash, _ABSENT) is _ABSENT:
            return
        p = n.parent
        assert p is not None
        # Only under a protected parent (or the root): classes stay monotone on chains.
        n.reused = p.parent is None or p.hits >= 2 or p.reused

    def resize(self, capacity: int) -> None:
        super().resize(capacity)
        self._max_prot = int(capacity * self.protected_fraction)
        self._max_ghost = int(capacity * self.ghost_factor)
        while len(self._ghost) > self._max_ghost:
            self._ghost.popitem(last=False)


_ABSENT = object()


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    if name == LRU_NAME:
        return LRU(capacity)
    if name == SLRU_NAME:
        return SLRU(capacity)
    raise ValueError(f"eviction policy must be one of {POLICIES}, got {name!r}")
