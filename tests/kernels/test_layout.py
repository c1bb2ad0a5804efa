"""KV layouts described, not assumed: zkv.kernels.layout, and the CPU backend on each."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.engine_layouts import ENGINE_LAYOUTS, check_round_trip, engine_caches
from tests.kernels.helpers import as_bytes, ids, layout
from zkv.errors import ConfigError
from zkv.kernels import TorchCpuBackend
from zkv.kernels.cpu import available_impls
from zkv.kernels.layout import (
    block_runs,
    describe_for_layout,
    describe_kv_caches,
    host_chunk_offset,
    host_pool_shape,
)
from zkv.kernels.reference import check_pattern, expected_block_bytes, fill_pattern

GEO = {"kv_heads": 2, "block_size": 4, "head_dim": 8}


def _t(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float16)


@pytest.mark.parametrize("name", sorted(ENGINE_LAYOUTS))
@pytest.mark.parametrize("impl", available_impls())
def test_cpu_backend_round_trips_every_engine_layout(name: str, impl: str) -> None:
    check_round_trip(TorchCpuBackend(impl=impl), name, seed=3)


@pytest.mark.parametrize("name", sorted(ENGINE_LAYOUTS))
def test_host_bytes_do_not_depend_on_the_device_layout(name: str) -> None:
    """The pattern written through any layout lands as the same page-first host block."""
    lay, caches, _ = engine_caches(name, seed=4)
    backend = TorchCpuBackend()
    host = backend.allocate_host_pool(lay)
    spec = backend.register(caches, host)
    keys = [bytes([7]) * 16, bytes([9]) * 16]
    fill_pattern(spec, ids([6, 2]), keys, rank=1)
    assert check_pattern(spec, ids([6, 2]), keys, rank=1) == 2
    backend.copy_d2h(spec, host, ids([6, 2]), ids([0, 3]))
    assert bytes(backend.host_block(host, 3)) == expected_block_bytes(lay, keys[1], rank=1)


def test_kinds_views_and_runs() -> None:
    lay, nhd, _ = engine_caches("nhd_pairs")
    spec = describe_for_layout(nhd, lay)
    assert spec.kind == "NHD" and spec[0][0].shape == (12, 2, 4, 8)
    assert spec[0][0].data_ptr() == nhd[0][0].data_ptr()  # a view, never a copy
    assert block_runs(spec[0][0]).num_runs == 8 and block_runs(spec[0][0]).run_bytes == 16
    lay, cpu, _ = engine_caches("vllm_cpu")
    runs = block_runs(describe_for_layout(cpu, lay)[1][1])
    assert runs.run_bytes == 64 and runs.offsets().tolist() == [0, 128]  # one run per head
    assert describe_for_layout(*reversed(engine_caches("mla_latent")[:2])).kind == "latent"
    assert host_pool_shape(lay) == (9, 3, 2, 2, 4, 8) and host_chunk_offset(2, 1, 2, 64) == 320


def test_nhd_only_when_it_cannot_be_hnd_or_when_asked() -> None:
    square = [(_t(5, 4, 4, 8), _t(5, 4, 4, 8))]  # heads == block_size: both orders fit
    geo = {"kv_heads": 4, "block_size": 4, "head_dim": 8}
    assert describe_kv_caches(square, **geo).kind == "HND"
    spec = describe_kv_caches(square, **geo, kv_order="NHD")
    assert spec.kind == "NHD" and spec[0][0].stride() == (128, 8, 32, 1)
    with pytest.raises(ConfigError, match="kv_order must be one of"):
        describe_kv_caches(square, **geo, kv_order="HDN")
    with pytest.raises(ConfigError, match=r"does not fit as kv_order=HND"):
        describe_kv_caches([(_t(5, 4, 2, 8), _t(5, 4, 2, 8))], **GEO, kv_order="HND")


@pytest.mark.parametrize(("caches", "match"), [
    ([], "kv_caches is empty"),
    (_t(2, 3), "one entry per layer"),
    ([(_t(5, 2, 4, 8),) * 3], r"layer 0: expected a \(K, V\) pair"),
    ([(_t(5, 2, 4, 8), _t(5, 2, 4, 9))], r"layer 0 V: shape \(5, 2, 4, 9\) does not fit"),
    ([(_t(5, 2, 4, 8), _t(5, 2, 4, 8)), (_t(5, 2, 4, 8), _t(6, 2, 4, 8))],
     "layer 1 V: 6 blocks, layer 0 has 5"),
    ([(_t(5, 2, 4, 8), _t(5, 2, 4, 8).float())], r"layer 0 V: dtype torch.float32"),
    ([(_t(5, 2, 4, 8), _t(5, 2, 4, 8).to("meta"))], "layer 0 V: on meta, layer 0 on cpu"),
    ([(_t(5, 2, 4, 8), _t(2, 4, 8))], r"layer 0 V: 3-D tensor"),
    ([_t(3, 5, 4, 2, 8)], "no K/V axis"),
    ([_t(2, 2, 4, 2, 8)], "ambiguous"),
    ([(_t(5, 2, 4, 8), _t(5, 2, 4, 8)), _t(5, 4, 8)], r"layer 1 latent: latent shape"),
    ([(_t(1, 2, 4, 8).expand(5, 2, 4, 8), _t(5, 2, 4, 8))], "layer 0 K: stride 0"),
    ([(_t(5, 2, 4, 8).as_strided((5, 2, 4, 8), (64, 32, 4, 1)), _t(5, 2, 4, 8))],
     "layer 0 K: elements of a block overlap"),
    ([(_t(5, 2, 4, 8).as_strided((5, 2, 4, 8), (64, 16, 8, 1)), _t(5, 2, 4, 8))],
     "layer 0 K: elements of a block overlap"),
    ([(_t(5, 2, 4, 8).as_strided((5, 2, 4, 8), (40, 32, 8, 1)), _t(5, 2, 4, 8))],
     "layer 0 K: block stride 40 elements is shorter than a block"),
])
def test_registration_errors_name_the_tensor_and_the_check(caches: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        describe_kv_caches(caches, **GEO)


def test_same_memory_names_and_parts_mismatch() -> None:
    k = _t(5, 2, 4, 8)
    with pytest.raises(ConfigError, match=r"layer 0 \(model.layers.0.attn\): K and V are the "
                                          "same memory"):
        describe_kv_caches([(k, k)], **GEO, names=["model.layers.0.attn"])
    with pytest.raises(ConfigError, match="2 layer names for 1 layers"):
        describe_kv_caches([(k, _t(5, 2, 4, 8))], **GEO, names=["a", "b"])
    with pytest.raises(ConfigError, match=r"every layer must have 2 part\(s\) \(K and V\)"):
        describe_kv_caches([_t(5, 4, 8)], **{**GEO, "kv_heads": 1}, num_kv_parts=2)
    lay = layout(num_layers=2)
    with pytest.raises(ConfigError, match="kv_caches has 1 layers, layout has 2"):
        describe_for_layout([(k, _t(5, 2, 4, 8))], lay)


def test_register_checks_the_host_pool_and_the_device() -> None:
    backend = TorchCpuBackend()
    lay, caches, _ = engine_caches("flash_attn_fused")
    host = backend.allocate_host_pool(lay)
    with pytest.raises(ValueError, match="host pool must be"):
        backend.register(caches[:2], host)
    with pytest.raises(ValueError, match=r"layer 0 K \(fused, K/V axis 0\): dtype torch.float16, "
                                         "expected torch.float32"):
        backend.register(caches, host.float())
    meta = [t.to("meta") for t in caches]
    with pytest.raises(ValueError, match=r"layer 0 K \(fused, K/V axis 0\): device cache on meta"):
        backend.register(meta, host)
    spec = backend.register(caches, host)
    assert backend.register(spec, host) is spec  # a spec re-checked, not re-described


@pytest.mark.parametrize("name", ["nhd_pairs", "flash_attn_fused", "flashinfer_nhd"])
def test_nhd_host_layout_keeps_the_engine_bytes(name: str) -> None:
    """kv_layout NHD: a host chunk is the engine's block bytes as they are, one dense run."""
    lay, caches, owners = engine_caches(name, seed=6)
    lay = dataclasses.replace(lay, kv_layout="NHD")
    backend = TorchCpuBackend()
    host = backend.allocate_host_pool(lay)
    spec = backend.register(describe_for_layout(caches, lay), host)
    assert block_runs(spec[1][1]).num_runs == 1  # no transpose: one memcpy per block
    backend.copy_d2h(spec, host, ids([4]), ids([2]))
    k, v = (owners[1][0], owners[1][1]) if name != "flashinfer_nhd" else (
        owners[1][:, 0], owners[1][:, 1])
    assert as_bytes(host[2, 1, 0]) == as_bytes(k[4]) and as_bytes(host[2, 1, 1]) == as_bytes(v[4])
    hnd = describe_for_layout(caches, dataclasses.replace(lay, kv_layout="HND"))
    assert as_bytes(hnd[1][0][4]) != as_bytes(k[4])  # the HND host order transposes


def test_a_spec_for_the_other_host_order_is_refused_by_the_layout() -> None:
    """A spec's views fix the byte order of the host blocks. One described for HND (the
    default) and handed to an NHD layout (the actor's ``describe_for_layout``) used to be
    returned as is: HND bytes in a pool whose fingerprint says NHD, which another instance
    reads back from L3 transposed."""
    lay, caches, _ = engine_caches("nhd_pairs", seed=7)
    nhd = dataclasses.replace(lay, kv_layout="NHD")
    backend = TorchCpuBackend()
    host = backend.allocate_host_pool(nhd)
    spec = backend.register(caches, host)  # described for HND host blocks
    with pytest.raises(ConfigError, match="described for HND host blocks, .* wants NHD"):
        describe_for_layout(spec, nhd)
    assert spec.host_order == "HND" and describe_for_layout(spec, lay) is spec
    good = describe_for_layout(caches, nhd)
    assert good.host_order == "NHD" and describe_for_layout(good, nhd) is good
    assert backend.register(good, host) is good  # a copy's re-check states no order


def test_nhd_host_layout_refuses_blocks_that_are_not_dense() -> None:
    t = _t(5, 4, 3, 8)[:, :, :2]  # NHD, 2 of 3 heads: [block, heads] cannot be regrouped
    with pytest.raises(ConfigError, match=r"layer 0 K: NHD blocks with strides .* not dense"):
        describe_kv_caches([(t, t.clone())], **GEO, host_order="NHD")
    assert describe_kv_caches([(t, t.clone())], **GEO).kind == "NHD"  # HND host: transposed
