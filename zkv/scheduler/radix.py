"""Radix tree of KV blocks keyed by chained block hashes, with one eviction policy per tier.

A node is one block: because hashes are chained, a node's hash names its whole prefix,
so lookups go through one ``hash -> node`` index in O(1) per block while the tree keeps
parent / children links for eviction order and subtree drops.

Statuses (only ``DEVICE`` and ``HOST`` nodes can be matched)::

    DEVICE                 dev >= 0          host copy optional (a backup, host_ok)
    HOST                   dev == -1         host >= 0, host_ok
    SWAP_TO_HOST           dev == -1 (given up, reusable this step)  host = d2h destination
    SWAP_TO_DEVICE         dev = h2d destination                     host = h2d source
    LOADING_FROM_STORAGE   dev == -1         host = s2h destination
    DELETING               detached from the tree; blocks freed when its last op is acked

Tier order: a node with a device block has a parent with a device block (or the root), so
no HOST node sits inside a device prefix.

Evictable sets, one per tier, closed under subtrees (so a victim is always a chain tail,
and eviction is O(1): see ``eviction.py`` for the ordering half of the argument)::

    device-listed  ⟺  DEVICE, ref 0, busy 0, and dpin == 0
    host-listed    ⟺  host_ok, ref 0, busy 0, and (DEVICE, or HOST and hpin == 0)

    dpin = children on device (DEVICE / SWAP_TO_DEVICE) that are not device-listed
    hpin = children that are not host-listed

A node is listed when it qualifies (``relist``), which lowers its parent's pin count and
may list the parent in turn (a cascade up the chain, one step per node listed); it is
unlisted when it stops qualifying (``unlist``, one step). A device node's backup can be
dropped whatever lies below it, so only HOST nodes wait for their children (``hpin``).
"""

from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zkv.scheduler.eviction import EvictionPolicy


class Status(IntEnum):
    DEVICE = 0
    HOST = 1
    SWAP_TO_HOST = 2
    SWAP_TO_DEVICE = 3
    LOADING_FROM_STORAGE = 4
    DELETING = 5


DEVICE = Status.DEVICE
HOST = Status.HOST
SWAP_TO_HOST = Status.SWAP_TO_HOST
SWAP_TO_DEVICE = Status.SWAP_TO_DEVICE
LOADING_FROM_STORAGE = Status.LOADING_FROM_STORAGE
DELETING = Status.DELETING
ON_DEVICE = (DEVICE, SWAP_TO_DEVICE)


class Node:
    """One block of KV. ``ref`` counts running requests that hold it; ``busy`` counts ops
    in flight that read or write one of its blocks; ``dpin`` / ``hpin`` count children
    that keep it out of the device / host evictable set; ``reused`` is the eviction
    policy's mark (see ``eviction.SLRU``)."""

    __slots__ = (
        "hash", "parent", "children", "dev", "host", "status", "ref", "hits", "last_access",
        "busy", "host_ok", "in_store", "dpin", "hpin", "dlisted", "hlisted", "reused",
    )

    def __init__(self, h: bytes, parent: Node | None, status: Status, dev: int = -1, host: int = -1):
        # Chained assignments and a lazily created children dict: a node is created per
        # new block on the scheduling hot path (half the cost of one field per line).
        self.hash = h
        self.parent = parent
        self.children: dict[bytes, Node] | None = None
        self.dev = dev
        self.host = host
        self.status = status
        self.ref = self.hits = self.last_access = self.busy = self.dpin = self.hpin = 0
        self.host_ok = self.in_store = self.dlisted = self.hlisted = self.reused = False

    def __repr__(self) -> str:
        return (f"Node({self.hash.hex()[:8]}, {self.status.name}, dev={self.dev}, host={self.host}, "
                f"ref={self.ref}, busy={self.busy})")


class RadixTree:
    """Index, parent/child links and the per-tier evictable sets (their order is the
    policies'). Every method is O(1) except ``subtree_postorder`` and the cascades of
    ``relist`` (one step per node listed)."""

    def __init__(self, device_policy: EvictionPolicy, host_policy: EvictionPolicy) -> None:
        self.root = Node(b"", None, DEVICE)
        self.root.children = {}
        self.index: dict[bytes, Node] = {}
        self.dpol = device_policy
        self.hpol = host_policy

    # ---------------------------------------------------------------- structure

    def add(self, parent: Node, h: bytes, status: Status, dev: int = -1, host: int = -1) -> Node:
        """A new (unlisted) child of ``parent``."""
        node = Node(h, parent, status, dev, host)
        if parent.children is None:
            parent.children = {h: node}
        else:
            parent.children[h] = node
        self.index[h] = node
        parent.hpin += 1
        if status in ON_DEVICE:
            parent.dpin += 1
        return node

    def detach(self, node: Node) -> None:
        """Remove a childless node from the index, its parent and the evictable sets (O(1))."""
        assert not node.children, f"detaching {node} with children"
        parent = node.parent
        assert parent is not None and parent.children is not None
        self.unlist(node)
        del parent.children[node.hash]
        del self.index[node.hash]
        parent.hpin -= 1
        if node.status in ON_DEVICE:
            parent.dpin -= 1

    def subtree_postorder(self, node: Node) -> list[Node]:
        """Node's descendants then node, children before parents (iterative)."""
        out: list[Node] = []
        stack = [node]
        while stack:
            n = stack.pop()
            out.append(n)
            if n.children:
                stack.extend(n.children.values())
        out.reverse()
        return out

    # ---------------------------------------------------------------- evictable sets

    def unlist(self, n: Node) -> None:
        """``n`` stops being evictable (held, busy, or leaving the tree)."""
        if n.dlisted:
            self.dpol.remove(n)
            n.dlisted = False
            n.parent.dpin += 1  # type: ignore[union-attr]
        if n.hlisted:
            self.hpol.remove(n)
            n.hlisted = False
            n.parent.hpin += 1  # type: ignore[union-attr]

    def relist(self, n: Node) -> None:
        """List ``n`` in each tier where it qualifies, then its ancestors that qualify now."""
        if (not n.dlisted and n.status is DEVICE and not n.ref and not n.busy and not n.dpin
                and n.parent is not None):
            self._dlist_up(n)
        if not n.hlisted and n.host_ok and not n.ref and not n.busy and (
                n.status is DEVICE or (n.status is HOST and not n.hpin)):
            self._hlist_up(n)

    def _dlist_up(self, n: Node) -> None:
        dpol = self.dpol
        while True:
            dpol.push(n)
            n.dlisted = True
            p: Node = n.parent  # type: ignore[assignment]
            p.dpin -= 1
            if (p.dpin or p.dlisted or p.ref or p.busy or p.status is not DEVICE
                    or p.parent is None):
                return
            n = p

    def _hlist_up(self, n: Node) -> None:
        hpol = self.hpol
        while True:
            hpol.push(n)
            n.hlisted = True
            p: Node = n.parent  # type: ignore[assignment]
            p.hpin -= 1
            if (p.hpin or p.hlisted or p.ref or p.busy or p.status is not HOST
                    or not p.host_ok):
                return
            n = p

    def dev_entered(self, n: Node) -> None:
        """An unlisted node came onto the device (swap-in, attach)."""
        n.parent.dpin += 1  # type: ignore[union-attr]

    def dev_left(self, n: Node) -> None:
        """An unlisted node left the device (a failed swap-in): its parent may qualify."""
        p: Node = n.parent  # type: ignore[assignment]
        p.dpin -= 1
        self.relist(p)

    def pop_device(self) -> Node | None:
        """The device policy's next victim, a chain tail, unlisted. The caller moves it off
        the device at once (its parent's ``dpin`` already does not count it)."""
        n = self.dpol.pop()
        if n is not None:
            n.dlisted = False
        return n

    def pop_host(self) -> Node | None:
        """The host policy's next victim, unlisted (a DEVICE node's backup, or a HOST chain
        tail). The caller drops its host copy at once."""
        n = self.hpol.pop()
        if n is not None:
            n.hlisted = False
            n.parent.hpin += 1  # type: ignore[union-attr]
        return n

    def became_host(self, n: Node) -> None:
        """A host-listed DEVICE node lost its device copy (now HOST): it stays listed only
        as the youngest entry with every child listed before it, else waits for them."""
        if not n.hlisted:
            return
        self.hpol.remove(n)
        if n.hpin:
            n.hlisted = False
            n.parent.hpin += 1  # type: ignore[union-attr]
        else:
            self.hpol.push(n)

    @property
    def num_dlru(self) -> int:
        """Device blocks evictable right now (every one of them, in policy order)."""
        return len(self.dpol)

    @property
    def num_hlru(self) -> int:
        return len(self.hpol)

    def dlru_nodes(self) -> list[Node]:
        return self.dpol.nodes()

    def hlru_nodes(self) -> list[Node]:
        return self.hpol.nodes()
