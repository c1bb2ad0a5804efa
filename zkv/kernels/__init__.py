"""Block copy backends (torch-CPU, CuPy) and a slow reference oracle.

Pure: tensors and index arrays in, nothing else (no sockets, no scheduler). Pick a
backend at runtime::

    backend = get_backend(device=local_rank)   # "auto": cupy when CUDA works, else torch-CPU
    host_pool = backend.allocate_host_pool(layout)   # pinned, exact size (GPU)
    spec = backend.register(kv_caches, host_pool)    # engine layouts validated once
    backend.begin_batch(compute_stream)
    backend.copy_d2h(spec, host_pool, src_ids, dst_ids)
    for layer in range(layout.num_layers):
        backend.copy_h2d(host_pool, spec, host_ids, dev_ids, layer)
        events[layer] = backend.record_event()   # model: wait_event_on_compute(events[i])

Modules: ``layout`` (device layouts described, the host format defined), ``base`` (the
interface), ``cpu`` / ``cupy_backend`` (the backends), ``pinned`` (exact-size pinned host
memory), ``reference`` (the oracle and the simulated forward).

Importing this package never imports cupy or touches a GPU.
"""

from __future__ import annotations

from zkv.config import CPU_BACKENDS, check_backend_name
from zkv.errors import ConfigError
from zkv.kernels.base import DONE, CopyBackend, EventHandle
from zkv.kernels.cpu import TorchCpuBackend
from zkv.kernels.layout import KVSpec, describe_kv_caches

__all__ = [
    "DONE", "CopyBackend", "EventHandle", "KVSpec", "TorchCpuBackend", "cuda_available",
    "describe_kv_caches", "get_backend",
]


def cuda_available() -> bool:
    """True when both torch and cupy can use a CUDA device (cupy imported only then)."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except (ImportError, OSError, RuntimeError):  # a broken cupy install: no GPU backend
        return False


def get_backend(name: str = "auto", *, device: int | None = None) -> CopyBackend:
    """``"auto"`` (cupy if :func:`cuda_available`, else cpu), ``"cupy"`` or ``"cpu"``."""
    if name == "auto":
        name = "cupy" if cuda_available() else "cpu"
    check_backend_name(name)
    if name in CPU_BACKENDS:
        return TorchCpuBackend()
    if name == "cupy":
        if not cuda_available():
            raise ConfigError(
                "copy backend 'cupy' needs CUDA, but torch or cupy sees no GPU; use 'cpu' or 'auto'"
            )
        from zkv.kernels.cupy_backend import CupyBackend

        return CupyBackend(device=device)
    raise AssertionError(name)  # (every name is checked above)
