"""The connector's worker half follows the stream vLLM's forward runs on (fake CUDA).

vLLM on CUDA registers its KV caches on the stream current then (the default one), and
makes a stream of its own at its first CUDA graph capture, after registration; every
forward runs there. A load released at ``bind`` must start after the work queued on that
stream (the previous forward still reads blocks the load overwrites), so the worker half
takes the model thread's current stream at every ``bind``, before it releases the batch.

Real WorkerHalf, Sidecar, Dispatcher and zmq sockets; the CuPy backend runs against the
stream-faithful fake (``tests/kernels/fake_cuda.py``), where the legacy stream does not
wait for a non-blocking one, as on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.kernels import fake_cuda
from tests.worker.helpers import endpoints, poll_until_done, short_ipc_dir
from zkv import protocol as P
from zkv.config import CacheLayout
from zkv.integrations.vllm.config import parse_extra_config
from zkv.integrations.vllm.records import ZkvMetadata
from zkv.integrations.vllm.worker import WorkerHalf
from zkv.kernels import TorchCpuBackend
from zkv.scheduler.dispatcher import Dispatcher
from zkv.worker import Sidecar

LAYOUT = CacheLayout(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float32",
                     num_device_blocks=8, num_host_blocks=8)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> fake_cuda.FakeCuda:
    f = fake_cuda.FakeCuda(num_devices=1, sm_count=4, sync_timeout_s=10)
    fake_cuda.install(monkeypatch, f)
    return f


@pytest.fixture
def half(fake: Any) -> Iterator[tuple[WorkerHalf, Dispatcher, list[Any]]]:
    """A gated worker half as vLLM's worker starts it, built on the legacy stream."""
    kv = TorchCpuBackend().allocate_device_cache(LAYOUT)
    for layer in kv:
        for t in layer:
            t.fill_(1.0)
    with short_ipc_dir() as folder:
        pub, pull = endpoints(folder)
        d = Dispatcher(pub, pull, 1, LAYOUT.fingerprint())
        w = WorkerHalf(parse_extra_config({"storage": "none"}), 0)
        w.layer_index = {f"l{i}": i for i in range(LAYOUT.num_layers)}
        w.sidecar = Sidecar(kv, layout=LAYOUT, rank=0, pub_endpoint=pub, pull_endpoint=pull,
                            backend=fake_cuda.cupy_backend(), heartbeat_interval_s=0.05,
                            gated=True)
        try:
            d.wait_for_ranks(10)
            yield w, d, kv
        finally:
            w.close()
            d.close()


def test_a_load_starts_after_the_forward_on_the_stream_vllm_moved_to(
        fake: Any, half: tuple[WorkerHalf, Dispatcher, list[Any]]) -> None:
    w, d, kv = half
    model = fake.new_stream()  # vLLM's own stream, made at graph capture: non-blocking
    fake.set_current_stream(model)
    seen: list[torch.Tensor] = []
    # the previous forward, still queued on the model's stream, reads block 4
    fake.enqueue(model, lambda: seen.append(kv[1][0][4].clone()), "forward reads K1[4]")
    w.sidecar.host_pool[0].fill_(2.0)
    seq = d.publish([P.Op(0, P.H2D, P.as_ids([0]), P.as_ids([4]), layerwise=True)], 0)
    w.bind(ZkvMetadata(step=0, release_upto=seq, load_seq=seq, load_op=0, loads=[4]))
    for layer in range(LAYOUT.num_layers):
        w.wait_for_layer_load(f"l{layer}")
    assert poll_until_done(d, seq, 10)[seq].ok
    assert w.load_errors() == set()
    fake.drain_all()
    assert seen and bool((seen[0] == 1.0).all()), \
        "the load overwrote block 4 before the forward queued before it read it"
    assert bool((kv[1][0][4] == 2.0).all()) and bool((kv[0][1][4] == 2.0).all())
