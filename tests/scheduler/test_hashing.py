"""Chained block hashing: determinism (across processes too), chaining, multimodal extras."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from zkv.scheduler.hashing import (
    DIGEST_SIZE,
    ROOT_HASH,
    MultiModalItem,
    hash_block,
    hash_ids_chain,
    hash_tokens,
)

BS = 4
TOKENS = list(range(100, 116))  # four full blocks of 4


def item(start: int, end: int, tag: int = 1) -> MultiModalItem:
    return MultiModalItem(start, end, bytes([tag]) * DIGEST_SIZE)


def block_alone(tokens: list[int], b: int, parent: bytes, items: list[MultiModalItem]) -> bytes:
    """Hash of block ``b`` alone (incrementally), so a test sees that block's own inputs."""
    block = tokens[b * BS : (b + 1) * BS]
    (h,) = hash_tokens(block, BS, parent=parent, start_token=b * BS, mm_items=items)
    return h


# ---------------------------------------------------------------- basics


def test_deterministic_and_16_bytes() -> None:
    a = hash_tokens(TOKENS, BS)
    b = hash_tokens(list(TOKENS), BS)
    assert a == b
    assert len(a) == 4
    assert all(type(h) is bytes and len(h) == DIGEST_SIZE == 16 for h in a)
    assert len(set(a)) == 4
    assert len(ROOT_HASH) == DIGEST_SIZE


def test_matches_the_documented_formula() -> None:
    """h_i = XXH3-128(h_{i-1} || tokens_i as int32 LE || extra_i): the cross-machine contract."""
    h = ROOT_HASH
    want = []
    for b in range(4):
        h = xxhash.xxh3_128_digest(h + np.asarray(TOKENS[b * BS : (b + 1) * BS], "<i4").tobytes())
        want.append(h)
    assert hash_tokens(TOKENS, BS) == want
    digest = bytes(range(16))
    mm = [MultiModalItem(5, 6, digest)]
    block1 = np.asarray(TOKENS[4:8], "<i4").tobytes()
    h1 = xxhash.xxh3_128_digest(want[0] + block1 + b"\xff" + digest)
    assert hash_tokens(TOKENS[:8], BS, mm_items=mm) == [want[0], h1]
    assert hash_block(ROOT_HASH, np.asarray(TOKENS[:4], "<i4").tobytes()) == want[0]


def test_list_and_numpy_inputs_agree() -> None:
    want = hash_tokens(TOKENS, BS)
    assert hash_tokens(np.asarray(TOKENS, dtype=np.int64), BS) == want
    assert hash_tokens(np.asarray(TOKENS, dtype=np.int32), BS) == want
    assert hash_tokens(tuple(TOKENS), BS) == want


def test_negative_and_extreme_int32_tokens() -> None:
    toks = [-(2**31), 2**31 - 1, -1, 0]
    (h,) = hash_tokens(toks, BS)
    assert h == xxhash.xxh3_128_digest(ROOT_HASH + np.asarray(toks, "<i4").tobytes())


_CHILD = """
import sys
from zkv.scheduler.hashing import MultiModalItem, hash_ids_chain, hash_tokens
toks = list(range(100, 116))
mm = [MultiModalItem(2, 7, bytes(range(16)))]
print(",".join(h.hex() for h in hash_tokens(toks, 4)))
print(",".join(h.hex() for h in hash_tokens(toks, 4, mm_items=mm)))
print(",".join(h.hex() for h in hash_ids_chain([7, -3, 2**40])))
"""


def _hashes_in_child(seed: str) -> list[str]:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )
    return out.stdout.split()


def test_same_hashes_in_separate_processes() -> None:
    """Never Python's salted hash(): two interpreters with different seeds agree with us."""
    a = _hashes_in_child("1")
    b = _hashes_in_child("12345")
    mm = [MultiModalItem(2, 7, bytes(range(16)))]
    here = [
        ",".join(h.hex() for h in hash_tokens(TOKENS, BS)),
        ",".join(h.hex() for h in hash_tokens(TOKENS, BS, mm_items=mm)),
        ",".join(h.hex() for h in hash_ids_chain([7, -3, 2**40])),
    ]
    assert a == b == here
    assert all(len(h) == 32 for line in here for h in line.split(","))


# ---------------------------------------------------------------- chaining


def test_only_full_blocks_are_hashed() -> None:
    full = hash_tokens(TOKENS[:12], BS)
    assert hash_tokens(TOKENS[:15], BS) == full
    assert hash_tokens(TOKENS[:13], BS) == full
    assert hash_tokens(TOKENS[:3], BS) == []
    assert hash_tokens([], BS) == []
    assert len(hash_tokens(TOKENS, BS)) == 4


def test_incremental_equals_one_shot() -> None:
    one_shot = hash_tokens(TOKENS, BS)
    for cut in (0, 4, 8, 12, 16):
        head = hash_tokens(TOKENS[:cut], BS)
        parent = head[-1] if head else ROOT_HASH
        tail = hash_tokens(TOKENS[cut:], BS, parent=parent, start_token=cut)
        assert head + tail == one_shot, cut


def test_incremental_equals_one_shot_with_multimodal_items() -> None:
    mm = [item(2, 7, 1), item(9, 13, 2)]  # absolute positions
    one_shot = hash_tokens(TOKENS, BS, mm_items=mm)
    head = hash_tokens(TOKENS[:8], BS, mm_items=mm)
    tail = hash_tokens(TOKENS[8:], BS, parent=head[-1], start_token=8, mm_items=mm)
    assert head + tail == one_shot
    # Three pieces, one block at a time.
    parent: bytes = ROOT_HASH
    pieces = []
    for b in range(4):
        parent = block_alone(TOKENS, b, parent, mm)
        pieces.append(parent)
    assert pieces == one_shot


def test_changing_one_token_changes_that_block_and_later_only() -> None:
    base = hash_tokens(TOKENS, BS)
    for pos in (0, 5, 11, 15):
        toks = list(TOKENS)
        toks[pos] += 1
        changed = hash_tokens(toks, BS)
        b = pos // BS
        assert changed[:b] == base[:b], pos
        assert all(changed[i] != base[i] for i in range(b, 4)), pos


def test_a_change_in_the_partial_tail_changes_nothing() -> None:
    toks = TOKENS[:14]
    other = toks[:12] + [0, 0]
    assert hash_tokens(toks, BS) == hash_tokens(other, BS)


def test_different_parent_changes_every_hash() -> None:
    base = hash_tokens(TOKENS, BS)
    other = hash_tokens(TOKENS, BS, parent=b"\x01" * 16)
    assert all(a != b for a, b in zip(base, other, strict=True))


def test_block_order_matters() -> None:
    a = hash_tokens([1, 2, 3, 4, 5, 6, 7, 8], BS)
    b = hash_tokens([5, 6, 7, 8, 1, 2, 3, 4], BS)
    assert a[0] != b[0] and a[1] != b[1] and a[1] != b[0]


# ---------------------------------------------------------------- multimodal items


def test_overlapping_item_changes_the_block_hash() -> None:
    plain = block_alone(TOKENS, 1, ROOT_HASH, [])  # block 1 covers [4, 8)
    for start, end in [(4, 8), (5, 6), (0, 5), (7, 12), (0, 16), (3, 5)]:
        assert block_alone(TOKENS, 1, ROOT_HASH, [item(start, end)]) != plain, (start, end)


def test_item_ending_exactly_at_block_start_does_not_count() -> None:
    plain = block_alone(TOKENS, 1, ROOT_HASH, [])
    assert block_alone(TOKENS, 1, ROOT_HASH, [item(0, 4)]) == plain
    assert block_alone(TOKENS, 1, ROOT_HASH, [item(2, 4), item(1, 3)]) == plain


def test_item_starting_exactly_at_block_end_does_not_count() -> None:
    plain = block_alone(TOKENS, 1, ROOT_HASH, [])
    assert block_alone(TOKENS, 1, ROOT_HASH, [item(8, 12)]) == plain
    assert block_alone(TOKENS, 1, ROOT_HASH, [item(8, 9), item(0, 4)]) == plain


def test_item_spanning_blocks_affects_each_of_them() -> None:
    mm = [item(2, 11)]  # blocks 0, 1, 2; not block 3 [12, 16)
    for b in range(4):
        with_item = block_alone(TOKENS, b, ROOT_HASH, mm)
        plain = block_alone(TOKENS, b, ROOT_HASH, [])
        assert (with_item != plain) == (b < 3), b
    # One-shot: the first touched block and everything after it change.
    base = hash_tokens(TOKENS, BS)
    assert all(a != b for a, b in zip(hash_tokens(TOKENS, BS, mm_items=mm), base, strict=True))
    late = hash_tokens(TOKENS, BS, mm_items=[item(12, 13)])
    assert late[:3] == base[:3] and late[3] != base[3]


def test_item_digest_and_order_of_items() -> None:
    a = block_alone(TOKENS, 0, ROOT_HASH, [item(0, 2, 1)])
    b = block_alone(TOKENS, 0, ROOT_HASH, [item(0, 2, 2)])
    assert a != b  # the item's content counts, not just its position
    two = [item(0, 2, 1), item(2, 4, 2)]
    assert block_alone(TOKENS, 0, ROOT_HASH, two) == block_alone(TOKENS, 0, ROOT_HASH, two[::-1])


def test_items_before_start_token_are_skipped_in_incremental_calls() -> None:
    mm = [item(0, 3), item(1, 2), item(14, 16)]
    one_shot = hash_tokens(TOKENS, BS, mm_items=mm)
    tail = hash_tokens(TOKENS[8:], BS, parent=one_shot[1], start_token=8, mm_items=mm)
    assert tail == one_shot[2:]
    plain_tail = hash_tokens(TOKENS[8:], BS, parent=one_shot[1], start_token=8)
    assert tail[0] == plain_tail[0] and tail[1] != plain_tail[1]


# ---------------------------------------------------------------- hash_ids_chain


def test_hash_ids_chain_equal_paths_equal_hashes() -> None:
    a = hash_ids_chain([1, 2, 3])
    assert a == hash_ids_chain([1, 2, 3])
    assert hash_ids_chain([1, 2]) == a[:2]
    assert hash_ids_chain([1, 2, 4])[:2] == a[:2]
    assert hash_ids_chain([1, 2, 4])[2] != a[2]
    assert hash_ids_chain([3], parent=a[1]) == a[2:]
    assert all(len(h) == 16 for h in a)
    assert hash_ids_chain([]) == []


def test_hash_ids_chain_different_parent_different_hashes() -> None:
    a = hash_ids_chain([1, 2, 3])
    b = hash_ids_chain([9, 2, 3])
    assert all(x != y for x, y in zip(a, b, strict=True))
    c = hash_ids_chain([1, 2, 3], parent=b"\x02" * 16)
    assert all(x != y for x, y in zip(a, c, strict=True))
    assert hash_ids_chain([5, 5, 5])[1] != hash_ids_chain([5, 5, 5])[0]


def test_hash_ids_chain_is_not_token_hashing() -> None:
    assert hash_ids_chain([1])[0] != hash_tokens([1], 1)[0]


# ---------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    ("kwargs", "tokens"),
    [
        pytest.param({"block_size": 0}, TOKENS, id="block-size-0"),
        pytest.param({"block_size": -4}, TOKENS, id="block-size-negative"),
        pytest.param({"block_size": 4, "start_token": 2}, TOKENS, id="start-not-multiple"),
        pytest.param({"block_size": 4, "parent": b"short"}, TOKENS, id="parent-too-short"),
        pytest.param({"block_size": 4, "parent": b"x" * 17}, TOKENS, id="parent-too-long"),
        pytest.param({"block_size": 4}, [[1, 2, 3, 4]], id="two-dimensional"),
        pytest.param({"block_size": 4}, [1, 2, 3, 2**31], id="above-int32"),
        pytest.param({"block_size": 4}, [1, 2, 3, -(2**31) - 1], id="below-int32"),
    ],
)
def test_bad_inputs_raise_value_error(kwargs: dict[str, object], tokens: list[object]) -> None:
    bs = kwargs.pop("block_size")
    with pytest.raises(ValueError):
        hash_tokens(tokens, bs, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("start", "end", "digest"),
    [
        pytest.param(3, 3, b"d" * 16, id="empty"),
        pytest.param(4, 3, b"d" * 16, id="reversed"),
        pytest.param(-1, 3, b"d" * 16, id="negative-start"),
        pytest.param(0, 3, b"d" * 15, id="short-digest"),
        pytest.param(0, 3, b"d" * 32, id="long-digest"),
    ],
)
def test_bad_multimodal_item_raises_value_error(start: int, end: int, digest: bytes) -> None:
    with pytest.raises(ValueError):
        MultiModalItem(start, end, digest)


def test_fractional_token_ids_raise_value_error() -> None:
    """1.5 must not silently hash like token 1 (two different prompts, one hash)."""
    with pytest.raises(ValueError):
        hash_tokens([1.5, 2, 3, 4], BS)
    with pytest.raises(ValueError):
        hash_tokens(np.asarray([1.5, 2, 3, 4]), BS)


@pytest.mark.parametrize(
    "ids",
    [
        pytest.param([1.5], id="fraction"),
        pytest.param(["1"], id="str"),
        pytest.param([1, True], id="bool"),  # numpy alone makes it [1, 1]
        pytest.param([2**63], id="above-int64"),
        pytest.param([-(2**63) - 1], id="below-int64"),
    ],
)
def test_hash_ids_chain_bad_ids_raise_value_error(ids: list[object]) -> None:
    with pytest.raises(ValueError):
        hash_ids_chain(ids)  # type: ignore[arg-type]
