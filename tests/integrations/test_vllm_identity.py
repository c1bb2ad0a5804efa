"""The model's identity in the L3 namespace (zkv.integrations.vllm.identity), on
Hugging Face caches laid out as huggingface_hub lays them out (refs/, snapshots/)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
from huggingface_hub.hf_api import ResolvedRevision

from zkv.integrations.vllm.identity import model_identity

A, B = "a" * 40, "b" * 40
REPO = "zkv-test/tiny"


def hub_cache(root: Path, main: str, config: dict[str, dict[str, int]] | None = None) -> Path:
    """A cache holding snapshots A and B of REPO (``config``: per commit; the same
    config.json by default), with refs/main at ``main``."""
    repo = root / "models--zkv-test--tiny"
    for commit in (A, B):
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True, exist_ok=True)
        (snap / "config.json").write_text(json.dumps((config or {}).get(commit, {"layers": 4})))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(main)
    return root


def ident(model: str, revision: object = None, cache: Path | None = None, **kw: object) -> str:
    mc = NS(model=model, revision=revision, hf_overrides=None, quantization=None,
            dtype="float32", **kw)
    return model_identity(mc, NS(cache_dtype="auto"), str(cache) if cache else None)


def test_a_snapshot_is_named_by_its_commit_not_by_the_machines_cache(tmp_path: Path) -> None:
    """vLLM offline gives the snapshot's path: two machines' caches in other places
    (another user, HF_HOME) name the same commit alike, and the online hub id too."""
    one, two = hub_cache(tmp_path / "one", A), hub_cache(tmp_path / "two", A)
    snap = "models--zkv-test--tiny/snapshots/" + A
    first, second = ident(str(one / snap)), ident(str(two / snap) + "/")
    assert first == second
    assert first.startswith(f"hub:models--zkv-test--tiny@{A}#")
    assert ident(REPO, ResolvedRevision(initial=None, resolved=A), cache=one) == first


def test_a_new_revision_under_the_same_name_is_another_model(tmp_path: Path) -> None:
    """A revision pushed to main (new weights, the same config.json) is another
    namespace, whether vLLM resolved the commit or only the local cache's ref knows it."""
    cache = hub_cache(tmp_path, A)
    old = ident(REPO, None, cache=cache)
    (cache / "models--zkv-test--tiny" / "refs" / "main").write_text(B)
    new = ident(REPO, None, cache=cache)
    assert old.startswith(f"hub:models--zkv-test--tiny@{A}#")
    assert new.startswith(f"hub:models--zkv-test--tiny@{B}#") and new != old
    assert ident(REPO, ResolvedRevision(initial=None, resolved=A), cache=cache) == old
    assert ident(REPO, B, cache=cache) == new  # a commit asked for by hash


def test_the_config_digest_tells_snapshots_of_one_commit_name_apart(tmp_path: Path) -> None:
    cache = hub_cache(tmp_path, A, config={A: {"layers": 4}, B: {"layers": 8}})
    snap = cache / "models--zkv-test--tiny" / "snapshots"
    assert ident(str(snap / A)).split("#")[1] != ident(str(snap / B)).split("#")[1]


def test_a_hub_id_nothing_knows_keeps_its_name(tmp_path: Path) -> None:
    """Online, before the download, with no commit resolved: the name and revision, as
    before (nothing is asked of the network here)."""
    assert ident("org/unknown", None, cache=tmp_path) == "org/unknown@main"
    assert ident("org/unknown", "v2", cache=tmp_path) == "org/unknown@v2"


def test_a_local_directory_keeps_the_identity_it_had(tmp_path: Path) -> None:
    """Unchanged for local models, so their stores keep their namespaces."""
    (tmp_path / "config.json").write_text("{}")
    out = ident(str(tmp_path))
    assert out.startswith(f"{tmp_path}@main#") and len(out.split("#")[1]) == 16
    assert ident(str(tmp_path / "gone")) == f"{tmp_path / 'gone'}@main"


def test_a_local_directory_is_named_by_its_real_path_not_as_typed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM keeps the path as typed. A relative one names another directory in each
    working directory: two fine-tunes with one config.json started as ``vllm serve ckpt``
    from two run folders shared a namespace, each reading the other's KV (wrong outputs;
    reproduced through vLLM's Scheduler on one store). One directory typed two ways
    (``/m`` and ``/m/``, ``a/../m``, a symlink) was two namespaces."""
    for run in ("exp1", "exp2"):
        (tmp_path / run / "ckpt").mkdir(parents=True)
        (tmp_path / run / "ckpt" / "config.json").write_text('{"hidden_size": 64}')
    names = []
    for run in ("exp1", "exp2"):
        monkeypatch.chdir(tmp_path / run)
        names.append(ident("ckpt"))
    assert names[0] != names[1], names
    assert names[0].startswith(f"{tmp_path / 'exp1' / 'ckpt'}@main#"), names
    (tmp_path / "link").symlink_to(tmp_path / "exp1" / "ckpt")
    typed = [str(tmp_path / "exp1" / "ckpt") + "/", str(tmp_path / "exp2" / ".." / "exp1" /
                                                        "ckpt"), str(tmp_path / "link")]
    assert {ident(t) for t in typed} == {names[0]}


@pytest.mark.parametrize("extra, part", [
    ({"hf_overrides": {"rope_parameters": {"rope_type": "yarn"}}}, "|hf="),
    ({"quantization": "awq"}, "|q=awq"),
    ({"model_class_overrides": {"LlamaForCausalLM": "my_pkg.model:MyLlama"}}, "|mc="),
])
def test_settings_that_change_the_kv_are_in_it(tmp_path: Path, extra: dict[str, object],
                                               part: str) -> None:
    mc = NS(model=str(tmp_path), revision=None, hf_overrides=None, quantization=None,
            dtype="float32")
    plain = model_identity(mc, NS(cache_dtype="auto"))
    changed = model_identity(NS(**{**vars(mc), **extra}), NS(cache_dtype="auto"))
    assert part in changed and part not in plain
    assert "|kv=fp8_e5m2/float32" in model_identity(mc, NS(cache_dtype="fp8_e5m2"))
    # both held in uint8 tensors by vLLM: only the format's name tells them apart
    assert (model_identity(mc, NS(cache_dtype="fp8_e4m3"))
            != model_identity(mc, NS(cache_dtype="fp8_e5m2")))


def test_one_kv_format_is_one_name_and_two_formats_are_two(tmp_path: Path) -> None:
    """``fp8`` is vLLM's alias of ``fp8_e4m3``: engines started with either wrote the same
    bytes under two namespaces and shared nothing. And ``fp8_e4m3`` is the platform's e4m3
    type: ROCm's ``float8_e4m3fnuz`` is other bytes than CUDA's ``float8_e4m3fn`` under
    the same name (a mixed fleet sharing a store read each other's). A float cache dtype
    equal to the model's is the model's own KV (``auto``)."""
    mc = NS(model=str(tmp_path), revision=None, hf_overrides=None, quantization=None,
            dtype="torch.bfloat16")

    def ident(cache_dtype: str, fp8: str | None = "float8_e4m3fn") -> str:
        return model_identity(mc, NS(cache_dtype=cache_dtype), fp8_e4m3=fp8)

    assert ident("fp8") == ident("fp8_e4m3") == ident("fp8", None)
    assert ident("fp8_e4m3").endswith("|kv=fp8_e4m3/torch.bfloat16")  # (as before)
    assert ident("fp8", "float8_e4m3fnuz") == ident("fp8_e4m3", "float8_e4m3fnuz")
    assert ident("fp8", "float8_e4m3fnuz") != ident("fp8")
    assert ident("fp8_e5m2", "float8_e4m3fnuz") == ident("fp8_e5m2")  # (one e5m2 everywhere)
    assert ident("bfloat16") == ident("auto") != ident("float16")


def test_a_longrope_model_is_named_by_the_factors_its_length_picks(tmp_path: Path) -> None:
    """vLLM rotates every position of a LongRoPE model (Phi-3 128k, Phi-4-mini) with the
    long factors when max_model_len is past original_max_position_embeddings, else with
    the short ones: engines with --max-model-len 4096 and 32768 made other KV under one
    namespace. Lengths on one side of the bound share it."""
    (tmp_path / "config.json").write_text("{}")

    def with_len(max_len: int, rope: dict[str, object] | None) -> str:
        text = NS(rope_parameters=rope, original_max_position_embeddings=4096)
        return ident(str(tmp_path), hf_text_config=text, max_model_len=max_len)

    longrope = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}
    assert with_len(4096, longrope).endswith("|longrope=short")
    assert with_len(32768, longrope).endswith("|longrope=long")
    assert with_len(2048, longrope) == with_len(4096, longrope)
    # transformers 5 may key the parameters by attention type
    assert with_len(32768, {"full_attention": longrope}).endswith("|longrope=long")
    assert with_len(32768, None) == with_len(4096, None) == ident(str(tmp_path))
    assert with_len(32768, {"rope_type": "yarn", "factor": 4.0}) == ident(str(tmp_path))


def test_the_config_vllm_reads_instead_of_the_models_is_in_it(tmp_path: Path) -> None:
    """``--hf-config-path``: vLLM builds the model from that config (another RoPE, other
    layers), not the model folder's: it is digested too."""
    (tmp_path / "config.json").write_text("{}")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"rope_scaling": {"type": "yarn"}}')
    plain = ident(str(tmp_path))
    with_cfg = ident(str(tmp_path), hf_config_path=str(other))
    assert with_cfg.startswith(plain + "|cfg#") and with_cfg != plain
    (other / "config.json").write_text('{"rope_scaling": {"type": "dynamic"}}')
    assert ident(str(tmp_path), hf_config_path=str(other)) != with_cfg
    assert ident(str(tmp_path), hf_config_path="org/cfg").endswith("|cfg=org/cfg")


def test_weights_loaded_from_elsewhere_are_in_it(tmp_path: Path) -> None:
    """``--model-weights``: the runai_streamer and sharded_state loaders read the weights
    there, ``--model`` gives the config alone: two fine-tunes behind one config folder
    made other KV under one namespace."""
    (tmp_path / "config.json").write_text("{}")
    a = ident(str(tmp_path), model_weights="s3://bucket/finetune-a")
    b = ident(str(tmp_path), model_weights="s3://bucket/finetune-b")
    assert a != b and a.startswith(ident(str(tmp_path)) + "|w=")
    assert ident(str(tmp_path), model_weights="") == ident(str(tmp_path))
    assert ident(str(tmp_path), model_weights=str(tmp_path)) == ident(str(tmp_path))


def test_the_online_quantization_settings_are_in_it(tmp_path: Path) -> None:
    """``--quantization-config``: per-layer-kind schemes and ignored layers of online
    quantization, under one ``--quantization`` name (``online``, ``fp8_per_block``):
    other weights, other KV, once one namespace."""
    (tmp_path / "config.json").write_text("{}")
    from vllm.config.quantization import resolve_quantization_config

    def with_qc(name: str, qc: dict[str, object] | None) -> str:
        mc = NS(model=str(tmp_path), revision=None, hf_overrides=None, quantization=name,
                quantization_config=resolve_quantization_config(name, qc), dtype="float32")
        return model_identity(mc, NS(cache_dtype="auto"))

    per_tensor = with_qc("online", {"linear": "fp8_per_tensor"})
    assert per_tensor != with_qc("online", {"linear": "fp8_per_block"})
    assert with_qc("fp8_per_block", None) != with_qc("fp8_per_block", {"ignore": ["lm_head"]})
    assert per_tensor == with_qc("online", {"linear": "fp8_per_tensor"})  # same: shared
    # a dict (a ModelConfig built by hand) is digested by its keys, in any order
    assert (ident(str(tmp_path), quantization_config={"ignore": ["x"], "linear": None})
            == ident(str(tmp_path), quantization_config={"linear": None, "ignore": ["x"]}))
    assert ident(str(tmp_path), quantization_config=None) == ident(str(tmp_path))


def test_overrides_by_a_function_are_named_by_what_they_made(tmp_path: Path) -> None:
    """``LLM(hf_overrides=fn)``: every lambda is ``__main__.<lambda>``, so scripts that
    scaled RoPE by 2 and by 4 shared a namespace; the config the function made is
    digested (without the fields that name a machine's path or a library version)."""
    (tmp_path / "config.json").write_text("{}")

    def with_fn(factor: float, path: str = "/m") -> str:
        made = {"rope_scaling": {"factor": factor}, "_name_or_path": path,
                "transformers_version": path}
        mc = NS(model=str(tmp_path), revision=None, hf_overrides=lambda c: c,
                hf_config=NS(to_dict=lambda: made), quantization=None, dtype="float32")
        return model_identity(mc, NS(cache_dtype="auto"))

    assert with_fn(2.0) != with_fn(4.0)
    assert with_fn(2.0) == with_fn(2.0, path="/elsewhere")
