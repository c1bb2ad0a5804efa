"""L3 store throughput per backend, as a ratio of the same bytes through a plain file.

    .venv/bin/python bench/storage.py [--blocks 1024] [--batch 32] [--reps 5] [--dir DIR]
                                      [--redis URL] [--mooncake URL]

Block size: the one ``zkv replay`` uses by default (4 layers x K,V x 2 kv heads x 16
tokens x 64 dims x float16 = 32 KiB; ``--layers`` etc. change it). For each rep, in one
process and interleaved so that noise from other processes hits all alike:

    plain file   the blocks written (os.write) into one file and read back (os.preadv)
                 in ``--dir``: the floor of the local file system, no store logic
    file://      LocalDirStore in ``--dir`` (one file per block, header, checksum, rename)
    redis://     a redis-server on 127.0.0.1 (started here unless --redis is given)
    mooncake://  a Mooncake master + one memory holder (started here unless --mooncake)

Each store call moves ``--batch`` blocks (the worker's chunk), from one thread. The table
shows median GB/s and ops/s (blocks/s) for put and get, and the ratio to the plain file's
median write / read. Every get is checked bit for bit. Mooncake rows: ``mooncake://``
as configured by default (header inline, staged, for blocks up to 256 KiB on TCP; split
above), ``mooncake, split header`` (always [header, payload] buffers, zero copy) and
``mooncake, no header`` (the same client, payload-only objects): what the header costs in
each form - the measurement behind the choice in zkv/storage/mooncake_store.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _args import directory, dtype, positive_int, store_url_of  # noqa: E402
from _cleanup import exit_on_sigterm, scratch_dir  # noqa: E402

from zkv.config import CacheLayout  # noqa: E402
from zkv.storage import Store, file_url, open_store, pack_key  # noqa: E402
from zkv.storage.mooncake_store import MooncakeStore  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--kv-heads", type=positive_int, default=2)
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--dtype", type=dtype, default="float16")
    p.add_argument("--blocks", type=positive_int, default=1024, help="blocks per rep")
    p.add_argument("--batch", type=positive_int, default=32, help="blocks per store call")
    p.add_argument("--reps", type=positive_int, default=5)
    p.add_argument("--dir", type=directory,
                   default="/dev/shm" if os.access("/dev/shm", os.W_OK) else None,
                   help="where the plain file and file:// live (default /dev/shm)")
    p.add_argument("--redis", type=store_url_of("redis", "rediss"), default=None,
                   help="an existing redis:// URL")
    p.add_argument("--mooncake", type=store_url_of("mooncake"), default=None,
                   help="an existing mooncake:// URL")
    return p.parse_args(argv)


def with_param(url: str, name: str, value: str) -> str:
    """``url`` with its query parameter ``name`` set to ``value`` (replaced if given)."""
    parts = urllib.parse.urlsplit(url)
    query = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
             if k != name] + [(name, value)]
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


def plain_file(folder: str, src: np.ndarray, dst: np.ndarray) -> tuple[float, float]:
    """Seconds to write every block into one file, and to read them back."""
    path = os.path.join(folder, f"plain-{uuid.uuid4().hex}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        for block in src:
            os.write(fd, block)
        t1 = time.perf_counter()
        size = src.shape[1]
        for i in range(len(dst)):
            os.preadv(fd, [dst[i]], i * size)
        t2 = time.perf_counter()
    finally:
        os.close(fd)
        os.unlink(path)
    assert dst.tobytes() == src.tobytes()
    return t1 - t0, t2 - t1


def through_store(store: Store, src: np.ndarray, dst: np.ndarray, batch: int,
                  rep: int) -> tuple[float, float]:
    keys = [pack_key(i.to_bytes(8, "big") + rep.to_bytes(8, "big"), 0) for i in range(len(src))]
    t0 = time.perf_counter()
    for i in range(0, len(src), batch):
        assert all(store.put_many(keys[i : i + batch], list(src[i : i + batch])))
    t1 = time.perf_counter()
    for i in range(0, len(src), batch):
        assert all(store.get_many_into(keys[i : i + batch], list(dst[i : i + batch])))
    t2 = time.perf_counter()
    assert dst.tobytes() == src.tobytes()
    for k in keys:  # keep the servers' memory flat across reps
        store.remove(k)
    return t1 - t0, t2 - t1


def mooncake_raw(store: MooncakeStore, src: np.ndarray, dst: np.ndarray, batch: int,
                 rep: int) -> tuple[float, float]:
    """The same client without the header: payload-only objects, zero copy."""
    client = store._client
    size = src.shape[1]
    names = [f"{store.namespace}/raw/{rep}/{i}" for i in range(len(src))]
    sp, dp = int(src.ctypes.data), int(dst.ctypes.data)
    t0 = time.perf_counter()
    for i in range(0, len(src), batch):
        n = names[i : i + batch]
        rcs = client.batch_put_from(n, [sp + j * size for j in range(i, i + len(n))],
                                    [size] * len(n))
        assert rcs == [0] * len(n), rcs
    t1 = time.perf_counter()
    for i in range(0, len(src), batch):
        n = names[i : i + batch]
        rcs = client.batch_get_into(n, [dp + j * size for j in range(i, i + len(n))],
                                    [size] * len(n))
        assert rcs == [size] * len(n), rcs
    t2 = time.perf_counter()
    assert dst.tobytes() == src.tobytes()
    client.batch_remove(names, True)
    return t1 - t0, t2 - t1


def start_servers(args: argparse.Namespace, stack: ExitStack, folder: str) -> tuple[str, str]:
    from tests.servers import MooncakeServer, RedisServer

    redis_url = args.redis
    if redis_url is None:
        redis_url = stack.enter_context(RedisServer(os.path.join(folder, "redis"), "2gb")).url
    mc_url = args.mooncake
    if mc_url is None:
        mc_url = stack.enter_context(MooncakeServer(os.path.join(folder, "mc"), 1024)).url
    return redis_url, mc_url


def row(name: str, times: list[tuple[float, float]], nbytes: int, n: int,
        base: tuple[float, float] | None) -> str:
    put = statistics.median(t[0] for t in times)
    get = statistics.median(t[1] for t in times)
    ratio = "" if base is None else f"{base[0] / put:>10.3f}x {base[1] / get:>9.3f}x"
    return (f"{name:<22}{nbytes / put / 1e9:>8.2f} {n / put:>10.0f} "
            f"{nbytes / get / 1e9:>8.2f} {n / get:>10.0f}  {ratio}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    layout = CacheLayout(args.layers, args.kv_heads, args.block_size, args.head_dim, args.dtype)
    size, n = layout.block_bytes, args.blocks
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (n, size), dtype=np.uint8)
    dst = np.zeros_like(src)
    ns = f"bench{uuid.uuid4().hex[:8]}"
    with ExitStack() as stack, tempfile.TemporaryDirectory(dir=args.dir) as folder:
        redis_url, mc_url = start_servers(args, stack,
                                          stack.enter_context(scratch_dir("zkv-bench-")))
        stores: dict[str, Store] = {
            "file://": open_store(file_url(os.path.join(folder, "l3")), ns),
            "redis://": open_store(redis_url, ns),
            "mooncake://": open_store(mc_url, ns),
            "mooncake, split header": open_store(with_param(mc_url, "header", "split"),
                                                 ns + "s"),
        }
        for s in stores.values():
            stack.callback(s.close)
        down = [s.url for s in stores.values() if s.link is not None and not s.link.up]
        if down:  # (a given server that is not there: every put failed, an AssertionError)
            print(f"bench/storage.py: error: {', '.join(dict.fromkeys(down))} unreachable "
                  "(see the storage.store_unreachable line above)", file=sys.stderr)
            return 1
        mc = stores["mooncake://"]
        assert isinstance(mc, MooncakeStore)
        for arr in (src, dst):  # zero copy where the backend can (RDMA needs it; TCP not)
            mc.register_buffer(int(arr.ctypes.data), arr.nbytes)
        runs: dict[str, Callable[[int], tuple[float, float]]] = {
            "plain file": lambda r: plain_file(folder, src, dst)}
        for name, store in stores.items():
            runs[name] = lambda r, s=store: through_store(s, src, dst, args.batch, r)
        runs["mooncake, no header"] = lambda r: mooncake_raw(mc, src, dst, args.batch, r)
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
        for rep in range(args.reps):
            for name, run in runs.items():
                dst[:] = 0
                times[name].append(run(rep))
        print(f"bench/storage.py: {n} blocks of {size / 1024:.0f} KiB ({layout.num_layers} layers"
              f" x K,V x {layout.kv_heads} heads x {layout.block_size} tokens x "
              f"{layout.head_dim} x {layout.dtype}), {args.batch} blocks per call, one thread, "
              f"median of {args.reps}; plain file and file:// in "
              f"{args.dir or tempfile.gettempdir()}")
        print(f"{'':<22}{'put GB/s':>8} {'put ops/s':>10} {'get GB/s':>8} {'get ops/s':>10}"
              f"  {'put/write':>10} {'get/read':>10}")
        base = (statistics.median(t[0] for t in times["plain file"]),
                statistics.median(t[1] for t in times["plain file"]))
        for name, t in times.items():
            print(row(name, t, n * size, n, None if name == "plain file" else base))
        raw = times["mooncake, no header"]
        for name in ("mooncake://", "mooncake, split header"):
            hdr = times[name]
            put = statistics.median(t[0] for t in hdr) / statistics.median(t[0] for t in raw)
            get = statistics.median(t[1] for t in hdr) / statistics.median(t[1] for t in raw)
            print(f"header cost, {name}: put {put:.2f}x, get {get:.2f}x the time of "
                  "payload-only objects")
    return 0


if __name__ == "__main__":
    sys.exit(main())
