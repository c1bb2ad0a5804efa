"""TorchCpuBackend against the reference oracle, byte for byte."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernels.helpers import (
    DTYPES,
    as_bytes,
    clone,
    ids,
    layout,
    pick,
    random_caches,
    same_caches,
)
from zkv.kernels import DONE, TorchCpuBackend, cpu
from zkv.kernels.cpu import IMPLS, available_impls
from zkv.kernels.layout import describe_kv_caches
from zkv.kernels.reference import ref_copy_d2h, ref_copy_h2d


def _impl_or_skip(impl: str) -> str:
    if impl not in available_impls():
        pytest.skip("C extension zkv.kernels._blockcopy not built (pip install -e . with gcc)")
    return impl


@pytest.fixture(params=IMPLS)
def backend(request: pytest.FixtureRequest) -> TorchCpuBackend:
    """Every test runs with the C extension and with the ctypes memmove fallback."""
    return TorchCpuBackend(impl=_impl_or_skip(request.param))


@pytest.mark.parametrize("dtype", DTYPES)
def test_d2h_matches_oracle(backend: TorchCpuBackend, dtype: str) -> None:
    lay = layout(dtype)
    kv, host = random_caches(backend, lay, seed=1)
    want = host.clone()
    rng = np.random.default_rng(1)
    src, dst = pick(rng, lay.num_device_blocks, 7), pick(rng, lay.num_host_blocks, 7)

    backend.copy_d2h(kv, host, src, dst)
    ref_copy_d2h(kv, want, src, dst)

    assert as_bytes(host) == as_bytes(want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_h2d_matches_oracle(backend: TorchCpuBackend, dtype: str) -> None:
    lay = layout(dtype)
    kv, host = random_caches(backend, lay, seed=2)
    want = clone(kv)
    rng = np.random.default_rng(2)
    src, dst = pick(rng, lay.num_host_blocks, 5), pick(rng, lay.num_device_blocks, 5)

    backend.copy_h2d(host, kv, src, dst, layer=1)
    ref_copy_h2d(host, want, src, dst, layer=1)

    assert same_caches(kv, want)
    # Only layer 1 moved.
    assert as_bytes(kv[0][0]) == as_bytes(want[0][0])


def test_d2h_layer_subset_writes_only_those_layers(backend: TorchCpuBackend) -> None:
    lay = layout(num_layers=4)
    kv, host = random_caches(backend, lay, seed=3)
    want = host.clone()
    src, dst = ids([4, 0, 11]), ids([8, 2, 3])

    backend.copy_d2h(kv, host, src, dst, layers=range(1, 3))
    ref_copy_d2h(kv, want, src, dst, layers=range(1, 3))

    assert as_bytes(host) == as_bytes(want)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_round_trip_is_byte_identical(backend: TorchCpuBackend, dtype: str) -> None:
    lay = layout(dtype, num_layers=2, num_device_blocks=20, num_host_blocks=10)
    kv, host = random_caches(backend, lay, seed=4)
    src, mid, back = ids([3, 17, 5, 9]), ids([9, 0, 4, 1]), ids([12, 13, 14, 15])
    before = [(as_bytes(k[src.tolist()]), as_bytes(v[src.tolist()])) for k, v in kv]

    backend.copy_d2h(kv, host, src, mid)
    for layer in range(lay.num_layers):
        backend.copy_h2d(host, kv, mid, back, layer)

    assert [(as_bytes(k[back.tolist()]), as_bytes(v[back.tolist()])) for k, v in kv] == before


def test_nan_payloads_and_negative_zero_survive(backend: TorchCpuBackend) -> None:
    """The CPU backend moves raw bytes (memcpy): signaling NaNs, NaN payloads,
    -0.0 and denormals (as float64 or as two float32 halves) must come through bit-exact."""
    lay = layout("float32", num_layers=1)
    kv, host = random_caches(backend, lay)
    k, _ = kv[0]
    bits = np.array(
        [
            0x7FF0000000000001,  # float64 signaling NaN
            0xFFF8000000000123,  # float64 quiet NaN with payload
            0x8000000000000000,  # float64 -0.0
            0x000FFFFFFFFFFFFF,  # float64 largest denormal
            0x7F800001FFC00123,  # two float32 NaNs
        ],
        dtype=np.uint64,
    )
    pattern = np.resize(bits, k.numel() // 2).view(np.int64)
    k.view(torch.int64).view(-1).copy_(torch.from_numpy(pattern))
    want = host.clone()

    backend.copy_d2h(kv, host, ids([0, 5]), ids([1, 2]))
    ref_copy_d2h(kv, want, ids([0, 5]), ids([1, 2]))

    assert as_bytes(host) == as_bytes(want)
    assert as_bytes(host[2, 0, 0]) == pattern.tobytes()[: lay.chunk_bytes]


def test_odd_geometry_strided_and_misaligned_caches(backend: TorchCpuBackend) -> None:
    """Chunks of 3*5*7 bytes (no wide element fits), a device cache whose blocks are
    interleaved K/V (stride 2 chunks), and one that starts 1 byte past an allocation."""
    lay = layout("uint8", kv_heads=3, block_size=5, head_dim=7, num_layers=2)
    shape = (lay.num_device_blocks, 3, 5, 7)
    gen = torch.Generator().manual_seed(5)
    joint = torch.randint(
        0, 256, (lay.num_device_blocks, 2, *shape[1:]), dtype=torch.uint8, generator=gen
    )
    raw = torch.randint(
        0, 256, (lay.num_device_blocks * 105 * 2 + 1,), dtype=torch.uint8, generator=gen
    )
    shifted = raw[1:].view(2, *shape)
    kv = [(joint[:, 0], joint[:, 1]), (shifted[0], shifted[1])]
    host = backend.allocate_host_pool(lay)
    want = host.clone()
    src, dst = ids([1, 10, 4]), ids([0, 8, 3])

    backend.copy_d2h(kv, host, src, dst)
    ref_copy_d2h(kv, want, src, dst)
    assert as_bytes(host) == as_bytes(want)

    want_kv = clone(kv)
    backend.copy_h2d(host, kv, dst, ids([11, 0, 2]), layer=0)
    ref_copy_h2d(host, want_kv, dst, ids([11, 0, 2]), layer=0)
    assert same_caches(kv, want_kv)


def test_many_blocks_every_chunk_lands(backend: TorchCpuBackend) -> None:
    lay = layout(num_device_blocks=300, num_host_blocks=300, num_layers=2)
    kv, host = random_caches(backend, lay, seed=6)
    want = host.clone()
    rng = np.random.default_rng(6)
    src, dst = pick(rng, 300, 257), pick(rng, 300, 257)

    backend.copy_d2h(kv, host, src, dst)
    ref_copy_d2h(kv, want, src, dst)

    assert as_bytes(host) == as_bytes(want)


def test_strided_path_when_chunks_are_not_contiguous(
    backend: TorchCpuBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks that are no few dense runs take the strided torch path; it must still be
    exact, here forced on the usual caches."""
    monkeypatch.setattr(cpu, "_block_runs", lambda t: None)
    lay = layout("bfloat16")
    kv, host = random_caches(backend, lay, seed=8)
    want_host, want_kv = host.clone(), clone(kv)
    src, dst, back = ids([4, 0, 11]), ids([8, 2, 3]), ids([1, 5, 0])

    backend.copy_d2h(kv, host, src, dst)
    ref_copy_d2h(kv, want_host, src, dst)
    assert as_bytes(host) == as_bytes(want_host)
    backend.copy_h2d(host, kv, dst, back, layer=2)
    ref_copy_h2d(host, want_kv, dst, back, layer=2)
    assert same_caches(kv, want_kv)


def test_strided_copy_of_transposed_blocks() -> None:
    """Blocks whose bytes are not one run (heads and tokens transposed) copy exactly."""
    gen = torch.Generator().manual_seed(9)
    base = torch.randint(-(2**15), 2**15, (6, 4, 3, 5), dtype=torch.int16, generator=gen)
    src = base.view(torch.float16).transpose(1, 2)  # [6, 3, 4, 5], t[0] not contiguous
    assert not src[0].is_contiguous()
    dst = torch.zeros(7, 3, 4, 5, dtype=torch.float16)
    cpu._copy_strided(src, np.array([5, 0, 2]), dst, np.array([1, 6, 3]))
    for s, d in ((5, 1), (0, 6), (2, 3)):
        assert as_bytes(dst[d]) == as_bytes(src[s])
    assert not dst[[0, 2, 4, 5]].view(torch.int16).any()


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    dtype=st.sampled_from(DTYPES),
    num_layers=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    block_size=st.sampled_from([1, 2, 16]),
    head_dim=st.sampled_from([1, 3, 8, 64]),
    impl=st.sampled_from(available_impls()),
)
def test_random_scattered_copies_match_oracle(
    data: st.DataObject,
    dtype: str,
    num_layers: int,
    kv_heads: int,
    block_size: int,
    head_dim: int,
    impl: str,
) -> None:
    backend = TorchCpuBackend(impl=impl)
    lay = layout(
        dtype, num_layers=num_layers, kv_heads=kv_heads, block_size=block_size, head_dim=head_dim
    )
    kv, host = random_caches(backend, lay, seed=data.draw(st.integers(0, 2**16)))
    n = data.draw(st.integers(0, lay.num_host_blocks))
    src = data.draw(st.lists(st.integers(0, lay.num_device_blocks - 1), min_size=n, max_size=n))
    dst = data.draw(st.permutations(range(lay.num_host_blocks)))[:n]
    layers = data.draw(
        st.sampled_from([None, range(num_layers), range(num_layers - 1, num_layers)])
    )

    want_host = host.clone()
    backend.copy_d2h(kv, host, ids(src), ids(dst), layers=layers)
    ref_copy_d2h(kv, want_host, ids(src), ids(dst), layers=layers)
    assert as_bytes(host) == as_bytes(want_host)

    # Back into distinct device blocks (dst of an h2d must be distinct, src may repeat).
    back = data.draw(st.permutations(range(lay.num_device_blocks)))[:n]
    layer = data.draw(st.integers(0, num_layers - 1))
    want_kv = clone(kv)
    backend.copy_h2d(host, kv, ids(dst), ids(back), layer)
    ref_copy_h2d(host, want_kv, ids(dst), ids(back), layer)
    assert same_caches(kv, want_kv)


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("src", "dst", "match"),
    [
        ([0, 12], [0, 1], r"device block id out of range \[0, 12\): min=0 max=12"),
        ([0, -1], [0, 1], "device block id out of range"),
        ([0, 1], [0, 9], r"host block id out of range \[0, 9\)"),
        ([0, 1], [0], "differ in length: 2 != 1"),
        ([[0, 1]], [[0, 1]], "one-dimensional"),
    ],
)
def test_d2h_rejects_bad_ids_before_writing(
    backend: TorchCpuBackend, src: list[int], dst: list[int], match: str
) -> None:
    lay = layout()
    kv, host = random_caches(backend, lay)
    before = as_bytes(host)

    with pytest.raises(ValueError, match=match):
        backend.copy_d2h(kv, host, np.array(src, dtype=np.int32), np.array(dst, dtype=np.int32))

    assert as_bytes(host) == before


@pytest.mark.parametrize(
    ("src", "dst", "layer", "match"),
    [
        ([9], [0], 0, "host block id out of range"),
        ([0], [12], 0, "device block id out of range"),
        ([0], [1], 3, r"layer 3 out of range \[0, 3\)"),
        ([0], [1], -1, "layer -1 out of range"),
    ],
)
def test_h2d_rejects_bad_ids_before_writing(
    backend: TorchCpuBackend, src: list[int], dst: list[int], layer: int, match: str
) -> None:
    lay = layout()
    kv, host = random_caches(backend, lay)
    before = clone(kv)

    with pytest.raises(ValueError, match=match):
        backend.copy_h2d(host, kv, ids(src), ids(dst), layer)

    assert same_caches(kv, before)


def test_bad_layer_range_and_mismatched_caches_rejected(backend: TorchCpuBackend) -> None:
    lay = layout()
    kv, host = random_caches(backend, lay)
    before = as_bytes(host)
    with pytest.raises(ValueError, match="layer 3 out of range"):
        backend.copy_d2h(kv, host, ids([0]), ids([0]), layers=range(2, 4))
    with pytest.raises(ValueError, match="dtype"):
        backend.copy_d2h([(k.float(), v.float()) for k, v in kv], host, ids([0]), ids([0]))
    with pytest.raises(ValueError, match="host pool must be"):
        backend.copy_d2h(kv[:2], host, ids([0]), ids([0]))
    assert as_bytes(host) == before


def test_device_cache_off_cpu_rejected_before_writing(backend: TorchCpuBackend) -> None:
    """Raw addresses of non-CPU memory must never reach memcpy (meta: no real GPU needed)."""
    lay = layout()
    kv, host = random_caches(backend, lay)
    before = as_bytes(host)
    meta = [(k.to("meta"), v.to("meta")) for k, v in kv]
    with pytest.raises(ValueError, match="device cache on meta"):
        backend.copy_d2h(meta, host, ids([0]), ids([0]))
    with pytest.raises(ValueError, match="device cache on meta"):
        backend.copy_h2d(host, meta, ids([0]), ids([0]), 1)
    assert as_bytes(host) == before


def test_spec_of_memory_the_backend_cannot_address_refused_before_any_copy(
    backend: TorchCpuBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spec described without ``register`` (or registered with another backend, e.g. of
    CUDA tensors) gets the device check too: its raw addresses never reach memcpy. Before,
    a spec skipped it: address 0 of meta tensors segfaulted the memmove loop (a CUDA
    address would in either implementation)."""
    lay = layout()
    kv, host = random_caches(backend, lay)
    meta = [(k.to("meta"), v.to("meta")) for k, v in kv]
    spec = describe_kv_caches(meta, kv_heads=lay.kv_heads, block_size=lay.block_size,
                              head_dim=lay.head_dim)
    before = as_bytes(host)

    def never(*args: object) -> None:
        raise AssertionError("a chunk copy was given addresses of meta memory")

    monkeypatch.setattr(backend, "_copy", never)
    with pytest.raises(ValueError, match="device cache on meta"):
        backend.copy_d2h(spec, host, ids([0]), ids([0]))
    with pytest.raises(ValueError, match="device cache on meta"):
        backend.copy_h2d(host, spec, ids([0]), ids([0]), 1)
    assert as_bytes(host) == before


@pytest.mark.parametrize("bad", [[1.9, 2.2], np.array([2.5]), np.array([True, False]),
                                 torch.tensor([1.0])])
def test_ids_that_are_not_integers_refused_not_truncated(
    backend: TorchCpuBackend, bad: object
) -> None:
    """``2.5`` used to become block 2 and a bool mask blocks 1 and 0: a silent wrong copy."""
    lay = layout()
    kv, host = random_caches(backend, lay)
    before = as_bytes(host)
    n = len(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="src_ids must be integers"):
        backend.copy_d2h(kv, host, bad, ids(list(range(n))))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dst_ids must be integers"):
        backend.copy_h2d(host, kv, ids(list(range(n))), bad, 0)  # type: ignore[arg-type]
    assert as_bytes(host) == before


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint32, np.uint64, ">i4", ">i8"])
def test_ids_of_any_integer_dtype_copy_like_int32(backend: TorchCpuBackend, dtype: str) -> None:
    lay = layout()
    kv, host = random_caches(backend, lay)
    want = host.clone()
    src, dst = np.array([11, 0, 5], dtype=dtype), np.array([8, 0, 3], dtype=dtype)
    backend.copy_d2h(kv, host, src, dst)
    ref_copy_d2h(kv, want, ids([11, 0, 5]), ids([8, 0, 3]))
    assert as_bytes(host) == as_bytes(want)


def test_empty_ids_are_a_no_op(backend: TorchCpuBackend) -> None:
    lay = layout()
    kv, host = random_caches(backend, lay)
    before = as_bytes(host)
    backend.copy_d2h(kv, host, ids([]), ids([]))
    backend.copy_h2d(host, kv, ids([]), ids([]), 0)
    assert as_bytes(host) == before


# ------------------------------------------------------------------ host blocks, events, threads


def test_host_block_is_writable_zero_copy_view(backend: TorchCpuBackend) -> None:
    lay = layout("bfloat16")
    host = backend.allocate_host_pool(lay)
    assert not host.any()

    view = backend.host_block(host, 4)
    assert len(view) == lay.block_bytes and not view.readonly
    view[:] = bytes(range(256)) * (lay.block_bytes // 256) + bytes(lay.block_bytes % 256)

    assert as_bytes(host[4])[:256] == bytes(range(256))
    assert not host[3].view(torch.uint8).any() and not host[5].view(torch.uint8).any()
    with pytest.raises(ValueError, match="host block id 9 out of range"):
        backend.host_block(host, 9)


def test_cpu_events_are_complete_and_ordering_is_a_no_op(backend: TorchCpuBackend) -> None:
    backend.begin_batch()
    handle = backend.record_event()
    assert handle == DONE
    assert backend.event_done(handle)
    backend.wait_event_on_compute(handle)
    backend.synchronize_event(handle)
    backend.synchronize()


def test_concurrent_copies_from_two_threads(backend: TorchCpuBackend) -> None:
    """The backend keeps no per-call state: two threads copying disjoint blocks both land."""
    lay = layout(num_device_blocks=40, num_host_blocks=40)
    kv, host = random_caches(backend, lay, seed=7)
    want = host.clone()
    halves = [(ids(range(20)), ids(range(20, 40))), (ids(range(20, 40)), ids(range(20)))]
    barrier = threading.Barrier(2)
    errors: list[Exception] = []

    def run(src: np.ndarray, dst: np.ndarray) -> None:
        try:
            barrier.wait(timeout=10)
            for _ in range(5):
                backend.copy_d2h(kv, host, src, dst)
        except Exception as e:  # noqa: BLE001 - surfaced in the main thread below
            errors.append(e)

    threads = [threading.Thread(target=run, args=h) for h in halves]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    for src, dst in halves:
        ref_copy_d2h(kv, want, src, dst)
    assert as_bytes(host) == as_bytes(want)


# ------------------------------------------------------------------ implementation choice


def test_default_impl_is_the_extension_when_built(monkeypatch: pytest.MonkeyPatch) -> None:
    if cpu._blockcopy is not None:
        assert TorchCpuBackend().impl == "ext"
    monkeypatch.setattr(cpu, "_blockcopy", None)
    assert available_impls() == ("memmove",)
    assert TorchCpuBackend().impl == "memmove"
    with pytest.raises(ValueError, match="not built"):
        TorchCpuBackend(impl="ext")
    with pytest.raises(ValueError, match="unknown CPU copy impl 'torch'"):
        TorchCpuBackend(impl="torch")


def test_vllm_cpu_layout_kv_interleaved_by_head(backend: TorchCpuBackend) -> None:
    """vLLM's CPU attention cache: one tensor per layer ``[blocks, heads, block, 2*dim]``
    viewed as ``[blocks, heads, 2*block, dim]``; K is ``[:, :, :block]`` and V the rest.
    A block's K is one dense run per head; the copies must match the oracle and leave
    every byte outside the named blocks alone."""
    lay = layout("bfloat16", kv_heads=3, block_size=4, head_dim=8, num_layers=2)
    gen = torch.Generator().manual_seed(11)
    fused = [torch.randint(-(2**15), 2**15, (lay.num_device_blocks, 3, 4, 16),
                           dtype=torch.int16, generator=gen).view(torch.bfloat16)
             for _ in range(2)]
    kv = []
    for t in fused:
        v = t.view(lay.num_device_blocks, 3, 8, 8)
        kv.append((v[:, :, :4], v[:, :, 4:]))
    assert cpu._block_runs(kv[0][0]) == (4 * 8 * 2, [0, 128, 256])  # one run per head
    host = backend.allocate_host_pool(lay)
    want = host.clone()
    src, dst = ids([3, 0, 11]), ids([2, 8, 0])
    backend.copy_d2h(kv, host, src, dst)
    ref_copy_d2h(kv, want, src, dst)
    assert as_bytes(host) == as_bytes(want)

    before = [as_bytes(t) for t in fused]
    want_kv = clone(kv)
    back = ids([5, 1, 9])
    backend.copy_h2d(host, kv, dst, back, layer=1)
    ref_copy_h2d(host, want_kv, dst, back, layer=1)
    assert same_caches(kv, want_kv)
    assert as_bytes(fused[0]) == before[0]  # layer 0 untouched
    changed = fused[1].view(torch.int16).view(lay.num_device_blocks, -1)
    orig = torch.frombuffer(bytearray(before[1]), dtype=torch.int16).view(lay.num_device_blocks, -1)
    diff_blocks = sorted(set((changed != orig).any(dim=1).nonzero().view(-1).tolist()))
    assert set(diff_blocks) <= {5, 1, 9}
