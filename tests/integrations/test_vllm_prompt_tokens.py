"""``zkv:prompt_tokens_total{tier}``: where a scheduled request's prompt tokens came from,
against real worker processes and a real ``file://`` store. One engine (``writer``) puts
DOC (8 blocks) into the store; the reader's requests then find its first blocks in vLLM's
own prefix cache (``local``), the next ones in zkv's host pool, the rest in the store.

A prompt is laid out as the match orders the tiers (zkv's host blocks are a prefix of the
prompt from block 0, so vLLM's local hit covers their first ones)::

    block   0   1   2   3   4   5   6   7   +1 token
            [local ][zkv host][zkv store    ][computed]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integrations.test_vllm_rank_loss import BS, DOC, LAYOUT, Group
from tests.waiting import holds_within, wait_until
from tests.worker.helpers import short_ipc_dir
from zkv.integrations.vllm import metrics
from zkv.scheduler.hashing import ROOT_HASH, hash_tokens
from zkv.storage import leading_present

DEADLINE_S = 10.0
TIERS = ("vllm_local", "zkv_host", "zkv_store", "computed")


@pytest.fixture
def writer_and_reader(tmp_path: Path, request: pytest.FixtureRequest
                      ) -> Iterator[tuple[Group, Group]]:
    """The writer with DOC in the store; the reader (``wait_complete``: its requests wait
    for their whole prefetch) with a host pool of ``request.param`` blocks (default 64)."""
    url = f"file://{tmp_path / 'l3'}"
    layout = dataclasses.replace(LAYOUT, num_host_blocks=getattr(request, "param", 64))
    with short_ipc_dir() as one, short_ipc_dir() as two:
        writer = Group(one, store_url=url)
        try:
            reader = Group(two, store_url=url, extra={"prefetch": "wait_complete"},
                           layout=layout)
            try:
                writer.compute_and_save()
                store = writer.store
                assert store is not None
                hashes = hash_tokens(DOC, BS, parent=ROOT_HASH)
                wait_until(lambda: leading_present(store, hashes, 1) == 8, DEADLINE_S,
                           "DOC's 8 blocks in L3")
                yield writer, reader
            finally:
                reader.close()
        finally:
            writer.close()


def _host_holds_first_blocks(group: Group, n: int) -> None:
    """Put DOC's first ``n`` blocks into the half's host pool (from the store), unheld: a
    request of those blocks alone prefetches them and goes away unscheduled."""
    half = group.half
    first = group.request()
    first.prompt_token_ids = first.all_token_ids = DOC[: n * BS] + [0]
    first.num_tokens = first.num_prompt_tokens = n * BS + 1
    assert half.get_num_new_matched_tokens(first, 0) == (None, False)  # waits for its s2h
    half.request_finished(first)  # (never allocated) its prefetch goes on
    assert half.wait_idle(DEADLINE_S)
    assert half.snapshot()["cm_loaded"] == n


def _schedule(group: Group, req: Any, local: int) -> int:
    """vLLM's scheduler with ``local`` tokens in its own prefix cache: asks until the half
    answers, then allocates the request's blocks; the tokens zkv promised."""
    half = group.half
    asked: list[int | None] = []

    def matched() -> bool:
        asked.append(half.get_num_new_matched_tokens(req, local)[0])
        return asked[-1] is not None

    assert holds_within(matched, DEADLINE_S), "the half kept saying: ask again"
    ext = asked[-1]
    assert ext is not None
    half.update_state_after_alloc(req, list(range(20, 29)), ext)
    return ext


def _scraped(group: Group) -> dict[str, int]:
    """This half's ``zkv:prompt_tokens_total`` samples, by tier, as an operator scrapes
    them."""
    return {s.labels["tier"]: int(s.value)
            for fam in text_string_to_metric_families(metrics.render()) for s in fam.samples
            if s.name == "zkv:prompt_tokens_total"
            and s.labels["engine_id"] == group.half.engine_id}


def _counted(group: Group) -> dict[str, int]:
    c = group.half.counters()
    return {"vllm_local": c["vllm_local_tokens"], "zkv_host": c["zkv_host_tokens"],
            "zkv_store": c["zkv_store_tokens"], "computed": c["computed_tokens"]}


def test_one_request_from_every_tier_is_split_as_its_prompt_is_laid_out(
        writer_and_reader: tuple[Group, Group]) -> None:
    """vLLM holds blocks 0-1, zkv's host pool 0-3, the store 0-7: the request is counted
    2 blocks local, 2 from zkv's host pool (blocks 2-3: those under vLLM's hit are
    vLLM's), 4 from the store (4-7, prefetched into the host pool before it ran) and
    its last token computed; 129 tokens in all."""
    _, reader = writer_and_reader
    _host_holds_first_blocks(reader, 4)
    req = reader.request()  # DOC + 1 token: 8 * 16 + 1 = 129 prompt tokens
    ext = _schedule(reader, req, local=2 * BS)
    assert ext == 129 - 1 - 32 == 96  # all but vLLM's 32 and the token vLLM computes
    want = {"vllm_local": 2 * 16,          # 32
            "zkv_host": (4 - 2) * 16,      # 32: blocks 2-3
            "zkv_store": (8 - 4) * 16,     # 64: blocks 4-7
            "computed": 129 - 32 - 32 - 64}  # 1
    assert want == {"vllm_local": 32, "zkv_host": 32, "zkv_store": 64, "computed": 1}
    assert _counted(reader) == want
    assert _scraped(reader) == want
    assert reader.half.hit_tiers(req.request_id, ext) == (32, 64)  # vLLM's split by source
    reader.half.request_finished(req)


@pytest.mark.parametrize("writer_and_reader", [4], indirect=True)
def test_host_hits_stay_host_hits_when_the_prefetch_gets_no_host_block(
        writer_and_reader: tuple[Group, Group]) -> None:
    """The reader's host pool (4 blocks) is full of the request's own host hits, which it
    holds: its prefetch of blocks 4-7 gets no host block, so the request is scheduled
    with its host hits alone and computes the rest. Its host hits are host hits: before,
    they were counted as store hits (the split took the host blocks only from a prefetch
    that started, and saw none)."""
    _, reader = writer_and_reader
    _host_holds_first_blocks(reader, 4)
    req = reader.request()
    ext = _schedule(reader, req, local=2 * BS)
    assert ext == (4 - 2) * 16  # blocks 2-3 from the host pool; nothing from the store
    assert reader.half.snapshot()["cm_loaded"] == 4  # no s2h beside the first one
    want = {"vllm_local": 32, "zkv_host": 32, "zkv_store": 0, "computed": 129 - 32 - 32}
    assert _counted(reader) == want
    assert _scraped(reader) == want
    assert reader.half.hit_tiers(req.request_id, ext) == (32, 0)
    reader.half.request_finished(req)


def test_a_prompt_of_whole_blocks_all_in_the_host_pool_leaves_vllm_its_last_token(
        group: Group) -> None:
    """A prompt of exactly 8 blocks, all 8 in the host pool: zkv promises all but the last
    token (vLLM computes at least one, to sample from), and loads every block, the last
    one too (vLLM recomputes only that token's KV in it)."""
    group.compute_and_save()
    half = group.half
    before = _counted(group)  # (the request that computed DOC)
    req = group.request()
    req.prompt_token_ids = req.all_token_ids = list(DOC)
    req.num_tokens = req.num_prompt_tokens = len(DOC)
    ext, _ = group.ask_until_matched(req)
    assert ext == len(DOC) - 1 == 8 * BS - 1
    blocks = list(range(20, 28))
    half.update_state_after_alloc(req, blocks, ext)
    meta = half.build_connector_meta(Group.step(req, blocks, ext))
    assert (meta.loads, meta.unloaded) == (blocks, [])
    counted = {tier: n - before[tier] for tier, n in _counted(group).items()}
    assert counted == {"vllm_local": 0, "zkv_host": 8 * BS - 1, "zkv_store": 0, "computed": 1}
    half.request_finished(req)


@pytest.mark.parametrize("url, source", [
    ("file:///var/cache/zkv", "disk"),
    ("redis://127.0.0.1:6379/0", "external_unspecified"),
    ("mooncake://127.0.0.1:50051", "external_unspecified"),
    (None, "external_unspecified"),
])
def test_l3_hits_are_named_as_vllm_names_their_tier(url: str | None, source: str) -> None:
    """vLLM's ``vllm:prompt_tokens_cached_by_source`` names a local disk ``disk`` and a
    remote store ``external_unspecified``: L3 hits from a ``file://`` store are the first,
    Redis's and Mooncake's the second (the end-to-end count: test_vllm_e2e)."""
    from zkv.integrations.vllm.config import l3_source

    assert l3_source(url) == source
