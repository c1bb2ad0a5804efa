"""Scattered block copy bandwidth of the copy backends, as a ratio of a contiguous copy.

    .venv/bin/python bench/transfer.py [--blocks 256] [--layers 32] [--reps 7] ...

For each backend the same bytes move three ways, interleaved rep by rep so that noise
from other processes hits all of them alike:

    contiguous   one ``copy_`` (CPU) / one ``cudaMemcpyAsync`` (GPU) of n*block_bytes
    d2h          ``copy_d2h`` of n random device blocks -> n random host blocks, all layers
    h2d          ``copy_h2d`` layer by layer, n random host blocks -> n random device blocks

and the table shows median GB/s, best GB/s and median / median of the contiguous copy
(goal on GPU: >= 0.9x of one contiguous pinned cudaMemcpyAsync of the same bytes).
CPU rows: each chunk-copy implementation of the torch-CPU backend, in the same process:
``ext`` (the C extension zkv.kernels._blockcopy, when built) and ``memmove`` (the ctypes
fallback). ``--threads 1 2`` repeats the CPU table per torch thread count (that only
changes the contiguous ``copy_``: the backend copies in the calling thread).

The CuPy part runs when CUDA is available: the pinned pool's time to ready (mmap +
cudaHostRegister vs torch ``pin_memory``), the copies with an HND cache, with vLLM
flash-attn's NHD views (before 0.32) and with vLLM 0.32's LBNHC tensors (NHC: each block's
two dense halves), and the layer-wise load: time to the first layer ready vs the
full load, and a per-layer matmul "forward" that waits layer by layer vs for the whole
load. Memory is touched before timing (an untouched calloc
page reads as the shared zero page).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _args import dtype, nonneg_int, positive_int  # noqa: E402

from zkv.config import CacheLayout
from zkv.kernels import TorchCpuBackend, cuda_available
from zkv.kernels.base import CopyBackend, torch_dtype
from zkv.kernels.cpu import _blockcopy, available_impls
from zkv.kernels.reference import ref_copy_d2h


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=positive_int, default=32)
    p.add_argument("--kv-heads", type=positive_int, default=8)
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--dtype", type=dtype, default="float16")
    p.add_argument("--blocks", type=positive_int, default=256,
                   help="blocks moved per copy (at most the smaller pool's size)")
    p.add_argument("--device-blocks", type=positive_int, default=512)
    p.add_argument("--host-blocks", type=positive_int, default=384)
    p.add_argument("--reps", type=positive_int, default=7)
    p.add_argument("--seed", type=nonneg_int, default=0)
    p.add_argument("--no-oracle", action="store_true", help="skip the per-block Python loop row")
    p.add_argument("--cpu-only", action="store_true")
    p.add_argument("--gpu-only", action="store_true", help="skip the CPU table")
    p.add_argument("--ctas", type=nonneg_int, nargs="*", default=None,
                   help="CuPy: also sweep the copy kernels' thread-block cap over these values "
                        "(bandwidth and layer-wise overlap per cap; 0 = one per SM x 4)")
    p.add_argument("--device", type=nonneg_int, default=0, help="CUDA device of the CuPy part")
    p.add_argument("--compute-dim", type=positive_int, default=4096,
                   help="matmul size of the simulated per-layer forward (layer-wise overlap)")
    p.add_argument(
        "--threads",
        type=positive_int,
        nargs="*",
        default=None,
        help="torch intra-op thread counts to run the CPU table with (default: torch's)",
    )
    args = p.parse_args(argv)
    if args.cpu_only and args.gpu_only:
        p.error("--cpu-only and --gpu-only leave nothing to run")
    if args.blocks > min(args.device_blocks, args.host_blocks):
        p.error(f"--blocks {args.blocks} is more than the smaller pool holds "
                f"({min(args.device_blocks, args.host_blocks)}); raise --device-blocks / "
                f"--host-blocks")
    if args.gpu_only and not cuda_available():
        p.error("--gpu-only needs CUDA, and this machine has none")
    return args


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
    if full:
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

    spec = backends[available_impls()[0]].register(kv, host)  # described once, as the worker does

    def d2h(be: TorchCpuBackend) -> Callable[[], None]:
        return lambda: be.copy_d2h(spec, host, src, dst)

    def h2d(be: TorchCpuBackend) -> Callable[[], None]:
        def run() -> None:
            for layer in range(lay.num_layers):
                be.copy_h2d(host, spec, dst, src, layer)

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
    from zkv.kernels.cupy_backend import CupyBackend

    backend = CupyBackend(device=args.device)
    backend.bind_thread()  # cupy events and torch streams below: on that device
    print(f"\nCuPy backend on {torch.cuda.get_device_name(args.device)}: "
          f"{backend.startup_info()}")
    bench_pinning(backend, lay)
    rng = np.random.default_rng(args.seed)
    src = rng.choice(lay.num_device_blocks, n, replace=False).astype("<i4")
    dst = rng.choice(lay.num_host_blocks, n, replace=False).astype("<i4")
    for order in ("HND", "NHD", "NHC"):
        kv, host = setup(backend, lay, args.seed)
        if order == "NHD":  # vLLM flash-attn: per layer [2, blocks, block, heads, dim]
            kv = [t.view(2, lay.num_device_blocks, lay.block_size, lay.kv_heads, lay.head_dim)
                  for t in _fused(backend, lay)]
        elif order == "NHC":
            kv = _vllm032_lbnhc(backend, lay)
        spec = backend.register(kv, host)
        bench_cupy_copies(args, backend, lay, spec, host, src, dst, order)
        if order == "HND":
            bench_layerwise(args, backend, lay, spec, host, src, dst)
            if args.ctas:
                bench_ctas(args, backend, lay, spec, host, src, dst)


def _fused(backend: CopyBackend, lay: CacheLayout) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(lay.num_layers):
        t = torch.empty(2 * lay.num_device_blocks * lay.chunk_bytes // lay.itemsize,
                        dtype=torch_dtype(lay), device=backend.device)
        touch(t, gen)
        out.append(t)
    return out


def _vllm032_lbnhc(backend: CopyBackend, lay: CacheLayout) -> list[Any]:
    """vLLM 0.32's flash-attn / Triton tensors (LBNHC): per layer [blocks, heads, block,
    2*dim] over [blocks][block][heads][2*dim] memory, as the connector's worker half splits
    them (each block's two dense halves)."""
    from zkv.integrations.vllm.layout import Geometry, split_kv

    geo = Geometry(lay.num_layers, lay.kv_heads, lay.block_size, lay.head_dim, lay.dtype,
                   lay.num_device_blocks)
    shape = (lay.num_device_blocks, lay.block_size, lay.kv_heads, 2 * lay.head_dim)
    out = []
    for i, t in enumerate(_fused(backend, lay)):
        k, v, kind = split_kv(f"l{i}", t.view(shape).permute(0, 2, 1, 3), geo, cpu=False)
        assert kind == "NHC", kind
        out.append((k, v))
    return out


def bench_pinning(backend: CopyBackend, lay: CacheLayout) -> None:
    """Time to a ready pinned pool: mmap + cudaHostRegister vs torch pin_memory."""
    nbytes = lay.num_host_blocks * lay.block_bytes
    t0 = time.perf_counter()
    host = backend.allocate_host_pool(lay)
    ours = time.perf_counter() - t0
    info = backend.startup_info()
    t0 = time.perf_counter()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    theirs = time.perf_counter() - t0
    print(f"\npinned host pool of {nbytes / 2**20:.0f} MiB: mmap+cudaHostRegister "
          f"{ours * 1e3:.1f} ms ({info['host_pool_chunks']} chunks, exact size); "
          f"torch pin_memory {theirs * 1e3:.1f} ms ({ours / theirs:.2f}x)")
    del host, pinned


def bench_cupy_copies(args: argparse.Namespace, backend: Any, lay: CacheLayout, spec: Any,
                      host: torch.Tensor, src: np.ndarray, dst: np.ndarray, order: str) -> None:
    """Scattered blocks vs one contiguous pinned cudaMemcpyAsync of the same bytes."""
    n = len(src)
    nbytes = n * lay.block_bytes
    fns = _copy_fns(args, backend, lay, spec, host, src, dst)
    torch.cuda.synchronize()
    for direction in ("d2h", "h2d"):
        table = Table(f"CuPy {direction}, device cache {order}", nbytes)
        runs = {f"contiguous cudaMemcpyAsync {direction}": fns[f"memcpy {direction}"],
                f"cupy {direction} ({n} scattered blocks, {order})": fns[direction]}
        for run in runs.values():
            run()
        for _ in range(args.reps):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                table.add(name, time.perf_counter() - t0)
        table.print(f"contiguous cudaMemcpyAsync {direction}")


def _copy_fns(args: argparse.Namespace, backend: Any, lay: CacheLayout, spec: Any,
              host: torch.Tensor, src: np.ndarray, dst: np.ndarray
              ) -> dict[str, Callable[[], None]]:
    """Each direction two ways, each run to completion: ``memcpy d2h`` / ``memcpy h2d``, one
    contiguous pinned cudaMemcpyAsync of the bytes of ``src``'s blocks, and ``d2h`` /
    ``h2d``, the backend's scattered copies of those blocks (h2d layer by layer)."""
    import cupy as cp

    from zkv.kernels.pinned import pinned_empty

    nbytes = len(src) * lay.block_bytes
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=backend.device)
    touch(dev_buf, torch.Generator().manual_seed(1))
    stream, rt = backend.transfer_stream, cp.cuda.runtime
    host_arr, _ = pinned_empty(cp, args.device, nbytes, stream)

    def memcpy(kind: int) -> Callable[[], None]:
        # run() holds the buffers, not just their addresses: with only the ints, host_arr
        # was freed (unpinned, unmapped) when this function returned, and the first
        # d2h wrote to unmapped memory (a segfault on the H100).
        def run() -> None:
            host_ptr, dev_ptr = host_arr.ctypes.data, dev_buf.data_ptr()
            to_host = kind == rt.memcpyDeviceToHost
            rt.memcpyAsync(host_ptr if to_host else dev_ptr, dev_ptr if to_host else host_ptr,
                           nbytes, kind, stream.ptr)
            stream.synchronize()

        return run

    def d2h() -> None:
        backend.copy_d2h(spec, host, src, dst)
        backend.synchronize()

    def h2d() -> None:
        for layer in range(lay.num_layers):
            backend.copy_h2d(host, spec, dst, src, layer)
        backend.synchronize()

    return {"memcpy d2h": memcpy(rt.memcpyDeviceToHost),
            "memcpy h2d": memcpy(rt.memcpyHostToDevice), "d2h": d2h, "h2d": h2d}


def bench_ctas(args: argparse.Namespace, backend: Any, lay: CacheLayout, spec: Any,
               host: torch.Tensor, src: np.ndarray, dst: np.ndarray) -> None:
    """The thread-block cap: copy bandwidth (vs one contiguous cudaMemcpyAsync) against the
    layer-wise forward it leaves room for, cap by cap, interleaved rep by rep."""
    nbytes = len(src) * lay.block_bytes
    fns = _copy_fns(args, backend, lay, spec, host, src, dst)
    compute = torch.cuda.Stream(backend.device)
    x = torch.randn(args.compute_dim, args.compute_dim, device=backend.device,
                    dtype=torch.float16)
    caps = [c or backend.sm_count * 4 for c in args.ctas]
    default = backend.copy_ctas

    def timed(fn: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def compute_only() -> None:
        with torch.cuda.stream(compute):
            for _ in range(lay.num_layers):
                torch.mm(x, x)
        compute.synchronize()

    rows: dict[int, dict[str, list[float]]] = {c: {} for c in caps}
    base: dict[str, list[float]] = {"d2h": [], "h2d": [], "compute": []}
    for rep in range(args.reps + 1):  # the first round warms up
        base_now = {"d2h": timed(fns["memcpy d2h"]), "h2d": timed(fns["memcpy h2d"]),
                    "compute": timed(compute_only)}
        for cap in caps:
            backend.copy_ctas = cap
            now = {"d2h": timed(fns["d2h"]), "h2d": timed(fns["h2d"]),
                   "full": _forward(backend, lay, spec, host, src, dst, compute, x, False),
                   "layer": _forward(backend, lay, spec, host, src, dst, compute, x, True)}
            if rep:
                for k, v in now.items():
                    rows[cap].setdefault(k, []).append(v)
        if rep:
            for k, v in base_now.items():
                base[k].append(v)
    backend.copy_ctas = default
    med = statistics.median
    print(f"\nthread-block cap sweep ({len(src)} blocks x {lay.num_layers} layers, "
          f"{nbytes / 2**20:.0f} MiB; {backend.sm_count} SMs; default cap {default}): "
          f"compute alone {med(base['compute']) * 1e3:.2f} ms")
    print(f"  {'cap':>6}{'d2h vs memcpy':>15}{'h2d vs memcpy':>15}{'fwd full-wait ms':>18}"
          f"{'fwd layer-wise ms':>19}{'layer-wise gain':>17}")
    for cap in caps:
        r = rows[cap]
        print(f"  {cap:>6}{med(base['d2h']) / med(r['d2h']):>14.2f}x"
              f"{med(base['h2d']) / med(r['h2d']):>14.2f}x{med(r['full']) * 1e3:>18.2f}"
              f"{med(r['layer']) * 1e3:>19.2f}{med(r['full']) / med(r['layer']):>16.2f}x")


def _forward(backend: Any, lay: CacheLayout, spec: Any, host: torch.Tensor, src: np.ndarray,
             dst: np.ndarray, compute: Any, x: torch.Tensor, layerwise: bool) -> float:
    """Load every layer and run a matmul per layer on ``compute``: waiting on each layer's
    event (layer-wise) or on the last one before the first matmul. Wall seconds."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    backend.begin_batch(compute.cuda_stream)
    handles = []
    for layer in range(lay.num_layers):
        backend.copy_h2d(host, spec, dst, src, layer)
        handles.append(backend.record_event())
    with torch.cuda.stream(compute):
        for layer in range(lay.num_layers):
            if layerwise or layer == 0:
                handle = handles[layer] if layerwise else handles[-1]
                backend.wait_event_on_compute(handle, compute.cuda_stream)
            torch.mm(x, x)  # the layer's "attention + MLP"
    compute.synchronize()
    return time.perf_counter() - t0


def bench_layerwise(args: argparse.Namespace, backend: Any, lay: CacheLayout, spec: Any,
                    host: torch.Tensor, src: np.ndarray, dst: np.ndarray) -> None:
    """Layer-wise load: time to the first layer ready vs the full load (CUDA events), and
    a forward that waits layer by layer vs one that waits for the whole load."""
    import cupy as cp

    stream = backend.transfer_stream
    first_ms, full_ms = [], []
    for _ in range(args.reps):
        start, first, end = cp.cuda.Event(), cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for layer in range(lay.num_layers):
            backend.copy_h2d(host, spec, dst, src, layer)
            if layer == 0:
                first.record(stream)
        end.record(stream)
        end.synchronize()
        first_ms.append(cp.cuda.get_elapsed_time(start, first))
        full_ms.append(cp.cuda.get_elapsed_time(start, end))
    f, a = statistics.median(first_ms), statistics.median(full_ms)
    print(f"\nlayer-wise h2d of {len(src)} blocks x {lay.num_layers} layers: first layer ready "
          f"{f:.3f} ms, all layers {a:.3f} ms ({f / a:.3f} of the full load)")

    compute = torch.cuda.Stream(backend.device)
    x = torch.randn(args.compute_dim, args.compute_dim, device=backend.device,
                    dtype=torch.float16)

    def forward(layerwise: bool) -> float:
        return _forward(backend, lay, spec, host, src, dst, compute, x, layerwise)

    for mode in (False, True):
        forward(mode)
    serial = statistics.median(forward(False) for _ in range(args.reps))
    overlap = statistics.median(forward(True) for _ in range(args.reps))
    print(f"forward over a {len(src)}-block load ({args.compute_dim}^2 matmul per layer): "
          f"wait for the full load {serial * 1e3:.2f} ms, layer by layer "
          f"{overlap * 1e3:.2f} ms ({serial / overlap:.2f}x)")


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
    n = args.blocks
    t0 = time.perf_counter()
    for threads in [] if args.gpu_only else args.threads or [torch.get_num_threads()]:
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
