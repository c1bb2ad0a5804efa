"""Wire messages between the scheduler node and the per-rank workers.

Every message is a multipart ZeroMQ message ``[type, header, *payload]``:

- ``type``    an ASCII tag (also the PUB/SUB topic): ``CopyBlocks`` (a batch),
  ``BlocksCopied`` (an ack), ``Hello``, ``Heartbeat``, ``Bye``, ``Shutdown``, ``Refused``
  (the scheduler's answer to a hello it does not take: that rank and pid stop).
- ``header``  an orjson object with ``"v": PROTOCOL_VERSION`` and scalar fields.
- ``payload`` raw frames. A batch carries three frames per op, in op order::

      src   little-endian int32 block ids   (4 * n_src bytes)
      dst   little-endian int32 block ids   (4 * n_dst bytes)
      keys  concatenated 16-byte block digests (16 * n_keys bytes)

Op kinds and which id space each side uses::

      kind     src            dst            keys
      d2h      device ids     host ids       -        evict: device block leaves L1
      backup   device ids     host ids       -        copy, device block stays
      h2d      host ids       device ids     -        swap in (layer by layer when layerwise)
      s2h      -              host ids       digests  load from L3 storage
      h2s      host ids       -              digests  write to L3 storage
      fill     -              device ids     digests  simulated forward: write the pattern of
                                                      (rank, digest) into new blocks (replay, tests)
      check    device ids     -              digests  simulated forward: verify that pattern
                                                      (fails the op on the first mismatch)

``decode`` refuses anything malformed with :class:`~zkv.errors.ProtocolError`: unknown
type or version, wrong field types, frame lengths that disagree with the header,
ids out of the receiver's range, duplicate op ids or duplicate destinations (within an op
or across the batch's ops), or a host block an s2h fills that another op of the batch uses.
A worker runs a batch by kind (d2h / backup, h2d layer by layer, fill / check, then s2h /
h2s on I/O threads), not in the listed order, so a block written in a batch is that op's.

Bounds (every socket sets them; see the README's "Security" section)::

    socket            max frame (ZMQ_MAXMSGSIZE)      queue (HWM, messages)
    scheduler XPUB    -                               SEND_HWM batches per rank, no drop:
                                                      a full queue fails publish (never a gap)
    worker SUB        MAX_BATCH_FRAME_BYTES           RECV_HWM (backpressure, never drops)
    worker PUSH       -                               RECV_HWM; a heartbeat is skipped when full
    scheduler PULL    MAX_WORKER_FRAME_BYTES          RECV_HWM per rank's connection

A peer that sends a larger frame is disconnected by libzmq before Python sees a byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Union

import numpy as np
import orjson

from zkv.errors import ProtocolError

PROTOCOL_VERSION = 1
DIGEST_SIZE = 16

#: Largest frame of a batch (one op's id or key frame, or the header) a worker accepts.
MAX_BATCH_FRAME_BYTES = 64 << 20
#: Largest frame of a worker message (ack, hello, heartbeat, bye) the scheduler accepts.
MAX_WORKER_FRAME_BYTES = 8 << 20
#: Ops per batch; a batch carries 3 frames per op. An ack of a full batch (a result per op,
#: every one failed) must fit MAX_WORKER_FRAME_BYTES: ~140 bytes a result besides its error.
MAX_OPS = 1 << 13
#: An op's error text is cut to this many characters (an ack stays small; decoded: refused
#: when longer) ...
MAX_ERROR_CHARS = 512
#: ... and an ack's errors together to this many (ASCII, escaped: at most 6 bytes a
#: character in the JSON), each error to its share when many ops failed.
MAX_ACK_ERROR_CHARS = 256 << 10
#: Hello's layout description (JSON) is at most this long.
MAX_GEOMETRY_CHARS = 4096
#: A refusal's reason (it may name every layout field that differs) is cut to this; so
#: are a bye's and a shutdown's (decoded: refused when longer).
MAX_REASON_CHARS = 2048
#: Hello's layout fingerprint (16 hex digits; a longer one is no fingerprint: refused at
#: decode, before it is quoted in a refusal's reason and its log line).
MAX_FINGERPRINT_CHARS = 64
#: Messages queued per connection: batches for a rank on the scheduler's XPUB (a full
#: queue means that rank stopped reading), anything else on the other sockets.
SEND_HWM = 1000
RECV_HWM = 10000

D2H, BACKUP, H2D, S2H, H2S = "d2h", "backup", "h2d", "s2h", "h2s"
FILL, CHECK = "fill", "check"
OP_KINDS = (D2H, BACKUP, H2D, S2H, H2S, FILL, CHECK)
#: (src id space, dst id space, keys on) per kind; None = that side is empty.
_SIDES: dict[str, tuple[str | None, str | None, bool]] = {
    D2H: ("device", "host", False),
    BACKUP: ("device", "host", False),
    H2D: ("host", "device", False),
    S2H: (None, "host", True),
    H2S: ("host", None, True),
    FILL: (None, "device", True),
    CHECK: ("device", None, True),
}

T_BATCH = b"CopyBlocks"
T_ACK = b"BlocksCopied"
T_HELLO = b"Hello"
T_HEARTBEAT = b"Heartbeat"
T_BYE = b"Bye"
T_SHUTDOWN = b"Shutdown"
T_REFUSED = b"Refused"
#: Prefix of the per-rank subscription marker (see :func:`ready_topic`). Starts with 0xFF so it
#: never prefixes a message type tag.
READY_TOPIC_PREFIX = b"\xffzkv-ready/"

_EMPTY_IDS = np.zeros(0, dtype=np.int32)
_EMPTY_IDS.setflags(write=False)


def as_ids(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Block ids as a read-only little-endian int32 array (the wire and kernel format)."""
    arr = np.asarray(ids, dtype="<i4")
    if arr.ndim != 1:
        raise ValueError(f"block ids must be one-dimensional, got shape {arr.shape}")
    return arr


# Messages are NamedTuples: immutable like frozen dataclasses, and built several times
# faster (one tuple allocation; a frozen dataclass sets each field through
# object.__setattr__), which counts on the control plane's per-step path. They compare
# like tuples; nothing here relies on more.


class Op(NamedTuple):
    """One copy command of a batch; see the module docstring for the id spaces."""

    id: int
    kind: str
    src: np.ndarray = _EMPTY_IDS
    dst: np.ndarray = _EMPTY_IDS
    keys: tuple[bytes, ...] = ()
    layerwise: bool = False

    @property
    def num_blocks(self) -> int:
        return max(len(self.src), len(self.dst), len(self.keys))


class CopyBlocks(NamedTuple):
    """A step's ops, published to every rank. ``seq`` increases by one per batch."""

    seq: int
    step: int
    ops: tuple[Op, ...]


class OpResult(NamedTuple):
    """Outcome of one op on one rank. ``done`` counts blocks that succeeded, from the start
    of the op (for ``s2h`` this is the prefix of keys that arrived)."""

    id: int
    ok: bool
    done: int
    error: str | None = None


def result_claim_error(res: OpResult, blocks: int) -> str | None:
    """Why ``res`` cannot be the result of an op of ``blocks`` blocks (``done`` outside
    ``[0, blocks]``, or ``ok`` with fewer done), or None. The one rule for a rank's ack (the
    dispatcher refuses it) and an engine's call (the cache manager raises)."""
    if not 0 <= res.done <= blocks:
        return f"done {res.done} is outside [0, {blocks}] (the op's blocks)"
    if res.ok and res.done != blocks:
        return f"ok with {res.done} of {blocks} blocks done"
    return None


class BlocksCopied(NamedTuple):
    """A rank's ack of one batch. ``pending`` names ops (storage I/O) whose results follow
    in later ``BlocksCopied`` of the same seq; the rank is done with the batch when a
    message leaves nothing pending. Copies are acked at once, so a slow store never holds
    back the next batch's ack."""

    seq: int
    rank: int
    ok: bool
    results: tuple[OpResult, ...]
    t_recv: float = 0.0
    t_done: float = 0.0
    pending: tuple[int, ...] = ()


class Hello(NamedTuple):
    """A rank joins. ``layout`` is its layout fingerprint; ``geometry`` its full layout as
    JSON (pool sizes included), so a refusal can name the fields that differ."""

    rank: int
    pid: int
    layout: str
    geometry: str = ""


class Heartbeat(NamedTuple):
    rank: int
    pid: int
    last_seq: int


class Bye(NamedTuple):
    rank: int
    pid: int
    reason: str


class Shutdown(NamedTuple):
    reason: str


class Refused(NamedTuple):
    """The scheduler does not take the hello of ``rank`` from process ``pid`` (a layout
    that differs, a rank outside the world, a group that started without it); published to
    every rank, read only by that one. ``reason`` is at most ``MAX_REASON_CHARS``."""

    rank: int
    pid: int
    reason: str


Message = Union[CopyBlocks, BlocksCopied, Hello, Heartbeat, Bye, Shutdown, Refused]
#: The types a rank sends the scheduler; its PULL refuses the others (a ``Refused``, which
#: names a rank too, was dropped there uncounted).
WORKER_MESSAGES = frozenset((BlocksCopied, Hello, Heartbeat, Bye))


@dataclass(frozen=True, slots=True)
class Limits:
    """The receiver's id ranges; ``None`` checks only non-negativity."""

    num_device_blocks: int | None = None
    num_host_blocks: int | None = None


def ready_topic(rank: int, pid: int) -> bytes:
    """The subscription marker a worker's SUB adds after its catch-all ``b""`` subscription.

    A SUB sends its subscriptions upstream in the order it made them, over one pipe, so when
    the dispatcher's XPUB reports this topic, the catch-all subscription is already in place:
    that rank provably receives everything published from then on (no slow-joiner drop).
    When the SUB goes away the XPUB reports the marker's unsubscription, which tells the
    dispatcher the rank is gone without waiting for a heartbeat timeout. Nothing is ever
    published on this topic.
    """
    return b"%s%d/%d" % (READY_TOPIC_PREFIX, rank, pid)


def parse_ready_topic(topic: bytes) -> tuple[int, int] | None:
    """``(rank, pid)`` of a :func:`ready_topic`, or ``None`` for any other topic."""
    if not topic.startswith(READY_TOPIC_PREFIX):
        return None
    parts = topic[len(READY_TOPIC_PREFIX) :].split(b"/")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


# ---------------------------------------------------------------- encode


def encode(msg: Message) -> list[bytes]:
    """Frames for ``socket.send_multipart(frames, copy=False)``."""
    if isinstance(msg, CopyBlocks):
        return _encode_batch(msg)
    if isinstance(msg, BlocksCopied):
        if not msg.results and not msg.pending:  # every rank, every step
            fast = _fast_ack_header(msg)
            if fast is not None:
                return [T_ACK, fast]
        hdr = {
            "v": PROTOCOL_VERSION,
            "seq": msg.seq,
            "rank": msg.rank,
            "ok": msg.ok,
            "ops": _result_headers(msg.results),
            "t_recv": msg.t_recv,
            "t_done": msg.t_done,
        }
        if msg.pending:
            hdr["pending"] = list(msg.pending)
        return [T_ACK, orjson.dumps(hdr)]
    if isinstance(msg, Hello):
        hdr = {"v": PROTOCOL_VERSION, "rank": msg.rank, "pid": msg.pid, "layout": msg.layout,
               "geometry": msg.geometry}
        return [T_HELLO, orjson.dumps(hdr)]
    if isinstance(msg, Heartbeat):
        hdr = {"v": PROTOCOL_VERSION, "rank": msg.rank, "pid": msg.pid, "last_seq": msg.last_seq}
        return [T_HEARTBEAT, orjson.dumps(hdr)]
    if isinstance(msg, Bye):
        hdr = {"v": PROTOCOL_VERSION, "rank": msg.rank, "pid": msg.pid,
               "reason": _reason_text(msg.reason)}
        return [T_BYE, orjson.dumps(hdr)]
    if isinstance(msg, Shutdown):
        return [T_SHUTDOWN, orjson.dumps({"v": PROTOCOL_VERSION,
                                          "reason": _reason_text(msg.reason)})]
    if isinstance(msg, Refused):
        hdr = {"v": PROTOCOL_VERSION, "rank": msg.rank, "pid": msg.pid,
               "reason": _reason_text(msg.reason)}
        return [T_REFUSED, orjson.dumps(hdr)]
    raise TypeError(f"not a zkv message: {type(msg).__name__}")


def _result_headers(results: Sequence[OpResult]) -> list[dict[str, Any]]:
    """An ack's results, errors cut so that a full batch's ack fits the scheduler's frame
    limit whatever the errors say (a longer frame would cost the rank its connection)."""
    num_errors = sum(r.error is not None for r in results)
    cap = min(MAX_ERROR_CHARS, MAX_ACK_ERROR_CHARS // max(1, num_errors))
    return [{"id": r.id, "ok": r.ok, "done": r.done,
             "error": None if r.error is None else _cut(r.error, cap)} for r in results]


def _reason_text(reason: str) -> str:
    """A bye's, shutdown's or refusal's reason as JSON can carry it: cut to
    ``MAX_REASON_CHARS``, a lone surrogate (a file name's undecodable byte, as Python
    decodes it) written as its escape. (orjson refused it: the encode raised, and a rank
    stopping with such a reason skipped the rest of its close.)"""
    if not reason.isascii():  # escaped first, then cut (a surrogate's escape is 6 chars:
        # cut first, the reason grew past what decode takes, and the message was refused)
        reason = reason.encode("utf-8", "backslashreplace").decode()
    return reason[:MAX_REASON_CHARS]


def _cut(error: str, cap: int) -> str:
    if error.isascii() and len(error) <= cap:
        return error
    return error.encode("ascii", "backslashreplace").decode("ascii")[:cap]


def _fast_ack_header(msg: BlocksCopied) -> bytes | None:
    """The header of an ack without results or pending ops, formatted directly: the JSON
    orjson gives for the same fields (tested to decode alike); None when a field is not
    of the plain type this format assumes (the general path handles it)."""
    seq, rank, ok, _, t_recv, t_done, _ = msg
    if (type(seq) is int and type(rank) is int and type(ok) is bool
            and type(t_recv) is float and -1e300 < t_recv < 1e300
            and type(t_done) is float and -1e300 < t_done < 1e300):
        return idle_ack_header(seq, rank, ok, t_recv, t_done)
    return None


def idle_ack_header(seq: int, rank: int, ok: bool, t_recv: float, t_done: float) -> bytes:
    """The header of an ack without results or pending ops, formatted directly, for a
    caller whose fields are of the plain types already (ints, a bool, finite floats: a
    worker's idle step, ``time.time()`` stamps); ``encode`` checks them first."""
    return (b'{"v":%d,"seq":%d,"rank":%d,"ok":%s,"ops":[],"t_recv":%r,"t_done":%r}'
            % (PROTOCOL_VERSION, seq, rank, b"true" if ok else b"false", t_recv, t_done))


def _encode_batch(msg: CopyBlocks) -> list[bytes]:
    seq, step = msg.seq, msg.step
    if not msg.ops and type(seq) is int and type(step) is int:  # an idle step, formatted
        return [T_BATCH, b'{"v":%d,"seq":%d,"step":%d,"ops":[]}' % (PROTOCOL_VERSION, seq, step)]
    ops_hdr: list[dict[str, Any]] = []
    frames: list[bytes] = []
    for op in msg.ops:
        src = as_ids(op.src)
        dst = as_ids(op.dst)
        ops_hdr.append(
            {
                "id": op.id,
                "kind": op.kind,
                "n_src": len(src),
                "n_dst": len(dst),
                "n_keys": len(op.keys),
                "layerwise": op.layerwise,
            }
        )
        frames += [src.tobytes(), dst.tobytes(), b"".join(op.keys)]
    hdr = {"v": PROTOCOL_VERSION, "seq": msg.seq, "step": msg.step, "ops": ops_hdr}
    return [T_BATCH, orjson.dumps(hdr), *frames]


# ---------------------------------------------------------------- decode


def decode(frames: Sequence[Any], limits: Limits | None = None) -> Message:
    """Decode a multipart message; raise :class:`ProtocolError` on anything malformed.

    ``frames`` may hold ``bytes``, ``memoryview`` or ``zmq.Frame`` objects.
    """
    if len(frames) < 2:
        raise ProtocolError(f"expected at least 2 frames, got {len(frames)}")
    f0 = frames[0]
    tag = f0 if type(f0) is bytes else _buf(f0).tobytes()
    f1 = frames[1]
    try:
        hdr = orjson.loads(f1 if type(f1) is bytes else _buf(f1))
    except orjson.JSONDecodeError as e:
        raise ProtocolError(f"header is not JSON: {e}") from e
    if not isinstance(hdr, dict):
        raise ProtocolError("header is not a JSON object")
    v = hdr.get("v")
    if v != PROTOCOL_VERSION or type(v) is not int:
        raise ProtocolError(f"unknown protocol version {_quote(v)} (this side speaks "
                            f"{PROTOCOL_VERSION})")
    if len(frames) == 2:  # the messages of every step, checked in one function
        idle = _idle(tag, hdr)
        if idle is not None:
            return idle
    rest = frames[2:]
    if tag == T_BATCH:
        return _decode_batch(hdr, rest, limits or Limits())
    if rest:
        raise ProtocolError(f"{tag[:32].decode(errors='replace')}: unexpected {len(rest)} payload "
                            "frames")
    if tag == T_ACK:
        results = tuple(_decode_result(r) for r in _get(hdr, "ops", list))
        ids = [r.id for r in results]
        if len(set(ids)) != len(ids):
            raise ProtocolError("ack: duplicate op ids")
        pending = _pending(hdr.get("pending", []), ids)
        return BlocksCopied(
            seq=_nonneg(hdr, "seq"),
            rank=_nonneg(hdr, "rank"),
            ok=_get(hdr, "ok", bool),
            results=results,
            t_recv=_num(hdr, "t_recv"),
            t_done=_num(hdr, "t_done"),
            pending=pending,
        )
    if tag == T_HELLO:
        geometry = _get(hdr, "geometry", str) if "geometry" in hdr else ""
        if len(geometry) > MAX_GEOMETRY_CHARS:
            raise ProtocolError(f"hello: geometry longer than {MAX_GEOMETRY_CHARS} characters")
        layout = _get(hdr, "layout", str)
        if len(layout) > MAX_FINGERPRINT_CHARS:
            raise ProtocolError(f"hello: layout fingerprint longer than {MAX_FINGERPRINT_CHARS} "
                                "characters")
        return Hello(_nonneg(hdr, "rank"), _nonneg(hdr, "pid"), layout, geometry)
    if tag == T_HEARTBEAT:
        return Heartbeat(_nonneg(hdr, "rank"), _nonneg(hdr, "pid"), _int(hdr, "last_seq"))
    if tag == T_BYE:
        return Bye(_nonneg(hdr, "rank"), _nonneg(hdr, "pid"), _reason(hdr, "bye"))
    if tag == T_SHUTDOWN:
        return Shutdown(_reason(hdr, "shutdown"))
    if tag == T_REFUSED:
        return Refused(_nonneg(hdr, "rank"), _nonneg(hdr, "pid"), _reason(hdr, "refused"))
    raise ProtocolError(f"unknown message type {tag[:32]!r}")


_NUMBER = (int, float)


_new = tuple.__new__  # a NamedTuple built without its Python-level __new__


def _idle(tag: bytes, h: dict[str, Any]) -> CopyBlocks | BlocksCopied | None:
    """An idle step's message (a batch without ops, an ack without results or pending ops)
    if the header ``h`` (parsed, version checked) is exactly that and valid: what the full
    path would return, type for type. None sends it down the full path, which decodes the
    rest and words the errors. One function on purpose: on this path each Python call
    counts (a process that slept in zmq_poll runs its first code from cold caches)."""
    seq, ops = h.get("seq"), h.get("ops")
    if type(seq) is not int or seq < 0 or type(ops) is not list or ops:
        return None
    if tag == T_ACK:
        rank, ok, t_recv, t_done = h.get("rank"), h.get("ok"), h.get("t_recv"), h.get("t_done")
        if (type(rank) is int and rank >= 0 and type(ok) is bool and "pending" not in h
                and type(t_recv) in _NUMBER and type(t_done) in _NUMBER):
            t0, t1 = float(t_recv), float(t_done)  # type: ignore[arg-type]  # (numbers)
            return _new(BlocksCopied, (seq, rank, ok, (), t0, t1, ()))
    elif tag == T_BATCH:
        step = h.get("step")
        if type(step) is int and step >= 0:
            return _new(CopyBlocks, (seq, step, ()))
    return None


def peek_seq(frames: Sequence[Any]) -> int | None:
    """Best-effort ``seq`` of a batch that failed to decode, so it can be acked as failed."""
    try:
        seq = orjson.loads(_buf(frames[1]))["seq"]
    except Exception:
        return None
    return seq if type(seq) is int and seq >= 0 else None


def peek_op_ids(frames: Sequence[Any]) -> list[int]:
    """Op ids of a batch that failed to decode, where they can be read (else none)."""
    try:
        ops = orjson.loads(bytes(frames[1]))["ops"]
        ids = [op["id"] for op in ops]
    except Exception:
        return []
    if all(type(i) is int and i >= 0 for i in ids) and len(set(ids)) == len(ids):
        return ids
    return []


def _decode_batch(hdr: dict[str, Any], payload: Sequence[Any], limits: Limits) -> CopyBlocks:
    seq = _nonneg(hdr, "seq")
    step = _nonneg(hdr, "step")
    ops_hdr = _get(hdr, "ops", list)
    if len(ops_hdr) > MAX_OPS:
        raise ProtocolError(f"batch {seq}: {len(ops_hdr)} ops, more than {MAX_OPS}")
    if len(payload) != 3 * len(ops_hdr):
        raise ProtocolError(
            f"batch {seq}: {len(ops_hdr)} ops need {3 * len(ops_hdr)} payload frames, got "
            f"{len(payload)}"
        )
    bounds = {"device": limits.num_device_blocks, "host": limits.num_host_blocks}
    ops: list[Op] = []
    seen: set[int] = set()
    writes: dict[str, list[np.ndarray]] = {}  # blocks written, per id space
    for i, oh in enumerate(ops_hdr):
        if not isinstance(oh, dict):
            raise ProtocolError(f"batch {seq}: op {i} is not an object")
        op_id = _nonneg(oh, "id")
        if op_id in seen:
            raise ProtocolError(f"batch {seq}: duplicate op id {op_id}")
        seen.add(op_id)
        kind = _get(oh, "kind", str)
        if kind not in _SIDES:
            raise ProtocolError(f"batch {seq}: op {op_id} has unknown kind {kind!r}")
        src_space, dst_space, has_keys = _SIDES[kind]
        n_src, n_dst, n_keys = _nonneg(oh, "n_src"), _nonneg(oh, "n_dst"), _nonneg(oh, "n_keys")
        layerwise = _get(oh, "layerwise", bool)
        src = _ids(payload[3 * i], n_src, seq, op_id, "src", bounds.get(src_space or ""))
        dst = _ids(payload[3 * i + 1], n_dst, seq, op_id, "dst", bounds.get(dst_space or ""))
        keys = _keys(payload[3 * i + 2], n_keys, seq, op_id)
        n = max(n_src, n_dst, n_keys)
        want = (n if src_space else 0, n if dst_space else 0, n if has_keys else 0)
        if (n_src, n_dst, n_keys) != want:
            raise ProtocolError(
                f"batch {seq}: op {op_id} ({kind}) has mismatched lengths "
                f"src={n_src} dst={n_dst} keys={n_keys}"
            )
        if dst_space and len(np.unique(dst)) != n_dst:
            raise ProtocolError(f"batch {seq}: op {op_id} writes one {dst_space} block twice")
        if dst_space and n_dst:
            writes.setdefault(dst_space, []).append(dst)
        ops.append(Op(op_id, kind, src, dst, keys, layerwise))
    _check_overlap(seq, ops, writes)
    return CopyBlocks(seq=seq, step=step, ops=tuple(ops))


def _check_overlap(seq: int, ops: list[Op], writes: dict[str, list[np.ndarray]]) -> None:
    """A batch runs by kind (copies first, storage I/O after, on threads of its own), not
    in the listed order: two ops writing one block leave either's bytes (on a GPU, a torn
    block), and an s2h's host block used by any other op of the batch races the I/O. The
    scheduler never sends either (one op per kind; a block in flight is pinned); a broken
    or forged one did, and each was acked ok."""
    for space, arrays in writes.items():
        if len(arrays) > 1:
            every = np.concatenate(arrays)
            if len(np.unique(every)) != len(every):
                raise ProtocolError(f"batch {seq}: two ops write one {space} block")
    loads = [op for op in ops if op.kind == S2H and len(op.dst)]
    if not loads:
        return
    loaded = np.concatenate([op.dst for op in loads])
    for op in ops:
        if op.kind == S2H:
            continue
        for side, side_space in zip((op.src, op.dst), _SIDES[op.kind][:2], strict=True):
            if side_space == "host" and len(side) and np.isin(side, loaded).any():
                raise ProtocolError(f"batch {seq}: op {op.id} ({op.kind}) uses a host block "
                                    "an s2h of the batch writes")


def _ids(frame: Any, n: int, seq: int, op_id: int, side: str, bound: int | None) -> np.ndarray:
    buf = _buf(frame)
    if buf.nbytes != 4 * n:
        raise ProtocolError(f"batch {seq}: op {op_id} {side} frame has {buf.nbytes} bytes, "
                            f"want {4 * n}")
    arr = np.frombuffer(buf, dtype="<i4") if n else _EMPTY_IDS
    if n and (int(arr.min()) < 0 or (bound is not None and int(arr.max()) >= bound)):
        raise ProtocolError(
            f"batch {seq}: op {op_id} {side} block id out of range "
            f"[0, {bound if bound is not None else 'inf'}): min={int(arr.min())} "
            f"max={int(arr.max())}"
        )
    return arr


def _keys(frame: Any, n: int, seq: int, op_id: int) -> tuple[bytes, ...]:
    raw = _buf(frame).tobytes()
    if len(raw) != DIGEST_SIZE * n:
        raise ProtocolError(
            f"batch {seq}: op {op_id} keys frame has {len(raw)} bytes, want {DIGEST_SIZE * n}"
        )
    return tuple(raw[j : j + DIGEST_SIZE] for j in range(0, len(raw), DIGEST_SIZE))


def _pending(raw: Any, result_ids: list[int]) -> tuple[int, ...]:
    if type(raw) is not list or not all(type(i) is int and i >= 0 for i in raw):
        raise ProtocolError("ack: pending must be a list of op ids")
    if len(set(raw)) != len(raw) or set(raw) & set(result_ids):
        raise ProtocolError("ack: pending op ids repeat or overlap the results")
    return tuple(raw)


def _decode_result(r: Any) -> OpResult:
    if not isinstance(r, dict):
        raise ProtocolError("ack: op result is not an object")
    err = r.get("error")
    if err is not None and (type(err) is not str or len(err) > MAX_ERROR_CHARS):
        # (longer is no encoder's: it cuts each to MAX_ERROR_CHARS. It went on, megabytes,
        # into the scheduler's op.failed log line and the batch's results)
        raise ProtocolError(f"ack: op error must be null or a string of at most "
                            f"{MAX_ERROR_CHARS} characters")
    return OpResult(_nonneg(r, "id"), _get(r, "ok", bool), _nonneg(r, "done"), err)


def _buf(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer
    try:
        return memoryview(buf).cast("B")
    except TypeError as e:
        raise ProtocolError(f"frame is not a byte buffer: {type(frame).__name__}") from e


def _reason(hdr: dict[str, Any], what: str) -> str:
    """A bye's, shutdown's or refusal's ``reason``: at most ``MAX_REASON_CHARS`` (it is
    logged; before, a bye's was any length, up to the frame limit, in one log line)."""
    reason = _get(hdr, "reason", str)
    if len(reason) > MAX_REASON_CHARS:
        raise ProtocolError(f"{what}: reason longer than {MAX_REASON_CHARS} characters")
    return reason  # type: ignore[no-any-return]


def _quote(value: Any) -> str:
    """A peer's bad value for an error line, cut (it may be megabytes)."""
    text = repr(value)
    return text if len(text) <= 64 else f"{text[:64]}... ({len(text)} characters)"


def _get(d: dict[str, Any], name: str, typ: type) -> Any:
    if name not in d:
        raise ProtocolError(f"missing field {name!r}")
    val = d[name]
    # bool is an int subclass: an int field must not accept true/false and vice versa.
    if type(val) is not typ:
        raise ProtocolError(f"field {name!r} must be {typ.__name__}, got {type(val).__name__}")
    return val


def _int(d: dict[str, Any], name: str) -> int:
    return int(_get(d, name, int))


def _nonneg(d: dict[str, Any], name: str) -> int:
    val = _int(d, name)
    if val < 0:
        raise ProtocolError(f"field {name!r} must be >= 0, got {val}")
    return val


def _num(d: dict[str, Any], name: str) -> float:
    val = d.get(name)
    if type(val) not in (int, float):
        raise ProtocolError(f"field {name!r} must be a number, got {type(val).__name__}")
    return float(val)  # type: ignore[arg-type]  # (an int or a float: checked above)
