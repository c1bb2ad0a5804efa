"""Radix tree of KV blocks keyed by chained block hashes; a node holds a run of blocks.

Hashes are chained, so one block's hash names its whole prefix. A node holds a run of
consecutive blocks of one chain that share every per-node field (status, refs, ops in
flight, hits, ...), like the edges of a compressed radix tree; each block keeps its own
hash and ids. ``index`` maps every block hash to its node, so a prefix is found with a
binary search over a request's hashes (present hashes form a prefix), and work per request
grows with the nodes it touches, not with its blocks::

    root ── [h0 h1 h2 h3] ── [h4 h5] ── [h6 h7 h8]       node.depth = chain position of
                  │                └── [h6' h7']           its first block (0, 4, 6, 6)
                  └── (children keyed by their first hash)

``split(n, c)`` puts a new node with ``n``'s first ``c`` blocks between ``n`` and its
parent; ``n`` keeps the rest, its children, its place in the eviction policies, and the
object identity that requests (their path ends at a node) and ops in flight (an entry
covers a node and the ancestors a split put above it: ``pieces``) refer to. A victim (no
holder, no op) gives its last blocks instead: ``split_tail`` moves them and its children
to a new child, and the rest keeps its place first in line in the policy.

Statuses (only ``DEVICE`` and ``HOST`` can be matched); ``dev`` / ``host`` are per-block
id lists or None::

    DEVICE                 dev                host optional (a backup, host_ok)
    HOST                   None               host, host_ok
    SWAP_TO_HOST           None (given up)    host = d2h destination
    SWAP_TO_DEVICE         dev = h2d dest.    host = h2d source
    LOADING_FROM_STORAGE   None               host = s2h destination
    DELETING               detached; blocks freed when its last op is acked

Tier order: a node on device has its parent on device (or the root).

Evictable sets, one per tier, closed under subtrees, so a victim is a chain tail and each
eviction is O(1) (``eviction.py`` gives the ordering half of the argument)::

    device-listed  ⟺  DEVICE, ref 0, busy == wbusy (nothing in flight but L3 writes of
                      its host copy), and dpin == 0
    host-listed    ⟺  host_ok, busy 0, and (DEVICE, or HOST, ref 0 and hpin == 0)
    dpin = children on device (DEVICE / SWAP_TO_DEVICE) that are not device-listed
    hpin = children that are not host-listed

``relist`` lists a node where it qualifies and goes on up the chain (one step per node
listed); ``hold`` / ``unlist`` are one step. A device node's backup may be dropped
whatever is below it, and while a request holds the node (it reads the device copy), so
only HOST nodes wait for their children and their holders.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from enum import IntEnum
from itertools import repeat
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
    """A run of blocks. ``ref`` counts running requests that hold it (a request holds whole
    nodes from the root); ``busy`` counts ops in flight over it, ``wbusy`` those of them
    that write its host copy to L3 (h2s: they leave its device copy evictable); ``dpin`` /
    ``hpin`` count children that keep it out of the device / host evictable set;
    ``reused`` is the eviction policy's mark (``eviction.SLRU``)."""

    __slots__ = (
        "hashes", "dev", "host", "parent", "children", "depth", "status", "ref", "busy",
        "wbusy", "hits", "last_access", "host_ok", "in_store", "reused", "dpin", "hpin",
        "dlisted", "hlisted",
    )

    def __init__(self, hashes: list[bytes], parent: Node | None, status: Status,
                 dev: list[int] | None = None, host: list[int] | None = None) -> None:
        self.hashes = hashes
        self.dev = dev
        self.host = host
        self.parent = parent
        self.children: dict[bytes, Node] | None = None
        self.depth: int = 0 if parent is None else parent.depth + len(parent.hashes)
        self.status = status
        self.ref = self.busy = self.wbusy = self.hits = self.last_access = 0
        self.dpin = self.hpin = 0
        self.host_ok = self.in_store = self.reused = self.dlisted = self.hlisted = False

    def __repr__(self) -> str:
        h = self.hashes[0].hex()[:8] if self.hashes else "root"
        return (f"Node({h}+{len(self.hashes)}@{self.depth}, {self.status.name}, dev={self.dev}, "
                f"host={self.host}, ref={self.ref}, busy={self.busy})")


class RadixTree:
    """Nodes, the block index and the per-tier evictable sets (their order is the
    policies'). O(1) per call, plus O(blocks) C-level index updates on add / split /
    detach; ``relist`` cascades one step per node listed."""

    def __init__(self, device_policy: EvictionPolicy, host_policy: EvictionPolicy) -> None:
        self.root = Node([], None, DEVICE)
        self.root.children = {}
        self.index: dict[bytes, Node] = {}
        self.dpol = device_policy
        self.hpol = host_policy

    # ---------------------------------------------------------------- lookup

    def num_present(self, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` are in the tree (they form a prefix: binary search)."""
        index = self.index
        n = len(hashes)
        if not n or hashes[0] not in index:
            return 0
        if hashes[-1] in index:
            return n
        return bisect_left(range(n), True, 1, n - 1, key=lambda i: hashes[i] not in index)

    @staticmethod
    def common_run(n: Node, hashes: Sequence[bytes], start: int, limit: int) -> int:
        """How many of ``n``'s blocks equal ``hashes[start:limit]`` from the first one (the
        first must). Chained hashes agree on a prefix only, so a binary search does it."""
        hs = n.hashes
        top = min(len(hs), limit - start)
        if hs[top - 1] == hashes[start + top - 1]:
            return top
        return bisect_left(range(top), True, 1, top - 1,
                           key=lambda i: hs[i] != hashes[start + i])

    def locate(self, h: bytes) -> tuple[Node, int] | None:
        """(node, offset) of block ``h``, or None."""
        n = self.index.get(h)
        if n is None:
            return None
        return n, n.hashes.index(h)

    def path(self, tail: Node | None) -> list[Node]:
        """Nodes from the root's child down to ``tail`` (none for None or the root)."""
        out = []
        n = tail
        while n is not None and n.parent is not None:
            out.append(n)
            n = n.parent
        out.reverse()
        return out

    # ---------------------------------------------------------------- structure

    def add(self, parent: Node, hashes: list[bytes], status: Status,
            dev: list[int] | None = None, host: list[int] | None = None) -> Node:
        """A new (unlisted) child of ``parent`` holding ``hashes``."""
        node = Node(hashes, parent, status, dev, host)
        if parent.children is None:
            parent.children = {hashes[0]: node}
        else:
            parent.children[hashes[0]] = node
        self.index.update(zip(hashes, repeat(node)))
        parent.hpin += 1
        if status in ON_DEVICE:
            parent.dpin += 1
        return node

    def split(self, n: Node, c: int) -> Node:
        """Put a new node with ``n``'s first ``c`` blocks between ``n`` and its parent and
        return it. It copies every per-node field; it is out of the device set (the caller
        holds it or lists it) and in the host set only as a DEVICE node's backup, with pin
        counts that see ``n`` as its only child."""
        hs = n.hashes
        assert 0 < c < len(hs), f"split of {n} at {c}"
        h = Node(hs[:c], None, n.status)  # (unlisted; its other fields are n's: set below)
        n.hashes = hs[c:]
        if n.dev is not None:
            h.dev = n.dev[:c]
            n.dev = n.dev[c:]
        else:
            h.dev = None
        if n.host is not None:
            h.host = n.host[:c]
            n.host = n.host[c:]
        else:
            h.host = None
        p: Node = n.parent  # type: ignore[assignment]
        h.parent = p
        p.children[hs[0]] = h  # type: ignore[index]
        h.children = {n.hashes[0]: n}
        n.parent = h
        h.depth = n.depth
        n.depth += c
        h.ref = n.ref
        h.busy = n.busy
        h.wbusy = n.wbusy
        h.hits = n.hits
        h.last_access = n.last_access
        h.host_ok = n.host_ok
        h.in_store = n.in_store
        h.reused = n.reused
        on_dev = n.status in ON_DEVICE
        h.dpin = 1 if on_dev and not n.dlisted else 0
        h.hpin = 0 if n.hlisted else 1
        if n.dlisted:  # the parent now sees an unlisted child where it saw a listed one
            p.dpin += 1
            self.dpol.shrink(n, c)
        if n.hlisted:
            self.hpol.shrink(n, c)
            if n.status is DEVICE:  # a backup stays droppable, held or not
                self.hpol.push(h)
                h.hlisted = True
            else:
                p.hpin += 1
        self.index.update(zip(h.hashes, repeat(h)))
        return h

    def split_tail(self, n: Node, k: int) -> Node:
        """Move ``n``'s last ``k`` blocks and its children into a new child of ``n`` and
        return it (for victims: nothing refers to ``n``, which keeps its place in the
        policies, shorter). The new node is unlisted; O(children) re-parenting."""
        hs = n.hashes
        c = len(hs) - k
        assert 0 < c and n.ref == 0 and n.busy == 0, f"tail split of {n} at {c}"
        t = Node(hs[c:], None, n.status)  # (its fields are n's: set below)
        n.hashes = hs[:c]
        if n.dev is not None:
            t.dev = n.dev[c:]
            n.dev = n.dev[:c]
        else:
            t.dev = None
        if n.host is not None:
            t.host = n.host[c:]
            n.host = n.host[:c]
        else:
            t.host = None
        t.parent = n
        t.children = kids = n.children
        if kids:
            for ch in kids.values():
                ch.parent = t
        n.children = {t.hashes[0]: t}
        t.depth = n.depth + c  # (status as n's; unheld, idle and unlisted: as made)
        t.hits = n.hits
        t.last_access = n.last_access
        t.host_ok = n.host_ok
        t.in_store = n.in_store
        t.reused = n.reused
        t.dpin = n.dpin
        t.hpin = n.hpin
        n.dpin = 1 if t.status in ON_DEVICE else 0
        n.hpin = 1
        if n.dlisted:
            self.dpol.shrink(n, k)
        if n.hlisted:
            self.hpol.shrink(n, k)
        self.index.update(zip(t.hashes, repeat(t)))
        return t

    def trim_tail(self, n: Node, k: int) -> tuple[list[bytes], list[int] | None, list[int] | None]:
        """Cut a childless victim's last ``k`` blocks out of the tree (it keeps its place in
        the policies, shorter); their hashes, device ids and host ids. O(k) in C."""
        assert not n.children and n.ref == 0 and n.busy == 0, f"trim of {n}"
        c = len(n.hashes) - k
        assert 0 < c, f"trim of {n} by {k}"
        hs = n.hashes[c:]
        del n.hashes[c:]
        dev = host = None
        if n.dev is not None:
            dev = n.dev[c:]
            del n.dev[c:]
        if n.host is not None:
            host = n.host[c:]
            del n.host[c:]
        deque(map(self.index.__delitem__, hs), 0)
        if n.dlisted:
            self.dpol.shrink(n, k)
        if n.hlisted:
            self.hpol.shrink(n, k)
        return hs, dev, host

    def drop_device_victim(self, v: Node, k: int) -> tuple[list[bytes], list[int]]:
        """The oldest device victim ``v`` (childless, no host copy) loses its last ``k``
        blocks from the tree, all of them or a tail (the rest keeps its place first in
        line); their hashes and device ids."""
        if k < len(v.hashes):
            hs, dev, _ = self.trim_tail(v, k)
            return hs, dev  # type: ignore[return-value]
        popped = self.dpol.pop()
        assert popped is v, f"device drop of {v}, not the oldest"
        v.dlisted = False
        ids: list[int] = v.dev  # type: ignore[assignment]
        v.dev = None
        v.status = HOST  # off the device: its parent's dpin did not count it (listed)
        self.detach(v)
        return v.hashes, ids

    def drop_host_victim(self, v: Node) -> tuple[list[bytes], list[int]]:
        """The oldest host victim ``v``, a HOST chain tail (childless, unheld, idle), leaves
        the tree whole; its hashes and host ids. One step: ``pop_host`` + ``detach`` without
        the pin counts' round trip (a listed child did not pin its parent, a removed one
        does not either)."""
        assert v.status is HOST and not v.children, f"host drop of {v}"
        popped = self.hpol.pop()
        assert popped is v, f"host drop of {v}, not the oldest"
        v.hlisted = False
        del v.parent.children[v.hashes[0]]  # type: ignore[union-attr]
        deque(map(self.index.__delitem__, v.hashes), 0)  # a C loop
        ids: list[int] = v.host  # type: ignore[assignment]
        v.host = None
        v.host_ok = False
        return v.hashes, ids

    def mark_reused(self, n: Node, r: int) -> None:
        """The policy recognized ``n``'s first ``r`` blocks (``note_inserted``): mark them
        ``reused``, splitting a new node when only a part came back."""
        if r <= 0:
            return
        if r < len(n.hashes):
            n = self.split(n, r)
        n.reused = True

    def split_at(self, n: Node, depth: int) -> Node:
        """The node that ends just before block ``depth`` of the chain, ``n`` covering it
        (split when ``depth`` falls inside ``n``)."""
        c = depth - n.depth
        return self.split(n, c) if c > 0 else n.parent  # type: ignore[return-value]

    def detach(self, node: Node) -> None:
        """Remove a childless node from the index, its parent and the evictable sets."""
        assert not node.children, f"detaching {node} with children"
        parent = node.parent
        assert parent is not None and parent.children is not None
        self.unlist(node)
        del parent.children[node.hashes[0]]
        deque(map(self.index.__delitem__, node.hashes), 0)  # a C loop
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

    def hold(self, n: Node) -> None:
        """One more request holds ``n``: it leaves the device set, and the host set when it
        is HOST (a held DEVICE node's backup can still go)."""
        if n.ref == 0:
            if n.dlisted:
                self.dpol.remove(n)
                n.dlisted = False
                n.parent.dpin += 1  # type: ignore[union-attr]
            if n.hlisted and n.status is HOST:
                self.hpol.remove(n)
                n.hlisted = False
                n.parent.hpin += 1  # type: ignore[union-attr]
        n.ref += 1

    def unlist(self, n: Node) -> None:
        """``n`` stops being evictable (busy, or leaving the tree)."""
        if n.dlisted:
            self.dpol.remove(n)
            n.dlisted = False
            n.parent.dpin += 1  # type: ignore[union-attr]
        if n.hlisted:
            self.hpol.remove(n)
            n.hlisted = False
            n.parent.hpin += 1  # type: ignore[union-attr]

    def unlist_host_chain(self, n: Node) -> None:
        """A HOST node ``n`` becomes busy: it leaves the host set, and so do the HOST
        ancestors that were listed only because it was (the set stays closed under
        subtrees; a DEVICE ancestor's backup stays). One step per node unlisted;
        ``relist`` lists them again when ``n`` settles. A DEVICE node (an L3 write of its
        backup) leaves the host set alone: its device listing stays (``wbusy``)."""
        if n.status is DEVICE:
            if n.hlisted:
                self.hpol.remove(n)
                n.hlisted = False
                n.parent.hpin += 1  # type: ignore[union-attr]
            return
        while n.hlisted and n.status is HOST:
            self.unlist(n)
            n = n.parent  # type: ignore[assignment]

    def unlist_device_chain(self, n: Node) -> None:
        """A device-listed node ``n`` (its only ops in flight L3 writes) is split by an op's
        outcome: it leaves the device set, and so do the ancestors listed only because it
        was (the new head would go in line after them: a parent before its child). One
        step per node; the op's commit lists them again, in chain order."""
        while n.dlisted:
            self.dpol.remove(n)
            n.dlisted = False
            n = n.parent  # type: ignore[assignment]  # (the root is never listed)
            n.dpin += 1

    def relist(self, n: Node) -> None:
        """List ``n`` in each tier where it qualifies, then its ancestors that qualify now."""
        if (not n.dlisted and n.status is DEVICE and not n.ref and n.busy == n.wbusy
                and not n.dpin and n.parent is not None):
            self._dlist_up(n)
        if not n.hlisted and n.host_ok and not n.busy and (
                n.status is DEVICE or (n.status is HOST and not n.ref and not n.hpin)):
            self._hlist_up(n)

    def _dlist_up(self, n: Node) -> None:
        dpol = self.dpol
        while True:
            dpol.push(n)
            n.dlisted = True
            p: Node = n.parent  # type: ignore[assignment]
            p.dpin -= 1
            if (p.dpin or p.dlisted or p.ref or p.busy != p.wbusy or p.status is not DEVICE
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

    def pop_device(self, want: int, v: Node | None = None) -> Node | None:
        """The device policy's next victim (``v``, when the caller looked already), its
        last ``want`` blocks at most (the rest stays first in line), unlisted; the caller
        moves it off the device at once (its parent's ``dpin`` does not count it). A victim
        with an L3 write in flight (``wbusy``) comes whole: a busy node is never split at
        its tail (its op entries end at its last block), so the caller may get more."""
        if v is None:
            v = self.dpol.oldest()
            if v is None:
                return None
        if len(v.hashes) > want and not v.busy:
            t = self.split_tail(v, want)
            v.dpin -= 1  # t is leaving the device
            return t
        self.dpol.pop()
        v.dlisted = False
        return v

    def pop_host(self) -> Node | None:
        """The host policy's next victim, unlisted: a DEVICE node (its backup goes) or a
        HOST chain tail (the caller detaches it at once); trim a longer HOST victim
        (``trim_tail``) to take fewer blocks."""
        v = self.hpol.pop()
        if v is not None:
            v.hlisted = False
            v.parent.hpin += 1  # type: ignore[union-attr]
        return v

    def became_host(self, n: Node) -> None:
        """A DEVICE node with a host copy lost its device copy (now HOST): it is listed again
        as the youngest entry when every child is listed before it, else waits for them."""
        if n.hlisted:
            self.hpol.remove(n)
            n.hlisted = False
            n.parent.hpin += 1  # type: ignore[union-attr]
        self.relist(n)

    @property
    def num_dlru(self) -> int:
        """Device blocks evictable right now."""
        return self.dpol.num_blocks

    @property
    def num_hlru(self) -> int:
        """Host blocks whose copy could be dropped right now."""
        return self.hpol.num_blocks

    def dlru_nodes(self) -> list[Node]:
        return self.dpol.nodes()

    def hlru_nodes(self) -> list[Node]:
        return self.hpol.nodes()

    # ---------------------------------------------------------------- per-block views

    def block(self, h: bytes) -> BlockView:
        if h not in self.index:
            raise KeyError(h.hex())
        return BlockView(self, h)

    def num_blocks(self) -> int:
        return len(self.index)


class BlockView:
    """One cached block as it is now (tests, logs): every read looks the block up again, so
    a view stays right across splits. Raises KeyError once the block left the tree."""

    __slots__ = ("_tree", "hash")

    def __init__(self, tree: RadixTree, h: bytes) -> None:
        self._tree = tree
        self.hash = h

    def _at(self) -> tuple[Node, int]:
        loc = self._tree.locate(self.hash)
        if loc is None:
            raise KeyError(f"block {self.hash.hex()[:8]} is not in the tree")
        return loc

    @property
    def node(self) -> Node:
        return self._at()[0]

    @property
    def status(self) -> Status:
        return self._at()[0].status

    @property
    def dev(self) -> int:
        n, i = self._at()
        return -1 if n.dev is None else n.dev[i]

    @property
    def host(self) -> int:
        n, i = self._at()
        return -1 if n.host is None else n.host[i]

    def __getattr__(self, name: str) -> object:  # ref, busy, hits, host_ok, in_store, ...
        return getattr(self._at()[0], name)

    @property
    def parent(self) -> BlockView | None:
        """The previous block of the chain; None for the first."""
        n, i = self._at()
        if i:
            return BlockView(self._tree, n.hashes[i - 1])
        p = n.parent
        return None if p is None or p.parent is None else BlockView(self._tree, p.hashes[-1])

    @property
    def children(self) -> list[bytes]:
        """Hashes of the next blocks of every chain through this block."""
        n, i = self._at()
        if i + 1 < len(n.hashes):
            return [n.hashes[i + 1]]
        return list(n.children or ())

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, BlockView) and other.hash == self.hash
                and other._tree is self._tree)

    def __hash__(self) -> int:
        return hash(self.hash)

    def __repr__(self) -> str:
        n, i = self._at()
        return f"Block({self.hash.hex()[:8]} of {n!r}[{i}])"
