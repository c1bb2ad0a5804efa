"""The cache manager's public calls with wrong arguments (from an API-misuse review): each
is refused with a ``TypeError`` / ``ValueError`` naming the argument, before anything
changes, so the pools and the tree stay consistent and a later valid use works. Before,
several changed state first and then failed deep inside: blocks leaked for good, an op
left the ledger with its node busy forever, a hash twice in a chain broke the index."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

from zkv.protocol import OpResult
from zkv.scheduler.hashing import hash_ids_chain
from zkv.scheduler.manager import CacheConfig, CacheManager

BS = 4
_ids = itertools.count(1000)


def H(n: int) -> list[bytes]:
    return hash_ids_chain([next(_ids) for _ in range(n)])


def ack(cm: CacheManager) -> None:
    cm.on_ops_done([OpResult(o.id, True, o.num_blocks) for o in cm.take_ops()])


def owned() -> CacheManager:
    """Device and host pools, write_through: a finished request's blocks are backed up."""
    return CacheManager(CacheConfig(8, 16, BS, "write_through"))


def external() -> CacheManager:
    """External-L1 mode: the engine owns device blocks."""
    return CacheManager(CacheConfig(0, 16, BS))


def still_works(cm: CacheManager) -> None:
    """Invariants hold, every request can end, and a valid use of each mode works."""
    cm.check_invariants()
    for rid in list(cm.core.requests):
        cm.abort(rid)
    ack(cm)
    cm.on_ops_done([OpResult(i, True, p.num_blocks)  # (what was in flight: the right acks)
                    for i, p in list(cm.core.ledger.pending.items())])
    cm.check_invariants()
    h = H(3)
    if cm.core.device.num_blocks:
        cm.match_prefix("ok1", h)
        assert cm.allocate("ok1", 3 * BS) is not None
        cm.finish("ok1")
        ack(cm)
        assert cm.match_prefix("ok2", h).num_device == 3
    else:
        cm.match_prefix("ok1", h)
        assert cm.cache_computed("ok1", 3 * BS, device_ids=[50, 51, 52]) == 3
        ack(cm)
        cm.finish("ok1")
        assert cm.match_prefix("ok2", h).num_host == 3
        assert cm.load_external("ok2", 0, [60, 61, 62]) == 3
        ack(cm)
    cm.finish("ok2")
    ack(cm)
    cm.check_invariants()
    assert cm.num_pending_ops == 0


def _swap_in_planned(cm: CacheManager) -> None:
    """A request whose match is in the host tier (its allocate plans a swap-in)."""
    h = H(2)
    cm.match_prefix("a", h)
    assert cm.allocate("a", 2 * BS) is not None
    cm.finish("a")
    ack(cm)
    for i in range(3):  # push a's blocks off the device (host copies stay)
        cm.match_prefix(f"f{i}", H(3))
        assert cm.allocate(f"f{i}", 3 * BS) is not None
        cm.finish(f"f{i}")
        ack(cm)
    assert cm.match_prefix("b", h).num_host == 2


def _op_in_flight(cm: CacheManager) -> int:
    """A finished request's backup op, taken and not acked; its op id."""
    cm.match_prefix("a", H(2))
    assert cm.allocate("a", 2 * BS) is not None
    cm.finish("a")
    (op,) = cm.take_ops()
    return op.id


CASES: list[tuple[str, Callable[[], CacheManager], Callable[[CacheManager], Any],
                  type[Exception], str]] = [
    ("finish with other hashes than the blocks it holds", owned,
     lambda cm: (cm.match_prefix("w", h := H(2)), cm.allocate("w", 2 * BS), cm.finish("w"),
                 ack(cm), cm.match_prefix("a", h + H(1)), cm.allocate("a", 3 * BS),
                 cm.finish("a", block_hashes=H(3))),
     ValueError, "block_hashes disagree with its prefix"),
    ("a float done", owned,
     lambda cm: cm.on_ops_done([OpResult(_op_in_flight(cm), True, 1.5)]),  # type: ignore[arg-type]
     TypeError, "id and done must be ints"),
    ("done past the op's blocks", owned,
     lambda cm: cm.on_ops_done([OpResult(_op_in_flight(cm), False, 7)]),
     ValueError, r"done 7 is outside \[0, 2\]"),
    ("ok with blocks not done", owned,
     lambda cm: cm.on_ops_done([OpResult(_op_in_flight(cm), True, 1)]),
     ValueError, "ok with 1 of 2 blocks done"),
    ("a float num_computed_tokens", owned,
     lambda cm: (cm.match_prefix("a", H(2)), cm.allocate("a", 2 * BS),
                 cm.finish("a", num_computed_tokens=6.5)),  # type: ignore[arg-type]
     TypeError, "num_computed_tokens must be an int"),
    ("a float num_tokens after a swap-in was planned", owned,
     lambda cm: (_swap_in_planned(cm), cm.allocate("b", 7.5)),  # type: ignore[arg-type]
     TypeError, "num_tokens must be an int"),
    ("a negative num_tokens", owned,
     lambda cm: (cm.match_prefix("a", H(2)), cm.allocate("a", -4)),
     ValueError, "num_tokens must be >= 0"),
    ("a hash twice in one request", owned,
     lambda cm: cm.match_prefix("a", [*(h := H(2)), h[0]]),
     ValueError, "holds a hash twice"),
    ("hashes that are not 16 bytes", owned,
     lambda cm: cm.match_prefix("a", [b"a", b"b"]),
     ValueError, "must hold 16-byte hashes"),
    ("hashes given as one bytes object", owned,
     lambda cm: cm.match_prefix("a", H(1)[0]),
     TypeError, "must be a sequence of 16-byte hashes"),
    ("engine ids that are not ints", external,
     lambda cm: (cm.match_prefix("a", H(2)), cm.cache_computed("a", 2 * BS,
                                                               device_ids=["x", "y"])),
     TypeError, "device_ids must hold ints"),
    ("engine ids that are not ints, with new hashes: neither taken", external,
     lambda cm: (cm.match_prefix("a", []), cm.cache_computed(
         "a", 2 * BS, block_hashes=H(2), device_ids=[1.0, 2.0])),  # type: ignore[list-item]
     TypeError, "device_ids must hold ints"),
    ("negative engine ids", external,
     lambda cm: (cm.match_prefix("a", H(2)), cm.cache_computed("a", 2 * BS,
                                                               device_ids=[-1, -2])),
     ValueError, "device_ids must hold ids >= 0"),
    ("an engine id twice in a load", external,
     lambda cm: (cm.match_prefix("w", h := H(2)), cm.cache_computed("w", 2 * BS,
                                                                     device_ids=[1, 2]),
                 ack(cm), cm.finish("w"), cm.match_prefix("a", h),
                 cm.load_external("a", 0, [9, 9])),
     ValueError, "device_ids holds an id twice"),
    ("a negative first block", external,
     lambda cm: (cm.match_prefix("a", H(2)), cm.load_external("a", -1, [1, 2])),
     ValueError, "first_block must be >= 0"),
    ("a kind to keep given as a string", owned,
     lambda cm: cm.take_ops(keep="backup"),  # type: ignore[arg-type]
     ValueError, "keep must be a tuple of op kinds"),
    ("a kind to keep that is none", owned,
     lambda cm: cm.take_ops(keep=("bakup",)),
     ValueError, "keep must be a tuple of op kinds"),
    ("a negative pool size", owned,
     lambda cm: cm.resize(4, -1),
     ValueError, "num_host_blocks must be >= 0"),
    # (the compiled core checks exact types deep inside: these met a raw mypyc TypeError,
    # or a True first block loaded from block 1, where the source refused them)
    ("a request id that is not a str", owned,
     lambda cm: cm.match_prefix(7, H(2)),  # type: ignore[arg-type]
     TypeError, "req_id must be a str"),
    ("hashes that are memoryviews", owned,
     lambda cm: cm.match_prefix("a", [memoryview(h) for h in H(2)]),  # type: ignore[misc]
     TypeError, "block_hashes must hold bytes, got memoryview"),
    ("a batch seq that is not an int", owned,
     lambda cm: cm.on_ops_done([OpResult(_op_in_flight(cm), True, 2)], seq="3"),  # type: ignore[arg-type]
     TypeError, "seq must be an int"),
    ("store_again of a request that owns device blocks", owned,
     lambda cm: (cm.match_prefix("a", H(2)), cm.allocate("a", 2 * BS), cm.store_again("a", 0)),
     ValueError, "store_again is an external-L1 call"),
    ("a first block given as a bool", external,
     lambda cm: (cm.match_prefix("w", h := H(2)), cm.cache_computed("w", 2 * BS,
                                                                     device_ids=[1, 2]),
                 ack(cm), cm.finish("w"), cm.match_prefix("a", h),
                 cm.load_external("a", True, [9])),  # type: ignore[arg-type]
     TypeError, "first_block must be an int"),
]


@pytest.mark.parametrize("name,make,misuse,error,message", CASES, ids=[c[0] for c in CASES])
def test_a_misuse_is_refused_before_anything_changes(
        name: str, make: Callable[[], CacheManager], misuse: Callable[[CacheManager], Any],
        error: type[Exception], message: str) -> None:
    cm = make()
    pools = (cm.core.device.num_blocks, cm.core.host.num_blocks)
    with pytest.raises(error, match=message):
        misuse(cm)
    assert (cm.core.device.num_blocks, cm.core.host.num_blocks) == pools  # (resize: none)
    a = cm.core.requests.get("a")
    if a is not None and name.endswith("neither taken"):  # the refused call changed nothing
        assert a.hashes == [] and not a.external, a
    still_works(cm)


def test_a_refused_ack_commits_none_of_its_batch() -> None:
    """One bad result among good ones: the call is refused whole, every op stays in
    flight, and the right acks commit them."""
    cm = owned()
    first = _op_in_flight(cm)
    cm.match_prefix("b", H(2))
    assert cm.allocate("b", 2 * BS) is not None
    cm.finish("b")
    (second,) = cm.take_ops()
    with pytest.raises(ValueError, match="outside"):
        cm.on_ops_done([OpResult(first, True, 2), OpResult(second.id, False, 9)])
    assert cm.num_pending_ops == 2
    cm.on_ops_done([OpResult(first, True, 2), OpResult(second.id, True, 2)])
    still_works(cm)


def test_cache_computed_before_allocate_is_refused_before_its_hashes_are_taken() -> None:
    """Owned-device mode: ``cache_computed`` of a request not yet allocated is refused, and
    the hashes it was given are not taken. (They were, then it raised: the storage load
    the request had in flight joined its path when acked, under other hashes, and the
    invariants broke.)"""
    stored = H(4)
    cm = CacheManager(CacheConfig(8, 16, BS), storage_exists=lambda hs: len(hs))
    assert cm.match_prefix("a", stored).num_storage == 4
    assert cm.prefetch("a") == 4
    (s2h,) = cm.take_ops()
    with pytest.raises(ValueError, match="not allocated"):
        cm.cache_computed("a", 4 * BS, block_hashes=H(4))
    cm.on_ops_done([OpResult(s2h.id, True, 4)])
    cm.check_invariants()
    assert cm.request("a").hashes == stored and cm.num_held_blocks("a") == 4
    still_works(cm)
