"""Per-rank identities, on tcp:// (CURVE keys) and on ipc:// (tokens derived from the keys):
a peer without a rank's credential reads nothing and counts for nothing; a rank cannot speak
for another rank; real worker processes work over both; plain tcp is refused."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from structlog.testing import capture_logs

from tests.worker.helpers import (
    FakeRank,
    joined_fakes,
    poll_until_done,
    reap,
    short_ipc_dir,
    worker_env,
)
from zkv import protocol as P
from zkv import security
from zkv.config import CacheLayout
from zkv.errors import ConfigError
from zkv.scheduler.dispatcher import Dispatcher
from zkv.security import ClientKeys, Keyring
from zkv.worker.actor import WorkerActor

FP = "layout-fp"
TCP = "tcp://127.0.0.1:*"


def _op(i: int) -> P.Op:
    return P.Op(i, P.D2H, P.as_ids([i]), P.as_ids([i]))


@pytest.fixture
def keyring() -> Keyring:
    return Keyring.generate(2)


def _poll_until(d: Dispatcher, pred: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {d.refusals()}"
        d.poll(0.02)


def _endpoints(transport: str, folder: str) -> tuple[str, str]:
    return (TCP, TCP) if transport == "tcp" else (f"ipc://{folder}/pub", f"ipc://{folder}/pull")


@pytest.fixture(params=["tcp", "ipc"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def group(ctx: zmq.Context[Any], keyring: Keyring, transport: str,
          folder: str) -> Iterator[tuple[Dispatcher, list[FakeRank]]]:
    with joined_fakes(ctx, _endpoints(transport, folder), 2, FP, keys=keyring,
                      join_timeout_s=10, heartbeat_timeout_s=60.0) as group:
        yield group


def test_a_scrape_during_close_never_sees_the_refusals_drop(
        ctx: zmq.Context[Any], keyring: Keyring,
        group: tuple[Dispatcher, list[FakeRank]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A metrics scrape reads ``refusals()`` on its own thread while the dispatcher closes:
    the close unregisters the ZAP domain, whose count then reads 0. A scrape that looked
    before the close and read the ZAP count after it reported ``unauthenticated`` 0 once
    (a counter that went back). The interleaving is made exact: the close runs inside
    the scrape's read of the ZAP count."""
    d, ranks = group
    own_public, own_secret = zmq.curve_keypair()  # a key pair of its own: not a rank's
    rogue = FakeRank(ctx, d.pub_endpoint, d.pull_endpoint, 0, FP, pid=ranks[0].pid,
                     keys=ClientKeys(0, keyring.server_public, own_public, own_secret))
    try:
        rogue.subscribe()
        _poll_until(d, lambda: d.refusals()["unauthenticated"] >= 1, "the ZAP refusal")
        before = d.refusals()["unauthenticated"]
        zap = d._zap
        read = zap.num_refused

        def close_first(domain: str) -> int:
            monkeypatch.setattr(zap, "num_refused", read)
            d.close(shutdown=False)  # lands between the scrape's look and its read
            return read(domain)

        monkeypatch.setattr(zap, "num_refused", close_first)
        assert d.refusals()["unauthenticated"] == before
    finally:
        rogue.close()


def test_rogue_without_a_rank_key_reads_no_batch_and_gets_nothing_counted(
        ctx: zmq.Context[Any], keyring: Keyring,
        group: tuple[Dispatcher, list[FakeRank]]) -> None:
    d, ranks = group
    pub, pull = d.pub_endpoint, d.pull_endpoint
    # One rogue brings no credential at all; the other knows the server's public key (it
    # is no secret) and brings a key pair of its own (on ipc: the token it derives).
    own_public, own_secret = zmq.curve_keypair()
    rogues = [FakeRank(ctx, pub, pull, 0, FP, pid=ranks[0].pid),
              FakeRank(ctx, pub, pull, 0, FP, pid=ranks[0].pid,
                       keys=ClientKeys(0, keyring.server_public, own_public, own_secret))]
    try:
        with capture_logs() as logs:
            for rogue in rogues:
                rogue.subscribe()
            _poll_until(d, lambda: d.refusals()["unauthenticated"] >= 2, "the ZAP refusals")
        # who knocked, how, and why not (was: only counted)
        refused = [e for e in logs if e["event"] == "security.handshake_refused"]
        assert len(refused) >= 2 and all(e["peer"] and e["reason"] for e in refused), logs
        assert {e["mechanism"] for e in refused} <= {"NULL", "CURVE", "PLAIN"}
        received = d.num_received  # the ranks' hellos
        seq = d.publish([_op(0)], step=0)
        batches = [r.recv_batch() for r in ranks]
        for rogue in rogues:  # an ack that fails every op, a heartbeat, a bye: all as rank 0
            for msg in (P.BlocksCopied(seq, 0, False, (P.OpResult(0, False, 0, "rogue"),)),
                        P.Heartbeat(0, ranks[0].pid, seq), P.Bye(0, ranks[0].pid, "rogue bye")):
                _try_send(rogue, msg)
        assert d.poll(0.3) == []  # nothing of theirs completed the batch
        assert d.lost_ranks == frozenset() and d.in_flight == 1
        for rogue in rogues:
            assert rogue.sub.poll(100) == 0  # no batch, no shutdown: nothing to read
        ranks[0].ack(batches[0])
        ranks[1].ack(batches[1])
        done = poll_until_done(d, seq)[seq]
        assert done.ok and done.results == {0: P.OpResult(0, True, 1)}
        assert d.num_received == received + 2  # the ranks' acks; no rogue got through
        assert d.lost_ranks == frozenset()
    finally:
        for rogue in rogues:
            rogue.close()


def test_ipc_token_is_refused_under_another_ranks_name(
        ctx: zmq.Context[Any], keyring: Keyring, folder: str) -> None:
    """On ipc a rank's token goes with its own name (``rank-N``): rank 1's valid token
    offered as rank 0 is refused at the handshake, as is a name of no rank."""
    with joined_fakes(ctx, _endpoints("ipc", folder), 2, FP, keys=keyring,
                      join_timeout_s=10, heartbeat_timeout_s=60.0) as (d, _ranks):
        token_1 = security.ipc_token(1, keyring.for_rank(1).secret).encode()
        socks = []
        try:
            with capture_logs() as logs:
                for name in (b"rank-0", b"rank-x"):
                    s = ctx.socket(zmq.PUSH)
                    s.setsockopt(zmq.LINGER, 0)
                    s.plain_username, s.plain_password = name, token_1
                    s.connect(d.pull_endpoint)
                    socks.append(s)
                _poll_until(d, lambda: d.refusals()["unauthenticated"] >= 2,
                            "the ZAP refusals")
            refused = [e for e in logs if e["event"] == "security.handshake_refused"]
            assert {e["reason"] for e in refused} == {"ipc token of no rank"}, logs
            assert {e["mechanism"] for e in refused} == {"PLAIN"}
        finally:
            for s in socks:
                s.close(0)


def _try_send(rogue: FakeRank, msg: P.Message) -> None:
    """A refused peer may not even get a queue (libzmq drops its pipe): never block on it."""
    try:
        rogue.push.send_multipart(P.encode(msg), zmq.NOBLOCK)
    except zmq.Again:
        pass


def test_a_rank_cannot_ack_heartbeat_or_say_bye_for_another(
        group: tuple[Dispatcher, list[FakeRank]]) -> None:
    d, (r0, r1) = group
    seq = d.publish([_op(0)], step=0)
    b0, b1 = r0.recv_batch(), r1.recv_batch()
    # Rank 1 holds a valid key, but rank 1's: everything it says as rank 0 is dropped.
    r1.send(P.BlocksCopied(seq, 0, False, (P.OpResult(0, False, 0, "forged"),)))
    r1.send(P.Heartbeat(0, r0.pid, seq))
    r1.send(P.Bye(0, r0.pid, "forged bye"))
    _poll_until(d, lambda: d.refusals()["forged"] == 3, "three forged messages")
    assert d.lost_ranks == frozenset() and d.in_flight == 1
    r1.ack(b1)
    r0.ack(b0)
    done = poll_until_done(d, seq)[seq]
    assert done.ok and done.results == {0: P.OpResult(0, True, 1)}


def test_a_rank_cannot_join_as_another(ctx: zmq.Context[Any], keyring: Keyring, transport: str,
                                       folder: str) -> None:
    d = Dispatcher(*_endpoints(transport, folder), 2, FP, context=ctx, keys=keyring)
    # rank 1's keys, claiming rank 0: its ready marker and hello are both refused
    impostor = FakeRank(ctx, d.pub_endpoint, d.pull_endpoint, 0, FP, keys=keyring.for_rank(1))
    try:
        impostor.join()
        with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2.*rank 0: no hello"):
            d.wait_for_ranks(0.5)
        assert d.refusals()["forged"] == 2
    finally:
        d.close(shutdown=False)
        impostor.close()


def test_plain_tcp_and_remote_binds_need_explicit_flags(ctx: zmq.Context[Any]) -> None:
    with pytest.raises(ConfigError, match="plain tcp:// is refused"):
        Dispatcher(TCP, TCP, 1, FP, context=ctx)
    with pytest.raises(ConfigError, match="other than loopback"):
        Dispatcher("tcp://0.0.0.0:*", TCP, 1, FP, context=ctx, keys=Keyring.generate(1))
    d = Dispatcher(TCP, TCP, 1, FP, context=ctx, insecure=True)
    d.close(shutdown=False)
    layout = CacheLayout(1, 1, 4, 4, num_device_blocks=2, num_host_blocks=2)
    with pytest.raises(ConfigError, match="plain tcp:// is refused"):
        WorkerActor(0, layout, [(np_zeros(), np_zeros())], np_zeros(), None,
                    pub_endpoint="tcp://127.0.0.1:5", pull_endpoint="tcp://127.0.0.1:6")
    with pytest.raises(ConfigError, match="keys of rank 1"):
        WorkerActor(0, layout, [(np_zeros(), np_zeros())], np_zeros(), None,
                    pub_endpoint="tcp://127.0.0.1:5", pull_endpoint="tcp://127.0.0.1:6",
                    keys=Keyring.generate(2).for_rank(1))


def np_zeros() -> Any:
    import numpy as np

    return np.zeros((2, 1, 4, 4), dtype=np.float16)


def test_worker_processes_with_keys(tmp_path: Path, transport: str, folder: str) -> None:
    """Real ``python -m zkv.worker`` ranks with keys from $ZKV_KEYS: fill, then check; a
    third with a stranger's key for rank 1 is refused."""
    layout = CacheLayout(num_layers=2, kv_heads=1, block_size=4, head_dim=8,
                         num_device_blocks=4, num_host_blocks=4, world_size=2)
    keyring = Keyring.generate(2)
    keys_dir = keyring.save(str(tmp_path / "keys"))
    other = Keyring.generate(2)  # a stranger who knows our server's public key (no secret)
    stranger = Keyring(keyring.server_public, None, other.rank_publics,
                       other.rank_secrets).save(str(tmp_path / "other-keys"))
    d = Dispatcher(*_endpoints(transport, folder), 2, layout, keys=keyring,
                   heartbeat_timeout_s=10.0)
    procs = []
    try:
        for rank, keys in ((0, keys_dir), (1, keys_dir), (1, stranger)):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "zkv.worker"], stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, env=worker_env(rank, layout.to_json(),
                                                          d.pub_endpoint, d.pull_endpoint,
                                                          ZKV_KEYS=keys)))
        with capture_logs() as logs:
            d.wait_for_ranks(60)
        joined = {e["rank"]: e["worker_pid"] for e in logs if "worker_pid" in e}
        assert joined == {0: procs[0].pid, 1: procs[1].pid}
        digests = tuple(bytes([i]) * 16 for i in range(3))
        ids = P.as_ids([0, 1, 3])
        seq = d.publish([P.Op(1, P.FILL, dst=ids, keys=digests)], step=0)
        assert poll_until_done(d, seq, 30)[seq].ok
        seq = d.publish([P.Op(2, P.CHECK, src=ids, keys=digests)], step=1)
        done = poll_until_done(d, seq, 30)[seq]
        assert done.ok and done.results[2].done == 3
        _poll_until(d, lambda: d.refusals()["unauthenticated"] >= 1, "the stranger's refusal")
    finally:
        if len(procs) == 3:
            procs[2].kill()  # the stranger never hears the shutdown
        d.close(shutdown=True)
        codes = reap(procs)
    assert codes[:2] == [0, 0]
    assert os.listdir(keys_dir)


def test_keyring_files_and_loading(tmp_path: Path) -> None:
    keyring = Keyring.generate(3)
    path = keyring.save(str(tmp_path / "k"))
    assert oct(os.stat(path).st_mode & 0o777) == "0o700"
    assert oct(os.stat(os.path.join(path, "rank-1.key_secret")).st_mode & 0o777) == "0o600"
    assert Keyring.load(path) == keyring
    # a rank node's copy: the server's public key and its own secret only
    node = tmp_path / "node1"
    node.mkdir(mode=0o700)
    for name in ("server.key", "rank-0.key", "rank-1.key", "rank-1.key_secret", "rank-2.key"):
        (node / name).write_bytes((Path(path) / name).read_bytes())
    os.chmod(node / "rank-1.key_secret", 0o600)
    partial = Keyring.load(str(node))
    assert partial.for_rank(1) == keyring.for_rank(1) and partial.server_secret is None
    with pytest.raises(ConfigError, match="no secret key for rank 0"):
        partial.for_rank(0)
    with pytest.raises(ConfigError, match="server secret"):
        Dispatcher(TCP, TCP, 3, FP, keys=partial)
    with short_ipc_dir() as d:  # on ipc the scheduler derives every rank's token
        with pytest.raises(ConfigError, match="whole keyring"):
            Dispatcher(f"ipc://{d}/pub", f"ipc://{d}/pull", 3, FP,
                       keys=dataclasses.replace(keyring, rank_secrets={1: keyring.rank_secrets[1]}))
    # without every rank's public key: one line that says what a node needs (the
    # README once said server.key and the rank's secret were enough: it failed on rank-0)
    lean = tmp_path / "lean"
    lean.mkdir(mode=0o700)
    for name in ("server.key", "rank-1.key_secret"):
        shutil.copy2(Path(path) / name, lean / name)
    with pytest.raises(ConfigError) as info:
        Keyring.load(str(lean))
    assert str(info.value) == (
        f"keyring {str(lean)!r} has no rank-0.key: every node needs server.key and every "
        "rank's public key (rank-N.key, from zkv keys); a rank's node also its own "
        "rank-N.key_secret, the scheduler's node server.key_secret")
    # a gap, rank 1's files gone and rank 2's there: before, it read as a world of 1 rank
    os.rename(node / "rank-1.key", tmp_path / "rank-1.key")
    os.rename(node / "rank-1.key_secret", tmp_path / "rank-1.key_secret")
    with pytest.raises(ConfigError, match="has no rank-1.key: every node needs"):
        Keyring.load(str(node))
    for name in ("rank-1.key", "rank-1.key_secret"):
        os.rename(tmp_path / name, node / name)
    os.chmod(node / "rank-1.key_secret", 0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        Keyring.load(str(node))
    os.chmod(node, 0o755)
    with pytest.raises(ConfigError, match="mode 755"):
        Keyring.load(str(node))


def test_zkv_keys_command(tmp_path: Path) -> None:
    out = tmp_path / "keys"
    r = subprocess.run([sys.executable, "-m", "zkv.cli", "keys", str(out), "--world-size", "4"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert Keyring.load(str(out)).world_size == 4
    again = subprocess.run([sys.executable, "-m", "zkv.cli", "keys", str(out), "--world-size",
                            "4"], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and again.stderr.count("\n") == 1
    assert "already exists" in again.stderr and "Traceback" not in again.stderr
    typo = subprocess.run([sys.executable, "-m", "zkv.cli", "keys", str(tmp_path / "k2"),
                           "--world-size", "1_0"], capture_output=True, text=True, timeout=60)
    assert typo.returncode == 2, typo.stderr  # (int() read it as 10: ten rank keys)
    assert typo.stderr.splitlines()[-1].endswith("argument --world-size: not an int: '1_0'")
    assert not (tmp_path / "k2").exists()


FULL_DISK_KEYS = (
    'dd if=/dev/zero of="$1/fill" bs=4k count=64 2>/dev/null; '
    '"$0" -m zkv.cli keys "$1/k" --world-size 2; echo "rc=$?"; ls -A "$1"; '
    'rm -f "$1/fill"; "$0" -m zkv.cli keys "$1/k" --world-size 2; echo "rc=$?"')


def test_zkv_keys_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    """A full file system: one line, status 2, no half keyring left; the same command
    works once there is room. Before: an ENOSPC traceback (status 1) and a directory with
    an empty server.key_secret, refused as "already exists" from then on."""
    from tests.smallfs import run_on_small_fs

    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = run_on_small_fs(str(mnt), "64k", ["sh", "-c", FULL_DISK_KEYS, sys.executable,
                                             str(mnt)],
                           timeout_s=120, cwd=str(Path(__file__).resolve().parents[2]))
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines() == [
        f"zkv keys: error: cannot write the keyring {mnt}/k: No space left on device"
    ], proc.stderr
    assert proc.stdout.splitlines() == [
        "rc=2", "fill",
        f"zkv keys: wrote the server key and 2 rank keys to {mnt}/k", "rc=0"], proc.stdout


def test_sidecar_loads_its_keys_from_a_keyring_directory(tmp_path: Path) -> None:
    """The worker half inside a model process: Sidecar(keys=DIR) (or $ZKV_KEYS)."""
    from zkv.kernels import get_backend
    from zkv.worker import Sidecar

    layout = CacheLayout(num_layers=2, kv_heads=1, block_size=4, head_dim=8,
                         num_device_blocks=4, num_host_blocks=4, world_size=1)
    keyring = Keyring.generate(1)
    keys_dir = keyring.save(str(tmp_path / "keys"))
    d = Dispatcher(TCP, TCP, 1, layout, keys=keyring)
    cpu = get_backend("cpu")
    try:
        with Sidecar(cpu.allocate_device_cache(layout), layout=layout, rank=0,
                     pub_endpoint=d.pub_endpoint, pull_endpoint=d.pull_endpoint,
                     backend=cpu, keys=keys_dir) as sc:
            d.wait_for_ranks(10)
            seq = d.publish([P.Op(1, P.FILL, dst=P.as_ids([2]), keys=(b"k" * 16,))], step=0)
            assert poll_until_done(d, seq)[seq].ok
            sc.wait_layer(seq, 1, timeout=5)
        assert d.refusals() == {k: 0 for k in d.refusals()}
    finally:
        d.close(shutdown=False)
