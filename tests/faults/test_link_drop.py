"""A rank's TCP link to a running scheduler drops and comes back (a blip between nodes):
the rank reconnects on its own (libzmq) and, as after a restart, starts over at seq 0 and
says hello. The scheduler it reaches is the same one: what it published meanwhile went
with the old connection. The defined outcome is the rank lost with a reason that says
so, on both sides, never a rank that waits for a seq 0 that never comes or stops on a
bare "seq gap".

The link is real TCP through a forwarding proxy on loopback whose connections the test
cuts (both ends see the connection close, as when a switch or a NAT drops it)."""

from __future__ import annotations

import socket
import threading
from contextlib import ExitStack
from typing import Any

import pytest
import zmq

import zkv.kernels as kernels
from tests.waiting import idle_for, wait_until
from tests.worker.helpers import FakeScheduler, poll_until_done
from tests.worker.test_actor import LAYOUT
from zkv import protocol as P
from zkv.errors import RankLost
from zkv.exit_codes import EXIT_REFUSED, EXIT_SEQ_GAP
from zkv.scheduler.dispatcher import Dispatcher
from zkv.security import ClientKeys, Keyring
from zkv.worker import Sidecar


class TcpProxy:
    """Forwards connections on a loopback port to ``target`` (a ``tcp://`` endpoint).
    ``cut()`` closes every connection it carries and keeps listening: peers reconnect."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self._target = (host, int(port))
        self._listen = socket.create_server(("127.0.0.1", 0))
        self._listen.settimeout(0.05)
        self.endpoint = f"tcp://127.0.0.1:{self._listen.getsockname()[1]}"
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()
        self.num_accepted = 0
        self._start(self._accept)

    def _start(self, fn: Any, *args: Any) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        with self._lock:
            self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                down, _ = self._listen.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            up = socket.create_connection(self._target, timeout=5)
            up.settimeout(None)
            with self._lock:
                self._conns += [down, up]
                self.num_accepted += 1
            self._start(self._pump, down, up)
            self._start(self._pump, up, down)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self._closed.set()
        self.cut()
        self._listen.close()
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(5)
            assert not t.is_alive(), "a proxy thread did not end"


def _proxies(stack: ExitStack, pub: str, pull: str) -> tuple[TcpProxy, TcpProxy]:
    proxies = (TcpProxy(pub), TcpProxy(pull))
    for p in proxies:
        stack.callback(p.close)
    return proxies


def _sidecar(stack: ExitStack, pub: str, pull: str, keys: ClientKeys | None) -> Sidecar:
    kv = kernels.get_backend("cpu").allocate_device_cache(LAYOUT)
    sc = Sidecar(kv, layout=LAYOUT, rank=0, pub_endpoint=pub, pull_endpoint=pull,
                 backend="cpu", heartbeat_interval_s=0.05, keys=keys)
    stack.callback(sc.close)
    return sc


def _fill(d: Dispatcher, op_id: int) -> int:
    keys = (b"k" * P.DIGEST_SIZE,)
    return d.publish([P.Op(op_id, P.FILL, dst=P.as_ids([op_id]), keys=keys)], step=op_id)


def test_a_dropped_link_to_the_running_scheduler_loses_the_rank_with_the_reason(
        stack: ExitStack) -> None:
    """A real Dispatcher and a real actor over TCP (CURVE, as between nodes). After the
    cut the rank says hello on its new connection; the scheduler refuses it (the rank
    stops, exit 4, saying its link dropped) and declares it lost, so the next publish
    fails at once. (Before: the hello was ignored; the rank waited for a seq 0 that never
    comes, for good on an idle engine, or stopped on the next batch with a bare "seq gap:
    expected 0 got 1".)"""
    ctx: zmq.Context[Any] = zmq.Context()
    stack.callback(ctx.term)
    keys = Keyring.generate(1)
    d = Dispatcher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", 1, LAYOUT.fingerprint(),
                   context=ctx, keys=keys, heartbeat_timeout_s=30.0)
    stack.callback(lambda: d.close(shutdown=False))
    pub, pull = _proxies(stack, d.pub_endpoint, d.pull_endpoint)
    sc = _sidecar(stack, pub.endpoint, pull.endpoint, keys.for_rank(0))
    d.wait_for_ranks(10)
    seq = _fill(d, 0)
    assert poll_until_done(d, seq)[seq].ok

    pub.cut()
    pull.cut()
    wait_until(lambda: sc.actor.exit_code is not None, 15, "the rank to stop",
               step=lambda: d.poll(0.05))  # (as an engine polls at every step)
    assert sc.actor.exit_code == EXIT_REFUSED, (sc.actor.exit_code, sc.actor.exit_reason)
    assert "link to the scheduler dropped and came back" in (sc.actor.exit_reason or "")
    assert pub.num_accepted >= 2  # (it did reconnect: the refusal came on the new link)

    with pytest.raises(RankLost, match="rank 0 is dead"):  # (what a lost rank gets)
        _fill(d, 1)


def test_a_batch_of_the_same_scheduler_after_a_dropped_link_is_a_gap_that_says_so(
        stack: ExitStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's batch can reach the rank's new connection before its refusal does
    (or a scheduler without the refusal): seq 1 where the rank, started over, expects 0.
    The rank stops on the gap, and its reason names the dropped link."""
    monkeypatch.setenv("ZKV_INSECURE", "1")  # (the fake scheduler speaks plain tcp)
    ctx: zmq.Context[Any] = zmq.Context()
    stack.callback(ctx.term)
    fake = FakeScheduler(ctx, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    stack.callback(fake.close)
    eps = (fake.xpub.getsockopt_string(zmq.LAST_ENDPOINT),
           fake.pull.getsockopt_string(zmq.LAST_ENDPOINT))
    pub, pull = _proxies(stack, *eps)
    sc = _sidecar(stack, pub.endpoint, pull.endpoint, None)
    fake.wait_ready({0})
    fake.send(P.encode(P.CopyBlocks(0, 0, ())))
    ack = fake.recv(5)
    assert isinstance(ack, P.BlocksCopied) and ack.seq == 0

    pub.cut()
    pull.cut()
    hello = fake.recv(15)  # the rank's hello on its new connection
    assert isinstance(hello, P.Hello), hello
    # Sent until it arrives: the new connection's subscription may come after the hello
    # (a PUB drops what no subscriber takes), and it may not be reported again (the old
    # connection's may still count). The rank reads nothing else meanwhile.
    wait_until(lambda: sc.actor.exit_code is not None, 10, "the rank to stop",
               step=lambda: (fake.send(P.encode(P.CopyBlocks(1, 1, ()))), idle_for(0.05)))
    assert sc.actor.exit_code == EXIT_SEQ_GAP
    assert sc.actor.exit_reason is not None
    assert sc.actor.exit_reason.startswith("seq gap: expected 0 got 1")
    assert "dropped and came back to the same running scheduler" in sc.actor.exit_reason
