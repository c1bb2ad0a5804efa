"""Eviction policies: which evictable entry of one tier goes next, in O(1).

The tree (``radix.py``) decides *whether* a node (a run of blocks) is evictable in a tier
and tells the policy (``push`` when it becomes evictable, ``remove`` when it stops being);
the policy decides only the *order*. Two rules make every victim a chain tail without a
scan:

1. Closed subtrees (the tree's rule): an entry is pushed only when everything below it in
   that tier is already evictable, so an entry's children in the tier are all in the
   policy whenever the entry is.
2. Children first (the policy's rule): each queue is ordered oldest → youngest with every
   entry older than its ancestors in the same queue (entries are pushed at the young end,
   children before parents), and an entry's class is never above its parent's class.

Then the oldest entry of the lowest non-empty class has no child in the tier: it is a
chain tail. ``oldest`` / ``pop`` are O(1) (``OrderedDict``), never a rotation or a rescan;
the tree takes the last blocks it needs of that victim and leaves the rest where it is
(``shrink``), so evicting a block costs O(1) too. Sizes are in blocks::

    LRU    one queue                     victim = oldest
    SLRU   probation ─────────────────►  victim = oldest of probation, else of protected
           protected (hit again, or came back soon after an eviction: ghost memory)
              │ over its share of the tier: its oldest is demoted to probation's young end
              └─────────────────────────►

SLRU's class is the queue. A node is pushed into protected when ``hits >= 2`` (used by
another request after the one that cached it) or ``reused`` (set by the ghost when a
block this tier evicted recently is inserted again, only under a protected parent or the
root); hits never decrease and a parent is hit whenever its child is (a request counts
its whole path), and no ancestor of a node being pushed is in the policy (closed
subtrees), so classes are monotone along every chain.
Demotion takes protected's oldest entry, whose protected descendants (older) are gone
already, and no ancestor of it is in probation. The two rules still hold.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from itertools import takewhile
from typing import TYPE_CHECKING, Any

from mypy_extensions import mypyc_attr

if TYPE_CHECKING:
    from zkv.scheduler.radix import Node

#: Attributes of a policy that a subclass keeps per instance (see __init_subclass__).
_COUNTS = ("capacity", "probes", "num_blocks")
LRU_NAME = "lru"
SLRU_NAME = "slru"
POLICIES = (LRU_NAME, SLRU_NAME)


@mypyc_attr(allow_interpreted_subclasses=True)  # a policy of one's own plugs in
class EvictionPolicy(ABC):
    """Order of one tier's evictable nodes. Every method is O(1) (amortized for SLRU's
    demotions and ghost trims).

    ``probes`` counts entries looked at to choose victims: one per ``oldest`` that found
    one (tests assert it, to show that no eviction scans or rotates). ``num_blocks`` is the
    size of the entries in blocks.
    """

    name = "?"
    #: Whether ``note_evicted`` does anything (callers skip the call when not).
    remembers = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A policy's counts are plain attributes the compiled core reads directly: one
        that a subclass shadows at class level or as a property would not be seen (every
        eviction would find 0 blocks evictable), so such a subclass is refused here. Its
        hooks return what they declare (``note_inserted`` a Python int, ``nodes`` a
        list): the compiled core checks."""
        super().__init_subclass__(**kwargs)
        for attr in (*_COUNTS, "name", "remembers"):
            v = vars(cls).get(attr)
            if isinstance(v, property) or (v is not None and attr in _COUNTS
                                            and not hasattr(type(v), "__set__")):
                raise TypeError(f"{cls.__name__}.{attr}: an eviction policy keeps it as "
                                "an instance attribute (set in __init__, kept up to date), "
                                "not at class level or as a property")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.probes = 0
        self.num_blocks = 0
        # The compiled core reads these from the instance, not through the class: a
        # subclass's own (class-level) values are copied in. A subclass keeps ``probes``
        # and ``num_blocks`` as the plain attributes they are (not properties).
        cls = type(self)
        name: object = getattr(cls, "name", None)  # (a compiled class: its descriptor)
        if isinstance(name, str):
            self.name = name
        remembers: object = getattr(cls, "remembers", None)
        if isinstance(remembers, bool):
            self.remembers = remembers

    @abstractmethod
    def push(self, n: Node) -> None:
        """``n`` became evictable: it enters at the young end of its class."""

    @abstractmethod
    def remove(self, n: Node) -> None:
        """``n`` (in the policy) stopped being evictable."""

    @abstractmethod
    def oldest(self) -> Node | None:
        """The next victim (not removed); None when empty."""

    @abstractmethod
    def pop(self) -> Node | None:
        """Remove and return the next victim; None when empty."""

    def shrink(self, n: Node, c: int) -> None:
        """``n`` (in the policy, where it stays) gave ``c`` of its blocks to a new node."""
        self.num_blocks -= c

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def nodes(self) -> list[Node]:
        """Entries in eviction order (tests and invariant checks; O(n))."""

    def __contains__(self, n: Node) -> bool:
        return any(n is m for m in self.nodes())

    def note_evicted(self, hashes: list[bytes]) -> None:
        """These blocks left this tier (a victim). Policies with a memory use this."""

    def note_inserted(self, n: Node) -> int:
        """``n`` is new in the tree, under ``n.parent``: how many of its leading blocks the
        policy recognizes (the tree marks them ``reused``); 0 by default."""
        return 0

    def resize(self, capacity: int) -> None:
        self.capacity = capacity

    def class_of(self, n: Node) -> int:
        """Eviction class (lower goes first); monotone along chains. Tests check it."""
        return 0


@mypyc_attr(allow_interpreted_subclasses=True)
class LRU(EvictionPolicy):
    """Least recently released first: one ``OrderedDict`` as the queue."""

    name = LRU_NAME

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._q: OrderedDict[Node, None] = OrderedDict()

    def push(self, n: Node) -> None:
        self._q[n] = None
        self.num_blocks += len(n.hashes)

    def remove(self, n: Node) -> None:
        del self._q[n]
        self.num_blocks -= len(n.hashes)

    def oldest(self) -> Node | None:
        if not self._q:
            return None
        self.probes += 1
        return next(iter(self._q))

    def pop(self) -> Node | None:
        if not self._q:
            return None
        n = self._q.popitem(last=False)[0]
        self.num_blocks -= len(n.hashes)
        return n

    def __len__(self) -> int:
        return len(self._q)

    def __contains__(self, n: Node) -> bool:
        return n in self._q

    def nodes(self) -> list[Node]:
        return list(self._q)


@mypyc_attr(allow_interpreted_subclasses=True)
class SLRU(EvictionPolicy):
    """Segmented LRU with a ghost memory (see the module docstring).

    ``protected_fraction`` of the tier (in blocks) may be protected; the ghost remembers
    the hashes of the last ``ghost_factor × capacity`` evicted blocks (FIFO), so a block
    recomputed soon after its eviction comes back protected. It keeps blocks that are hit
    again over blocks seen once, where LRU lets a burst of one-off prompts flush them. The
    defaults were chosen on the bundled Mooncake trace (0.3-0.5 and 0.25-2x all beat LRU
    there at 1k and 10k blocks; these gave the best of both).
    """

    name = SLRU_NAME
    remembers = True

    def __init__(self, capacity: int, protected_fraction: float = 0.5,
                 ghost_factor: float = 2.0) -> None:
        super().__init__(capacity)
        if not 0.0 <= protected_fraction <= 1.0 or ghost_factor < 0:
            raise ValueError("protected_fraction must be in [0, 1] and ghost_factor >= 0")
        self.protected_fraction = protected_fraction
        self.ghost_factor = ghost_factor
        self._prob: OrderedDict[Node, None] = OrderedDict()
        self._prot: OrderedDict[Node, None] = OrderedDict()
        self._prot_blocks = 0
        self._ghost: dict[bytes, None] = {}  # insertion-ordered; trimmed in bulk
        self._max_prot = int(capacity * protected_fraction)
        self._max_ghost = int(capacity * ghost_factor)

    def class_of(self, n: Node) -> int:
        """1 in protected, 0 in probation (a demoted node is in probation)."""
        return 1 if n in self._prot else 0

    def push(self, n: Node) -> None:
        k = len(n.hashes)
        self.num_blocks += k
        if n.hits >= 2 or n.reused:
            self._prot[n] = None
            self._prot_blocks += k
            self._demote()
        else:
            self._prob[n] = None

    def _demote(self) -> None:
        """Move the oldest protected entries to the young end of probation until the
        protected queue holds no more than its share."""
        prot = self._prot
        while self._prot_blocks > self._max_prot:
            d = prot.popitem(last=False)[0]
            self._prot_blocks -= len(d.hashes)
            self._prob[d] = None

    def remove(self, n: Node) -> None:
        k = len(n.hashes)
        self.num_blocks -= k
        if self._prob.pop(n, _ABSENT) is _ABSENT:
            del self._prot[n]
            self._prot_blocks -= k

    def shrink(self, n: Node, c: int) -> None:
        self.num_blocks -= c
        if n in self._prot:
            self._prot_blocks -= c

    def oldest(self) -> Node | None:
        q = self._prob or self._prot
        if not q:
            return None
        self.probes += 1
        return next(iter(q))

    def pop(self) -> Node | None:
        if self._prob:
            n = self._prob.popitem(last=False)[0]
        elif self._prot:
            n = self._prot.popitem(last=False)[0]
            self._prot_blocks -= len(n.hashes)
        else:
            return None
        self.num_blocks -= len(n.hashes)
        return n

    def __len__(self) -> int:
        return len(self._prob) + len(self._prot)

    def __contains__(self, n: Node) -> bool:
        return n in self._prob or n in self._prot

    def nodes(self) -> list[Node]:
        return list(self._prob) + list(self._prot)

    def queues(self) -> tuple[list[Node], list[Node]]:
        """(probation, protected), each oldest first (tests)."""
        return list(self._prob), list(self._prot)

    def note_evicted(self, hashes: list[bytes]) -> None:
        ghost = self._ghost
        if ghost:  # a block evicted again goes to the young end, or a trim forgets it early
            for h in ghost.keys() & hashes:
                del ghost[h]
        ghost.update(dict.fromkeys(hashes))
        if len(ghost) > 2 * self._max_ghost:  # amortized O(1) per block, in C
            keep = list(ghost)[len(ghost) - self._max_ghost:]
            self._ghost = dict.fromkeys(keep)

    def note_inserted(self, n: Node) -> int:
        """Leading blocks of ``n`` evicted recently (in the ghost), counted in C; none
        unless the parent is protected-worthy (or the root): classes stay monotone."""
        p = n.parent
        assert p is not None
        if p.parent is not None and p.hits < 2 and not p.reused:
            return 0
        ghost = self._ghost
        if n.hashes[0] not in ghost:
            return 0
        return len(list(takewhile(ghost.__contains__, n.hashes)))

    def resize(self, capacity: int) -> None:
        super().resize(capacity)
        self._max_prot = int(capacity * self.protected_fraction)
        self._max_ghost = int(capacity * self.ghost_factor)
        self._demote()


_ABSENT = object()


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    if name == LRU_NAME:
        return LRU(capacity)
    if name == SLRU_NAME:
        return SLRU(capacity)
    raise ValueError(f"eviction policy must be one of {POLICIES}, got {name!r}")
