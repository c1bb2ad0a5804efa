"""What zkv hashes of a vLLM request (no engine needed): its tokens, and
what changes every block's KV without changing the tokens: the chain's root (LoRA
adapter, cache salt, the connector's cache generation) and the items whose content stands
behind placeholder tokens (multimodal inputs, prompt embeddings), each with where it
starts, as vLLM's own block hashes do."""

from __future__ import annotations

import os
from typing import Any

import orjson
import xxhash

from zkv.scheduler.hashing import ROOT_HASH, MultiModalItem


def request_root(request: Any, generation: bytes = b"") -> bytes:
    """The chain's parent for a request: LoRA adapter (its name and path, as vLLM's own
    hashes: a name pointed at another adapter does not reuse KV), cache salt and the
    connector's cache generation (new at each reset) change every hash."""
    lora = getattr(request, "lora_request", None)
    salt = getattr(request, "cache_salt", None)
    if lora is None and not salt and not generation:
        return ROOT_HASH
    # a JSON array: a name or salt holding a separator never spells another's fields
    # (``lora=a|salt=x|salt=`` was both adapter ``a|salt=x`` and salt ``x|salt=``)
    tag = orjson.dumps([getattr(lora, "lora_name", "") if lora else "", salt or "",
                        (getattr(lora, "lora_path", None) or "") if lora else ""])
    return xxhash.xxh3_128_digest(ROOT_HASH + tag + generation)


def mm_ids_name_content(vllm_config: Any) -> bool:
    """Whether vLLM names a multimodal input by a hash of its content. It does unless the
    model is multimodal and both its caches that need one are off (prefix caching, and the
    processor cache, ``mm_processor_cache_gb=0``): then an input without a client's
    ``multi_modal_uuids`` is named ``renderer<R>-mm-<n>-<modality>-<i>``, a counter that
    starts at 1 in every process (vLLM's ``_process_mm_uuids``)."""
    mm = getattr(vllm_config.model_config, "multimodal_config", None)
    if mm is None:
        return True
    return bool(getattr(vllm_config.cache_config, "enable_prefix_caching", True)
                or getattr(mm, "mm_processor_cache_gb", 1) != 0)


#: The engine's multimodal settings that change an input's KV but not vLLM's name for it
#: (its content hash covers the request's processor kwargs, not the engine's, which the
#: processor merges in later: ``--mm-processor-kwargs '{"max_pixels": ...}'`` resizes one
#: image to other pixels; EVS pruning keeps other video tokens; an fp8 encoder).
_MM_SETTINGS = ("mm_processor_kwargs", "media_io_kwargs", "video_pruning_rate",
                "mm_encoder_attn_dtype", "mm_encoder_fp8_scale_path")


def mm_scope(vllm_config: Any) -> bytes:
    """The ``scope`` of :func:`request_mm_items` for an engine: random (16 bytes, new at
    each start) when its identifiers name an input only within one process
    (:func:`mm_ids_name_content` false); else a digest of the settings in
    ``_MM_SETTINGS`` that are set (engines that agree share), b"" when none are."""
    if not mm_ids_name_content(vllm_config):
        return os.urandom(16)
    mm = getattr(vllm_config.model_config, "multimodal_config", None)
    settings = {k: getattr(mm, k, None) for k in _MM_SETTINGS}
    settings = {k: v for k, v in settings.items() if v}  # (unset, empty, 0: off)
    if not settings:
        return b""
    if "video_pruning_rate" in settings:
        settings["video_pruning_method"] = getattr(mm, "video_pruning_method", None)
    return xxhash.xxh3_128_digest(orjson.dumps(settings, option=orjson.OPT_SORT_KEYS,
                                               default=str))


def request_mm_items(request: Any, scope: bytes = b"") -> tuple[MultiModalItem, ...]:
    """Multimodal inputs: their content's identifier and where it starts (as vLLM's own
    hashes: one image at other positions of otherwise equal placeholder blocks is other
    KV). ``scope``: :func:`mm_scope`, mixed into every item: an engine's own (another
    engine's or an earlier run's ``renderer0-mm-1-image-0``, another image, never matches
    through a shared store), or its settings'. A scoped digest starts with 0xff, a byte no
    UTF-8 identifier holds, so no client's uuid spells a scope's bytes."""
    items = []
    for f in getattr(request, "mm_features", None) or ():
        pos = f.mm_position
        ident = str(getattr(f, "identifier", "") or getattr(f, "mm_hash", ""))
        name = f"{ident}@{pos.offset}".encode()
        items.append(MultiModalItem(pos.offset, pos.offset + pos.length, xxhash.xxh3_128_digest(
            b"\xff" + scope + name if scope else name)))
    return tuple(items)


def request_embeds_items(request: Any, block_size: int) -> tuple[MultiModalItem, ...]:
    """Blocks whose model input comes from ``prompt_embeds`` (every block of an embeddings
    prompt; of a mixed one, a chat completion with ``prompt_embeds`` parts, those with a
    position where ``prompt_is_token_ids`` is false): one item per such block, its digest
    naming the embedding rows and the positions that read them. The token ids there are
    placeholders, so without it prompts with other embeddings share blocks."""
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is None:
        return ()
    mask = getattr(request, "prompt_is_token_ids", None)
    n = int(embeds.shape[0])
    items = []
    for start in range(0, n, block_size):
        end = min(start + block_size, n)
        if mask is None:
            rows, which = embeds[start:end], b""
        else:
            which = bytes(not t for t in mask[start:end])
            if not any(which):
                continue
            rows = embeds[[start + i for i, e in enumerate(which) if e]]
        # float32 holds every bf16 / fp16 value exactly: the bytes name the rows
        data = rows.detach().float().cpu().contiguous().numpy().tobytes()
        items.append(MultiModalItem(start, end, xxhash.xxh3_128_digest(
            b"prompt_embeds" + start.to_bytes(8, "little") + which + data)))
    return tuple(items)


def request_tokens(request: Any) -> list[int]:
    """The prompt's token ids as vLLM feeds the model: an embeddings prompt's positions
    hold zeros (``all_token_ids``; the items above name what they read)."""
    if getattr(request, "prompt_embeds", None) is None:
        return request.prompt_token_ids  # type: ignore[no-any-return]
    return list(request.all_token_ids[: request.num_prompt_tokens])
