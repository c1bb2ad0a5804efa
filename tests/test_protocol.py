"""Wire format: every message round-trips; anything malformed is refused with ProtocolError."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import orjson
import pytest
import zmq

from zkv import protocol as P
from zkv.errors import ProtocolError

D1, D2, D3 = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16


def _batch() -> P.CopyBlocks:
    return P.CopyBlocks(
        seq=7,
        step=3,
        ops=(
            P.Op(0, P.D2H, P.as_ids([1, 2]), P.as_ids([10, 11])),
            P.Op(1, P.BACKUP, P.as_ids([3]), P.as_ids([12])),
            P.Op(2, P.H2D, P.as_ids([10, 11]), P.as_ids([4, 5]), layerwise=True),
            P.Op(3, P.S2H, dst=P.as_ids([13, 14]), keys=(D1, D2)),
            P.Op(4, P.H2S, src=P.as_ids([12]), keys=(D3,)),
            P.Op(5, P.FILL, dst=P.as_ids([6]), keys=(D1,)),
            P.Op(6, P.CHECK, src=P.as_ids([6]), keys=(D1,)),
        ),
    )


def _same_batch(a: P.CopyBlocks, b: P.CopyBlocks) -> None:
    assert (a.seq, a.step, len(a.ops)) == (b.seq, b.step, len(b.ops))
    for x, y in zip(a.ops, b.ops):
        assert (x.id, x.kind, x.keys, x.layerwise) == (y.id, y.kind, y.keys, y.layerwise)
        assert x.src.tolist() == y.src.tolist()
        assert x.dst.tolist() == y.dst.tolist()
        assert y.src.dtype == np.dtype("<i4") and y.dst.dtype == np.dtype("<i4")


def test_batch_round_trip_every_kind() -> None:
    msg = _batch()
    frames = P.encode(msg)
    assert frames[0] == P.T_BATCH
    assert len(frames) == 2 + 3 * len(msg.ops)
    assert frames[2] == np.array([1, 2], dtype="<i4").tobytes()  # raw little-endian ids
    _same_batch(msg, P.decode(frames, P.Limits(16, 16)))


def test_empty_batch_round_trip() -> None:
    out = P.decode(P.encode(P.CopyBlocks(0, 0, ())))
    assert out == P.CopyBlocks(0, 0, ())


def test_batch_round_trip_through_zmq_frames() -> None:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://proto")
        b.connect("inproc://proto")
        a.send_multipart(P.encode(_batch()), copy=False)
        assert b.poll(2000)
        frames = b.recv_multipart(copy=False)
        _same_batch(_batch(), P.decode(frames, P.Limits(16, 16)))  # type: ignore[arg-type]
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


@pytest.mark.parametrize(
    "msg",
    [
        P.BlocksCopied(3, 1, True, (P.OpResult(0, True, 2), P.OpResult(1, False, 1, "boom")),
                       t_recv=1.5, t_done=2.25),
        P.BlocksCopied(0, 0, False, ()),
        P.Hello(2, 1234, "abcdef"),
        P.Heartbeat(1, 99, -1),
        P.Heartbeat(1, 99, 42),
        P.Bye(0, 5, "seq gap: expected 3 got 5"),
        P.Shutdown("done"),
        P.Refused(1, 4321, "layout differs: head_dim: rank has 16, scheduler has 8"),
    ],
)
def test_control_round_trip(msg: P.Message) -> None:
    assert P.decode(P.encode(msg)) == msg


def test_ready_topic_round_trip() -> None:
    topic = P.ready_topic(3, 4567)
    assert P.parse_ready_topic(topic) == (3, 4567)
    for tag in (P.T_BATCH, P.T_SHUTDOWN, P.T_ACK, P.T_HELLO, P.T_REFUSED):
        assert not tag.startswith(P.READY_TOPIC_PREFIX)
        assert not topic.startswith(tag)
    assert P.parse_ready_topic(b"CopyBlocks") is None
    assert P.parse_ready_topic(P.READY_TOPIC_PREFIX + b"x/1") is None


def test_encode_rejects_non_messages() -> None:
    with pytest.raises(TypeError):
        P.encode("hello")  # type: ignore[arg-type]


# ---------------------------------------------------------------- malformed input


def _hdr(frames: list[bytes]) -> dict:
    return orjson.loads(frames[1])


def _with_hdr(frames: list[bytes], hdr: dict) -> list[bytes]:
    return [frames[0], orjson.dumps(hdr), *frames[2:]]


def _refused(frames: list, limits: P.Limits | None = None, match: str | None = None) -> None:
    with pytest.raises(ProtocolError, match=match):
        P.decode(frames, limits)


@pytest.mark.parametrize("v", [0, 2, "1", 1.0, True, None])
def test_bad_version_refused(v: object) -> None:
    frames = P.encode(_batch())
    hdr = _hdr(frames)
    hdr["v"] = v
    _refused(_with_hdr(frames, hdr), match="version")
    ack = P.encode(P.Hello(0, 1, "x"))
    _refused([ack[0], orjson.dumps({**_hdr(ack), "v": v})], match="version")


def test_missing_version_refused() -> None:
    _refused([P.T_SHUTDOWN, orjson.dumps({"reason": "x"})], match="version")


@pytest.mark.parametrize(
    ("field", "value"),
    [("seq", True), ("seq", 1.0), ("seq", "1"), ("seq", -1), ("step", False), ("ops", {})],
)
def test_batch_field_types_refused(field: str, value: object) -> None:
    frames = P.encode(_batch())
    hdr = _hdr(frames)
    hdr[field] = value
    _refused(_with_hdr(frames, hdr))


@pytest.mark.parametrize(
    ("field", "value"),
    [("id", True), ("id", -1), ("kind", 1), ("n_src", "2"), ("n_dst", False),
     ("layerwise", 1), ("layerwise", None)],
)
def test_op_field_types_refused(field: str, value: object) -> None:
    frames = P.encode(_batch())
    hdr = _hdr(frames)
    hdr["ops"][0][field] = value
    _refused(_with_hdr(frames, hdr))


@pytest.mark.parametrize(
    ("msg", "field", "value"),
    [
        (P.BlocksCopied(1, 0, True, ()), "ok", 1),
        (P.BlocksCopied(1, 0, True, ()), "rank", True),
        (P.BlocksCopied(1, 0, True, ()), "t_recv", "now"),
        (P.BlocksCopied(1, 0, True, ()), "ops", [{"id": 0, "ok": 1, "done": 0, "error": None}]),
        (P.BlocksCopied(1, 0, True, ()), "ops", [{"id": 0, "ok": True, "done": 0, "error": 3}]),
        (P.BlocksCopied(1, 0, True, ()), "ops", ["x"]),
        (P.Hello(0, 1, "fp"), "layout", 5),
        (P.Hello(0, 1, "fp"), "pid", False),
        (P.Heartbeat(0, 1, 3), "last_seq", 3.0),
        (P.Bye(0, 1, "x"), "reason", None),
        (P.Shutdown("x"), "reason", ["x"]),
        (P.Refused(0, 1, "x"), "pid", -1),
        (P.Refused(0, 1, "x"), "rank", "0"),
        (P.Refused(0, 1, "x"), "reason", "x" * (P.MAX_REASON_CHARS + 1)),
    ],
)
def test_control_field_types_refused(msg: P.Message, field: str, value: object) -> None:
    frames = P.encode(msg)
    hdr = _hdr(frames)
    hdr[field] = value
    _refused(_with_hdr(frames, hdr))


def test_refused_reason_is_cut_to_its_bound() -> None:
    msg = P.decode(P.encode(P.Refused(2, 7, "y" * (3 * P.MAX_REASON_CHARS))))
    assert msg == P.Refused(2, 7, "y" * P.MAX_REASON_CHARS)


@pytest.mark.parametrize("make", [lambda r: P.Bye(2, 7, r), lambda r: P.Shutdown(r),
                                  lambda r: P.Refused(2, 7, r)])
def test_a_reason_with_a_lone_surrogate_is_sent_escaped(make: Callable[[str], P.Message]) -> None:
    """A reason naming a file whose name is not UTF-8 (Python decodes its bytes to lone
    surrogates): the message encodes, the surrogate written as its escape, other non-ASCII
    kept. Before, orjson refused it and ``encode`` raised: a rank stopping with such a
    reason skipped the rest of its close."""
    msg = P.decode(P.encode(make("no /tmp/\udcff-é")))
    assert msg == make("no /tmp/\\udcff-é")


def test_an_ack_of_a_full_failed_batch_fits_the_schedulers_frame_limit() -> None:
    """Every op of the largest batch failed, each with a long error of characters that
    JSON escapes (control characters, non-ASCII): the ack still fits the frame the
    scheduler accepts (a larger one costs the rank its connection, unreported), and each
    error keeps its share. (Before: 65,536 ops, an ack of 8.7 MB without any error.)"""
    pending = tuple(range(P.MAX_OPS, 2 * P.MAX_OPS))
    worst = "\x01é→" * 1000
    results = tuple(P.OpResult(i, False, i, f"op {i}: {worst}") for i in range(P.MAX_OPS))
    frames = P.encode(P.BlocksCopied(7, 3, False, results, 1.0, 2.0, pending))
    assert sum(map(len, frames)) <= P.MAX_WORKER_FRAME_BYTES
    msg = P.decode(frames)
    assert isinstance(msg, P.BlocksCopied) and msg.pending == pending
    share = P.MAX_ACK_ERROR_CHARS // P.MAX_OPS
    for i, r in enumerate(msg.results):
        assert (r.id, r.ok, r.done) == (i, False, i)
        assert r.error is not None and r.error.isascii() and len(r.error) == share
        assert r.error.startswith(f"op {i}: \x01\\xe9\\u2192")  # escaped, but \x01
    one = P.decode(P.encode(P.BlocksCopied(7, 3, False, (P.OpResult(0, False, 0, worst),))))
    assert len(one.results[0].error) == P.MAX_ERROR_CHARS  # type: ignore[union-attr]
    ok = (P.OpResult(1, True, 4, "plain"),)
    assert P.decode(P.encode(P.BlocksCopied(7, 3, True, ok))).results == ok  # as it was


def test_an_op_error_longer_than_any_encoder_sends_is_refused() -> None:
    """The encoder cuts each op error to MAX_ERROR_CHARS; a longer one (a broken or forged
    rank's, up to the 8 MB frame) went on into the scheduler's op.failed log line and the
    batch's results. One at the bound still decodes."""
    frames = P.encode(P.BlocksCopied(1, 0, False, (P.OpResult(3, False, 0, "x"),)))
    hdr = _hdr(frames)
    hdr["ops"][0]["error"] = "e" * P.MAX_ERROR_CHARS
    assert P.decode(_with_hdr(frames, hdr)).results[0].error == "e" * P.MAX_ERROR_CHARS  # type: ignore[union-attr]
    hdr["ops"][0]["error"] = "e" * (P.MAX_ERROR_CHARS + 1)
    _refused(_with_hdr(frames, hdr), match="error")
    hdr["ops"][0]["error"] = "é" * (1 << 20)
    _refused(_with_hdr(frames, hdr), match="error")


def test_ack_duplicate_op_ids_refused() -> None:
    frames = P.encode(P.BlocksCopied(1, 0, True, (P.OpResult(4, True, 1), P.OpResult(4, True, 1))))
    _refused(frames, match="duplicate")


@pytest.mark.parametrize("pending", [[4], [5, 5], [-1], [True], [5.0], "5", None])
def test_ack_pending_must_name_distinct_ops_without_a_result(pending: object) -> None:
    """``pending`` names the ops whose results follow in later acks: an op that already
    has its result here (or one named twice) would keep the batch waiting on a result
    that never comes, and no deadline bounds pending storage I/O."""
    frames = P.encode(P.BlocksCopied(1, 0, True, (P.OpResult(4, True, 1),), pending=(5, 6)))
    assert P.decode(frames).pending == (5, 6)  # type: ignore[union-attr]
    hdr = _hdr(frames)
    hdr["pending"] = pending
    _refused(_with_hdr(frames, hdr), match="pending")


def test_a_batch_over_max_ops_is_refused() -> None:
    """A batch's ack names every op (a failed one too) and must fit the scheduler's frame
    limit: a batch of more than MAX_OPS ops is refused (one at the bound decodes)."""
    ops = tuple(P.Op(i, P.D2H) for i in range(P.MAX_OPS + 1))
    _refused(P.encode(P.CopyBlocks(0, 0, ops)), match=f"more than {P.MAX_OPS}")
    assert len(P.decode(P.encode(P.CopyBlocks(0, 0, ops[:-1]))).ops) == P.MAX_OPS  # type: ignore[union-attr]


def test_frame_count_mismatch_refused() -> None:
    frames = P.encode(_batch())
    _refused(frames[:-1], match="payload frames")
    _refused([*frames, b""], match="payload frames")
    _refused([*P.encode(P.Hello(0, 1, "x")), b"extra"], match="unexpected")


def test_frame_length_mismatch_refused() -> None:
    frames = P.encode(_batch())
    bad = list(frames)
    bad[2] = bad[2][:-4]  # op 0 src: one id short
    _refused(bad, match="src frame")
    bad = list(frames)
    bad[3] = bad[3] + b"\x00"  # op 0 dst: not a multiple of 4
    _refused(bad, match="dst frame")
    bad = list(frames)
    bad[2 + 3 * 3 + 2] = bad[2 + 3 * 3 + 2][:-1]  # op 3 keys: truncated digest
    _refused(bad, match="keys frame")


def test_truncated_frames_refused() -> None:
    frames = P.encode(_batch())
    _refused([], match="at least 2")
    _refused(frames[:1], match="at least 2")
    _refused([frames[0], frames[1][: len(frames[1]) // 2], *frames[2:]], match="JSON")


def test_mismatched_lengths_within_op_refused() -> None:
    msg = P.CopyBlocks(0, 0, (P.Op(0, P.D2H, P.as_ids([1, 2]), P.as_ids([3])),))
    _refused(P.encode(msg), match="mismatched lengths")
    msg = P.CopyBlocks(0, 0, (P.Op(0, P.S2H, P.as_ids([1]), P.as_ids([3]), keys=(D1,)),))
    _refused(P.encode(msg), match="mismatched lengths")


@pytest.mark.parametrize(
    "op",
    [
        P.Op(0, P.D2H, P.as_ids([8]), P.as_ids([0])),  # device src >= 8
        P.Op(0, P.D2H, P.as_ids([0]), P.as_ids([4])),  # host dst >= 4
        P.Op(0, P.H2D, P.as_ids([4]), P.as_ids([0])),  # host src >= 4
        P.Op(0, P.H2D, P.as_ids([0]), P.as_ids([-1])),  # negative
        P.Op(0, P.FILL, dst=P.as_ids([9]), keys=(D1,)),
        P.Op(0, P.S2H, dst=P.as_ids([2**31 - 1]), keys=(D1,)),
    ],
)
def test_ids_out_of_range_refused(op: P.Op) -> None:
    _refused(P.encode(P.CopyBlocks(0, 0, (op,))), P.Limits(8, 4), match="out of range")


def test_negative_ids_refused_without_limits() -> None:
    _refused(P.encode(P.CopyBlocks(0, 0, (P.Op(0, P.D2H, P.as_ids([-2]), P.as_ids([0])),))),
             match="out of range")


def test_duplicate_op_ids_refused() -> None:
    ops = (P.Op(3, P.D2H, P.as_ids([0]), P.as_ids([0])),
           P.Op(3, P.D2H, P.as_ids([1]), P.as_ids([1])))
    _refused(P.encode(P.CopyBlocks(0, 0, ops)), match="duplicate op id")


def test_duplicate_destination_refused() -> None:
    _refused(P.encode(P.CopyBlocks(0, 0, (P.Op(0, P.H2D, P.as_ids([0, 1]), P.as_ids([5, 5])),))),
             match="twice")
    # duplicate sources are fine (one host block copied to two device blocks)
    P.decode(P.encode(P.CopyBlocks(0, 0, (P.Op(0, P.H2D, P.as_ids([0, 0]), P.as_ids([5, 6])),))))


@pytest.mark.parametrize("ops, why", [
    # two h2d write device block 5: either's bytes (on a GPU, a torn block)
    ((P.Op(0, P.H2D, P.as_ids([0]), P.as_ids([5])), P.Op(1, P.H2D, P.as_ids([1]), P.as_ids([5]))),
     "two ops write one device block"),
    # a d2h and an s2h write host block 2
    ((P.Op(0, P.D2H, P.as_ids([1]), P.as_ids([2])), P.Op(1, P.S2H, dst=P.as_ids([2]), keys=(D1,))),
     "two ops write one host block"),
    # an h2d reads host block 3 while the batch's s2h writes it (the I/O runs after copies)
    ((P.Op(0, P.S2H, dst=P.as_ids([3]), keys=(D1,)), P.Op(1, P.H2D, P.as_ids([3]), P.as_ids([7]))),
     r"op 1 \(h2d\) uses a host block an s2h of the batch writes"),
    # an h2s writes out host block 1 as an s2h of the batch fills it
    ((P.Op(0, P.S2H, dst=P.as_ids([1]), keys=(D1,)), P.Op(1, P.H2S, P.as_ids([1]), keys=(D2,))),
     r"op 1 \(h2s\) uses a host block"),
])
def test_ops_of_one_batch_that_overlap_are_refused(ops: tuple[P.Op, ...], why: str) -> None:
    """A batch runs by kind (copies, then storage I/O on threads), not in the listed order:
    such a batch (a broken or forged scheduler's) was run and every op acked ok, with
    bytes from either writer (from a review of the worker side)."""
    _refused(P.encode(P.CopyBlocks(0, 0, ops)), match=why)


def test_what_the_scheduler_sends_in_one_batch_still_decodes() -> None:
    """Reads and writes of one block by different kinds, ordered by kind: a d2h saves a
    device block an h2d then fills (an evicted block reused in the step); two loads read
    one host block; a d2h fills a host block an h2s of the batch does not touch."""
    ops = (P.Op(0, P.D2H, P.as_ids([5, 6]), P.as_ids([0, 1])),
           P.Op(1, P.H2D, P.as_ids([2, 2]), P.as_ids([5, 7])),
           P.Op(2, P.H2D, P.as_ids([2]), P.as_ids([6])),
           P.Op(3, P.S2H, dst=P.as_ids([3]), keys=(D1,)),
           P.Op(4, P.H2S, P.as_ids([2]), keys=(D2,)))
    got = P.decode(P.encode(P.CopyBlocks(0, 0, ops)))
    assert isinstance(got, P.CopyBlocks)
    assert [(o.id, o.kind, o.src.tolist(), o.dst.tolist(), o.keys) for o in got.ops] == \
        [(o.id, o.kind, o.src.tolist(), o.dst.tolist(), o.keys) for o in ops]


def test_unknown_type_and_kind_refused() -> None:
    _refused([b"Nonsense", orjson.dumps({"v": 1})], match="unknown message type")
    frames = P.encode(_batch())
    hdr = _hdr(frames)
    hdr["ops"][0]["kind"] = "teleport"
    _refused(_with_hdr(frames, hdr), match="unknown kind")


@pytest.mark.parametrize("header", [b"not json", b"[1, 2]", b"", b"\xff\xfe", b"42"])
def test_non_json_or_non_object_header_refused(header: bytes) -> None:
    _refused([P.T_BATCH, header])
    _refused([P.T_HEARTBEAT, header])


def test_non_buffer_frame_refused() -> None:
    _refused([P.T_HELLO, 12345])


def test_missing_field_refused() -> None:
    frames = P.encode(P.Heartbeat(0, 1, 2))
    hdr = _hdr(frames)
    del hdr["last_seq"]
    _refused(_with_hdr(frames, hdr), match="missing")


def test_peek_seq() -> None:
    frames = P.encode(_batch())
    assert P.peek_seq(frames) == 7
    hdr = _hdr(frames)
    hdr["v"] = 99
    assert P.peek_seq(_with_hdr(frames, hdr)) == 7
    assert P.peek_seq([P.T_BATCH, b"garbage"]) is None
    assert P.peek_seq([P.T_BATCH]) is None
    assert P.peek_seq([P.T_BATCH, orjson.dumps({"seq": True})]) is None
    assert P.peek_seq([P.T_BATCH, orjson.dumps({"seq": -3})]) is None


@pytest.mark.parametrize("ops", [[{"id": 1}, {"id": 1}], [{"id": -1}], [{"id": True}],
                                 [{"id": 1.0}], [{"kind": "d2h"}], [1], {"id": 1}])
def test_peek_op_ids_of_a_batch_that_failed_to_decode(ops: object) -> None:
    """A rank acks a batch it refused as failed, naming the ops it could read: ids that
    repeat or are no op ids would make that ack malformed in turn (refused by the
    scheduler, which then waited for the ack deadline), so then it names none."""
    frames = P.encode(_batch())
    hdr = _hdr(frames)
    hdr["v"] = 99  # (refused by decode: peek reads it anyway)
    assert P.peek_op_ids(_with_hdr(frames, hdr)) == [0, 1, 2, 3, 4, 5, 6]
    hdr["ops"] = ops
    assert P.peek_op_ids(_with_hdr(frames, hdr)) == []
    assert P.peek_op_ids([P.T_BATCH, b"garbage"]) == []


def test_as_ids_rejects_2d() -> None:
    with pytest.raises(ValueError):
        P.as_ids([[1, 2]])


# ------------------------------------------------------------ fast paths == full path

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(-1, 1e10),
                    st.text(max_size=3), st.just([]), st.lists(st.integers(0, 3), max_size=2),
                    st.just({}))
_ACK_KEYS = ("seq", "rank", "ok", "ops", "t_recv", "t_done", "pending")
_BATCH_KEYS = ("seq", "step", "ops")


def _outcome(tag: bytes, hdr: dict[str, object], full: bool,
             monkeypatch: pytest.MonkeyPatch) -> object:
    with monkeypatch.context() as m:
        if full:
            m.setattr(P, "_idle", lambda tag, h: None)
        try:
            return P.decode([tag, orjson.dumps(hdr)])
        except ProtocolError:
            return ProtocolError


@pytest.mark.parametrize("tag", [P.T_ACK, P.T_BATCH])
@settings(max_examples=400, deadline=None)
@given(data=st.data(), valid=st.booleans())
def test_fast_paths_accept_and_refuse_what_the_full_decoder_does(tag, data, valid) -> None:
    """decode() answers the messages of an idle step (an empty batch, an ack without
    results) in one expression; whatever the header, it must decide as the full path."""
    keys = _ACK_KEYS if tag == P.T_ACK else _BATCH_KEYS
    fields = data.draw(st.dictionaries(st.sampled_from(keys), _VALUES, max_size=2))
    base: dict[str, object] = ({"seq": 1, "rank": 0, "ok": True, "ops": [], "t_recv": 1.0,
                                "t_done": 2} if tag == P.T_ACK else
                               {"seq": 1, "step": 0, "ops": []})
    _same_outcome(tag, {"v": P.PROTOCOL_VERSION, **(base if valid else {}), **fields})


@pytest.mark.parametrize("tag,hdr", [
    (P.T_ACK, {"seq": -1, "rank": 0, "ok": True, "ops": [], "t_recv": 1, "t_done": 2}),
    (P.T_ACK, {"seq": 1, "rank": -1, "ok": True, "ops": [], "t_recv": 1, "t_done": 2}),
    (P.T_ACK, {"seq": 1, "rank": 0, "ok": 1, "ops": [], "t_recv": 1, "t_done": 2}),
    (P.T_ACK, {"seq": 1, "rank": 0, "ok": True, "ops": [], "t_recv": 1, "t_done": True}),
    (P.T_ACK, {"seq": 1, "rank": 0, "ok": True, "ops": [], "t_recv": 1, "t_done": 2,
               "pending": [3]}),
    (P.T_ACK, {"seq": 1, "rank": 0, "ok": True, "ops": [], "t_recv": 1, "t_done": 2,
               "pending": None}),
    (P.T_BATCH, {"seq": 1, "step": -1, "ops": []}),
    (P.T_BATCH, {"seq": -1, "step": 0, "ops": []}),
    (P.T_BATCH, {"seq": 1, "step": False, "ops": []}),
    (P.T_BATCH, {"seq": 1, "step": 0, "ops": {}}),
])
def test_fast_paths_on_the_edges(tag: bytes, hdr: dict[str, object]) -> None:
    _same_outcome(tag, {"v": P.PROTOCOL_VERSION, **hdr})


def _same_outcome(tag: bytes, hdr: dict[str, object]) -> None:
    mp = pytest.MonkeyPatch()
    fast, full = _outcome(tag, hdr, False, mp), _outcome(tag, hdr, True, mp)
    assert fast == full
    try:  # frames as buffers (zmq.Frame, memoryview) decide alike
        views = P.decode([memoryview(tag), memoryview(orjson.dumps(hdr))])
    except ProtocolError:
        views = ProtocolError
    assert views == fast
    if fast is not ProtocolError:
        assert type(fast) is type(full)
        assert fast._fields  # a message type: its fields are compared one by one
        assert [type(getattr(fast, f)) for f in fast._fields] == \
            [type(getattr(full, f)) for f in full._fields]


def _general_encode(msg: P.Message, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    with monkeypatch.context() as m:
        m.setattr(P, "_fast_ack_header", lambda msg: None)
        m.setattr(P, "_encode_batch", _encode_batch_general)
        return P.encode(msg)


_ENCODE_BATCH = P._encode_batch


def _encode_batch_general(msg: P.CopyBlocks) -> list[bytes]:
    """The batch encoder with its idle-step shortcut bypassed (a one-op detour: the op is
    dropped from the header again)."""
    frames = _ENCODE_BATCH(P.CopyBlocks(msg.seq, msg.step, (P.Op(0, P.D2H),)))
    hdr = orjson.loads(frames[1])
    hdr["ops"] = []
    return [frames[0], orjson.dumps(hdr)]


_TIMES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(0, 2**40),
                   st.booleans())


@settings(max_examples=400, deadline=None)
@given(seq=st.integers(0, 2**62), rank=st.integers(0, 2**20), ok=st.booleans(),
       t_recv=_TIMES, t_done=_TIMES)
def test_idle_ack_encodes_as_the_general_encoder_does(seq, rank, ok, t_recv, t_done) -> None:
    """encode() formats an ack without results directly; the header must decode to what
    orjson makes of the same fields (floats of any size, and the values it falls back on:
    ints, bools, inf and nan, which orjson writes as null)."""
    mp = pytest.MonkeyPatch()
    msg = P.BlocksCopied(seq, rank, ok, (), t_recv, t_done)
    fast, general = P.encode(msg), _general_encode(msg, mp)
    assert fast[0] == general[0] == P.T_ACK
    assert orjson.loads(fast[1]) == orjson.loads(general[1])
    if isinstance(t_recv, float) and isinstance(t_done, float) and abs(t_recv) < 1e300 \
            and abs(t_done) < 1e300:
        back = P.decode(fast)
        assert back == msg and type(back.t_recv) is float


@settings(max_examples=200, deadline=None)
@given(seq=st.integers(0, 2**62), step=st.integers(0, 2**62))
def test_idle_batch_encodes_as_orjson_does(seq: int, step: int) -> None:
    mp = pytest.MonkeyPatch()
    msg = P.CopyBlocks(seq, step, ())
    assert P.encode(msg) == _general_encode(msg, mp)  # byte for byte
    assert P.decode(P.encode(msg)) == msg
