"""Multipart send / receive for the control plane's hot path.

pyzmq's ``send_multipart`` / ``recv_multipart`` type-check every part and combine
``IntFlag`` members per frame (``zmq.SNDMORE | flags`` builds a new enum object each
time); with one batch and one ack per step that was ~2 µs a message on each side of
every hop (bench/pipeline.py). These do the same calls with plain ints. Semantics are
pyzmq's: a multipart message is atomic at the high-water mark (the first frame decides),
``zmq.Again`` under ``DONTWAIT`` when there is no room or nothing to read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq

SNDMORE = int(zmq.SNDMORE)
DONTWAIT = int(zmq.DONTWAIT)
POLLIN = int(zmq.POLLIN)
_EVENTS = zmq.EVENTS
#: ``zmq_poll([(socket or fd, POLLIN), ...], timeout_ms)``: the ready items, in order. One
#: call into libzmq, without ``zmq.Poller``'s registration dict and result mapping.
zmq_poll = zmq.zmq_poll


def send_frames(sock: zmq.Socket[Any], frames: Sequence[Any], flags: int = 0,
                copy: bool = True) -> None:
    """``sock.send_multipart(frames, flags, copy=copy)`` for a non-empty ``frames``."""
    last = len(frames) - 1
    more = SNDMORE | flags
    for i in range(last):
        sock.send(frames[i], more, copy=copy)
    sock.send(frames[last], flags, copy=copy)


def recv_frames(sock: zmq.Socket[Any], flags: int = 0, copy: bool = True) -> list[Any]:
    """``sock.recv_multipart(flags, copy=copy)``. Frames are received as ``zmq.Frame``
    and asked ``more`` (a field of the message): ``get(RCVMORE)`` is a getsockopt call
    into libzmq per frame, which costs more than the receive itself."""
    f = sock.recv(flags, copy=False)
    parts = [f]
    while f.more:
        f = sock.recv(flags, copy=False)
        parts.append(f)
    if copy:
        return [f.bytes for f in parts]
    return parts


def readable(sock: zmq.Socket[Any]) -> bool:
    """A message is queued (cheaper than a ``DONTWAIT`` receive that raises ``Again``)."""
    return bool(sock.get(_EVENTS) & POLLIN)  # type: ignore[operator]  # (EVENTS is an int)


def allow_ipv6(sock: zmq.Socket[Any], endpoint: str) -> None:
    """``ZMQ_IPV6`` on for an IPv6 literal (``tcp://[::1]:PORT``), before bind / connect:
    libzmq's sockets are IPv4-only by default, and such an endpoint failed ("No such
    device"). Names and IPv4 addresses stay IPv4, as before (a name with both records is
    not sent to IPv6 on one side only)."""
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
