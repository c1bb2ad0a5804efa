"""Choosing a backend at runtime, and what importing zkv.kernels may pull in."""

from __future__ import annotations

import subprocess
import sys

import pytest

from zkv.errors import ConfigError
from zkv.kernels import TorchCpuBackend, cuda_available, get_backend


def test_cpu_names() -> None:
    for name in ("cpu", "torch", "torch-cpu"):
        assert isinstance(get_backend(name), TorchCpuBackend)


def test_auto_follows_cuda_availability() -> None:
    assert get_backend("auto").name == ("cupy" if cuda_available() else "cpu")


@pytest.mark.skipif(cuda_available(), reason="only meaningful without CUDA")
def test_cupy_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="'cupy' needs CUDA"):
        get_backend("cupy")


def test_unknown_name_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown copy backend 'gpu'"):
        get_backend("gpu")


def test_import_is_lazy_and_pure() -> None:
    """Importing every kernels module loads no cupy, no sockets, no scheduler or worker."""
    code = (
        "import sys, zkv.kernels, zkv.kernels.cupy_backend, zkv.kernels.reference\n"
        "bad = [m for m in ('cupy', 'zmq', 'zkv.scheduler', 'zkv.worker') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
