"""CupyBackend against the reference oracle, and its stream/event semantics (GPU only).

The same properties run without a GPU against the stream-faithful fake
(``test_cupy_logic.py``, ``test_cupy_streams.py``); here they meet the real kernel,
the real streams and the real driver.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import torch

from tests.kernels.engine_layouts import ENGINE_LAYOUTS, check_round_trip, check_v_own_strides
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
from zkv.kernels import DONE, cuda_available, get_backend
from zkv.kernels.reference import (
    check_pattern,
    expected_block_bytes,
    fill_pattern,
    ref_copy_d2h,
    ref_copy_h2d,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs CUDA (torch and cupy)"),
]

KEYS = [bytes([i]) * 16 for i in range(1, 5)]


@pytest.fixture(scope="module")
def backend() -> Any:
    from zkv.kernels.cupy_backend import CupyBackend

    return CupyBackend(num_events=8)  # small ring: tests also cover wrap-around


def test_auto_picks_cupy() -> None:
    assert get_backend("auto").name == "cupy"


def test_allocations_live_where_they_should(backend: Any) -> None:
    lay = layout()
    host = backend.allocate_host_pool(lay)
    kv = backend.allocate_device_cache(lay)
    assert host.is_pinned() and host.is_contiguous() and not host.any()
    assert host.untyped_storage().nbytes() == lay.num_host_blocks * lay.block_bytes  # exact
    assert all(t.is_cuda and not t.any() for pair in kv for t in pair)
    info = backend.startup_info()
    assert info["host_pool_ready_ms"] > 0 and info["kernel_compile_ms"] > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_d2h_matches_oracle(backend: Any, dtype: str) -> None:
    lay = layout(dtype, num_device_blocks=40, num_host_blocks=30)
    kv, host = random_caches(backend, lay, seed=1)
    want = host.clone()
    rng = np.random.default_rng(1)
    for n in (1, 7, 30):
        src, dst = pick(rng, lay.num_device_blocks, n), pick(rng, lay.num_host_blocks, n)
        backend.copy_d2h(kv, host, src, dst)
        ref_copy_d2h(kv, want, src, dst)
    backend.synchronize()
    assert as_bytes(host) == as_bytes(want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_h2d_matches_oracle(backend: Any, dtype: str) -> None:
    lay = layout(dtype, num_device_blocks=40, num_host_blocks=30)
    kv, host = random_caches(backend, lay, seed=2)
    want = clone(kv)
    rng = np.random.default_rng(2)
    src, dst = pick(rng, lay.num_host_blocks, 9), pick(rng, lay.num_device_blocks, 9)
    for layer in range(lay.num_layers):
        backend.copy_h2d(host, kv, src, dst, layer)
        ref_copy_h2d(host, want, src, dst, layer)
    backend.synchronize()
    assert same_caches(kv, want)


@pytest.mark.parametrize("ctas", [1, 7, 100_000])
def test_any_thread_block_cap_moves_every_slice(ctas: int) -> None:
    """One thread block looping over every work item, an odd cap, and more thread blocks
    than items: the grid-stride loop covers each slice of each part once."""
    from zkv.kernels.cupy_backend import CupyBackend

    backend = CupyBackend(copy_ctas=ctas)
    # 68 KiB chunks: 4352 vectors in 5 slices of 871 (the last one partial)
    lay = layout("float32", num_layers=2, kv_heads=8, block_size=16, head_dim=136,
                 num_device_blocks=24, num_host_blocks=20)
    kv, host = random_caches(backend, lay, seed=ctas)
    want_host, want_kv = host.clone(), clone(kv)
    rng = np.random.default_rng(ctas)
    src, dst = pick(rng, lay.num_device_blocks, 11), pick(rng, lay.num_host_blocks, 11)
    backend.copy_d2h(kv, host, src, dst)
    ref_copy_d2h(kv, want_host, src, dst)
    back = pick(rng, lay.num_device_blocks, 11)
    for layer in range(lay.num_layers):
        backend.copy_h2d(host, kv, dst, back, layer)
        ref_copy_h2d(want_host, want_kv, dst, back, layer)
    backend.synchronize()
    assert as_bytes(host) == as_bytes(want_host) and same_caches(kv, want_kv)


def test_layer_subset_and_round_trip(backend: Any) -> None:
    lay = layout("bfloat16", num_layers=4, num_device_blocks=20, num_host_blocks=10)
    kv, host = random_caches(backend, lay, seed=3)
    want = host.clone()
    src, mid, back = ids([3, 17, 5, 9]), ids([9, 0, 4, 1]), ids([12, 13, 14, 15])
    backend.copy_d2h(kv, host, src, mid, layers=range(1, 3))
    ref_copy_d2h(kv, want, src, mid, layers=range(1, 3))
    backend.synchronize()
    assert as_bytes(host) == as_bytes(want)

    before = [(as_bytes(k[src.tolist()]), as_bytes(v[src.tolist()])) for k, v in kv]
    backend.copy_d2h(kv, host, src, mid)
    for layer in range(lay.num_layers):
        backend.copy_h2d(host, kv, mid, back, layer)
    backend.synchronize()
    assert [(as_bytes(k[back.tolist()]), as_bytes(v[back.tolist()])) for k, v in kv] == before


def test_odd_geometry_strided_and_misaligned(backend: Any) -> None:
    """105-byte chunks (byte-wide kernel), interleaved K/V blocks, a 1-byte-shifted base."""
    lay = layout("uint8", kv_heads=3, block_size=5, head_dim=7, num_layers=2)
    shape = (lay.num_device_blocks, 3, 5, 7)
    gen = torch.Generator().manual_seed(5)
    joint = torch.randint(
        0, 256, (shape[0], 2, *shape[1:]), dtype=torch.uint8, generator=gen
    ).cuda()
    raw = torch.randint(0, 256, (shape[0] * 210 + 1,), dtype=torch.uint8, generator=gen).cuda()
    shifted = raw[1:].view(2, *shape)
    kv = [(joint[:, 0], joint[:, 1]), (shifted[0], shifted[1])]
    host = backend.allocate_host_pool(lay)
    want = host.clone()
    backend.copy_d2h(kv, host, ids([1, 10, 4]), ids([0, 8, 3]))
    ref_copy_d2h(kv, want, ids([1, 10, 4]), ids([0, 8, 3]))
    backend.synchronize()
    assert as_bytes(host) == as_bytes(want)

    want_kv = clone(kv)
    backend.copy_h2d(host, kv, ids([0, 8, 3]), ids([11, 0, 2]), layer=1)
    ref_copy_h2d(host, want_kv, ids([0, 8, 3]), ids([11, 0, 2]), layer=1)
    backend.synchronize()
    assert same_caches(kv, want_kv)


def test_rejects_unpinned_host_wrong_device_and_bad_ids(backend: Any) -> None:
    lay = layout()
    kv, host = random_caches(backend, lay)
    with pytest.raises(ValueError, match="pinned"):
        backend.copy_d2h(kv, host.clone(), ids([0]), ids([0]))
    with pytest.raises(ValueError, match="backend on cuda"):
        backend.copy_d2h([(k.cpu(), v.cpu()) for k, v in kv], host, ids([0]), ids([0]))
    before = as_bytes(host)
    with pytest.raises(ValueError, match="device block id out of range"):
        backend.copy_d2h(kv, host, ids([0, 12]), ids([0, 1]))
    backend.synchronize()
    assert as_bytes(host) == before


def test_begin_batch_orders_d2h_after_pending_compute(backend: Any) -> None:
    """The compute stream writes a block after a long sleep; a d2h enqueued after
    begin_batch must see the write, not the old bytes."""
    lay = layout("float32", num_layers=1)
    kv = backend.allocate_device_cache(lay)
    host = backend.allocate_host_pool(lay)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # ~tens of ms on the current (compute) stream
    kv[0][0][3].fill_(7.0)
    kv[0][1][3].fill_(-2.0)
    backend.begin_batch()
    backend.copy_d2h(kv, host, ids([3]), ids([5]))
    handle = backend.record_event()
    backend.synchronize_event(handle)
    assert backend.event_done(handle)
    assert bool((host[5, 0, 0] == 7.0).all()) and bool((host[5, 0, 1] == -2.0).all())


def test_wait_event_on_compute_orders_reads_after_h2d(backend: Any) -> None:
    lay = layout("float32", num_layers=2)
    kv = backend.allocate_device_cache(lay)
    host = backend.allocate_host_pool(lay)
    host[2].fill_(3.5)
    backend.begin_batch()
    handles = []
    for layer in range(lay.num_layers):
        backend.copy_h2d(host, kv, ids([2]), ids([6]), layer)
        handles.append(backend.record_event())
    for layer, handle in enumerate(handles):
        backend.wait_event_on_compute(handle)
        seen = kv[layer][1][6].sum()  # runs on the compute stream, after the wait
        assert float(seen) == 3.5 * kv[layer][1][6].numel()


def test_event_ring_wraps_and_stale_handles_stay_safe(backend: Any) -> None:
    first = backend.record_event()
    for _ in range(3 * 8):
        backend.record_event()
    backend.synchronize()
    assert backend.event_done(first)  # answered by a later record of its slot
    backend.synchronize_event(first)
    backend.wait_event_on_compute(first)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="not an event of this backend"):
        backend.event_done(DONE)


def test_fill_check_and_expected_bytes_on_device(backend: Any) -> None:
    lay = layout("bfloat16")
    kv = backend.allocate_device_cache(lay)
    host = backend.allocate_host_pool(lay)
    dev = ids([4, 0, 9, 2])
    fill_pattern(kv, dev, KEYS, rank=2)
    assert check_pattern(kv, dev, KEYS, rank=2) == 4
    torch.cuda.synchronize()  # fill ran on the compute stream
    backend.begin_batch()
    backend.copy_d2h(kv, host, dev, ids([1, 2, 3, 4]))
    backend.synchronize()
    assert bytes(backend.host_block(host, 3)) == expected_block_bytes(lay, KEYS[2], rank=2)
    kv[1][0][9].view(torch.uint8).view(-1)[5] ^= 1
    assert check_pattern(kv, dev, KEYS, rank=2) == 2


@pytest.mark.parametrize("name", sorted(ENGINE_LAYOUTS))
def test_engine_layouts_match_oracle(backend: Any, name: str) -> None:
    check_round_trip(backend, name, seed=7, device="cuda")


def test_v_is_copied_with_its_own_strides(backend: Any) -> None:
    check_v_own_strides(backend, device="cuda")


def test_each_device_gets_its_own_backend() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    from zkv.kernels.cupy_backend import CupyBackend

    b1 = CupyBackend(device=1)
    lay = layout()
    kv = b1.allocate_device_cache(lay)
    assert {t.device for pair in kv for t in pair} == {torch.device("cuda", 1)}
    host = b1.allocate_host_pool(lay)
    b1.copy_d2h(kv, host, ids([1]), ids([1]))
    b1.synchronize()
    with pytest.raises(ValueError, match="backend on cuda:1"):
        b1.copy_d2h([(k.to("cuda:0"), v.to("cuda:0")) for k, v in kv], host, ids([0]), ids([0]))


_FAULT = textwrap.dedent("""
    import sys
    import zkv.kernels.cupy_backend as cb
    from zkv.errors import DeviceFault
    from tests.kernels.helpers import ids, layout

    good = cb.spec_params

    def far_away(spec):  # every device base 64 TiB past its allocation: unmapped
        params = good(spec).copy()
        params[:, :, 0] += 1 << 46
        return params

    b = cb.CupyBackend()
    lay = layout()
    kv = b.allocate_device_cache(lay)
    host = b.allocate_host_pool(lay)
    cb.spec_params = far_away
    try:
        b.copy_h2d(host, kv, ids([0]), ids([1]), 0)
        b.synchronize()
    except DeviceFault as e:
        print("FAULT", e.status)
        try:
            b.record_event()
        except DeviceFault:
            print("STAYS")
        sys.exit(0)
    print("NO FAULT")
    sys.exit(1)
""")


def test_illegal_address_becomes_a_sticky_device_fault() -> None:
    """In a child process: a sticky error ends that process's CUDA context."""
    out = subprocess.run([sys.executable, "-c", _FAULT], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAULT 700" in out.stdout and "STAYS" in out.stdout
