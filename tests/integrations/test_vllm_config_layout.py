"""The vLLM connector's config parsing and KV layout adapters (no engine needed)."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integrations.child import STUB_CONNECTOR, run_child
from zkv.config import CacheLayout, available_memory
from zkv.errors import ConfigError
from zkv.integrations.vllm.config import (
    DEFAULT_HOST_BYTES,
    STORE_URL_ENV,
    check_host_memory,
    default_storage_url,
    failure_policy_advice,
    parse_extra_config,
    parse_size,
    storage_secret_advice,
)
from zkv.integrations.vllm.layout import Geometry, kv_views, split_kv


@pytest.mark.parametrize(("policy", "asynchronous", "says"), [
    ("recompute", False, None),
    ("fail", False, "set kv_load_failure_policy=recompute"),
    ("fail", True, None),
    ("recompute", True, "set kv_load_failure_policy=fail"),
])
def test_failure_policy_advice(policy: str, asynchronous: bool, says: str | None) -> None:
    """Synchronous scheduling recovers a failed load by recompute; under async scheduling
    vLLM 0.32 does not (test_vllm_e2e.py: the engine dies), so ``fail`` is the advice."""
    hint = failure_policy_advice(policy, asynchronous)
    assert hint is None if says is None else says in hint


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STORE_URL_ENV, raising=False)
    cfg = parse_extra_config({})
    assert cfg.policy == "write_through" and cfg.prefetch == "timeout"
    assert cfg.storage is not None and cfg.storage.startswith("file://") and cfg.storage_write
    assert cfg.num_host_blocks(1 << 20) == DEFAULT_HOST_BYTES >> 20
    assert parse_extra_config({"storage": "none"}).storage_write is False
    assert cfg.heartbeat_timeout_s == 30.0
    assert parse_extra_config({"heartbeat_timeout_s": 2.5}).heartbeat_timeout_s == 2.5


@pytest.mark.parametrize("extra, msg", [
    ({"host_blockz": 4}, r"unknown kv_connector_extra_config key\(s\) \['host_blockz'\]"),
    ({"host_blocks": 0}, "host_blocks must be > 0"),
    ({"host_blocks": "8"}, "host_blocks must be an integer"),
    ({"host_blocks": True}, "host_blocks must be an integer"),
    ({"host_blocks": 8, "host_bytes": "1GiB"}, "not both"),
    ({"host_bytes": "lots"}, "host_bytes must be a byte size"),
    ({"host_bytes": -5}, "host_bytes must be > 0"),
    ({"storage": "s3://bucket"}, "storage: .*unknown scheme 's3'"),
    ({"storage": "redis://127.0.0.1:6379/x"}, "storage: .*database must be a number"),
    ({"storage": 7}, "storage must be an L3 URL"),
    ({"policy": "lru"}, "policy must be one of write_back, write_through"),
    ({"prefetch": "eager"}, "prefetch must be one of best_effort, wait_complete, timeout"),
    ({"prefetch_base_ms": -1}, "prefetch_base_ms must be >= 0"),
    ({"layer_timeout_s": 0}, "layer_timeout_s must be > 0"),
    ({"layer_timeout_s": float("nan")}, "layer_timeout_s must be a finite number"),
    ({"prefetch_max_ms": float("inf")}, "prefetch_max_ms must be a finite number"),
    ({"heartbeat_timeout_s": -1}, "heartbeat_timeout_s must be >= 1.0"),
    ({"heartbeat_timeout_s": 1e-9}, "heartbeat_timeout_s must be >= 1.0"),
    ({"storage": ""}, "storage is empty: give an L3 URL, or 'none'"),
    ({"storage": "file:///tmp/a#b"}, "storage: .*'#' starts a fragment"),
    ({"storage": "none", "storage_write": True}, "storage_write is true but storage is none"),
    ({"log_dir": "/dev/null"}, "log_dir: log directory /dev/null: not a directory"),
    ("notadict", "kv_connector_extra_config must be a JSON object of zkv keys, got str"),
    (5, "kv_connector_extra_config must be a JSON object of zkv keys, got int"),
    ({"write_through_threshold": 0}, "write_through_threshold must be >= 1"),
    ({"inject_load_failures": [1, -2]}, "inject_load_failures must be a list of integers"),
    ({"log_level": "loud"}, "log_level must be one of"),
    ({"layer_timeout_s": 1e10}, r"layer_timeout_s must be <= 86400 s, got 1e\+10"),
    ({"heartbeat_timeout_s": 1e6}, r"heartbeat_timeout_s must be <= 86400 s"),
    ({"gate": "maybe"}, "gate must be"),
    ({"metrics_port": "9000"}, "metrics_port must be an integer port"),
    ({"metrics_port": 70000}, "metrics_port must be <= 65535"),
])
def test_bad_values_refused_with_one_line(extra: Any, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg) as e:
        parse_extra_config(extra)
    assert "\n" not in str(e.value) and str(e.value).startswith("zkv: ")



def test_log_levels_as_zkv_log_level_takes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any case and ``warn``, as ``$ZKV_LOG_LEVEL`` takes them (``INFO`` and ``warn`` were
    refused), and ``$ZKV_LOG_LEVEL`` itself when the key is absent (it was ignored)."""
    monkeypatch.delenv("ZKV_LOG_LEVEL", raising=False)
    assert parse_extra_config({}).log_level == "warning"
    assert parse_extra_config({"log_level": "INFO"}).log_level == "info"
    assert parse_extra_config({"log_level": "warn"}).log_level == "warning"
    monkeypatch.setenv("ZKV_LOG_LEVEL", "Debug")
    assert parse_extra_config({}).log_level == "debug"
    assert parse_extra_config({"log_level": "error"}).log_level == "error"  # the key wins
    for name, level in (("critical", "critical"), ("FATAL", "critical")):  # as zkv.log
        monkeypatch.setenv("ZKV_LOG_LEVEL", name)  # takes them (it stopped the engine)
        assert parse_extra_config({}).log_level == level
    monkeypatch.setenv("ZKV_LOG_LEVEL", "verbose")
    with pytest.raises(ConfigError, match="ZKV_LOG_LEVEL must be one of debug"):
        parse_extra_config({})


def test_sizes() -> None:
    assert parse_size("k", "4GiB") == 4 << 30
    assert parse_size("k", "1.5 MB") == 1_500_000
    assert parse_size("k", 4096) == 4096
    assert parse_extra_config({"host_bytes": "1MiB"}).num_host_blocks(4096) == 256
    with pytest.raises(ConfigError, match="holds no block"):
        parse_extra_config({"host_bytes": 100}).num_host_blocks(4096)


GEO = Geometry(num_layers=2, kv_heads=3, block_size=4, head_dim=8, dtype="float32",
               num_blocks=5)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_host_pools_that_do_not_fit_the_machine_are_refused_at_start() -> None:
    """Every rank's pool (they share the machine) against this machine's MemAvailable."""
    free = available_memory()
    assert free is not None  # Linux: /proc/meminfo

    def layout(world_size: int, pool_bytes: int) -> CacheLayout:
        # 32 KiB blocks (4 layers x K/V x 2 heads x 16 tokens x 64 dims x fp16)
        return CacheLayout(4, 2, 16, 64, "float16", num_host_blocks=pool_bytes >> 15,
                           world_size=world_size)

    check_host_memory(layout(2, 64 << 20))  # 128 MiB: fits
    share = int(0.5 * free)  # half the memory for each rank: fits alone, not twice
    check_host_memory(layout(1, share))
    with pytest.raises(ConfigError, match=r"^zkv: the host pools need .* \(2 ranks x \d+ "
                                          r"blocks x 32 KiB\) and .* GiB is available \(pools "
                                          r"may take 80% of it\); lower host_bytes or "
                                          r"host_blocks$"):
        check_host_memory(layout(2, share))
    # two data-parallel engines of one rank each share the machine as two ranks do (each
    # engine checked its own ranks alone: both started, then ran it out of memory)
    check_host_memory(layout(1, share), engines=1)
    with pytest.raises(ConfigError, match=r"\(2 ranks x \d+ blocks x 32 KiB\)"):
        check_host_memory(layout(1, share), engines=2)


def test_cpu_attention_layout_views_alias_vllms_tensor() -> None:
    """vLLM's CPU cache [blocks, heads, block, 2*dim] holds K then V per head as
    [heads, 2*block, dim]; the views must alias exactly those elements."""
    t = torch.arange(5 * 3 * 4 * 16, dtype=torch.float32).view(5, 3, 4, 16)
    k, v, kind = split_kv("layers.0", t, GEO)
    assert kind == "HND" and k.shape == v.shape == (5, 3, 4, 8)
    halves = t.view(5, 3, 8, 8)
    assert torch.equal(k, halves[:, :, :4]) and torch.equal(v, halves[:, :, 4:])
    k[2, 1].fill_(-1)  # writes through to vLLM's tensor
    assert (t.view(5, 3, 8, 8)[2, 1, :4] == -1).all()


def test_flash_attention_layout_is_reinterpreted_nhd() -> None:
    t = torch.randn(2, 5, 4, 3, 8)  # [2, blocks, block, heads, dim]
    k, v, kind = split_kv("l", t, GEO)
    assert kind == "NHD" and k.shape == (5, 3, 4, 8)
    assert _bytes(k[3]) == _bytes(t[0, 3]) and _bytes(v[1]) == _bytes(t[1, 1])


def test_flashinfer_layout() -> None:
    t = torch.randn(5, 2, 4, 3, 8)  # [blocks, 2, block, heads, dim]
    k, v, kind = split_kv("l", t, GEO)
    assert kind == "NHD" and _bytes(k[4]) == _bytes(t[4, 0]) and _bytes(v[0]) == _bytes(t[0, 1])


def test_unknown_layout_refused_naming_the_layer() -> None:
    t = torch.randn(5, 3, 4, 9)
    with pytest.raises(ConfigError, match=r"layer model.layers.7.attn: KV tensor of shape "
                                          r"\(5, 3, 4, 9\)"):
        split_kv("model.layers.7.attn", t, GEO)
    with pytest.raises(ConfigError, match="registered 1 KV layers"):
        kv_views({"a": torch.randn(5, 3, 4, 16)}, GEO)
    with pytest.raises(ConfigError, match="dtype torch.float16, spec says float32"):
        kv_views({"a": torch.randn(5, 3, 4, 16).half(), "b": torch.randn(5, 3, 4, 16)}, GEO)


def _vllm_views(layout_name: str, geo: Geometry) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """vLLM 0.32's per-layer KV tensors for a resolved layout, built by vLLM's own code
    (``create_kv_cache_views``: what a GPU worker hands ``register_kv_caches``), over
    random bytes."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    spec = FullAttentionSpec(geo.block_size, num_kv_heads=geo.kv_heads,
                             head_size=geo.head_dim, dtype=getattr(torch, geo.dtype))
    page, nb, n = spec.page_size_bytes, geo.num_blocks, geo.num_layers
    raw = torch.randint(-128, 128, (n * nb * page,), dtype=torch.int8)
    layer_stride, block_stride = (nb * page, page) if layout.is_layer_compact else (page, n * page)
    tensor = KVCacheTensor(size=n * nb * page, layers=[f"l{i}" for i in range(n)],
                           layer_stride=layer_stride, block_stride=block_stride)
    return raw, create_kv_cache_views(raw, spec, nb, layout, tensor)


@pytest.mark.parametrize("name", ["LBNHC", "LBHNC", "BLNHC", "BLHNC"])
def test_vllm_032_gpu_tensors_move_whole_blocks(name: str) -> None:
    """vLLM 0.32 hands every backend [blocks, heads, block, 2*dim] tensors in the layout
    the engine resolved (flash-attn and Triton: LBNHC; FlashInfer on SM100: LBHNC). On a
    GPU the worker half takes each layer's block as two dense halves and names it HNC /
    NHC, as the scheduler half names it from the resolved layout (the two must agree, or
    the rank is refused). A block moved device -> host -> another device block is the
    same bytes, every layer, both halves. (Before, only 5-D tensors were GPU ones: every
    layout of vLLM 0.32 was refused at registration, or named HND by the worker half and
    NHD by the scheduler's, so the engine could not start.)"""
    pytest.importorskip("vllm")
    from zkv.integrations.vllm.layout import cache_layout, expected_kv_layout
    from zkv.kernels import get_backend
    from zkv.kernels.layout import describe_for_layout
    from zkv.protocol import as_ids

    geo = Geometry(num_layers=3, kv_heads=4, block_size=16, head_dim=8, dtype="float16",
                   num_blocks=6)
    _, tensors = _vllm_views(name, geo)
    names, views, kind = kv_views({f"l{i}": t for i, t in enumerate(tensors)}, geo, cpu=False)
    assert kind == expected_kv_layout(False, name) == ("NHC" if "NH" in name else "HNC")
    for (k, v), t in zip(views, tensors):  # the halves cover each block once
        assert k.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        block = torch.as_strided(t, (t[0].numel(),), (1,), t.storage_offset() + 2 * t.stride(0))
        assert _bytes(torch.cat([k[2].flatten(), v[2].flatten()])) == _bytes(block)
    layout = cache_layout(geo, kv_layout=kind, num_host_blocks=4, world_size=1, model="m")
    assert layout.fingerprint() != cache_layout(geo, kv_layout="HND", num_host_blocks=4,
                                                world_size=1, model="m").fingerprint()
    cpu = get_backend("cpu")
    host = cpu.allocate_host_pool(layout)
    spec = describe_for_layout(views, layout)
    cpu.prepare(spec)
    cpu.copy_d2h(spec, host, as_ids([1, 4]), as_ids([0, 3]))
    for layer in range(geo.num_layers):
        cpu.copy_h2d(host, spec, as_ids([0, 3]), as_ids([2, 5]), layer)
    cpu.synchronize()
    for t in tensors:
        assert _bytes(t[2]) == _bytes(t[1]) and _bytes(t[5]) == _bytes(t[4])
        assert _bytes(t[0]) != _bytes(t[1])  # (random bytes: the copy did it)


@pytest.mark.parametrize("name", ["LBNHC", "LBHNC", "BLNHC", "BLHNC"])
def test_the_kernel_tests_build_vllm_032_tensors_as_vllm_does(name: str) -> None:
    """The CPU, fake-CuPy and GPU copy tests build vLLM 0.32's tensors without vLLM
    (``tests.kernels.engine_layouts.vllm032_views``, so a GPU machine need not have it):
    the same shapes, strides and offsets as vLLM's own ``create_kv_cache_views``."""
    pytest.importorskip("vllm")
    from tests.kernels.engine_layouts import vllm032_views

    geo = Geometry(num_layers=3, kv_heads=4, block_size=16, head_dim=8, dtype="float16",
                   num_blocks=6)
    raw, theirs = _vllm_views(name, geo)
    ours = vllm032_views(name, raw.view(torch.float16), num_layers=3, num_blocks=6,
                         kv_heads=4, block_size=16, head_dim=8)
    assert [(t.shape, t.stride(), t.storage_offset()) for t in ours] == \
        [(t.shape, t.stride(), t.storage_offset()) for t in theirs]
    assert all(_bytes(a) == _bytes(b) for a, b in zip(ours, theirs))


def test_vllm_032_layouts_without_dense_blocks_are_refused() -> None:
    """A layout whose heads are outside the blocks (LHBNC: [heads][blocks][block][C] per
    layer) leaves a block in pieces: refused at registration, naming the way out."""
    h, nb, bs, c = 4, 6, 16, 16
    t = torch.zeros(h, nb, bs, c, dtype=torch.float16).permute(1, 0, 2, 3)
    geo = Geometry(num_layers=1, kv_heads=h, block_size=bs, head_dim=c // 2,
                   dtype="float16", num_blocks=nb)
    with pytest.raises(ConfigError, match=r"layer l0: .*not dense per layer; run vLLM with "
                                          r"VLLM_KV_CACHE_LAYOUT=LBNHC"):
        kv_views({"l0": t}, geo, cpu=False)


def test_vllm_032_cpu_tensors_stay_hnd() -> None:
    """vLLM's CPU attention reads the same LBHNC tensor as K then V per head: the worker
    half keeps HND for it, and the scheduler half says so too."""
    pytest.importorskip("vllm")
    from zkv.integrations.vllm.layout import expected_kv_layout

    _, tensors = _vllm_views("LBHNC", GEO)
    *_, kind = kv_views({f"l{i}": t for i, t in enumerate(tensors)}, GEO)
    assert kind == expected_kv_layout(True, "LBHNC") == "HND"


@pytest.mark.parametrize("name", ["LBNHC", "LBHNC"])
def test_kernel_blocks_smaller_than_the_managers_are_refused_naming_the_block_size(
        name: str) -> None:
    """An attention backend that takes no block of vLLM's ``--block-size`` (32 here) gets
    each manager block split into kernel blocks (16 tokens): vLLM hands the connector
    tensors of 2 x as many blocks of half the tokens (built here by vLLM's own
    ``create_kv_cache_views`` with ``kernel_block_size=16``). zkv names blocks by the
    manager's ids: refused in one line that names the cause and the way out. (Before:
    "matches no known layout for 6 blocks x 4 heads x 32 tokens x 8 dims", which named
    neither.)"""
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    geo = Geometry(num_layers=1, kv_heads=4, block_size=32, head_dim=8, dtype="float16",
                   num_blocks=6)
    spec = FullAttentionSpec(32, num_kv_heads=4, head_size=8, dtype=torch.float16)
    page = spec.page_size_bytes
    raw = torch.zeros(6 * page, dtype=torch.int8)
    tensor = KVCacheTensor(size=6 * page, layers=["l0"], layer_stride=6 * page,
                           block_stride=page)
    (t,) = create_kv_cache_views(raw, spec, 6, KVCacheLayout[name], tensor,
                                 kernel_block_size=16)
    assert tuple(t.shape) == (12, 4, 16, 16)  # 12 kernel blocks of 16 tokens
    want = (r"^zkv: layer l0: KV tensor of shape \(12, 4, 16, 16\) holds 12 blocks of 16 "
            r"tokens, not 6 of 32: vLLM's attention kernel block size \(16\) differs from "
            r"its KV cache manager's block_size \(32, the one zkv was given\), which zkv "
            r"does not support; run vLLM with --block-size 16 \(or an attention backend "
            r"that takes 32-token blocks\)$")
    for cpu in (False, True):
        with pytest.raises(ConfigError, match=want):
            kv_views({"l0": t}, geo, cpu=cpu)


def test_kernel_blocks_of_5d_tensors_are_refused_naming_the_block_size() -> None:
    """The same for the 5-D tensors of vLLMs before 0.32 (flash-attn's
    [2, blocks, block, heads, dim], 4 kernel blocks of 8 tokens per 32-token block); a
    tensor that is no split of a known shape keeps the general message."""
    geo = Geometry(num_layers=1, kv_heads=3, block_size=32, head_dim=8, dtype="float32",
                   num_blocks=5)
    t = torch.zeros(2, 20, 8, 3, 8)
    with pytest.raises(ConfigError, match=r"^zkv: layer l: KV tensor of shape \(2, 20, 8, 3, "
                                          r"8\) holds 20 blocks of 8 tokens, not 5 of 32: "
                                          r".* --block-size 8 "):
        split_kv("l", t, geo)
    with pytest.raises(ConfigError, match="matches no known layout"):
        split_kv("l", torch.zeros(2, 20, 8, 3, 9), geo)


# ---------------------------------------------------------------- the store URL's secret

SECRET_URL = "redis://:S3cret@127.0.0.1:6397/0"


def test_the_store_url_comes_from_the_environment_when_storage_is_absent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM logs its whole extra config at every start: without a ``storage`` key the
    connector takes ``$ZKV_STORE_URL`` (what ``python -m zkv.worker`` reads), so a password
    need not be in that config. Before, the variable was not read: the default store."""
    monkeypatch.setenv(STORE_URL_ENV, SECRET_URL)
    assert parse_extra_config({}).storage == SECRET_URL  # os.environ, as vLLM's processes
    assert parse_extra_config({"policy": "write_back"}).storage_write is True
    env = {STORE_URL_ENV: "rediss://zkv:S3cret@kv.example:6380/1"}
    assert parse_extra_config({}, env).storage == env[STORE_URL_ENV]
    assert parse_extra_config({"storage": "none"}).storage is None  # an explicit key wins
    file = "file:///srv/zkv/l3"
    assert parse_extra_config({"storage": file}).storage == file
    none = parse_extra_config({}, {STORE_URL_ENV: "none"})
    assert none.storage is None and none.storage_write is False
    for unset in ({}, {STORE_URL_ENV: ""}, {STORE_URL_ENV: "  "}):
        assert parse_extra_config({}, unset).storage == default_storage_url()


def test_a_bad_store_url_in_the_environment_is_one_line_without_its_password() -> None:
    with pytest.raises(ConfigError) as bad:
        parse_extra_config({}, {STORE_URL_ENV: "redis://:S3cret@127.0.0.1:6397/x"})
    assert str(bad.value) == ("zkv: ZKV_STORE_URL: bad store URL "
                              "'redis://***@127.0.0.1:6397/x': database must be a number, got 'x'")
    with pytest.raises(ConfigError, match="^zkv: ZKV_STORE_URL: .*unknown scheme 's3'"):
        parse_extra_config({}, {STORE_URL_ENV: "s3://bucket"})
    # (a bad variable is not read when the extra config names the store)
    assert parse_extra_config({"storage": "none"}, {STORE_URL_ENV: "s3://x"}).storage is None


def _parsed_in_a_child() -> tuple[str | None, str | None]:
    cfg = parse_extra_config({})
    return cfg.storage, repr(cfg)


def test_both_halves_resolve_the_same_url_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each half parses the extra config in its own process: the scheduler half in the
    EngineCore, a worker half in each of vLLM's worker processes, which vLLM starts with
    multiprocessing (spawn once CUDA is up) and which inherit the environment. A spawned
    process resolves what this one does."""
    monkeypatch.setenv(STORE_URL_ENV, SECRET_URL)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        storage, shown = pool.apply(_parsed_in_a_child)
    assert storage == parse_extra_config({}).storage == SECRET_URL
    assert "S3cret" not in shown


@pytest.mark.parametrize("url", [
    SECRET_URL,
    "redis://zkv:S3cret@127.0.0.1:6397/0",
    "rediss://zkv:S3cret@kv.example:6380/1?timeout_s=2",
    "redis://:S3cret@[::1]:6397",
])
def test_a_password_in_storage_still_works_and_is_advised_against(url: str) -> None:
    """A ``storage`` with a password keeps working; the start's advice says that vLLM logs
    the extra config and names ``$ZKV_STORE_URL``, showing the URL without the password."""
    assert parse_extra_config({"storage": url}).storage == url
    advice = storage_secret_advice({"storage": url})
    assert advice is not None and "S3cret" not in advice
    assert "***@" in advice and "vLLM logs" in advice and "$ZKV_STORE_URL" in advice


@pytest.mark.parametrize("extra", [
    None, {}, {"host_blocks": 8}, {"storage": "none"}, {"storage": "file:///srv/kv@1/l3"},
    {"storage": "redis://127.0.0.1:6397/0"}, {"storage": "mooncake://127.0.0.1:50051"},
])
def test_a_storage_without_credentials_is_not_advised_against(
        extra: dict[str, Any] | None) -> None:
    assert storage_secret_advice(extra) is None


def test_a_mooncake_url_with_a_password_is_refused_without_showing_it() -> None:
    with pytest.raises(ConfigError, match="takes no user or password") as bad:
        parse_extra_config({"storage": "mooncake://:S3cret@127.0.0.1:50051"})
    assert "S3cret" not in str(bad.value)


def test_the_config_repr_hides_the_store_password() -> None:
    """vLLM or a user may log the parsed config: its ``repr`` shows the store without the
    password (it showed it), the rest as a dataclass's ``repr`` would."""
    shown = repr(parse_extra_config({"storage": SECRET_URL, "host_blocks": 8}))
    assert "S3cret" not in shown
    assert shown.startswith("ZkvVllmConfig(host_blocks=8, host_bytes=None, "
                            "storage='redis://***@127.0.0.1:6397/0', storage_write=True, ")
    assert shown.endswith("inject_load_failures=(), inject_rank=0)")
    assert repr(parse_extra_config({"storage": "none"})).count("storage=None") == 1


_SECRET_CHILD = STUB_CONNECTOR + '''
from zkv.integrations.vllm import connector

def stop(*args, **kwargs):
    raise ConfigError("zkv: stopped after the start's warnings")

connector.open_l3 = lambda *args, **kwargs: None  # (no store server here)
connector.SchedulerHalf = stop  # (no ranks to join)
extra = json.loads(sys.argv[1])
vllm_config = plain_vllm_config()
vllm_config.kv_transfer_config.kv_connector_extra_config = extra
print(json.dumps(start(stub_connector(f"secret-{os.getpid()}", extra, vllm_config))))
'''


def test_the_scheduler_half_warns_once_of_a_password_in_storage(tmp_path: Path) -> None:
    """The scheduler half's start (once per engine; the worker halves say nothing) writes
    one ``connector.secret_in_config`` warning, and no line of its log holds the password.
    (In a child process: importing vLLM here would change this one.)"""
    logs = tmp_path / "logs"
    extra = {"storage": SECRET_URL, "log_dir": str(logs)}
    got = run_child(_SECRET_CHILD.replace("sys.argv[1]", repr(json.dumps(extra))))
    assert got == "zkv: stopped after the start's warnings"
    text = "".join(p.read_text() for p in sorted(logs.iterdir()))
    assert "S3cret" not in text
    events = [json.loads(line) for line in text.splitlines()]
    (warning,) = [e for e in events if e["event"] == "connector.secret_in_config"]
    assert warning["level"] == "warning" and "redis://***@127.0.0.1:6397/0" in warning["hint"]
