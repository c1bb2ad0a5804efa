"""Scattered block copy bandwidth of the copy backends, as a ratio of a contiguous copy.

    .venv/bin/python bench/transfer.py [--blocks 256] [--layers 32] [--reps 7] ...

For each backend the same bytes move three ways, interleaved rep by rep so that noise
from other processes hits all of them alike:

    contiguous   one ``copy_`` (CPU) / one ``cudaMemcpyAsync`` (GPU) of n*block_bytes
    d2h          ``copy_d2h`` of n random device blocks -> n random host blocks, all layers
    h2d          ``copy_h2d`` layer by layer, n random host blocks -> n random device blocks

and the table shows median GB/s, best GB/s and median / median of the contiguous copy.
CPU rows: each chunk-copy implementation of the torch-CPU backend, in the same process:
``ext`` (the C extension zkv.kernels._blockcopy, when built) and ``memmove`` (the ctypes
fallback). ``--threads 1 2`` repeats the CPU table per torch thread count (that only
changes the contiguous ``copy_``: the backend copies in the calling thread). The CuPy
part runs when CUDA is available. Memory is touched before timing (an untouched calloc
page reads as the shared zero page).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zkv.config import CacheLayout
from zkv.kernels import TorchCpuBackend, cuda_available
from zkv.kernels.base import CopyBackend
from zkv.kernels.cpu import _blockcopy, available_impls
from zkv.kernels.reference import ref_copy_d2h


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--blocks", type=int, default=256, help="blocks moved per copy")
    p.add_argument("--device-blocks", type=int, default=512)
    p.add_argument("--host-blocks", type=int, default=384)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-oracle", action="store_true", help="skip the per-block Python loop row")
    p.add_argument("--cpu-only", action="store_true")
    p.add_argument(
        "--threads",
        type=int,
        nargs="*",
        default=None,
        help="torch intra-op thread counts to run the CPU table with (default: torch's)",
    )
    return p.parse_args(argv)


class Table:
    def __init__(self, title: str, nbytes: int) -> None:
        self.title = title
        self.nbytes = nbytes
        self.times: dict[str, list[float]] = {}

    def add(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds)

    def gbps(self, name: str, pick: Callable[[list[float]], float]) -> float:
        return self.nbytes / pick(self.times[name]) / 1e9

    def print(self, baseline: str) -> None:
        base = self.gbps(baseline, statistics.median)
        print(f"\n{self.title}  ({self.nbytes / 2**20:.0f} MiB per copy)")
        print(f"  {'copy':<40}{'median GB/s':>12}{'best GB/s':>12}{'vs contiguous':>15}")
        for name in self.times:
            med = self.gbps(name, statistics.median)
            best = self.gbps(name, min)
            print(f"  {name:<40}{med:>12.2f}{best:>12.2f}{med / base:>14.2f}x")


def touch(t: torch.Tensor, gen: torch.Generator) -> None:
    """Fault every page in and write non-trivial bytes (cheap: one small random row tiled)."""
    u8 = t.view(torch.uint8).view(-1)
    row = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=gen).to(t.device)
    full = u8.numel() // row.numel()
    u8[: full * row.numel()].view(full, -1).copy_(row.expand(full, -1))
    u8[full * row.numel() :].fill_(7)


def setup(backend: CopyBackend, lay: CacheLayout, seed: int):
    gen = torch.Generator().manual_seed(seed)
    kv = backend.allocate_device_cache(lay)
    host = backend.allocate_host_pool(lay)
    for k, v in kv:
        touch(k, gen)
        touch(v, gen)
    touch(host, gen)
    return kv, host


def bench_cpu(args: argparse.Namespace, lay: CacheLayout, n: int) -> None:
    backends = {impl: TorchCpuBackend(impl=impl) for impl in available_impls()}
    kv, host = setup(backends[available_impls()[0]], lay, args.seed)
    rng = np.random.default_rng(args.seed)
    src = rng.choice(lay.num_device_blocks, n, replace=False).astype("<i4")
    dst = rng.choice(lay.num_host_blocks, n, replace=False).astype("<i4")
    nbytes = n * lay.block_bytes
    a = torch.empty(nbytes, dtype=torch.uint8)
    b = torch.empty(nbytes, dtype=torch.uint8)
    touch(a, torch.Generator().manual_seed(1))
    touch(b, torch.Generator().manual_seed(2))

    def d2h(be: TorchCpuBackend) -> Callable[[], None]:
        return lambda: be.copy_d2h(kv, host, src, dst)

    def h2d(be: TorchCpuBackend) -> Callable[[], None]:
        def run() -> None:
            for layer in range(lay.num_layers):
                be.copy_h2d(host, kv, dst, src, layer)

        return run

    runs: dict[str, Callable[[], object]] = {"contiguous torch copy_": lambda: b.copy_(a)}
    if "ext" in backends:
        # The same bytes as one memcpy in the calling thread: the backend's own ceiling.
        zero = np.zeros(1, dtype=np.int64)
        args1 = (a.data_ptr(), 0, b.data_ptr(), 0, nbytes, zero.ctypes.data, zero.ctypes.data, 1)
        runs["contiguous memcpy (1 thread)"] = lambda: _blockcopy.copy_chunks(*args1)
    for impl, be in backends.items():
        runs[f"cpu d2h {impl} ({n} scattered blocks)"] = d2h(be)
        runs[f"cpu h2d {impl} ({n} scattered blocks)"] = h2d(be)
    if "ext" not in backends:
        print("\nnote: C extension zkv.kernels._blockcopy not built; only the memmove fallback")
    table = Table(
        f"torch-CPU backend, {torch.get_num_threads()} threads: {lay.num_layers} layers x "
        f"{lay.kv_heads} heads x {lay.block_size} tokens x {lay.head_dim} dim {lay.dtype}, "
        f"chunk {lay.chunk_bytes // 1024} KiB",
        nbytes,
    )
    for fn in runs.values():  # warm-up: allocator, page tables
        fn()
    for _ in range(args.reps):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            table.add(name, time.perf_counter() - t0)
    if not args.no_oracle:
        t0 = time.perf_counter()
        ref_copy_d2h(kv, host, src, dst)
        table.add("oracle d2h (Python loop per block)", time.perf_counter() - t0)
    # Spot check: each implementation's d2h moves the right bytes into a cleared block.
    j = n // 2
    want = b"".join(
        t[int(src[j])].contiguous().view(torch.uint8).numpy().tobytes() for pair in kv for t in pair
    )
    for impl, be in backends.items():
        host[int(dst[j])].zero_()
        be.copy_d2h(kv, host, src, dst)
        assert bytes(be.host_block(host, int(dst[j]))) == want, f"{impl}: d2h moved wrong bytes"
    table.print("contiguous torch copy_")


def bench_cupy(args: argparse.Namespace, lay: CacheLayout, n: int) -> None:
    import cupy as cp

    from zkv.kernels.cupy_backend import CupyBackend

    backend = CupyBackend()
    kv, host = setup(backend, lay, args.seed)
    rng = np.random.default_rng(args.seed)
    src = rng.choice(lay.num_device_blocks, n, replace=False).astype("<i4")
    dst = rng.choice(lay.num_host_blocks, n, replace=False).astype("<i4")
    nbytes = n * lay.block_bytes
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=backend.device)
    host_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    touch(dev_buf, torch.Generator().manual_seed(1))
    touch(host_buf, torch.Generator().manual_seed(2))
    stream = cp.cuda.Stream(non_blocking=True)
    rt = cp.cuda.runtime

    def memcpy(kind: int) -> Callable[[], None]:
        dst_ptr, src_ptr = (
            (host_buf.data_ptr(), dev_buf.data_ptr())
            if kind == rt.memcpyDeviceToHost
            else (dev_buf.data_ptr(), host_buf.data_ptr())
        )

        def run() -> None:
            rt.memcpyAsync(dst_ptr, src_ptr, nbytes, kind, stream.ptr)
            stream.synchronize()

        return run

    def d2h() -> None:
        backend.copy_d2h(kv, host, src, dst)
        backend.synchronize()

    def h2d() -> None:
        for layer in range(lay.num_layers):
            backend.copy_h2d(host, kv, dst, src, layer)
        backend.synchronize()

    torch.cuda.synchronize()
    for direction, base, fn in (
        ("d2h", memcpy(rt.memcpyDeviceToHost), d2h),
        ("h2d", memcpy(rt.memcpyHostToDevice), h2d),
    ):
        table = Table(f"CuPy backend {direction} on {torch.cuda.get_device_name()}", nbytes)
        runs = {
            f"contiguous cudaMemcpyAsync {direction}": base,
            f"cupy {direction} ({n} scattered blocks)": fn,
        }
        for run in runs.values():
            run()
        for _ in range(args.reps):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                table.add(name, time.perf_counter() - t0)
        table.print(f"contiguous cudaMemcpyAsync {direction}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    lay = CacheLayout(
        num_layers=args.layers,
        kv_heads=args.kv_heads,
        block_size=args.block_size,
        head_dim=args.head_dim,
        dtype=args.dtype,
        num_device_blocks=args.device_blocks,
        num_host_blocks=args.host_blocks,
    )
    n = min(args.blocks, lay.num_device_blocks, lay.num_host_blocks)
    t0 = time.perf_counter()
    for threads in args.threads or [torch.get_num_threads()]:
        # The benchmark is its own process: it may choose the thread count; the library never does.
        torch.set_num_threads(threads)
        bench_cpu(args, lay, n)
    if not args.cpu_only and cuda_available():
        bench_cupy(args, lay, n)
    elif not args.cpu_only:
        print("\nCuPy backend: skipped (no CUDA on this machine)")
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
