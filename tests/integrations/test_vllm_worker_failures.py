"""The connector's worker half reports every load that failed, and waits on its fence
(CPU backend, real Sidecar and Dispatcher). From a mutation review: with the ack's failure
ignored, a timed-out layer forgotten, or the ungated fence skipped, no test failed."""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.waiting import wait_until
from tests.worker.helpers import endpoints, poll_until_done, short_ipc_dir
from zkv import protocol as P
from zkv.config import CacheLayout
from zkv.integrations.vllm.config import parse_extra_config
from zkv.integrations.vllm.records import ZkvMetadata
from zkv.integrations.vllm.worker import WorkerHalf, _FaultyLoads
from zkv.kernels import TorchCpuBackend
from zkv.scheduler.dispatcher import Dispatcher
from zkv.security import Keyring
from zkv.worker import Sidecar

LAYOUT = CacheLayout(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float32",
                     num_device_blocks=8, num_host_blocks=8)


def _half(folder: str, backend: Any, *, gated: bool, kv: Any = None,
          **extra: Any) -> tuple[WorkerHalf, Dispatcher]:
    kv = kv if kv is not None else TorchCpuBackend().allocate_device_cache(LAYOUT)
    pub, pull = endpoints(folder)
    d = Dispatcher(pub, pull, 1, LAYOUT.fingerprint())
    w = WorkerHalf(parse_extra_config({"storage": "none", **extra}), 0)
    w.layer_index = {f"l{i}": i for i in range(LAYOUT.num_layers)}
    w.gated = gated
    w.sidecar = Sidecar(kv, layout=LAYOUT, rank=0, pub_endpoint=pub, pull_endpoint=pull,
                        backend=backend, heartbeat_interval_s=0.05, gated=gated)
    d.wait_for_ranks(10)
    return w, d


def test_a_failed_load_ack_is_a_load_error_without_the_layer_hooks() -> None:
    """A full CUDA graph replays the forward without wait_for_layer_load: the ack of the
    load batch alone must report every block that did not arrive."""
    with short_ipc_dir() as folder:
        w, d = _half(folder, _FaultyLoads(TorchCpuBackend(), (0,)), gated=True)
        try:
            seq = d.publish([P.Op(0, P.H2D, P.as_ids([0, 1, 2]), P.as_ids([4, 5, 6]),
                                  layerwise=True)], 0)
            w.bind(ZkvMetadata(step=0, release_upto=seq, load_seq=seq, load_op=0,
                               loads=[4, 5, 6]))
            assert not poll_until_done(d, seq, 10)[seq].ok
            assert w.load_errors() == {4, 5, 6}
        finally:
            w.close()
            d.close()



def test_a_load_failing_every_step_is_three_error_lines_and_a_count_at_close() -> None:
    """A copy path that fails every load (a broken device) fails one each step: 3 error
    lines, then only counts, written at close (before: a line a step, for as long as the
    cause lasted). Every failed load is still reported to vLLM, and another cause's first
    line (a layer that timed out) is not held back by the first cause's limit."""
    n = 7
    with short_ipc_dir() as folder:
        w, d = _half(folder, _FaultyLoads(TorchCpuBackend(), tuple(range(n))), gated=True,
                     layer_timeout_s=0.3)
        try:
            with capture_logs() as logs:
                for step in range(n):
                    seq = d.publish([P.Op(step, P.H2D, P.as_ids([0, 1]), P.as_ids([4, 5]),
                                          layerwise=True)], 0)
                    w.bind(ZkvMetadata(step=step, release_upto=seq, load_seq=seq,
                                       load_op=step, loads=[4, 5]))
                    assert not poll_until_done(d, seq, 10)[seq].ok
                    assert w.load_errors() == {4, 5}
                failed = [e for e in logs if e["event"] == "connector.load_failed"]
                assert len(failed) == 3 and all(e["log_level"] == "error" for e in failed)
                # then a load released too late: its layer times out, a cause of its own
                seq = d.publish([P.Op(n, P.H2D, P.as_ids([0]), P.as_ids([6]),
                                      layerwise=True)], 0)
                w.bind(ZkvMetadata(step=n, release_upto=-1, load_seq=seq, load_op=n,
                                   loads=[6]))
                w.wait_for_layer_load("l0")
                w.sidecar.release(seq)
                poll_until_done(d, seq, 10)
                assert w.load_errors() == {6}
                late = [e for e in logs if e["event"] == "connector.load_failed"
                        and e.get("abandoned")]
                assert len(late) == 1, late
                w.close()
        finally:
            w.close()
            d.close()
    (summary,) = [e for e in logs if e["event"] == "connector.load_failed" and e.get("summary")]
    assert (summary["num_suppressed"], summary["num_total"]) == (n - 3, n), summary
    # which of the three causes (copy, layer timeout, ack) it counted: the failed acks
    # (was: no cause, one such summary per cause at close)
    assert summary["cause"] == "ack_failed", summary
    assert {e.get("cause") for e in failed} == {"ack_failed"}
    assert late[0]["cause"] == "layer_timed_out"


def test_a_load_bound_after_close_is_recomputed_without_an_error_line() -> None:
    """vLLM's teardown may ask a closed worker half for its load errors: every block is
    one (nothing will arrive), said at info with the reason, not as a failed load."""
    with short_ipc_dir() as folder:
        w, d = _half(folder, TorchCpuBackend(), gated=True)
        w.close()
        d.close()
        w.bind(ZkvMetadata(step=0, release_upto=-1, load_seq=3, load_op=0, loads=[4, 5]))
        with capture_logs() as logs:
            assert w.load_errors() == {4, 5}
        [line] = [e for e in logs if e["event"] == "connector.load_failed"]
        assert line["log_level"] == "info" and line["error"] == "closed", line


def test_a_keyring_in_vllms_environment_does_not_keep_the_rank_out(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """The connector's scheduler half builds its Dispatcher without keys (its sockets are
    in a private ipc directory): a ``$ZKV_KEYS`` vLLM inherited (zkvrun exports one) must
    not make the worker half speak CURVE to it. (It did: the rank never joined, and vLLM
    waited 120 s for a start that failed without naming keys.)"""
    monkeypatch.setenv("ZKV_KEYS", Keyring.generate(1).save(os.path.join(tmp_path, "keys")))
    with short_ipc_dir() as folder:
        pub, pull = endpoints(folder)
        d = Dispatcher(pub, pull, 1, LAYOUT.fingerprint())
        w = WorkerHalf(parse_extra_config({"storage": "none"}), 0)
        try:
            kv = TorchCpuBackend().allocate_device_cache(LAYOUT)
            w.start([f"l{i}" for i in range(LAYOUT.num_layers)], kv, LAYOUT,
                    pub_endpoint=pub, pull_endpoint=pull, store=None)
            d.wait_for_ranks(10)
        finally:
            w.close()
            d.close()

def _recomputed(kv: Any, block: int, value: float) -> bool:
    return all(bool((part[block] == value).all()) for layer in kv for part in layer)


def _write(kv: Any, blocks: tuple[int, ...], value: float) -> None:
    """The engine's forward writes ``blocks`` of every layer."""
    for layer in kv:
        for part in layer:
            for b in blocks:
                part[b].fill_(value)


def test_a_layer_that_timed_out_is_a_load_error_and_its_copy_never_lands() -> None:
    """The forward went past layer 0 without its KV (wait timed out) and vLLM recomputes
    the block: the blocks are reported, and the load, released later, must not write them
    (before: it landed over the recomputed KV, and its ack said ok)."""
    with short_ipc_dir() as folder:
        kv = TorchCpuBackend().allocate_device_cache(LAYOUT)
        w, d = _half(folder, TorchCpuBackend(), gated=True, kv=kv, layer_timeout_s=0.3)
        try:
            assert w.sidecar is not None
            w.sidecar.host_pool[0].fill_(7.0)  # what the load would bring
            seq = d.publish([P.Op(0, P.H2D, P.as_ids([0]), P.as_ids([4]), layerwise=True)], 0)
            # the step's metadata released nothing yet (a late release): layer 0 times out
            w.bind(ZkvMetadata(step=0, release_upto=-1, load_seq=seq, load_op=0, loads=[4]))
            w.wait_for_layer_load("l0")
            w.wait_for_layer_load("l1")  # at once: the load was called off
            _write(kv, (4,), 3.0)  # vLLM recomputes the block
            w.sidecar.release(seq)
            done = poll_until_done(d, seq, 10)[seq]
            assert not done.ok and "abandoned" in str(done.results[0].error), done
            assert w.load_errors() == {4}
            assert _recomputed(kv, 4, 3.0), "the abandoned load wrote the recomputed block"
        finally:
            w.close()
            d.close()


class _Held(TorchCpuBackend):
    """Copies of one kind (``"d2h"``: a device busy with an earlier save; ``"h2d"``: a load
    copy still running when the forward gives up on it) run only once the test lets them
    (``go``); ``copying``: one started."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.go = threading.Event()
        self.copying = threading.Event()

    def _hold(self, kind: str) -> None:
        if kind == self.kind:
            self.copying.set()
            self.go.wait(10)

    def copy_d2h(self, *a: Any, **k: Any) -> None:
        self._hold("d2h")
        super().copy_d2h(*a, **k)

    def copy_h2d(self, *a: Any, **k: Any) -> None:
        self._hold("h2d")
        super().copy_h2d(*a, **k)


@contextlib.contextmanager
def _held_half(kind: str = "d2h") -> Iterator[tuple[Any, _Held, WorkerHalf, Dispatcher]]:
    """An ungated worker half (a 0.2 s layer timeout) whose ``kind`` copies wait for
    ``go``: (its KV cache, the backend, the half, the dispatcher)."""
    with short_ipc_dir() as folder:
        kv = TorchCpuBackend().allocate_device_cache(LAYOUT)
        backend = _Held(kind)
        w, d = _half(folder, backend, gated=False, kv=kv, layer_timeout_s=0.2)
        try:
            assert w.sidecar is not None
            yield kv, backend, w, d
        finally:
            backend.go.set()
            w.close()
            d.close()


def test_a_load_abandoned_before_its_batch_began_never_lands() -> None:
    """The actor is still on an earlier batch when the forward gives up on the load: the
    load's batch, reached later, writes nothing and fails its op."""
    with _held_half() as (kv, backend, w, d):
        assert w.sidecar is not None
        w.sidecar.host_pool[0].fill_(7.0)
        save = d.publish([P.Op(0, P.D2H, P.as_ids([5]), P.as_ids([1]))], 0)
        load = d.publish([P.Op(1, P.H2D, P.as_ids([0]), P.as_ids([4]), layerwise=True)], 1)
        w.bind(ZkvMetadata(step=1, release_upto=load, load_seq=load, load_op=1, loads=[4]))
        w.wait_for_layer_load("l0")
        _write(kv, (4,), 3.0)
        backend.go.set()
        both = poll_until_done(d, {save, load}, 10)
        done = both[load]
        assert both[save].ok
        assert not done.ok and "abandoned" in str(done.results[1].error), done
        assert w.load_errors() == {4}
        assert _recomputed(kv, 4, 3.0), "the abandoned load wrote the recomputed block"


class _SlowSaves(TorchCpuBackend):
    """A d2h that takes half a second (a slow device), so the fence has something to wait
    for."""

    slow = threading.Event()  # never set: its wait is the copy's duration

    def copy_d2h(self, *a: Any, **k: Any) -> None:
        self.slow.wait(0.5)
        super().copy_d2h(*a, **k)


def test_an_ungated_worker_waits_on_the_fence_before_the_forward() -> None:
    with short_ipc_dir() as folder:
        w, d = _half(folder, _SlowSaves(), gated=False)
        try:
            seq = d.publish([P.Op(0, P.D2H, P.as_ids([4]), P.as_ids([0]))], 0)
            w.bind(ZkvMetadata(step=1, release_upto=seq, fence=seq))
            assert w.sidecar.last_seq >= seq, "the forward started while the save still read"
        finally:
            w.close()
            d.close()


def test_a_gated_worker_without_a_load_waits_for_the_released_batch() -> None:
    """Gated, a step without a load: its forward may write a block this step's batch
    still saves (evicted and reused in the same step), so it starts once that batch, the
    last one released, was acked; not only the batch before it."""
    with short_ipc_dir() as folder:
        w, d = _half(folder, _SlowSaves(), gated=True)
        try:
            seq = d.publish([P.Op(0, P.D2H, P.as_ids([4]), P.as_ids([0]))], 0)
            w.bind(ZkvMetadata(step=1, release_upto=seq))
            assert w.sidecar.last_seq >= seq, "the forward started while the save still read"
        finally:
            w.close()
            d.close()


def test_saves_past_a_timed_out_fence_never_store_what_the_forward_wrote() -> None:
    """Request A finished (its save: device block 5, in batch ``fence``) and vLLM gave
    block 5 to request B; the actor is still inside an earlier save (batch ``busy``) when
    the forward's wait for the fence times out. The forward goes on and B writes block 5:
    neither save may commit. Before, A's save ran later, copied B's KV and acked ok: the
    scheduler stored B's KV under A's block hashes (L2, then L3)."""
    with _held_half() as (kv, backend, w, d):
        assert w.sidecar is not None
        _write(kv, (5, 6), 1.0)  # A's KV (and an earlier request's)
        busy = d.publish([P.Op(0, P.D2H, P.as_ids([6]), P.as_ids([2]))], 0)
        fence = d.publish([P.Op(1, P.D2H, P.as_ids([5]), P.as_ids([1]))], 1)
        w.bind(ZkvMetadata(step=2, release_upto=fence, fence=fence))  # gives up at 0.2 s
        _write(kv, (5, 6), 9.0)  # B's forward
        backend.go.set()
        done = poll_until_done(d, {busy, fence}, 10)
        assert "while it ran" in str(done[busy].results[0].error), done[busy]
        assert "abandoned" in str(done[fence].results[1].error), done[fence]
        assert not done[busy].ok and not done[fence].ok
        assert bool((w.sidecar.host_pool[1] == 0).all()), "A's save copied after the forward"



class _QueuedSaves(TorchCpuBackend):
    """Events as on a GPU: a d2h issued is only queued, and the batch's sync before its ack
    waits until the test lets the copy run (``go``); the compute stream's waits are kept."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.events = 0
        self.compute_waited: list[Any] = []
        self.after_d2h: str | None = None  # the first event recorded after the d2h

    def copy_d2h(self, *a: Any, **k: Any) -> None:
        super().copy_d2h(*a, **k)
        self.after_d2h = f"event-{self.events + 1}"

    def record_event(self) -> Any:
        self.events += 1
        return f"event-{self.events}"

    def synchronize_event(self, handle: Any) -> None:
        self.go.wait(10)

    def wait_event_on_compute(self, handle: Any, compute_stream: int | None = None) -> None:
        self.compute_waited.append(handle)


def test_a_forward_past_a_timed_out_fence_waits_on_the_queued_save() -> None:
    """On a GPU the fence's save may be issued (queued on the transfer stream) and not have
    run when the forward gives up waiting for its ack: the forward's writes must then wait
    on that copy's event, or the copy reads them. (Only a save still running was waited.)"""
    with short_ipc_dir() as folder:
        backend = _QueuedSaves()
        w, d = _half(folder, backend, gated=False, layer_timeout_s=0.2)
        try:
            assert w.sidecar is not None
            fence = d.publish([P.Op(0, P.D2H, P.as_ids([5]), P.as_ids([1]))], 0)
            wait_until(lambda: backend.after_d2h is not None, 10.0, "the save's d2h issued")
            w.bind(ZkvMetadata(step=1, release_upto=fence, fence=fence))  # gives up at 0.2 s
            assert backend.after_d2h in backend.compute_waited, backend.compute_waited
            backend.go.set()
            assert poll_until_done(d, fence, 10)[fence].ok  # it ran before the forward's writes
        finally:
            backend.go.set()
            w.close()
            d.close()


def test_the_next_forward_waits_for_a_load_copy_that_outran_its_abandon() -> None:
    """Ungated: the forward gave up on layer 0 while its copy still ran, and the abandon's
    own wait ran out too. The next forward must not start before that copy landed, or it
    lands over what vLLM recomputes (an ungated forward waits for its fence alone)."""
    with _held_half("h2d") as (kv, backend, w, d):
        assert w.sidecar is not None
        w.sidecar.host_pool[0].fill_(7.0)
        load = d.publish([P.Op(0, P.H2D, P.as_ids([0]), P.as_ids([4]), layerwise=True)], 0)
        w.bind(ZkvMetadata(step=0, release_upto=load, load_seq=load, load_op=0, loads=[4]))
        assert backend.copying.wait(10)
        w.wait_for_layer_load("l0")  # gives up; so does the abandon: the copy still runs
        assert w.load_errors() == {4}
        waiting = threading.Event()
        wait_acked = w.sidecar.wait_acked

        def watched(seq: int, timeout: float | None = None) -> Any:
            waiting.set()  # the next forward waits here, for the load's batch
            return wait_acked(seq, timeout)

        w.sidecar.wait_acked = watched  # type: ignore[method-assign]
        letter = threading.Thread(target=lambda: waiting.wait(10) and backend.go.set(),
                                  daemon=True)
        letter.start()
        w.bind(ZkvMetadata(step=1, release_upto=load, fence=-1))  # the next step
        _write(kv, (4,), 3.0)  # its forward: vLLM recomputes block 4
        backend.go.set()
        waiting.set()  # (the letter's wait ends either way)
        letter.join(10)
        assert not poll_until_done(d, load, 10)[load].ok  # abandoned: never committed
        assert _recomputed(kv, 4, 3.0), "the load's copy landed after the next forward"


class _FailsOneHoldsTheRest(_Held):
    """Layer 0 of the load into block 4 fails; every later layer's copy waits for ``go``."""

    def copy_h2d(self, host: Any, kv: Any, src: Any, dst: Any, layer: int) -> None:
        if layer == 0 and 4 in [int(b) for b in dst]:
            raise RuntimeError("injected: the load into block 4 fails")
        if layer > 0:
            self._hold("h2d")
        TorchCpuBackend.copy_h2d(self, host, kv, src, dst, layer)


def test_a_load_that_failed_midway_calls_off_the_batchs_other_copies() -> None:
    """One op of the step's load batch fails at layer 0: vLLM recomputes every block of
    the step's loads (the wait raised), so the batch's other ops must not write later
    layers after it: ungated, nothing else held the next forward back (before, the other
    op's later layers were copied and acked ok after the engine had given up, over what the
    next forward recomputed; the timeout path called the load off already)."""
    with short_ipc_dir() as folder:
        kv = TorchCpuBackend().allocate_device_cache(LAYOUT)
        backend = _FailsOneHoldsTheRest("h2d")
        w, d = _half(folder, backend, gated=False, kv=kv, layer_timeout_s=0.2)
        try:
            assert w.sidecar is not None
            w.sidecar.host_pool[0].fill_(7.0)
            w.sidecar.host_pool[1].fill_(7.0)
            load = d.publish([P.Op(0, P.H2D, P.as_ids([0]), P.as_ids([4]), layerwise=True),
                              P.Op(1, P.H2D, P.as_ids([1]), P.as_ids([5]), layerwise=True)], 0)
            w.bind(ZkvMetadata(step=0, release_upto=load, load_seq=load, load_op=0,
                               loads=[4, 5]))
            w.wait_for_layer_load("l0")  # the load failed
            w.wait_for_layer_load("l1")
            assert w.load_errors() == {4, 5}
            letter = threading.Timer(0.05, backend.go.set)  # a copy held lands only then
            letter.start()
            w.bind(ZkvMetadata(step=1, release_upto=load, fence=-1))  # the next step
            _write(kv, (4, 5), 3.0)  # its forward: vLLM recomputes both blocks
            letter.join(10)
            done = poll_until_done(d, load, 10)[load]
            assert not done.ok and not done.results[0].ok, done
            assert _recomputed(kv, 5, 3.0), "the other op's copy landed after the next forward"
        finally:
            backend.go.set()
            w.close()
            d.close()


def test_a_load_whose_ack_timed_out_without_the_layer_hooks_never_lands() -> None:
    """A forward that ran no ``wait_for_layer_load`` (a full CUDA graph) learns of its load
    from the ack alone: when that wait times out, vLLM recomputes every block of the load,
    so the load must be called off as a timed-out layer is. (Before, the batch, reached
    later, copied the host blocks over what vLLM recomputed, and its ack said ok.)"""
    with _held_half() as (kv, backend, w, d):
        assert w.sidecar is not None
        w.sidecar.host_pool[0].fill_(7.0)
        save = d.publish([P.Op(0, P.D2H, P.as_ids([5]), P.as_ids([1]))], 0)  # held
        load = d.publish([P.Op(1, P.H2D, P.as_ids([0]), P.as_ids([4]), layerwise=True)], 1)
        w.bind(ZkvMetadata(step=1, release_upto=load, load_seq=load, load_op=1, loads=[4]))
        assert w.load_errors() == {4}  # no ack within 0.2 s: vLLM recomputes block 4
        _write(kv, (4,), 3.0)
        backend.go.set()
        both = poll_until_done(d, {save, load}, 10)
        assert both[save].ok
        assert not both[load].ok and "abandoned" in str(both[load].results[1].error), both
        assert _recomputed(kv, 4, 3.0), "the load landed over the recomputed block"
