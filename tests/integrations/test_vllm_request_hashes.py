"""What the connector hashes of a vLLM request besides its token ids (no engine needed):
adapters and salts change every block, embeddings the blocks that read them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from zkv.integrations.vllm.request_hashes import (
    mm_ids_name_content,
    request_embeds_items,
    request_mm_items,
    request_root,
    request_tokens,
)
from zkv.scheduler.hashing import ROOT_HASH, hash_tokens

BS = 4


def _req(embeds: torch.Tensor | None = None, mask: list[bool] | None = None,
         ids: list[int] | None = None, **kw: object) -> SimpleNamespace:
    n = len(ids) if ids is not None else int(embeds.shape[0])  # type: ignore[union-attr]
    all_ids = list(ids) if ids is not None else [0] * n
    if mask is not None:  # vLLM zeroes the placeholders in all_token_ids
        all_ids = [t if m else 0 for t, m in zip(all_ids, mask)]
    return SimpleNamespace(prompt_token_ids=ids, prompt_embeds=embeds, prompt_is_token_ids=mask,
                           all_token_ids=all_ids, num_prompt_tokens=n, **kw)


def _hashes(r: SimpleNamespace) -> list[bytes]:
    return hash_tokens(request_tokens(r), BS, parent=request_root(r),
                       mm_items=request_embeds_items(r, BS))


def test_plain_prompts_hash_their_ids_alone() -> None:
    r = _req(ids=list(range(10)), lora_request=None, cache_salt=None)
    assert request_root(r) == ROOT_HASH and request_embeds_items(r, BS) == ()
    assert _hashes(r) == hash_tokens(list(range(10)), BS)


def test_adapter_and_salt_change_every_block() -> None:
    """An adapter by name and path (one name pointed at another adapter is another
    adapter, as in vLLM's own hashes), a salt."""
    ids = list(range(8))

    def lora(name: str, path: str) -> SimpleNamespace:
        return SimpleNamespace(lora_name=name, lora_path=path)

    plain = _hashes(_req(ids=ids, lora_request=None, cache_salt=None))
    a = _hashes(_req(ids=ids, lora_request=lora("a", "/adapters/a"), cache_salt=None))
    again = _hashes(_req(ids=ids, lora_request=lora("a", "/adapters/a"), cache_salt=None))
    moved = _hashes(_req(ids=ids, lora_request=lora("a", "/adapters/a-v2"), cache_salt=None))
    salted = _hashes(_req(ids=ids, lora_request=None, cache_salt="s"))
    assert a == again
    assert len({*plain, *a, *moved, *salted}) == 8


def test_mixed_prompts_share_the_blocks_before_their_embeddings_only() -> None:
    """Blocks 0-1 are token ids, block 2 reads one embedding row, block 3 none: only 0-1
    are shared between prompts whose rows differ; equal rows give equal hashes."""
    ids = list(range(100, 116))
    mask = [True] * 9 + [False] + [True] * 6
    rows = torch.randn(16, 8, dtype=torch.bfloat16)
    other = rows.clone()
    other[9, 0] += 1  # one value of the one embedding row
    a = _hashes(_req(rows, mask, ids, lora_request=None, cache_salt=None))
    b = _hashes(_req(other, mask, ids, lora_request=None, cache_salt=None))
    same = _hashes(_req(rows.clone(), mask, ids, lora_request=None, cache_salt=None))
    assert a == same and len(a) == 4
    assert a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]
    other_rows_unread = rows.clone()
    other_rows_unread[3] += 1  # a token position: vLLM does not read that row
    assert _hashes(_req(other_rows_unread, mask, ids, lora_request=None, cache_salt=None)) == a
    moved = [True] * 10 + [False] + [True] * 5  # the same row read one position later
    assert _hashes(_req(rows, moved, ids, lora_request=None, cache_salt=None))[2] != a[2]


def test_embeddings_only_prompts_differ_by_every_row() -> None:
    rows = torch.randn(8, 4)
    other = rows.clone()
    other[7, 3] += 1
    a = _hashes(_req(rows, lora_request=None, cache_salt=None))
    b = _hashes(_req(other, lora_request=None, cache_salt=None))
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert a != hash_tokens([0] * 8, BS)  # not the placeholder zeros' hashes


def test_one_image_at_other_positions_of_equal_placeholder_blocks_is_other_kv() -> None:
    """Placeholder tokens are all alike: an image (content ``img``) at positions 2-9, in a
    run of placeholders, is not the same KV as at 1-8 (both start in block 0), nor is
    another image at 2-9."""
    ids = [9] * 16

    def hashes(ident: str, offset: int) -> list[bytes]:
        feature = SimpleNamespace(identifier=ident,
                                  mm_position=SimpleNamespace(offset=offset, length=8))
        r = SimpleNamespace(mm_features=[feature])
        return hash_tokens(ids, BS, mm_items=request_mm_items(r))

    a = hashes("img", 2)
    assert a == hashes("img", 2)
    assert a[0] != hashes("img", 1)[0] and a[0] != hashes("other", 2)[0]
    assert a[3] != hash_tokens(ids, BS)[3]  # a later block: the chain carries it


def test_mm_ids_that_name_no_content_are_scoped_to_the_engine() -> None:
    """With prefix caching off and ``mm_processor_cache_gb=0`` vLLM names an input
    ``renderer0-mm-<n>-image-<i>``, a counter that starts at 1 in every process: two
    engines (or one restarted) over one store gave two images the same block hashes, and
    the second request read the first image's KV. The connector then gives each engine a
    scope of its own: the blocks before the image still match, the image's never do
    across engines; within one engine an input the client named keeps matching."""
    ids = [9] * 16

    def hashes(ident: str, scope: bytes) -> list[bytes]:
        feature = SimpleNamespace(identifier=ident,
                                  mm_position=SimpleNamespace(offset=6, length=8))
        r = SimpleNamespace(mm_features=[feature])
        return hash_tokens(ids, BS, mm_items=request_mm_items(r, scope))

    one, two = b"\x01" * 16, b"\x02" * 16
    a, b = hashes("renderer0-mm-1-image-0", one), hashes("renderer0-mm-1-image-0", two)
    assert a[0] == b[0] == hash_tokens(ids, BS)[0]  # before the image: text alone
    assert all(x != y for x, y in zip(a[1:], b[1:]))
    assert hashes("client-uuid", one) == hashes("client-uuid", one)
    assert hashes("renderer0-mm-1-image-0", b"") == hashes("renderer0-mm-1-image-0", b"")


def test_which_configurations_name_mm_inputs_by_content() -> None:
    """vLLM's ``_process_mm_uuids``: content hashes unless a multimodal model has both
    prefix caching and the processor cache off."""
    def cfg(mm: object, prefix: bool) -> SimpleNamespace:
        return SimpleNamespace(model_config=SimpleNamespace(multimodal_config=mm),
                               cache_config=SimpleNamespace(enable_prefix_caching=prefix))

    assert mm_ids_name_content(cfg(None, False))  # a text model: no inputs to name
    assert mm_ids_name_content(cfg(SimpleNamespace(mm_processor_cache_gb=0), True))
    assert mm_ids_name_content(cfg(SimpleNamespace(mm_processor_cache_gb=4), False))
    assert not mm_ids_name_content(cfg(SimpleNamespace(mm_processor_cache_gb=0), False))


def test_the_configurations_match_what_vllm_does() -> None:
    """vLLM's own ``BaseRenderer._process_mm_uuids`` names an image by a counter exactly
    where ``mm_ids_name_content`` says it does not name content (else it leaves the name to
    the content hash made later)."""
    import warnings

    import pytest

    pytest.importorskip("vllm")
    with warnings.catch_warnings():  # what vLLM's imports warn of is not this test's
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm.renderers.base import BaseRenderer

    for gb in (0, 4):
        for prefix in (False, True):
            model = SimpleNamespace(multimodal_config=SimpleNamespace(mm_processor_cache_gb=gb))
            cache = SimpleNamespace(enable_prefix_caching=prefix)
            renderer = SimpleNamespace(model_config=model,
                                       config=SimpleNamespace(cache_config=cache),
                                       _validate_mm_uuids=lambda *a: None)
            items = SimpleNamespace(get_all_counts=lambda: {"image": 1})
            uuids = BaseRenderer._process_mm_uuids(  # type: ignore[arg-type]
                renderer, {"image": [b"png"]}, items, {}, "renderer0-mm-1")
            named_by_counter = uuids.get("image", [None])[0] is not None
            config = SimpleNamespace(model_config=model, cache_config=cache)
            assert named_by_counter == (not mm_ids_name_content(config)), (gb, prefix)


def test_adapter_names_and_salts_never_spell_one_another() -> None:
    """The root's fields are encoded apart: a client's salt that spells the separator
    (``x|salt=``) never names the blocks of an adapter whose name holds it (``a|salt=x``),
    as ``lora=a|salt=x|salt=|lora_path=/p`` did for both."""
    def root(name: str, salt: str) -> bytes:
        lora = SimpleNamespace(lora_name=name, lora_path="/p")
        return request_root(SimpleNamespace(lora_request=lora, cache_salt=salt))

    assert root("a|salt=x", "") != root("a", "x|salt=")
    assert root("a", "x|lora_path=/q") != request_root(SimpleNamespace(
        lora_request=SimpleNamespace(lora_name="a", lora_path="/q|lora_path=/p"),
        cache_salt="x"))


def test_engine_wide_mm_processing_settings_scope_the_inputs() -> None:
    """vLLM's content hash of an image covers the request's ``mm_processor_kwargs``, not
    the engine's (``--mm-processor-kwargs '{"max_pixels": ...}'``, merged in later): two
    engines over one store that resize one image apart gave its placeholder blocks the
    same hashes, and one read the other's KV. The engine's settings now scope the inputs;
    text before them still matches, and engines without such settings keep their hashes."""
    from zkv.integrations.vllm.request_hashes import mm_scope

    def cfg(**mm: object) -> SimpleNamespace:
        return SimpleNamespace(
            model_config=SimpleNamespace(multimodal_config=SimpleNamespace(
                mm_processor_cache_gb=4, **mm)),
            cache_config=SimpleNamespace(enable_prefix_caching=True))

    ids = [9] * 16
    feature = SimpleNamespace(identifier="f00d", mm_position=SimpleNamespace(offset=6, length=8))

    def hashes(config: SimpleNamespace) -> list[bytes]:
        r = SimpleNamespace(mm_features=[feature])
        return hash_tokens(ids, BS, mm_items=request_mm_items(r, mm_scope(config)))

    small, large = cfg(mm_processor_kwargs={"max_pixels": 1 << 16}), cfg(
        mm_processor_kwargs={"max_pixels": 1 << 20})
    assert hashes(small)[0] == hashes(large)[0] == hash_tokens(ids, BS)[0]
    assert all(x != y for x, y in zip(hashes(small)[1:], hashes(large)[1:]))
    assert hashes(small) == hashes(cfg(mm_processor_kwargs={"max_pixels": 1 << 16}))
    assert hashes(cfg(video_pruning_rate=0.5)) != hashes(cfg())
    assert mm_scope(cfg()) == mm_scope(cfg(mm_processor_kwargs={})) == b""
    text_only = SimpleNamespace(model_config=SimpleNamespace(multimodal_config=None),
                                cache_config=SimpleNamespace(enable_prefix_caching=False))
    assert mm_scope(text_only) == b""
    counters = SimpleNamespace(
        model_config=SimpleNamespace(multimodal_config=SimpleNamespace(mm_processor_cache_gb=0)),
        cache_config=SimpleNamespace(enable_prefix_caching=False))
    assert len({mm_scope(counters), mm_scope(counters), b""}) == 3  # per engine, random
