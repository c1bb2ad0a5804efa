"""The model's identity in the L3 namespace: what a token chain's KV depends on besides
the geometry (which the layout carries).

::

    model vLLM was given          identity
    local directory               <its real path>@<revision or main>#<config.json digest>
    Hugging Face cache snapshot   hub:models--<org>--<name>@<commit>#<digest>
      (.../models--org--name/snapshots/<commit>: vLLM swaps a hub id for it offline)
    hub id (org/name)             hub:models--<org>--<name>@<commit>#<digest>
                                  (the commit vLLM resolved, else the local cache's ref)
    hub id, commit unknown        <org/name>@<revision or main>

A hub model is named by its commit, not by where a machine keeps its cache, so engines
on machines with other cache directories (another user, ``HF_HOME``), online or offline,
share a store, and a new revision pushed under the same name (new weights, same config)
never reads the old one's KV. Then, where set: the config vLLM reads instead of the
model's (``hf_config_path``), which RoPE factors a LongRoPE model runs with (the long ones
past ``original_max_position_embeddings``: vLLM picks them by ``max_model_len``),
``hf_overrides`` (a RoPE or other config change the file does not show; a function, by
the config it made), ``model_class_overrides`` (another implementation of the
architecture), where the weights come from when not from the model's folder
(``model_weights``: the runai_streamer and sharded_state loaders read them there), weight
quantization and its online settings (``quantization_config``), and the KV cache dtype
with the model dtype it was computed in (vLLM keeps every fp8 / quantized KV format in uint8
tensors, so the geometry's dtype cannot tell ``fp8_e4m3`` from ``fp8_e5m2``). Unset ones
add nothing, so the namespaces of plain engines stay what they were.

Weights rewritten in place in a local directory under an unchanged config.json are not
seen (reading them all would cost a load's worth of I/O at every start): the caller
announces them, with ``namespace_salt`` across restarts or vLLM's
``reset_prefix_cache(reset_connector=True)`` in a running engine.

Free of vLLM (it reads the configs' attributes), so it is testable without it.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

import orjson

_SNAPSHOT = re.compile(r"(?:^|/)(?P<repo>models--[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})$")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def hub_folder(repo_id: str) -> str:
    """The Hugging Face cache's folder name for a model repo (``org/name``)."""
    return "models--" + repo_id.replace("/", "--")


def _cached_config(repo_id: str, revision: str | None, hub_cache: str | None) -> str | None:
    """config.json of ``repo_id`` at ``revision`` (a branch, tag or commit; None: main) in
    the local Hugging Face cache, or None: no network is asked."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - vLLM depends on it
        return None
    try:
        path = try_to_load_from_cache(repo_id, "config.json", cache_dir=hub_cache,
                                      revision=revision)
    except Exception:  # noqa: BLE001 - not a repo id (a missing local path): unknown
        return None
    return path if isinstance(path, str) else None


def model_source(model: str, revision: Any, hub_cache: str | None = None
                 ) -> tuple[str, str | None]:
    """(name with revision, its config.json's path or None) for the model vLLM loads;
    see the module docstring. ``revision``: vLLM's, a str or huggingface_hub's
    ``ResolvedRevision`` (a str equal to the branch asked for, ``.resolved`` the commit)."""
    # A local directory by its real path: vLLM keeps the path as typed, and a relative
    # one names another directory in each working directory (two fine-tunes started as
    # `vllm serve ckpt` from two run folders shared a namespace: each read the other's
    # KV), while '/m' and '/m/' were two namespaces of one model.
    path = os.path.realpath(model) if os.path.isabs(model) or os.path.isdir(model) else model
    snap = _SNAPSHOT.search(path)
    if snap is not None and os.path.isdir(path):
        return f"hub:{snap['repo']}@{snap['commit']}", os.path.join(path, "config.json")
    if os.path.isdir(path) or os.path.isabs(path):
        return f"{path}@{revision or 'main'}", os.path.join(path, "config.json")
    commit = getattr(revision, "resolved", None)
    commit = commit if isinstance(commit, str) and _COMMIT.fullmatch(commit) else None
    cfg = _cached_config(model, commit or (str(revision) if revision else None), hub_cache)
    if commit is None and cfg is not None:
        snap = _SNAPSHOT.search(os.path.dirname(os.path.normpath(cfg)))
        commit = snap["commit"] if snap is not None else None
    if commit is None:
        return f"{model}@{revision or 'main'}", cfg
    return f"hub:{hub_folder(model)}@{commit}", cfg


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def _longrope(model_config: Any) -> str | None:
    """``long`` / ``short`` for a LongRoPE model (Phi-3 and 3.5 128k, Phi-4-mini,
    MiniCPM4): vLLM rotates every position with the long factors when ``max_model_len``
    is past ``original_max_position_embeddings``, else with the short ones, so one
    checkpoint makes two KVs by a runtime flag. None for other models."""
    cfg = getattr(model_config, "hf_text_config", None)
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(cfg, name, None)
        if not isinstance(params, dict):
            continue
        # transformers 5 may key them by attention type: {"full_attention": {...}, ...}
        for p in [params, *(v for v in params.values() if isinstance(v, dict))]:
            if (p.get("rope_type") or p.get("type")) != "longrope":
                continue
            original = p.get("original_max_position_embeddings",
                             getattr(cfg, "original_max_position_embeddings", None))
            max_len = getattr(model_config, "max_model_len", None)
            if not isinstance(original, int) or not isinstance(max_len, int):
                return f"len{max_len}"  # cannot tell: apart by the length itself
            return "long" if max_len > original else "short"
    return None


def _made_config(model_config: Any, fn: Any) -> str:
    """A callable ``hf_overrides``, named by the config it made: its name alone is
    ``__main__.<lambda>`` for every lambda (scripts scaling RoPE by 2 and by 4 shared a
    namespace). Without the fields that name a machine's path or a library's version."""
    name = f"{fn.__module__}.{fn.__qualname__}"
    cfg = getattr(model_config, "hf_config", None)
    opts = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS  # (id2label: int keys)
    try:
        made = dict(cfg.to_dict())  # type: ignore[union-attr]
        for key in ("_name_or_path", "transformers_version"):
            made.pop(key, None)
        return name + orjson.dumps(made, option=opts, default=str).decode()
    except Exception:  # noqa: BLE001 - no config to read: the name alone, as before
        return name


def kv_format(cache_dtype: str, model_dtype: Any, fp8_e4m3: str | None = None) -> str:
    """The KV format a ``cache_dtype`` stores, one name per format: ``fp8`` is vLLM's
    alias of ``fp8_e4m3`` (they shared no block); that one is the platform's e4m3 type
    (``fp8_e4m3``: ``float8_e4m3fn``, named so, as before; others, ROCm's
    ``float8_e4m3fnuz``, added: other bytes under one name); a float type equal to the
    model's is ``auto``."""
    if cache_dtype == str(model_dtype).removeprefix("torch."):
        return "auto"
    name = "fp8_e4m3" if cache_dtype == "fp8" else cache_dtype
    if name == "fp8_e4m3" and fp8_e4m3 not in (None, "float8_e4m3fn"):
        name += f":{fp8_e4m3}"
    return name


def model_identity(model_config: Any, cache_config: Any, hub_cache: str | None = None,
                   fp8_e4m3: str | None = None) -> str:
    """The identity of vLLM's ``model_config`` / ``cache_config``; see the module
    docstring. ``hub_cache``: the Hugging Face cache (None: huggingface_hub's default).
    ``fp8_e4m3``: the platform's e4m3 torch type (:func:`kv_format`)."""
    mc = model_config
    ident, cfg_path = model_source(str(mc.model), getattr(mc, "revision", None), hub_cache)
    if cfg_path is not None and os.path.isfile(cfg_path):
        ident += "#" + _digest(cfg_path)
    hf_config_path = getattr(mc, "hf_config_path", None)
    if hf_config_path:  # vLLM reads the config there, not in the model's folder
        path = str(hf_config_path)
        path = os.path.join(path, "config.json") if os.path.isdir(path) else path
        ident += f"|cfg#{_digest(path)}" if os.path.isfile(path) else f"|cfg={hf_config_path}"
    rope = _longrope(mc)
    if rope is not None:
        ident += f"|longrope={rope}"
    overrides = getattr(mc, "hf_overrides", None)
    if overrides:
        text = (_made_config(mc, overrides) if callable(overrides)
                else orjson.dumps(overrides, option=orjson.OPT_SORT_KEYS, default=str).decode())
        ident += "|hf=" + hashlib.sha256(text.encode()).hexdigest()[:16]
    classes = getattr(mc, "model_class_overrides", None)
    if classes:  # another implementation of the architecture computes the KV
        text = orjson.dumps(classes, option=orjson.OPT_SORT_KEYS, default=str).decode()
        ident += "|mc=" + hashlib.sha256(text.encode()).hexdigest()[:16]
    weights = getattr(mc, "model_weights", None)
    if weights and str(weights) != str(mc.model):  # the loader reads them there
        w = str(weights)
        ident += f"|w={os.path.realpath(w) if os.path.exists(w) else w}"  # (as the model's)
    if getattr(mc, "quantization", None):
        ident += f"|q={mc.quantization}"
    qc = getattr(mc, "quantization_config", None)
    if qc is not None:  # online schemes, ignored layers: other weights under one name
        text = (orjson.dumps(qc, option=orjson.OPT_SORT_KEYS, default=str).decode()
                if isinstance(qc, dict) else repr(qc))  # (vLLM's args: a stable repr)
        ident += "|qc=" + hashlib.sha256(text.encode()).hexdigest()[:16]
    kv = kv_format(str(getattr(cache_config, "cache_dtype", "auto")), mc.dtype, fp8_e4m3)
    if kv != "auto":
        ident += f"|kv={kv}/{mc.dtype}"
    return ident
