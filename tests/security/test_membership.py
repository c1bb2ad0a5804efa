"""What a key holder (or a rank's own stale process) can do to the group's membership
through messages that pass CURVE: none of it costs another rank its place, grows the
scheduler without bound or raises out of its poll."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest
import zmq
from structlog.testing import capture_logs

from tests.security.test_curve import FP, _endpoints, _poll_until, group, keyring, transport
from tests.waiting import holds_within, wait_until
from tests.worker.helpers import FakeRank, events_named, poll_for, poll_until_done
from zkv import log as ev
from zkv import protocol as P
from zkv import security
from zkv.scheduler.dispatcher import Dispatcher
from zkv.scheduler.membership import MAX_SUB_PIDS
from zkv.security import Keyring

__all__ = ["group", "keyring", "transport"]  # (fixtures)


def test_a_first_message_that_arrives_in_pieces_never_raises_out_of_poll(
        group: tuple[Dispatcher, list[FakeRank]], ctx: zmq.Context[Any],
        keyring: Keyring) -> None:
    """With keys, libzmq queues a credential frame at the head of a new connection: while
    its first message (a 4 MB frame: several reads) still arrives, the socket reads as
    readable and a receive finds nothing. (Before, ``zmq.Again`` escaped ``poll``: one
    message from any key holder, or a rank's reconnect with a large ack queued, raised
    out of the engine's scheduling step.)"""
    d, _ = group
    for _ in range(5):
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        security.setup_client(push, keyring.for_rank(1), d.pull_endpoint)
        push.connect(d.pull_endpoint)
        before = d.refusals()["malformed"]
        push.send_multipart([P.T_ACK, b'{"v":1,"pad":"' + b"x" * (4 << 20) + b'"}'])
        try:
            _poll_until(d, lambda: d.refusals()["malformed"] == before + 1, "the refusal")
        finally:
            push.close(0)
    assert d.lost_ranks == frozenset()


def _xsub_of_rank_1(ctx: zmq.Context[Any], keyring: Keyring, d: Dispatcher) -> Any:
    """An XSUB with rank 1's key connected to the dispatcher's PUB: it sends upstream
    whatever bytes it likes."""
    x = ctx.socket(zmq.XSUB)
    x.setsockopt(zmq.LINGER, 0)
    security.setup_client(x, keyring.for_rank(1), d.pub_endpoint)
    x.connect(d.pub_endpoint)
    return x


def test_an_upstream_message_naming_another_ranks_marker_is_refused(
        group: tuple[Dispatcher, list[FakeRank]], ctx: zmq.Context[Any],
        keyring: Keyring) -> None:
    """Rank 1's key on an XSUB sends upstream a message that is no subscription (first
    byte 2) naming rank 0's ready marker: counted malformed, rank 0 stays. (Before, any
    first byte but 1 was an unsubscription, checked for no sender: rank 0 was lost.)"""
    d, (r0, r1) = group
    x = _xsub_of_rank_1(ctx, keyring, d)
    try:
        before = d.refusals()["malformed"]
        deadline = time.monotonic() + 10
        while d.refusals()["malformed"] == before:  # (sent again until the pipe is up)
            assert time.monotonic() < deadline, d.refusals()
            x.send(b"\x02" + P.ready_topic(0, r0.pid))
            poll_for(d, 0.05)
        poll_for(d, 0.3)  # past the grace a lost subscriber gets
        assert d.lost_ranks == frozenset()
        seq = d.publish([P.Op(0, P.D2H, P.as_ids([1]), P.as_ids([1]))], step=0)
        r0.ack(r0.recv_batch())
        r1.ack(r1.recv_batch())
        assert poll_until_done(d, seq)[seq].ok
    finally:
        x.close(0)


def test_a_process_replaced_before_the_start_is_told_to_stop(
        ctx: zmq.Context[Any], keyring: Keyring, transport: str, folder: str) -> None:
    """Two processes of one rank (a restart before the group started): the newer one's
    hello takes the place, the older one is told ``Refused`` and its acks never count for
    the rank. (Before, it was never told: it read every batch and its ok ack, which
    carries no pid, completed a batch the joined process failed.)"""
    kr = Keyring.generate(1)
    d = Dispatcher(*_endpoints(transport, folder), 1, FP, context=ctx, keys=kr,
                   heartbeat_timeout_s=60)
    a = FakeRank(ctx, d.pub_endpoint, d.pull_endpoint, 0, FP, pid=111, keys=kr.for_rank(0))
    b = FakeRank(ctx, d.pub_endpoint, d.pull_endpoint, 0, FP, pid=222, keys=kr.for_rank(0))
    try:
        a.join()
        _poll_until(d, lambda: d._ranks[0].joined_pid == 111, "A to join")
        b.join()
        _poll_until(d, lambda: d._ranks[0].joined_pid == 222, "B to join in A's place")
        d.wait_for_ranks(10)
        told = a.recv()
        assert isinstance(told, P.Refused) and (told.rank, told.pid) == (0, 111), told
        assert "replaced by pid 222" in told.reason
        seq = d.publish([P.Op(0, P.D2H, P.as_ids([1]), P.as_ids([1]))], step=0)
        failed = P.OpResult(0, False, 0, "the joined process failed the copy")
        b.ack(b.recv_batch(), {0: failed})
        done = poll_until_done(d, seq)[seq]
        assert not done.ok and done.results[0].error == f"rank 0: {failed.error}"
    finally:
        d.close(shutdown=False)
        a.close()
        b.close()


def test_a_replaced_process_neither_keeps_the_rank_alive_nor_loses_it(
        ctx: zmq.Context[Any], transport: str, folder: str) -> None:
    """The older process of a rank (replaced before the start, told to stop) may still
    send with the rank's key: neither its bye nor its subscriber going away (it stops, as
    told) may end the rank's place, nor its heartbeats stand in for the joined process's
    (a frozen rank would never be declared lost), nor its acks, refused as they are (they
    refreshed the rank's liveness before any check: an ack of a made-up seq every 50 ms
    kept a frozen rank 0 alive for good)."""
    kr = Keyring.generate(1)
    d = Dispatcher(*_endpoints(transport, folder), 1, FP, context=ctx, keys=kr,
                   heartbeat_timeout_s=1.0)
    a = FakeRank(ctx, d.pub_endpoint, d.pull_endpoint, 0, FP, pid=111, keys=kr.for_rank(0))
    b = FakeRank(ctx, d.pub_endpoint, d.pull_endpoint, 0, FP, pid=222, keys=kr.for_rank(0))
    try:
        a.join()
        _poll_until(d, lambda: d._ranks[0].joined_pid == 111, "A to join")
        b.join()
        _poll_until(d, lambda: d._ranks[0].joined_pid == 222, "B to join in A's place")
        d.wait_for_ranks(10)
        b_beats = lambda: (b.heartbeat(), d.poll(0.02))  # noqa: E731
        before = d.refusals()["malformed"]
        a.send(P.Bye(0, 111, "the replaced process stops"))
        a.send_raw([P.T_BYE, b"{}"])  # counted: A's bye (sent before it) was read then
        wait_until(lambda: d.refusals()["malformed"] == before + 1, what="A's messages",
                   step=b_beats)
        a.sub.close(0)  # the XPUB reports the unsubscription of A's ready marker
        assert not holds_within(lambda: 0 in d.lost_ranks, 0.5, step=b_beats)
        seq = d.publish([P.Op(0, P.D2H, P.as_ids([1]), P.as_ids([1]))], step=0)
        b.ack(b.recv_batch())
        assert poll_until_done(d, seq)[seq].ok
        # B goes silent; A beats and acks on: rank 0 is lost at B's heartbeat timeout
        # all the same
        wait_until(lambda: 0 in d.lost_ranks, timeout=5, what="rank 0 lost",
                   step=lambda: (a.heartbeat(99), a.send(P.BlocksCopied(10**9, 0, True, ())),
                                 d.poll(0.05)))
        assert "no heartbeat" in d._lost[0]
    finally:
        d.close(shutdown=False)
        a.close()
        b.close()


def test_ready_markers_of_made_up_pids_are_bounded(
        group: tuple[Dispatcher, list[FakeRank]]) -> None:
    """A rank subscribing to its own marker under many pids: the scheduler remembers at
    most ``MAX_SUB_PIDS`` (before: every one, for good), and after the start none but the
    joined process's."""
    d, (_, r1) = group
    for pid in range(1000, 1000 + 3 * MAX_SUB_PIDS):
        r1.sub.setsockopt(zmq.SUBSCRIBE, P.ready_topic(1, pid))
    deadline = time.monotonic() + 10
    while d._ranks[1].sub_pids.keys() != {r1.pid}:
        assert time.monotonic() < deadline, len(d._ranks[1].sub_pids)
        poll_for(d, 0.05)
    assert d._ranks[1].joined_pid == r1.pid


def test_a_hello_flood_logs_a_bounded_few_lines(ctx: zmq.Context[Any], transport: str,
                                                folder: str) -> None:
    """Hellos that are refused (another layout), and hellos whose fingerprint is a
    megabyte: a few lines, each short; the megabyte one is refused at decode. (Before:
    an error line per hello, each quoting what the peer sent: 200 hellos wrote 210 MB.)
    At close, one summary line counts the refusals the rate limit held back (before, it
    was never written for hellos), and a message whose type tag is a megabyte is quoted
    cut (before, whole: a megabyte line each)."""
    kr = Keyring.generate(1)
    d = Dispatcher(*_endpoints(transport, folder), 1, FP, context=ctx, keys=kr,
                   heartbeat_timeout_s=60)
    r = FakeRank(ctx, d.pub_endpoint, d.pull_endpoint, 0, FP, keys=kr.for_rank(0))
    try:
        with capture_logs() as logs:
            for i in range(60):
                r.send(P.Hello(0, 5000 + i, "another-layout"))
            hdr = {"v": P.PROTOCOL_VERSION, "rank": 0, "pid": 1, "layout": "f" * (1 << 20)}
            r.send_raw([P.T_HELLO, orjson.dumps(hdr)])
            hdr = {"v": "x" * (1 << 20)}
            r.send_raw([P.T_HELLO, orjson.dumps(hdr)])
            r.send_raw([P.T_BYE, orjson.dumps({"v": P.PROTOCOL_VERSION, "rank": 0, "pid": 1,
                                                "reason": "r" * (1 << 20)})])
            r.send_raw([b"X" * (1 << 20), orjson.dumps({"v": P.PROTOCOL_VERSION}), b"extra"])
            _poll_until(d, lambda: d.refusals()["hello"] == 60
                        and d.refusals()["malformed"] == 4, "the refusals")
            assert d._ranks[0].refused is not None  # still reported to wait_for_ranks
            d.close(shutdown=False)
        refused = events_named(logs, ev.RANK_REFUSED)
        assert 1 <= len(refused) <= 13, len(refused)
        [summary] = [e for e in refused if e.get("summary")]
        assert summary["num_total"] == 60
        assert max(len(repr(e)) for e in logs) < 8192
    finally:
        d.close(shutdown=False)
        r.close()


def test_a_storm_of_hellos_and_byes_before_the_start_logs_a_bounded_few_lines(
        ctx: zmq.Context[Any], transport: str, folder: str) -> None:
    """A rank's key holder says hello with a new pid each (each replaces the last), then
    hello / bye pairs: a few ``dispatcher.rank_left`` lines and, at close, one summary
    counting the rest. Before: a warning per message (300 hellos, 299 lines)."""
    kr = Keyring.generate(2)
    d = Dispatcher(*_endpoints(transport, folder), 2, FP, context=ctx, keys=kr,
                   heartbeat_timeout_s=60)
    r = FakeRank(ctx, d.pub_endpoint, d.pull_endpoint, 0, FP, keys=kr.for_rank(0))
    try:
        with capture_logs() as logs:
            for i in range(150):
                r.send(P.Hello(0, 5000 + i, FP))
            for _ in range(150):
                r.send(P.Hello(0, 7, FP))
                r.send(P.Bye(0, 7, "bye"))
            wait_until(lambda: d.num_received >= 450, what="the storm",
                       step=lambda: d.poll(0.02))
            d.close(shutdown=False)
        left = events_named(logs, ev.RANK_LEFT)
        assert 1 <= len(left) <= 13, len(left)
        [summary] = [e for e in left if e.get("summary")]
        assert summary["num_total"] == 300, summary  # 149 + 1 replaced, 150 byes
    finally:
        d.close(shutdown=False)
        r.close()


@pytest.mark.parametrize("reason", ["bye", "shutdown", "refused"])
def test_a_reason_of_escaped_characters_is_cut_after_escaping(reason: str) -> None:
    """Lone surrogates (a file name's undecodable bytes) grow six-fold when escaped: cut
    first, the reason passed what decode takes, and the message was refused (a rank's
    Bye lost its reason)."""
    long = "\udcff" * P.MAX_REASON_CHARS
    msg = {"bye": P.Bye(0, 1, long), "shutdown": P.Shutdown(long),
           "refused": P.Refused(0, 1, long)}[reason]
    out = P.decode(P.encode(msg)).reason  # type: ignore[union-attr]
    assert len(out) == P.MAX_REASON_CHARS and out.startswith("\\udcff")


@pytest.mark.parametrize("reason", ["bye", "shutdown", "refused"])
def test_reasons_are_cut_when_encoded_and_refused_when_longer(reason: str) -> None:
    long = "r" * (P.MAX_REASON_CHARS + 10)
    msg = {"bye": P.Bye(0, 1, long), "shutdown": P.Shutdown(long),
           "refused": P.Refused(0, 1, long)}[reason]
    assert len(P.decode(P.encode(msg)).reason) == P.MAX_REASON_CHARS  # type: ignore[union-attr]
    frames = P.encode(msg)
    hdr = orjson.loads(frames[1])
    hdr["reason"] = long
    with pytest.raises(P.ProtocolError, match="reason longer than"):
        P.decode([frames[0], orjson.dumps(hdr)])


def test_a_key_holder_subscribing_first_to_another_ranks_marker_cannot_keep_it_out(
        ctx: zmq.Context[Any], keyring: Keyring, transport: str, folder: str) -> None:
    """Rank 1's key subscribes to rank 0's ready marker before rank 0 does (its pid is
    easy to guess): counted forged, and rank 0 still joins. (Before, the XPUB reported a
    topic's first subscription only: rank 0's own one was never seen, so it never joined
    and the group did not start.)"""
    d = Dispatcher(*_endpoints(transport, folder), 2, FP, context=ctx, keys=keyring,
                   heartbeat_timeout_s=60)
    r0 = FakeRank(ctx, d.pub_endpoint, d.pull_endpoint, 0, FP, pid=1234,
                  keys=keyring.for_rank(0))
    r1 = FakeRank(ctx, d.pub_endpoint, d.pull_endpoint, 1, FP, keys=keyring.for_rank(1))
    try:
        r1.sub.setsockopt(zmq.SUBSCRIBE, P.ready_topic(0, r0.pid))
        wait_until(lambda: d.refusals()["forged"] == 1, 10, "the forged subscription",
                   step=lambda: d.poll(0.02))
        r1.join()
        r0.join()
        d.wait_for_ranks(10)
        assert d._ranks[0].joined_pid == r0.pid
    finally:
        d.close(shutdown=False)
        r0.close()
        r1.close()


def test_an_upstream_message_that_is_no_subscription_counts_once(
        group: tuple[Dispatcher, list[FakeRank]], ctx: zmq.Context[Any],
        keyring: Keyring) -> None:
    """One upstream message that is no (un)subscription is one ``malformed`` refusal.
    (Before, membership counted it and then the dispatcher's refuse counted it again:
    the metric read 2 per message.) The forged subscriptions around it show it was read:
    one pipe keeps them in order."""
    d, (r0, _) = group
    x = _xsub_of_rank_1(ctx, keyring, d)
    try:
        pid = iter(range(900000, 901000))
        before = d.refusals()
        deadline = time.monotonic() + 10
        while d.refusals()["forged"] == before["forged"]:  # (sent again until the pipe is up)
            assert time.monotonic() < deadline, d.refusals()
            x.send(b"\x01" + P.ready_topic(0, next(pid)))
            poll_for(d, 0.05)
        forged = d.refusals()["forged"]
        x.send(b"\x02" + P.ready_topic(0, r0.pid))
        x.send(b"\x01" + P.ready_topic(0, next(pid)))
        wait_until(lambda: d.refusals()["forged"] == forged + 1, 10, "the forged marker after",
                   step=lambda: d.poll(0.02))
        assert d.refusals()["malformed"] == before["malformed"] + 1
    finally:
        x.close(0)


def test_an_ack_naming_many_ops_the_batch_lacks_logs_a_short_line(
        group: tuple[Dispatcher, list[FakeRank]]) -> None:
    """A rank's ack naming 100,000 ops its batch does not have (a broken rank's, or made
    up): refused, and its line names a few of them and counts the rest. (Before, it quoted
    every one: a 700 KB line per ack, ten a second.) The batch still waits for that rank."""
    d, (r0, r1) = group
    seq = d.publish([P.Op(0, P.D2H, P.as_ids([1]), P.as_ids([1]))], step=0)
    b0, b1 = r0.recv_batch(), r1.recv_batch()
    bogus = tuple(P.OpResult(i, False, 0) for i in range(1, 100_001))
    with capture_logs() as logs:
        r0.send(P.BlocksCopied(seq, 0, False, bogus))
        _poll_until(d, lambda: d.refusals()["malformed"] == 1, "the refusal")
    (line,) = events_named(logs, ev.ACK_REFUSED)
    assert len(repr(line)) < 1024, len(repr(line))
    assert "ops 1, 2, 3" in line["error"] and "100000 in all" in line["error"], line["error"]
    assert d.in_flight == 1 and d.lost_ranks == frozenset()
    r0.ack(b0)
    r1.ack(b1)
    assert poll_until_done(d, seq)[seq].ok


@pytest.mark.parametrize("value", [True, 1.0, "1"])
def test_a_layout_field_of_another_json_type_differs(value: object) -> None:
    """A hello whose layout says ``"world_size": true`` (or 1.0, "1") does not fit a world
    of 1: JSON's true and 1.0 equal Python's 1, and such a layout was taken as the same."""
    from zkv.config import CacheLayout
    from zkv.scheduler.membership import layout_diff

    layout = CacheLayout(2, 2, 16, 32, "float16", 16, 16, world_size=1)
    theirs = orjson.loads(layout.to_json())
    assert layout_diff(layout, orjson.dumps(theirs).decode()) is None
    theirs["world_size"] = value
    assert layout_diff(layout, orjson.dumps(theirs).decode()) == (
        f"layout differs: world_size: rank has {value!r}, scheduler has 1")
