"""The native hashing path (zkv.scheduler._chainhash) against the pure-Python reference.

``hash_tokens`` / ``hash_ids_chain`` take the native path when it is built; the reference
``hash_tokens_py`` / ``hash_ids_chain_py`` never do. Every digest must agree (lists,
tuples, numpy arrays, multimodal extras, incremental calls, id chains), and inputs the
native path hands back to Python must raise the same errors or give the same digests.
"""

from __future__ import annotations

import random

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from zkv.scheduler import hashing
from zkv.scheduler.hashing import (
    DIGEST_SIZE,
    ROOT_HASH,
    MultiModalItem,
    hash_ids_chain,
    hash_ids_chain_py,
    hash_tokens,
    hash_tokens_py,
)

native = pytest.importorskip(
    "zkv.scheduler._chainhash", reason="C extension not built (pip install -e . with gcc)")

I32 = st.integers(-(2**31), 2**31 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
DIGESTS = st.binary(min_size=DIGEST_SIZE, max_size=DIGEST_SIZE)


def test_the_public_functions_use_the_native_path() -> None:
    assert hashing.NATIVE and hashing._native is native


@st.composite
def mm_items(draw: st.DrawFn, n_tokens: int) -> list[MultiModalItem]:
    out = []
    for _ in range(draw(st.integers(0, 4))):
        start = draw(st.integers(0, max(0, n_tokens + 4)))
        end = draw(st.integers(start + 1, start + 40))
        out.append(MultiModalItem(start, end, draw(DIGESTS)))
    return out


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(I32, max_size=120),
    block_size=st.integers(1, 17),
    parent=st.one_of(st.just(ROOT_HASH), DIGESTS),
    start_blocks=st.integers(0, 3),
    data=st.data(),
)
def test_native_equals_reference(tokens: list[int], block_size: int, parent: bytes,
                                 start_blocks: int, data: st.DataObject) -> None:
    start = start_blocks * block_size
    items = data.draw(mm_items(start + len(tokens)))
    kw = dict(parent=parent, start_token=start, mm_items=items)
    want = hash_tokens_py(tokens, block_size, **kw)
    assert len(want) == len(tokens) // block_size
    assert hash_tokens(tokens, block_size, **kw) == want
    assert hash_tokens(tuple(tokens), block_size, **kw) == want
    assert hash_tokens(np.asarray(tokens, dtype=np.int64), block_size, **kw) == want
    assert hash_tokens(np.asarray(tokens, dtype="<i4"), block_size, **kw) == want


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(I64, max_size=60), parent=st.one_of(st.just(ROOT_HASH), DIGESTS))
def test_native_id_chain_equals_reference(ids: list[int], parent: bytes) -> None:
    want = hash_ids_chain_py(ids, parent=parent)
    assert hash_ids_chain(ids, parent=parent) == want
    assert hash_ids_chain(tuple(ids), parent=parent) == want
    assert native.hash_id_list(ids, parent) == want


def test_a_chat_sized_prompt_and_its_incremental_extension() -> None:
    """A 2,437-token prompt in 16-token blocks, then extended by its decode tokens."""
    rng = random.Random(7)
    prompt = [rng.randrange(32_000) for _ in range(2_437)]
    items = [MultiModalItem(100, 900, b"i" * 16), MultiModalItem(890, 1_200, b"j" * 16)]
    for mm in ((), items):
        want = hash_tokens_py(prompt, 16, mm_items=mm)
        assert hash_tokens(prompt, 16, mm_items=mm) == want
        cut = 16 * 100
        tail = hash_tokens(prompt[cut:], 16, parent=want[99], start_token=cut, mm_items=mm)
        assert want[:100] + tail == want


def test_extras_reach_exactly_the_overlapping_blocks() -> None:
    """The native path's per-block extras (computed apart from the reference's loop)."""
    items = [MultiModalItem(4, 8, b"a" * 16), MultiModalItem(3, 5, b"b" * 16),
             MultiModalItem(8, 9, b"c" * 16), MultiModalItem(0, 4, b"d" * 16)]
    extras = hashing._block_extras(items, 0, 4, 3)
    assert extras == {
        0: b"\xff" + b"d" * 16 + b"b" * 16,
        1: b"\xff" + b"b" * 16 + b"a" * 16,
        2: b"\xff" + b"c" * 16,
    }
    # Incremental: positions are absolute, blocks counted from start_token.
    assert hashing._block_extras(items, 4, 4, 2) == {0: extras[1], 1: extras[2]}


@pytest.mark.parametrize(
    "tokens",
    [
        pytest.param([1, 2, 3, 2**31], id="above-int32"),
        pytest.param([1, 2, 3, -(2**31) - 1], id="below-int32"),
        pytest.param([1.5, 2, 3, 4], id="float"),
        pytest.param([1, 2, 3, "4"], id="str"),
        pytest.param([1, 2, 3, 4, 5, 2**40], id="bad-token-in-the-partial-tail"),
        pytest.param([[1, 2, 3, 4]], id="nested"),
    ],
)
def test_bad_tokens_raise_on_both_paths(tokens: list[object]) -> None:
    assert native.hash_tokens(tokens, 4, ROOT_HASH, None) is None  # left to Python
    with pytest.raises(ValueError):
        hash_tokens_py(tokens, 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        hash_tokens(tokens, 4)  # type: ignore[arg-type]


def test_inputs_left_to_python_hash_as_the_reference_does() -> None:
    """bool and numpy ints are not exact ints: the reference decides, on both paths."""
    for toks in ([True, 2, 3, 4], [np.int64(1), 2, 3, 4]):
        assert native.hash_tokens(toks, 4, ROOT_HASH, None) is None
        assert hash_tokens(toks, 4) == hash_tokens_py(toks, 4)
    for ids in ([np.int64(5)], np.arange(3)):
        assert hash_ids_chain(ids) == hash_ids_chain_py(ids)  # type: ignore[arg-type]
    for ids in ([2**63], [1.5], [True, 2]):
        assert native.hash_id_list(ids, ROOT_HASH) is None
        with pytest.raises(ValueError):
            hash_ids_chain(ids)  # type: ignore[arg-type]


def test_native_argument_checks() -> None:
    with pytest.raises(ValueError):
        native.hash_tokens([1, 2], 0, ROOT_HASH, None)
    with pytest.raises(ValueError):
        native.hash_tokens([1, 2], 1, b"short", None)
    with pytest.raises(ValueError):
        native.hash_id_list([1], b"x" * 17)
    with pytest.raises(TypeError):
        native.hash_tokens(b"\0" * 8, 1, ROOT_HASH, [b"x"])
    with pytest.raises(TypeError):
        native.hash_tokens([1], 1, ROOT_HASH)  # type: ignore[call-arg]


def test_fallback_when_the_extension_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    toks = list(range(50))
    items = [MultiModalItem(3, 20, b"z" * 16)]
    want = hash_tokens(toks, 4, mm_items=items), hash_ids_chain(toks)
    monkeypatch.setattr(hashing, "_native", None)
    assert (hash_tokens(toks, 4, mm_items=items), hash_ids_chain(toks)) == want
