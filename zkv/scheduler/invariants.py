"""Whole-state invariant check for CacheManager (tests call it after every operation).

O(nodes + blocks + ops); never called on a hot path.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from zkv.scheduler.radix import (
    DELETING,
    DEVICE,
    HOST,
    LOADING_FROM_STORAGE,
    ON_DEVICE,
    SWAP_TO_DEVICE,
    SWAP_TO_HOST,
    Node,
)

if TYPE_CHECKING:
    from zkv.scheduler.eviction import EvictionPolicy
    from zkv.scheduler.manager import CacheManager


def check(cm: CacheManager) -> None:
    tree = cm.tree
    cm.device.check()
    cm.host.check()
    attached = _walk(cm)
    assert len(attached) == len(tree.index), "index and tree disagree"
    for n in cm._deleting:
        assert n.status is DELETING and n.busy > 0, f"deleting node {n} should be freed"
        assert n.hash not in tree.index or tree.index[n.hash] is not n
    owners_dev: Counter[int] = Counter()
    owners_host: Counter[int] = Counter()
    for n in list(attached) + list(cm._deleting):
        if n.dev >= 0:
            owners_dev[n.dev] += 1
        if n.host >= 0:
            owners_host[n.host] += 1
    refs: Counter[int] = Counter()
    for st in cm._reqs.values():
        for b in st.fresh.values():
            owners_dev[b] += 1
        for n in st.nodes + st.loading:
            refs[id(n)] += 1
        if not st.allocated:
            # matched as DEVICE/HOST; another request's allocation may be swapping it in
            for n in st.nodes:
                assert n.status in (DEVICE, HOST, SWAP_TO_DEVICE), f"matched node {n} is {n.status.name}"
        else:
            for i, b in enumerate(st.table):
                if i in st.fresh:
                    assert st.fresh[i] == b
                else:
                    assert i < len(st.nodes) and st.nodes[i].dev == b, f"table[{i}] of {st.req_id}"
    _check_owned(cm.device, owners_dev)
    _check_owned(cm.host, owners_host)
    busy: Counter[int] = Counter()
    for p in list(cm._pending.values()) + list(cm._open.values()):
        for n in p.nodes:
            busy[id(n)] += 1
    for n in attached:
        assert n.ref == refs[id(n)], f"{n}: ref {n.ref} but {refs[id(n)]} requests hold it"
        assert n.busy == busy[id(n)], f"{n}: busy {n.busy} but {busy[id(n)]} ops in flight"
        _check_status(n)
        parent = n.parent
        assert parent is not None
        if n.status in ON_DEVICE:
            assert parent is tree.root or parent.status in ON_DEVICE, (
                f"tier order: {n} on device under {parent}")
        assert parent is tree.root or parent.hits >= n.hits, f"{n}: more hits than its parent"
        want_d = n.status is DEVICE and n.ref == 0 and n.busy == 0 and n.dpin == 0
        assert n.dlisted == want_d, f"{n}: device evictable-set membership wrong"
        want_h = n.host_ok and n.ref == 0 and n.busy == 0 and (
            n.status is DEVICE or (n.status is HOST and n.hpin == 0))
        assert n.hlisted == want_h, f"{n}: host evictable-set membership wrong"
    for n in [*attached, tree.root]:
        kids = list((n.children or {}).values())
        dpin = sum(1 for c in kids if c.status in ON_DEVICE and not c.dlisted)
        assert n.dpin == dpin, f"{n}: dpin {n.dpin} != {dpin}"
        hpin = sum(1 for c in kids if not c.hlisted)
        assert n.hpin == hpin, f"{n}: hpin {n.hpin} != {hpin}"
    _check_policy(tree.dpol, [n for n in attached if n.dlisted], lambda n: True)
    _check_policy(tree.hpol, [n for n in attached if n.hlisted], lambda n: n.status is HOST)
    for p in cm._pending.values():
        for n in p.nodes:
            assert n.busy > 0


def _check_policy(pol: EvictionPolicy, listed: list[Node], ordered: Callable[[Node], bool]) -> None:
    """The policy holds exactly the listed nodes; among the ``ordered`` ones (those that
    must leave as chain tails) classes never rise from parent to child and each node comes
    before its ancestors of the same class: the oldest of the lowest class is a tail."""
    order = pol.nodes()
    assert len(order) == len(pol) == len(listed), f"{pol.name}: {len(order)} vs {len(listed)} listed"
    pos = {id(n): i for i, n in enumerate(order)}
    assert all(id(n) in pos for n in listed), f"{pol.name}: a listed node is missing"
    for n in listed:
        if not ordered(n):
            continue
        a = n.parent
        while a is not None and a.parent is not None:
            if id(a) in pos and ordered(a):
                assert pol.class_of(a) >= pol.class_of(n), f"{pol.name}: class rises at {n}"
                if pol.class_of(a) == pol.class_of(n):
                    assert pos[id(a)] > pos[id(n)], f"{pol.name}: {a} before its descendant {n}"
            a = a.parent


def _walk(cm: CacheManager) -> list[Node]:
    tree = cm.tree
    out: list[Node] = []
    stack = list(tree.root.children.values())
    while stack:
        n = stack.pop()
        assert tree.index.get(n.hash) is n, f"{n} reachable but not indexed"
        assert n.parent is not None and (n.parent.children or {}).get(n.hash) is n
        out.append(n)
        stack.extend((n.children or {}).values())
    return out


def _check_owned(pool: object, owners: Counter[int]) -> None:
    for b, c in owners.items():
        assert c == 1, f"{pool.name} block {b} has {c} owners"  # type: ignore[attr-defined]
        assert pool.is_allocated(b), f"{pool.name} block {b} owned but free"  # type: ignore[attr-defined]
    assert len(owners) == pool.num_used, (  # type: ignore[attr-defined]
        f"{pool.name}: {pool.num_used} used but {len(owners)} owned")  # type: ignore[attr-defined]


def _check_status(n: Node) -> None:
    s = n.status
    if s is DEVICE:
        assert n.dev >= 0
        assert n.host_ok == (n.host >= 0) or n.busy > 0, f"{n}: host copy state"
    elif s is HOST:
        assert n.dev < 0 and n.host >= 0 and n.host_ok, f"{n}: HOST needs a committed host copy"
    elif s is SWAP_TO_HOST:
        assert n.dev < 0 and n.host >= 0 and n.busy > 0 and not n.host_ok
    elif s is SWAP_TO_DEVICE:
        assert n.dev >= 0 and n.host >= 0 and n.busy > 0 and n.host_ok
    elif s is LOADING_FROM_STORAGE:
        assert n.dev < 0 and n.host >= 0 and n.busy > 0 and not n.host_ok
    else:
        raise AssertionError(f"attached node {n} is DELETING")
