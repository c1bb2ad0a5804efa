"""Two zkvrun nodes on loopback, as the README's multi-node command runs them: node 0 starts
the scheduler (the main job's) and rank 0, node 1 starts rank 1, over tcp:// with the
group's CURVE keys. The job verifies every reused block byte for byte on both ranks."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from tests.servers import free_port
from zkv.config import CacheLayout

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = CacheLayout(4, 2, 16, 64, "float16", 768, 1024, world_size=2)  # zkv replay's


def _port_pair() -> int:
    """A free port whose next one is free too (PUB on it, PULL on it + 1)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two free ports in a row")


def test_two_nodes_over_tcp_with_curve_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "zkv.cli", "keys", str(keys), "--world-size", "2"],
                   check=True, capture_output=True, timeout=60)
    # node 1 gets what the README says a rank's node needs: the public keys, and its own
    # rank's secret alone (neither the scheduler's nor another rank's)
    node1_keys = tmp_path / "keys-node1"
    node1_keys.mkdir(mode=0o700)
    for name in ("server.key", "rank-0.key", "rank-1.key", "rank-1.key_secret"):
        shutil.copy2(keys / name, node1_keys / name)
    port = str(_port_pair())
    # Both nodes share this machine's 2 cores here: a rank per node would otherwise get
    # every core's worth of OpenMP threads, and the two spin against each other.
    env = dict(os.environ, ZKV_BACKEND="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("ZKV_STORE_URL", None)

    zero, out_one = _two_nodes(
        tmp_path, env, lambda rank: ["--nproc-per-node", "1", "--keys",
                                     str(node1_keys if rank else keys), "--master-port", port],
        "-m zkv.replay --node --ranks 2 --requests 60 --no-progress --storage none")
    m = re.search(r"verified\s+(\d+) reused blocks checked byte-for-byte on every rank, "
                  r"0 mismatched; 0 failed ops", zero.stdout)
    assert m and int(m.group(1)) > 0, zero.stdout
    assert re.search(r"requests\s+60 ", zero.stdout), zero.stdout
    started = [orjson.loads(line) for n in (0, 1)
               for line in (tmp_path / f"logs{n}" / f"launcher-node{n}.jsonl").read_bytes()
               .splitlines() if b"launch.group_started" in line]
    assert [(e["node_rank"], e["curve"], e["pub"]) for e in started] == [
        (n, True, f"tcp://127.0.0.1:{port}") for n in (0, 1)]


def test_a_node_whose_scheduler_node_never_comes_stops(tmp_path: Path) -> None:
    """Node 1 without node 0 (it died, or never started): its rank stops after
    ZKV_SCHEDULER_TIMEOUT_S with code 5, and zkvrun does not restart it (no rerun brings
    the scheduler back) but ends, saying why. Before, node 1 waited forever."""
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "zkv.cli", "keys", str(keys), "--world-size", "2"],
                   check=True, capture_output=True, timeout=60)
    env = dict(os.environ, ZKV_BACKEND="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               ZKV_SCHEDULER_TIMEOUT_S="1")
    env.pop("ZKV_STORE_URL", None)
    r = subprocess.run([sys.executable, "-m", "launch.zkvrun", "--nnodes", "2", "--node-rank",
                        "1", "--nproc-per-node", "1", "--keys", str(keys), "--master-port",
                        str(_port_pair()), "--max-restarts", "2", "--config", LAYOUT.to_json(),
                        "--log-dir", str(tmp_path / "logs"), "-m", "zkv.worker"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr  # zkvrun's for a failed rank
    assert re.search(r"zkv\.worker: rank 1: no scheduler reached for \d+\.\d s \(scheduler "
                     r"timeout 1 s\) at tcp://127\.0\.0\.1:\d+\n", r.stderr), r.stderr
    assert r.stderr.splitlines()[-1].endswith(
        "exited with code 5 (scheduler unreachable): not restarting; tearing down 0 processes")


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_two_nodes_over_ipv6_loopback(tmp_path: Path) -> None:
    """``--master-addr ::1`` (bracketed into ``tcp://[::1]:PORT``). Was: "the scheduler
    cannot listen on tcp://[::1]:PORT: No such device" (libzmq's sockets are IPv4-only
    unless ZMQ_IPV6 is set), status 2, and node 1's rank waited for nothing."""
    port = str(_port_pair())
    env = dict(os.environ, ZKV_BACKEND="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               ZKV_SCHEDULER_TIMEOUT_S="30")
    env.pop("ZKV_STORE_URL", None)

    zero, _ = _two_nodes(
        tmp_path, env, lambda rank: ["--master-addr", "::1", "--master-port", port,
                                     "--insecure-tcp"],
        "-m zkv.cli replay --node --ranks 2 --requests 20 --no-progress --storage none")
    assert re.search(r"requests\s+20 ", zero.stdout), zero.stdout
    assert "0 mismatched; 0 failed ops" in zero.stdout, zero.stdout


def _two_nodes(tmp_path: Path, env: dict[str, str], args: Callable[[int], list[str]],
               scheduler: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """Node 1 started first (its rank waits for the scheduler: zmq reconnects until it
    listens), then node 0 with ``scheduler``; both must exit 0. Node 0's run, node 1's
    output."""
    def node(rank: int, *extra: str) -> list[str]:
        return [sys.executable, "-m", "launch.zkvrun", "--nnodes", "2", "--node-rank", str(rank),
                *args(rank), "--config", LAYOUT.to_json(),
                "--log-dir", str(tmp_path / f"logs{rank}"), *extra, "-m", "zkv.worker"]

    one = subprocess.Popen(node(1), env=env, cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        zero = subprocess.run(node(0, "--scheduler", scheduler), env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=180)
        out_one, _ = one.communicate(timeout=60)
    finally:
        if one.poll() is None:
            one.kill()
            one.communicate()
    assert zero.returncode == 0, zero.stdout + zero.stderr
    assert one.returncode == 0, out_one
    return zero, out_one
