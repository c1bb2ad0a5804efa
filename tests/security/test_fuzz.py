"""Fuzzing (hypothesis) of the codec and of both actors' message handling: random bytes and
mutated valid messages never raise anything but ProtocolError from ``decode``, never crash
the worker actor or the dispatcher, and never change cache state unless they are a valid
message for the receiver's current state."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zkv.kernels as kernels
from tests.worker.helpers import FakeRank, short_ipc_dir
from zkv import protocol as P
from zkv.config import CacheLayout
from zkv.errors import ProtocolError
from zkv.scheduler.dispatcher import Dispatcher
from zkv.security import Keyring
from zkv.worker.actor import EXIT_SEQ_GAP, WorkerActor
from zkv.worker.layers import LayerDoneCounter

LAYOUT = CacheLayout(num_layers=2, kv_heads=1, block_size=4, head_dim=8, dtype="float16",
                     num_device_blocks=8, num_host_blocks=8, world_size=2)
SEQ = 5
FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

KEYS = tuple(bytes([i]) * 16 for i in range(3))
VALID: list[P.Message] = [
    P.CopyBlocks(SEQ, 1, (
        P.Op(1, P.D2H, P.as_ids([0, 1]), P.as_ids([2, 3])),
        P.Op(2, P.H2D, P.as_ids([4]), P.as_ids([5]), layerwise=True),
        P.Op(3, P.FILL, dst=P.as_ids([6, 7, 2]), keys=KEYS),
        P.Op(4, P.CHECK, src=P.as_ids([6]), keys=KEYS[:1]),
        P.Op(5, P.H2S, src=P.as_ids([1]), keys=KEYS[1:2]))),
    P.BlocksCopied(SEQ, 0, True, (P.OpResult(1, True, 2), P.OpResult(2, False, 0, "x")), 1.0, 2.0),
    P.Hello(0, 4242, "fp", LAYOUT.to_json()),
    P.Heartbeat(0, 4242, SEQ),
    P.Bye(0, 4242, "bye"),
    P.Shutdown("done"),
]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                               max_size=3),
    max_leaves=6)


@st.composite
def mutated(draw: Any, msg: P.Message | None = None) -> list[bytes]:
    """A valid message's frames with one to three mutations."""
    frames = [bytes(f) for f in P.encode(msg if msg is not None
                                         else draw(st.sampled_from(VALID)))]
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["flip", "cut", "drop", "dup", "insert", "field", "swap"]))
        i = draw(st.integers(0, len(frames) - 1)) if frames else 0
        if how == "flip" and frames and frames[i]:
            j = draw(st.integers(0, len(frames[i]) - 1))
            b = bytearray(frames[i])
            b[j] ^= draw(st.integers(1, 255))
            frames[i] = bytes(b)
        elif how == "cut" and frames:
            frames[i] = frames[i][:draw(st.integers(0, max(0, len(frames[i]) - 1)))]
        elif how == "drop" and frames:
            del frames[i]
        elif how == "dup" and frames:
            frames.insert(i, frames[i])
        elif how == "insert":
            frames.insert(i, draw(st.binary(max_size=40)))
        elif how == "swap" and len(frames) > 1:
            j = draw(st.integers(0, len(frames) - 1))
            frames[i], frames[j] = frames[j], frames[i]
        elif how == "field" and len(frames) > 1:
            try:
                hdr = orjson.loads(frames[1])
            except orjson.JSONDecodeError:
                continue
            if isinstance(hdr, dict) and hdr:
                key = draw(st.sampled_from(sorted(hdr)))
                hdr[key] = draw(json_values)
                frames[1] = orjson.dumps(hdr)
    return frames


random_frames = st.lists(st.binary(max_size=64), max_size=6)
any_frames = random_frames | mutated()


# ---------------------------------------------------------------- codec


@FUZZ
@given(any_frames)
def test_decode_raises_only_protocol_error(frames: list[bytes]) -> None:
    limits = P.Limits(LAYOUT.num_device_blocks, LAYOUT.num_host_blocks)
    for lim in (None, limits):
        try:
            msg = P.decode(frames, lim)
        except ProtocolError:
            continue
        again = P.decode(P.encode(msg), lim)  # what decodes, re-encodes to the same
        if not isinstance(msg, P.CopyBlocks):
            assert again == msg
            continue
        assert isinstance(again, P.CopyBlocks) and (again.seq, again.step) == (msg.seq, msg.step)
        for x, y in zip(again.ops, msg.ops, strict=True):  # arrays compare by value
            assert (x.id, x.kind, x.keys, x.layerwise) == (y.id, y.kind, y.keys, y.layerwise)
            assert x.src.tolist() == y.src.tolist() and x.dst.tolist() == y.dst.tolist()


# ---------------------------------------------------------------- worker actor


@pytest.fixture(scope="module")
def actor() -> Iterator[tuple[WorkerActor, zmq.Socket[Any]]]:
    """A rank's actor whose ``_on_frames`` the tests call directly, acking into a real
    PULL socket (inproc) that the test drains."""
    import torch

    cpu = kernels.get_backend("cpu")
    ctx: zmq.Context[Any] = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        with short_ipc_dir() as folder:
            a = WorkerActor(0, LAYOUT, cpu.allocate_device_cache(LAYOUT),
                            cpu.allocate_host_pool(LAYOUT), cpu,
                            pub_endpoint=f"ipc://{folder}/p", pull_endpoint=f"ipc://{folder}/q")
        pull.bind("inproc://acks")
        push.connect("inproc://acks")
        a._push = push
        gen = torch.Generator().manual_seed(0)
        for t in [t for kv in a.kv_caches for t in kv] + [a.host_pool]:
            t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))
        yield a, pull
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()


def _snapshot(a: WorkerActor) -> list[Any]:
    return [t.clone() for kv in a.kv_caches for t in kv] + [a.host_pool.clone()]


@FUZZ
@given(any_frames)
def test_worker_actor_survives_anything_and_the_cache_is_untouched(
        actor: tuple[WorkerActor, zmq.Socket[Any]], frames: list[bytes]) -> None:
    a, acks = actor
    a._expected, a._last_seq = SEQ, SEQ - 1
    a.counter = LayerDoneCounter(LAYOUT.num_layers, a.backend)
    try:
        msg = P.decode(frames, a.limits)
    except ProtocolError:
        msg = None
    runs = isinstance(msg, P.CopyBlocks) and msg.seq == SEQ  # a valid batch: it runs
    before = _snapshot(a)
    outcome = a._on_frames(frames)  # must not raise
    if isinstance(msg, P.Shutdown):
        assert outcome == (0, "shutdown")
    elif outcome is not None:
        assert outcome[0] == EXIT_SEQ_GAP  # a batch from the future: a defined stop
    if not runs:
        import torch

        for x, y in zip(before, _snapshot(a), strict=True):  # bit for bit (NaN patterns too)
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    while acks.poll(0):  # a refused batch with our seq is acked as failed, nothing else
        ack = P.decode(acks.recv_multipart())
        assert isinstance(ack, P.BlocksCopied) and ack.seq == SEQ
        assert runs or not any(r.ok for r in ack.results)


# ---------------------------------------------------------------- dispatcher


@pytest.fixture(scope="module")
def dispatcher() -> Iterator[tuple[Dispatcher, FakeRank, FakeRank]]:
    """A dispatcher with a batch in flight, CURVE keys, and two ranks; rank 1's sockets
    send the fuzz (so everything it says as rank 0 is also forgery)."""
    keyring = Keyring.generate(2)
    ctx: zmq.Context[Any] = zmq.Context()
    d = Dispatcher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", 2, LAYOUT, context=ctx, keys=keyring,
                   heartbeat_timeout_s=600.0, ack_timeout_s=600.0)
    ranks = [FakeRank(ctx, d.pub_endpoint, d.pull_endpoint, r, LAYOUT.fingerprint(),
                      pid=4242 + r, keys=keyring.for_rank(r)) for r in range(2)]
    try:
        for r in ranks:
            r.subscribe()
            r.send(P.Hello(r.rank, r.pid, LAYOUT.fingerprint(), LAYOUT.to_json()))
        d.wait_for_ranks(10)
        for _ in range(SEQ):  # seqs 0..SEQ-1 done; SEQ stays in flight
            d.publish([], step=0)
            for r in ranks:
                r.ack(r.recv_batch())
            while not d.poll(1.0):
                pass
        assert d.publish([P.Op(1, P.D2H, P.as_ids([0]), P.as_ids([0]))], step=1) == SEQ
        yield d, ranks[0], ranks[1]
    finally:
        d.close(shutdown=False)
        for r in ranks:
            r.close()
        ctx.term()


def _state(d: Dispatcher) -> tuple[Any, ...]:
    b = d._in_flight.get(SEQ)
    return (d.in_flight, b and b.acked, b and dict(b.results), d.lost_ranks,
            len(d._completed), d.joined)


@FUZZ
@given(any_frames | mutated(P.BlocksCopied(SEQ, 1, True, (P.OpResult(1, True, 1),))))
def test_dispatcher_survives_anything_and_commits_only_a_valid_ack(
        dispatcher: tuple[Dispatcher, FakeRank, FakeRank], frames: list[bytes]) -> None:
    d, _, fuzzer = dispatcher
    if not frames:
        return  # a ZeroMQ message has at least one frame
    before, received = _state(d), d.num_received
    fuzzer.push.send_multipart(frames)
    while d.num_received == received:
        d._drain()  # (poll would hand completed batches out; look at the state instead)
    try:
        msg = P.decode(frames)
    except ProtocolError:
        msg = None
    legit = (isinstance(msg, P.BlocksCopied) and msg.rank == 1 and msg.seq == SEQ
             and {r.id for r in msg.results} <= {1}) or (
        isinstance(msg, P.Bye) and msg.rank == 1 and msg.pid == fuzzer.pid)
    if not legit:  # (a valid ack or bye of rank 1 itself may change the state)
        assert _state(d) == before
