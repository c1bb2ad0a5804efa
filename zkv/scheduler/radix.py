"""Radix tree of KV blocks keyed by chained block hashes, with one LRU per tier.

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
no HOST node sits inside a device prefix. Each node counts its children on device
(``ndev``) to let tests check this cheaply.

LRU lists are intrusive doubly linked lists with a sentinel (insert / remove / pop-oldest
in O(1)); the device list holds ``DEVICE`` nodes with ref 0 and no op in flight, the host
list holds nodes whose committed host copy nobody needs (ref 0, no op in flight). Nodes
released together are pushed leaf first, so every node sits nearer the old end than its
ancestors and the oldest entry is a chain tail.
"""

from __future__ import annotations

from enum import IntEnum


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
    in flight that read or write one of its blocks."""

    __slots__ = (
        "hash", "parent", "children", "dev", "host", "status", "ref", "hits", "last_access",
        "busy", "host_ok", "in_store", "ndev", "dprev", "dnext", "hprev", "hnext",
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
        self.ref = self.hits = self.last_access = self.busy = self.ndev = 0
        self.host_ok = self.in_store = False
        self.dprev = self.dnext = self.hprev = self.hnext = None

    def __repr__(self) -> str:
        return (f"Node({self.hash.hex()[:8]}, {self.status.name}, dev={self.dev}, host={self.host}, "
                f"ref={self.ref}, busy={self.busy})")


class RadixTree:
    """Index, parent/child links and the two LRU lists. Policy lives in CacheManager."""

    def __init__(self) -> None:
        self.root = Node(b"", None, DEVICE)
        self.root.children = {}
        self.index: dict[bytes, Node] = {}
        self._dsent = Node(b"<dlru>", None, DELETING)
        self._dsent.dprev = self._dsent.dnext = self._dsent
        self._hsent = Node(b"<hlru>", None, DELETING)
        self._hsent.hprev = self._hsent.hnext = self._hsent
        self.num_dlru = 0
        self.num_hlru = 0

    # ---------------------------------------------------------------- structure

    def add(self, parent: Node, h: bytes, status: Status, dev: int = -1, host: int = -1) -> Node:
        node = Node(h, parent, status, dev, host)
        if parent.children is None:
            parent.children = {h: node}
        else:
            parent.children[h] = node
        self.index[h] = node
        if dev >= 0:
            parent.ndev += 1
        return node

    def detach(self, node: Node) -> None:
        """Remove a childless node from the index and its parent (O(1))."""
        assert not node.children, f"detaching {node} with children"
        parent = node.parent
        assert parent is not None and parent.children is not None
        del parent.children[node.hash]
        del self.index[node.hash]
        if node.dev >= 0 and node.status in ON_DEVICE:
            parent.ndev -= 1
        if node.dprev is not None:
            self.dlru_remove(node)
        if node.hprev is not None:
            self.hlru_remove(node)

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

    # ---------------------------------------------------------------- device LRU

    def dlru_push(self, n: Node) -> None:
        s = self._dsent
        t = s.dprev
        assert t is not None
        n.dprev = t
        n.dnext = s
        t.dnext = n
        s.dprev = n
        self.num_dlru += 1

    def dlru_remove(self, n: Node) -> None:
        p = n.dprev
        if p is None:
            return
        q = n.dnext
        p.dnext = q
        q.dprev = p  # type: ignore[union-attr]
        n.dprev = n.dnext = None
        self.num_dlru -= 1

    def dlru_oldest(self) -> Node | None:
        n = self._dsent.dnext
        return None if n is self._dsent else n

    def dlru_nodes(self) -> list[Node]:
        out = []
        n = self._dsent.dnext
        while n is not self._dsent:
            out.append(n)
            n = n.dnext  # type: ignore[union-attr]
        return out

    # ---------------------------------------------------------------- host LRU

    def hlru_push(self, n: Node) -> None:
        s = self._hsent
        t = s.hprev
        assert t is not None
        n.hprev = t
        n.hnext = s
        t.hnext = n
        s.hprev = n
        self.num_hlru += 1

    def hlru_remove(self, n: Node) -> None:
        p = n.hprev
        if p is None:
            return
        q = n.hnext
        p.hnext = q
        q.hprev = p  # type: ignore[union-attr]
        n.hprev = n.hnext = None
        self.num_hlru -= 1

    def hlru_oldest(self) -> Node | None:
        n = self._hsent.hnext
        return None if n is self._hsent else n

    def hlru_nodes(self) -> list[Node]:
        out = []
        n = self._hsent.hnext
        while n is not self._hsent:
            out.append(n)
            n = n.hnext  # type: ignore[union-attr]
        return out
