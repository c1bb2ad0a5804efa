"""The gated Sidecar (an engine that schedules ahead): a batch that writes the KV cache
runs only after the engine released its seq; saves (d2h: they read blocks whose forward
ended) and storage-only batches are not held; a batch never released fails (its layers
fail, the scheduler gets a failed ack), nothing hangs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from structlog.testing import capture_logs

import zkv.kernels.reference as reference
from tests.worker.helpers import digest, endpoints, poll_until_done, short_ipc_dir
from zkv import kernels
from zkv import protocol as P
from zkv.config import CacheLayout
from zkv.errors import TransferError
from zkv.scheduler.dispatcher import Dispatcher
from zkv.worker import Sidecar

LAYOUT = CacheLayout(num_layers=3, kv_heads=2, block_size=4, head_dim=8, dtype="float16",
                     num_device_blocks=8, num_host_blocks=8, world_size=1)


@pytest.fixture
def rig() -> Iterator[tuple[Dispatcher, Sidecar]]:
    with ExitStack() as stack, short_ipc_dir() as folder:
        pub, pull = endpoints(folder)
        d = Dispatcher(pub, pull, 1, LAYOUT.fingerprint())
        stack.callback(d.close)
        kv = kernels.get_backend("cpu").allocate_device_cache(LAYOUT)
        sc = Sidecar(kv, layout=LAYOUT, rank=0, pub_endpoint=pub, pull_endpoint=pull,
                     backend="cpu", gated=True)
        sc.actor.gate_timeout_s = 1.0
        stack.callback(sc.close)
        d.wait_for_ranks(10)
        yield d, sc


def test_batch_waits_for_release_then_runs(rig: tuple[Dispatcher, Sidecar]) -> None:
    d, sc = rig
    keys = tuple(digest(i) for i in range(2))
    seq = d.publish([P.Op(0, P.FILL, dst=P.as_ids([3, 5]), keys=keys)], 0)
    assert sc.wait_acked(seq, 0.3) is None  # held: the engine has not released it
    assert reference.check_pattern(sc.actor.kv_caches, P.as_ids([3, 5]), keys, 0) == 0
    sc.release(seq)
    ack = sc.wait_acked(seq, 5)
    assert ack is not None and ack.ok
    assert poll_until_done(d, seq)[seq].ok
    assert reference.check_pattern(sc.actor.kv_caches, P.as_ids([3, 5]), keys, 0) == 2
    sc.wait_layer(seq, 2, timeout=1)


def test_release_covers_every_earlier_seq(rig: tuple[Dispatcher, Sidecar]) -> None:
    d, sc = rig
    seqs = [d.publish([P.Op(0, P.FILL, dst=P.as_ids([i]), keys=(digest(i),))], i)
            for i in range(3)]
    sc.release(seqs[-1])
    done = poll_until_done(d, set(seqs))
    assert all(done[s].ok for s in seqs) and sc.last_seq == seqs[-1]


def test_a_batch_never_released_fails_its_layers_and_its_ack(
        rig: tuple[Dispatcher, Sidecar]) -> None:
    d, sc = rig
    seq = d.publish([P.Op(0, P.H2D, P.as_ids([0]), P.as_ids([1]), layerwise=True)], 0)
    with pytest.raises(TransferError, match="did not release batch"):
        sc.wait_layer(seq, 0, timeout=5)
    done = poll_until_done(d, seq)[seq]
    assert not done.ok and "did not release" in str(done.results[0].error)
    later = d.publish([], 1)  # the actor is alive and in order afterwards
    assert poll_until_done(d, later)[later].ok


def test_a_load_left_held_at_shutdown_fails_without_an_error_line(
        rig: tuple[Dispatcher, Sidecar]) -> None:
    """vLLM stops with a load published that no forward released: the load fails (its
    layers and ack, as above) but at info level: an operator alerts on errors, and this
    is a normal shutdown. A held load that times out (above) is still an error."""
    d, sc = rig
    seq = d.publish([P.Op(0, P.H2D, P.as_ids([0]), P.as_ids([1]), layerwise=True)], 0)
    assert sc.wait_acked(seq, 0.2) is None  # held
    with capture_logs() as logs:
        assert sc.close()
    (failed,) = [e for e in logs if e["event"] == "worker.copy_failed"]
    assert failed["log_level"] == "info" and "actor stopping" in failed["error"], failed
    with pytest.raises(TransferError, match="actor stopping"):
        sc.wait_layer(seq, 0, timeout=1)


def test_saves_are_not_held_and_a_batch_with_a_load_is(rig: tuple[Dispatcher, Sidecar]) -> None:
    """The last request to finish has its save published after the last step's release:
    nothing would ever release it. A save in a batch with a load waits with the load."""
    d, sc = rig
    keys = tuple(digest(i) for i in range(2))
    fill = d.publish([P.Op(0, P.FILL, dst=P.as_ids([3, 5]), keys=keys)], 0)
    sc.release(fill)
    assert poll_until_done(d, fill)[fill].ok
    save = d.publish([P.Op(1, P.D2H, P.as_ids([3, 5]), P.as_ids([0, 1]))], 1)
    ack = sc.wait_acked(save, 5)  # never released, run at once
    assert ack is not None and ack.ok and poll_until_done(d, save)[save].ok
    both = d.publish([P.Op(2, P.D2H, P.as_ids([3]), P.as_ids([2])),
                      P.Op(3, P.H2D, P.as_ids([0]), P.as_ids([6]), layerwise=True)], 2)
    assert sc.wait_acked(both, 0.3) is None  # held: it writes block 6
    assert reference.check_pattern(sc.actor.kv_caches, P.as_ids([6]), keys[:1], 0) == 0
    sc.release(both)
    assert poll_until_done(d, both)[both].ok  # block 6 now holds what the save took from 3
    assert reference.check_pattern(sc.actor.kv_caches, P.as_ids([6]), keys[:1], 0) == 1


def test_storage_only_batches_are_not_held(tmp_path) -> None:  # noqa: ANN001
    from zkv.storage import LocalDirStore

    with ExitStack() as stack, short_ipc_dir() as folder:
        pub, pull = endpoints(folder)
        d = Dispatcher(pub, pull, 1, LAYOUT.fingerprint())
        stack.callback(d.close)
        cpu = kernels.get_backend("cpu")
        store = LocalDirStore(str(tmp_path), LAYOUT.fingerprint())
        sc = Sidecar(cpu.allocate_device_cache(LAYOUT), layout=LAYOUT, rank=0,
                     pub_endpoint=pub, pull_endpoint=pull, backend="cpu", gated=True,
                     store=store)
        stack.callback(sc.close)
        d.wait_for_ranks(10)
        seq = d.publish([P.Op(0, P.H2S, src=P.as_ids([2]), keys=(digest(9),))], 0)
        done = poll_until_done(d, seq)[seq]  # never released, still done
        assert done.ok and done.results[0].done == 1
