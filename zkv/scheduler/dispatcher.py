"""Scheduler side of the actor pipeline: publish batches, aggregate acks, watch ranks.

::

    Dispatcher ── XPUB ─ CopyBlocks(seq), Shutdown ───────────────► SUB   rank 0..W-1
               ◄─ PULL ─ BlocksCopied, Hello, Heartbeat, Bye ─────── PUSH

Joining. A rank counts as joined when (a) its ``Hello`` carried the scheduler's layout
fingerprint and (b) the XPUB reported the rank's :func:`~zkv.protocol.ready_topic`
subscription for the same pid. The worker's SUB subscribes to everything (``b""``) before
that marker, and a SUB sends its subscriptions in order over one pipe, so (b) proves that
every later batch reaches the rank: no slow-joiner drop. Nothing is published before every
rank joined.

Acks. Every in-flight batch keeps a bitmask of the ranks that acked it; an ack does
``acked |= 1 << rank`` and the batch completes when ``acked == all_mask`` (O(ops) per
ack). An op's result is the minimum over ranks: ``ok`` = all ok, ``done`` = min done,
``error`` = the first error seen. A rank acks its copies at once and may name storage
ops as ``pending``: their results come in later acks of the same seq, and the batch
completes when every rank acked and none has ops pending. Ranks ack copies in seq order,
but a batch waiting on storage I/O completes after later batches: completion order is not
seq order (the CacheManager commits per op, so that is fine). The ack deadline covers the
first ack of every rank; pending I/O is bounded by the stores' own timeouts.

Rank loss. A rank is lost when it misses heartbeats for ``heartbeat_timeout_s``, misses the
ack deadline of a batch (``ack_timeout_s`` after publishing), says ``Bye`` while batches
may still come (a seq gap, a crash it caught, a sidecar closed early), or its SUB goes away
(the XPUB reports the marker's unsubscription: a killed process is seen at once). Loss is
final: every in-flight batch completes as failed at once and later ``publish`` raises
:class:`~zkv.errors.RankLost`.

The dispatcher is single-threaded: call it from the scheduling loop only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from zkv import log as ev
from zkv import protocol as P
from zkv.errors import ConfigError, ProtocolError, RankLost

RANK_REFUSED = "dispatcher.rank_refused"
RANK_LEFT = "dispatcher.rank_left"
DISPATCHER_STOPPED = "dispatcher.stopped"

#: How often deadlines are checked while messages keep arriving (they are always checked
#: before ``poll`` blocks).
_CHECK_INTERVAL_S = 0.005
#: A rank whose subscriber disconnected is declared lost this long after (unless its Bye
#: arrives first and gives the reason).
_BYE_GRACE_S = 0.05


def _logger() -> Any:
    get = getattr(ev, "get_logger", None)
    if get is not None:
        return get("dispatcher")
    import structlog

    return structlog.get_logger(component="dispatcher", pid=os.getpid())


@dataclass(frozen=True, slots=True)
class BatchDone:
    """A batch whose outcome is known on every rank (or that failed because a rank is lost).

    ``results`` maps op id to the minimum over ranks; ``latency_s`` runs from publish to
    the last ack (or to the moment the batch was failed).
    """

    seq: int
    step: int
    ok: bool
    results: dict[int, P.OpResult]
    lost_ranks: frozenset[int]
    latency_s: float


@dataclass(slots=True)
class _InFlight:
    seq: int
    step: int
    op_ids: tuple[int, ...]
    op_set: frozenset[int]
    t_pub: float
    deadline: float
    acked: int = 0
    results: dict[int, P.OpResult] = field(default_factory=dict)
    waiting: dict[int, frozenset[int]] = field(default_factory=dict)  # rank -> ops still pending


@dataclass(slots=True)
class _Rank:
    rank: int
    hello_pid: int | None = None
    sub_pids: set[int] = field(default_factory=set)
    joined_pid: int | None = None
    last_seen: float = 0.0
    last_seq: int = -1
    refused: str | None = None
    disconnected_at: float | None = None


class Dispatcher:
    """Publishes one :class:`~zkv.protocol.CopyBlocks` per step to ``world_size`` ranks and
    aggregates their :class:`~zkv.protocol.BlocksCopied` acks.

    Invariants: seqs are published 0, 1, 2, ... with no gap; a batch completes exactly once
    (all acks, or failed by a rank loss); the in-flight table only holds uncompleted seqs.
    Cost: ``publish`` O(ops); an ack O(ops of its batch); deadline checks O(world_size).
    """

    def __init__(
        self,
        pub_endpoint: str,
        pull_endpoint: str,
        world_size: int,
        layout_fingerprint: str,
        *,
        heartbeat_timeout_s: float = 5.0,
        ack_timeout_s: float = 30.0,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if world_size <= 0 or world_size > 4096:
            raise ValueError(f"world_size must be in [1, 4096], got {world_size}")
        self.world_size = world_size
        self.layout_fingerprint = layout_fingerprint
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.ack_timeout_s = ack_timeout_s
        self._all_mask = (1 << world_size) - 1
        self._own_context = context is None
        self._ctx: zmq.Context[Any] = zmq.Context() if context is None else context
        self._log = _logger()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pull = self._ctx.socket(zmq.PULL)
        for sock in (self._pub, self._pull):
            sock.setsockopt(zmq.LINGER, 0)
        # Unbounded queues: a PUB drops at its high-water mark, and a drop is a seq gap.
        # The scheduler bounds the number of batches in flight, not the transport.
        self._pub.setsockopt(zmq.SNDHWM, 0)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        try:
            self._pub.bind(pub_endpoint)
            self._pull.bind(pull_endpoint)
        except zmq.ZMQError:
            self._pub.close(0)
            self._pull.close(0)
            if self._own_context:
                self._ctx.term()
            raise
        self.pub_endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.pull_endpoint = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._poller.register(self._pub, zmq.POLLIN)
        self._ranks = [_Rank(r) for r in range(world_size)]
        self._lost: dict[int, str] = {}
        self._in_flight: dict[int, _InFlight] = {}
        self._completed: list[BatchDone] = []
        self._next_seq = 0
        self._started = False
        self._closing = False
        self._closed = False
        self._next_check = 0.0

    # ------------------------------------------------------------ public API

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def lost_ranks(self) -> frozenset[int]:
        return frozenset(self._lost)

    @property
    def next_seq(self) -> int:
        return self._next_seq

    @property
    def joined(self) -> bool:
        return self._started

    def wait_for_ranks(self, timeout_s: float) -> None:
        """Return once every rank joined (hello with our layout + subscription proven).

        Raises ``TimeoutError`` naming the missing (and refused) ranks.
        """
        if self._started:
            return
        deadline = time.monotonic() + timeout_s
        while True:
            self._drain()
            if all(r.joined_pid is not None for r in self._ranks):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(self._missing_message(timeout_s))
            self._poller.poll(max(1, min(100, int(left * 1000))))
        now = time.monotonic()
        for r in self._ranks:
            r.last_seen = now
        self._started = True
        self._log.info(ev.RANK_JOINED, num_ranks=self.world_size, all_joined=True)

    def publish(self, ops: Sequence[P.Op], step: int) -> int:
        """Send one batch with the next seq and return that seq.

        Raises :class:`RankLost` if a rank is lost (nothing is sent then), ``RuntimeError``
        before :meth:`wait_for_ranks`, ``ValueError`` for duplicate op ids.
        """
        if not self._started or self._closed:
            raise RuntimeError("publish before wait_for_ranks() or after close()")
        if self._lost:
            rank, reason = next(iter(self._lost.items()))
            raise RankLost(rank, reason)
        ops = tuple(ops)
        op_ids = tuple(op.id for op in ops)
        if len(set(op_ids)) != len(op_ids):
            raise ValueError(f"duplicate op ids in batch: {op_ids}")
        seq = self._next_seq
        frames = P.encode(P.CopyBlocks(seq=seq, step=step, ops=ops))
        now = time.monotonic()
        self._in_flight[seq] = _InFlight(seq, step, op_ids, frozenset(op_ids), time.perf_counter(),
                                         now + self.ack_timeout_s)
        self._pub.send_multipart(frames, copy=False)
        self._next_seq = seq + 1
        self._log.info(ev.BATCH_PUBLISHED, seq=seq, step=step, num_ops=len(ops))
        return seq

    def poll(self, timeout_s: float = 0.0) -> list[BatchDone]:
        """Process incoming messages for at most ``timeout_s``; return completed batches.

        Returns as soon as at least one batch completed (after taking every message that
        is already there), so a tight loop of ``poll`` calls adds no latency.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            self._drain()
            now = time.monotonic()
            if now >= self._next_check or self._completed or now >= deadline:
                self._check_deadlines(now)
            if self._completed or now >= deadline:
                return self.take_completed()
            # zmq_poll takes whole milliseconds; under one, spin (a tight ack loop).
            self._poller.poll(min(int((deadline - now) * 1000), self._max_wait_ms()))

    def _max_wait_ms(self) -> int:
        if any(r.disconnected_at is not None for r in self._ranks):
            return int(_BYE_GRACE_S * 1000)
        return 100

    def drain(self, timeout_s: float) -> list[BatchDone]:
        """Poll until nothing is in flight (or ``timeout_s`` passed); return what completed."""
        deadline = time.monotonic() + timeout_s
        done: list[BatchDone] = []
        while True:
            done += self.poll(max(0.0, min(0.1, deadline - time.monotonic())))
            if not self._in_flight or time.monotonic() >= deadline:
                return done

    def take_completed(self) -> list[BatchDone]:
        done, self._completed = self._completed, []
        return done

    def close(self, shutdown: bool = True, timeout_s: float = 1.0) -> None:
        """Publish ``Shutdown`` (and wait up to ``timeout_s`` for the ranks' ``Bye``), then
        close both sockets with linger 0. Idempotent."""
        if self._closed:
            return
        self._closing = True
        try:
            if shutdown:
                self._pub.send_multipart(P.encode(P.Shutdown("scheduler closed")), copy=False)
                self._wait_byes(timeout_s)
        finally:
            self._closed = True
            self._pub.close(0)
            self._pull.close(0)
            if self._own_context:
                self._ctx.term()
            self._log.info(DISPATCHER_STOPPED, next_seq=self._next_seq,
                           num_in_flight=len(self._in_flight))

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ------------------------------------------------------------ receiving

    def _drain(self) -> None:
        """Handle every message already queued on both sockets, without blocking."""
        pull, pub = self._pull, self._pub
        # EVENTS is cheaper than a NOBLOCK recv that raises zmq.Again.
        while pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = pull.recv_multipart(zmq.NOBLOCK)
            try:
                self._on_message(frames)
            except Exception as e:  # a message must never take the scheduler down
                self._log.exception(ev.ACK_REFUSED, error=repr(e), type=_tag(frames))
        while pub.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._on_subscription(pub.recv(zmq.NOBLOCK))

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            msg = P.decode(frames)
        except ProtocolError as e:
            self._log.error(ev.ACK_REFUSED, error=str(e), type=_tag(frames))
            return
        if isinstance(msg, P.BlocksCopied):
            self._on_ack(msg)
        elif isinstance(msg, P.Heartbeat):
            self._on_heartbeat(msg)
        elif isinstance(msg, P.Hello):
            self._on_hello(msg)
        elif isinstance(msg, P.Bye):
            self._on_bye(msg)
        else:
            self._log.error(ev.ACK_REFUSED, error="not a worker message", type=_tag(frames))

    def _rank_of(self, rank: int, what: str) -> _Rank | None:
        if rank >= self.world_size:
            self._log.error(ev.ACK_REFUSED, error=f"{what} from rank {rank} >= world size "
                            f"{self.world_size}", rank=rank)
            return None
        return self._ranks[rank]

    def _on_hello(self, msg: P.Hello) -> None:
        r = self._rank_of(msg.rank, "hello")
        if r is None:
            return
        if msg.layout != self.layout_fingerprint:
            err = ConfigError(f"rank {msg.rank} (pid {msg.pid}) has layout {msg.layout}, "
                              f"the scheduler has {self.layout_fingerprint}")
            r.refused = str(err)
            self._log.error(RANK_REFUSED, rank=msg.rank, worker_pid=msg.pid, error=str(err))
            return
        if self._started:
            if msg.pid != r.joined_pid:
                self._log.error(RANK_REFUSED, rank=msg.rank, worker_pid=msg.pid,
                                error="hello after the group started (ranks cannot rejoin)")
            return
        r.hello_pid = msg.pid
        r.refused = None
        r.last_seen = time.monotonic()
        self._maybe_join(r)

    def _on_subscription(self, sub: bytes) -> None:
        if not sub:
            return
        marker = P.parse_ready_topic(sub[1:])
        if marker is None:
            return
        rank, pid = marker
        if rank >= self.world_size:
            return
        r = self._ranks[rank]
        if sub[0] == 1:
            r.sub_pids.add(pid)
            self._maybe_join(r)
            return
        r.sub_pids.discard(pid)
        if pid != r.joined_pid:
            return
        if self._started:
            # Declared lost after a short grace, so that a Bye sent just before the
            # disconnect (say, a seq gap) gives the reason.
            if r.disconnected_at is None:
                r.disconnected_at = time.monotonic()
        else:
            r.joined_pid = None
            r.hello_pid = None
            self._log.warning(RANK_LEFT, rank=rank, worker_pid=pid,
                              reason="subscriber disconnected")

    def _maybe_join(self, r: _Rank) -> None:
        if self._started or r.hello_pid is None or r.hello_pid not in r.sub_pids:
            return
        if r.joined_pid != r.hello_pid:
            r.joined_pid = r.hello_pid
            self._log.info(ev.RANK_JOINED, rank=r.rank, worker_pid=r.joined_pid)

    def _on_heartbeat(self, msg: P.Heartbeat) -> None:
        r = self._rank_of(msg.rank, "heartbeat")
        if r is not None and msg.pid == (r.joined_pid or r.hello_pid):
            r.last_seen = time.monotonic()
            r.last_seq = msg.last_seq

    def _on_bye(self, msg: P.Bye) -> None:
        r = self._rank_of(msg.rank, "bye")
        if r is None or msg.pid != (r.joined_pid or r.hello_pid):
            return
        if not self._started:
            r.joined_pid = r.hello_pid = None
            self._log.warning(RANK_LEFT, rank=msg.rank, worker_pid=msg.pid, reason=msg.reason)
        elif not self._closing:
            self._declare_lost(msg.rank, f"it said bye: {msg.reason}")

    def _on_ack(self, ack: P.BlocksCopied) -> None:
        rank = ack.rank
        r = self._rank_of(rank, "ack")
        if r is None:
            return
        r.last_seen = time.monotonic()
        batch = self._in_flight.get(ack.seq)
        if batch is None:
            if ack.seq < self._next_seq and (self._lost or rank in self._lost):
                return  # a late ack of a batch that already failed with a lost rank
            self._log.error(ev.ACK_REFUSED, seq=ack.seq, rank=rank,
                            error="ack for an unknown or completed seq")
            return
        bit = 1 << rank
        later = batch.acked & bit  # a follow-up: results of ops this rank left pending
        expected = batch.waiting.get(rank, frozenset()) if later else batch.op_set
        if later and not expected:
            self._log.error(ev.ACK_REFUSED, seq=ack.seq, rank=rank, error="duplicate ack")
            return
        by_id = {res.id: res for res in ack.results}
        pending = set(ack.pending)
        if not (by_id.keys() | pending) <= expected:
            self._log.error(ev.ACK_REFUSED, seq=ack.seq, rank=rank,
                            error=f"ack names ops {sorted((by_id.keys() | pending) - expected)}, "
                                  "which the batch does not have or already reported")
            return
        batch.acked |= bit
        r.last_seq = max(r.last_seq, ack.seq)
        left = (expected - by_id.keys()) if later else pending
        if left:
            batch.waiting[rank] = frozenset(left)
        else:
            batch.waiting.pop(rank, None)
        missing = () if later else (i for i in batch.op_ids if i not in by_id and i not in pending)
        for op_id in missing:
            by_id[op_id] = P.OpResult(op_id, False, 0, "no result")
        self._merge(batch.results, by_id.values(), rank)
        if batch.acked == self._all_mask and not batch.waiting:
            del self._in_flight[ack.seq]
            self._complete(batch)

    @staticmethod
    def _merge(merged: dict[int, P.OpResult], results: Any, rank: int) -> None:
        """An op's result is the minimum over ranks: all ok, min done, first error."""
        for res in results:
            op_id = res.id
            if res.error is not None:
                res = P.OpResult(op_id, res.ok, res.done, f"rank {rank}: {res.error}")
            cur = merged.get(op_id)
            if cur is None:
                merged[op_id] = res
            elif cur.ok > res.ok or res.done < cur.done:
                merged[op_id] = P.OpResult(op_id, cur.ok and res.ok, min(cur.done, res.done),
                                           cur.error or res.error)

    def _complete(self, batch: _InFlight) -> None:
        latency = time.perf_counter() - batch.t_pub
        ok = all(res.ok for res in batch.results.values())
        self._completed.append(BatchDone(batch.seq, batch.step, ok, batch.results,
                                         frozenset(self._lost), latency))
        self._log.info(ev.BATCH_ACKED, seq=batch.seq, num_ops=len(batch.op_ids), ok=ok,
                       dur_ms=round(latency * 1e3, 3))

    # ------------------------------------------------------------ failure

    def _check_deadlines(self, now: float) -> None:
        self._next_check = now + _CHECK_INTERVAL_S
        if not self._started or self._closing:
            return
        for r in self._ranks:
            if r.rank in self._lost:
                continue
            if r.disconnected_at is not None and now - r.disconnected_at >= _BYE_GRACE_S:
                self._declare_lost(r.rank, "its subscriber disconnected")
            elif now - r.last_seen > self.heartbeat_timeout_s:
                self._declare_lost(r.rank, f"no heartbeat for {now - r.last_seen:.2f} s "
                                           f"(timeout {self.heartbeat_timeout_s} s)")
        if self._in_flight:  # the oldest batch some rank has not acked (I/O may be pending)
            full = self._all_mask
            oldest = next((b for b in self._in_flight.values() if b.acked != full), None)
            if oldest is not None and now > oldest.deadline:
                for rank in range(self.world_size):
                    if not oldest.acked & (1 << rank) and rank not in self._lost:
                        self._declare_lost(rank, f"no ack for seq {oldest.seq} within "
                                                 f"{self.ack_timeout_s} s")

    def _declare_lost(self, rank: int, reason: str) -> None:
        if rank in self._lost:
            return
        self._lost[rank] = reason
        self._log.error(ev.RANK_LOST, rank=rank, reason=reason,
                        num_in_flight=len(self._in_flight))
        error = f"rank {rank} lost: {reason}"
        lost = frozenset(self._lost)
        t = time.perf_counter()
        for batch in self._in_flight.values():
            results = {i: P.OpResult(i, False, 0, error) for i in batch.op_ids}
            self._completed.append(BatchDone(batch.seq, batch.step, False, results, lost,
                                             t - batch.t_pub))
        self._in_flight.clear()

    def _wait_byes(self, timeout_s: float) -> None:
        """After ``Shutdown``: take messages until every live joined rank said bye."""
        waiting = {r.rank for r in self._ranks if r.joined_pid is not None} - set(self._lost)
        deadline = time.monotonic() + timeout_s
        while waiting and time.monotonic() < deadline:
            if not self._pull.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                break
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK)
                msg = P.decode(frames)
            except (zmq.Again, ProtocolError):
                continue
            if isinstance(msg, P.Bye) and msg.rank < self.world_size:
                waiting.discard(msg.rank)

    def _missing_message(self, timeout_s: float) -> str:
        parts = []
        for r in self._ranks:
            if r.joined_pid is not None:
                continue
            if r.refused:
                parts.append(f"rank {r.rank}: refused ({r.refused})")
            elif r.hello_pid is not None:
                parts.append(f"rank {r.rank}: said hello (pid {r.hello_pid}) but its "
                             "subscription never arrived")
            else:
                parts.append(f"rank {r.rank}: no hello")
        missing = [r.rank for r in self._ranks if r.joined_pid is None]
        return (f"ranks {missing} of {self.world_size} did not join within {timeout_s} s: "
                + "; ".join(parts))


def _tag(frames: Sequence[Any]) -> str:
    if not frames:
        return ""
    try:
        return bytes(frames[0][:32]).decode(errors="replace")
    except Exception:
        return "?"
