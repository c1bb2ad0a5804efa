"""Scheduler side of the actor pipeline: publish batches, aggregate acks, watch ranks.

::

    Dispatcher ── XPUB ─ CopyBlocks(seq), Shutdown, Refused ──────► SUB   rank 0..W-1
               ◄─ PULL ─ BlocksCopied, Hello, Heartbeat, Bye ─────── PUSH

Joining and refusing (:mod:`zkv.scheduler.membership`, drawn there). A rank joins with a
``Hello`` carrying the scheduler's layout and its ready-topic subscription (proof that
every later batch reaches it); no batch is published before every rank joined. A hello
that is not taken is answered with ``Refused(rank, pid, reason)`` on the XPUB (the
process exits 4), and ``wait_for_ranks`` raises ``ConfigError`` for a layout that differs.

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

Trust (see :mod:`zkv.security`). Every peer passes the ZAP handler at connect time. With
a :class:`~zkv.security.Keyring` every connection is CURVE and carries its rank as
``User-Id``; a message naming another rank (ack, heartbeat, bye, hello, ready marker) is
dropped and counted as forged. Anything malformed is refused and counted; refusals are
logged at most ``_LOG_BURST`` lines a second (the rest only counted, see
:meth:`Dispatcher.refusals`), and one drain takes at most ``_MAX_DRAIN`` messages, so a
flood cannot stall deadline checks. A rank whose batch queue is full (``send_hwm``
batches it has not read) holds publish back for at most ``send_timeout_s``, then is lost:
publish never drops a batch for one rank only (that would be a seq gap).

The dispatcher is single-threaded: call it from the scheduling loop only.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import zmq

from zkv import log as ev
from zkv import protocol as P
from zkv import security
from zkv.config import CacheLayout, endpoints_from_env
from zkv.errors import ConfigError, ProtocolError, RankLost
from zkv.scheduler import acks, checks
from zkv.scheduler.membership import TELL_S, Membership
from zkv.zmqio import DONTWAIT, POLLIN, allow_ipv6, readable, recv_frames, send_frames, zmq_poll

#: How often ``poll`` checks deadlines (heartbeats, acks, disconnects); it wakes at least
#: every ``_SUBS_EVERY_S`` while it waits, and checks once more when its timeout ends.
_CHECK_INTERVAL_S = 0.005
#: How often ``poll`` reads the XPUB's subscription messages (a rank's SUB joining or going
#: away); it wakes for them at least this often while it waits for acks.
_SUBS_EVERY_S = 0.01
_BYE_GRACE_S = 0.05  # a rank whose SUB disconnected is lost this long after (its Bye: why)
#: Messages taken per drain before deadlines are looked at again.
_MAX_DRAIN = 256
#: ``_drain`` rounds to read a backlog before judging deadlines (8 ranks beating every
#: 0.25 s for a 30 s timeout queue ~1,000 heartbeats: 4 rounds).
_MAX_BACKLOG_ROUNDS = 64
_NO_RANKS: frozenset[int] = frozenset()
#: Refusal log lines per second; the rest are counted.
_LOG_BURST = 10


def _logger() -> Any:
    get = getattr(ev, "get_logger", None)
    if get is not None:
        return get("dispatcher")
    import structlog

    return structlog.get_logger(component="dispatcher", pid=os.getpid())


class BatchDone(NamedTuple):
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


class _InFlight:
    """A published batch until every rank acked it (one per step: a plain class)."""

    __slots__ = ("seq", "step", "op_ids", "op_set", "sizes", "io_ops", "t_pub", "deadline",
                 "acked", "results", "waiting")

    def __init__(self, seq: int, step: int, ops: Sequence[P.Op], t_pub: float,
                 deadline: float) -> None:
        self.seq = seq
        self.step = step
        if ops:
            self.op_ids = tuple(op.id for op in ops)
            self.sizes = {op.id: op.num_blocks for op in ops}  # what a result may claim
            self.io_ops = frozenset(op.id for op in ops if op.kind in acks.IO_KINDS)  # may pend
        else:  # an idle step's (every step of an idle cache)
            self.op_ids, self.sizes, self.io_ops = (), {}, frozenset()
        self.op_set = frozenset(self.op_ids)
        self.t_pub = t_pub
        self.deadline = deadline
        self.acked = 0  # bit per rank
        self.results: dict[int, P.OpResult] = {}
        self.waiting: dict[int, frozenset[int]] = {}  # rank -> ops still pending


class Dispatcher:
    """Publishes one :class:`~zkv.protocol.CopyBlocks` per step to ``world_size`` ranks and
    aggregates their :class:`~zkv.protocol.BlocksCopied` acks.

    ``layout``: the scheduler's :class:`~zkv.config.CacheLayout` (a rank whose layout
    differs in any field, pool sizes included, is refused at its hello, naming the fields),
    or only a layout fingerprint string (then only the fingerprint is compared).
    ``keys``: a :class:`~zkv.security.Keyring` (CURVE, per-rank identities); without one,
    only ``ipc://`` in a private directory is accepted, or ``tcp://`` with ``insecure``.
    ``batch_log_level``: of ``batch_published`` / ``batch_acked`` (an engine's: debug, not
    a line a step); ``log_fields``: bound on every line (an engine's ``engine_id``).

    Invariants: seqs are published 0, 1, 2, ... with no gap; a batch completes exactly once
    (all acks, or failed by a rank loss); the in-flight table only holds uncompleted seqs;
    a message counts only for the rank whose identity sent it.
    Cost: ``publish`` O(ops); an ack O(ops of its batch); deadline checks O(world_size).
    """

    def __init__(
        self,
        pub_endpoint: str,
        pull_endpoint: str,
        world_size: int,
        layout: CacheLayout | str,
        *,
        heartbeat_timeout_s: float = 5.0,
        ack_timeout_s: float = 30.0,
        context: zmq.Context[Any] | None = None,
        keys: security.Keyring | None = None,
        insecure: bool = False,
        allow_remote: bool = False,
        send_hwm: int = P.SEND_HWM,
        send_timeout_s: float | None = None,
        batch_log_level: str = "info",
        log_fields: dict[str, Any] | None = None,
    ) -> None:
        if world_size <= 0 or world_size > 4096:
            raise ValueError(f"world_size must be in [1, 4096], got {world_size}")
        if keys is not None and keys.world_size != world_size:
            raise ConfigError(f"the keyring has keys for {keys.world_size} ranks, the group "
                              f"has {world_size}")
        for ep in (pub_endpoint, pull_endpoint):
            security.check_endpoint(ep, keys=keys, insecure=insecure, allow_remote=allow_remote)
        self.world_size = world_size
        self.layout = layout if isinstance(layout, CacheLayout) else None
        self.layout_fingerprint = layout.fingerprint() if isinstance(layout, CacheLayout) \
            else layout
        self.heartbeat_timeout_s = checks.timeout("heartbeat_timeout_s", heartbeat_timeout_s)
        self.ack_timeout_s = checks.timeout("ack_timeout_s", ack_timeout_s)
        self.send_hwm = send_hwm
        self.send_timeout_s = checks.timeout(
            "send_timeout_s", ack_timeout_s if send_timeout_s is None else send_timeout_s)
        self._all_mask = (1 << world_size) - 1
        self._own_context = context is None
        self._ctx: zmq.Context[Any] = zmq.Context() if context is None else context
        self._log = _logger().bind(**(log_fields or {}))  # (an engine's: its engine_id)
        # Per-batch events: bound once logging is configured (wait_for_ranks); a lazy proxy
        # resolves the configuration on every call (~4 us even when filtered out).
        if batch_log_level not in ev.LEVELS:
            raise ValueError(f"batch_log_level must be one of {list(ev.LEVELS)}")
        self._hot_log = getattr(self._log, batch_log_level)
        self._batch_level = batch_log_level  # of the two lines a batch (an engine: debug)
        self._info = True  # whether those lines pass (checked once the group started)
        self._refused_log = ev.RateLimited(self._log, ev.ACK_REFUSED, burst=_LOG_BURST)
        self._forged_log = ev.RateLimited(self._log, ev.IDENTITY_FORGED, burst=_LOG_BURST)
        self._counts = {"malformed": 0, "forged": 0, "unknown_seq": 0, "duplicate": 0,
                        "unknown_rank": 0, "hello": 0}
        self._final_counts: dict[str, int] | None = None  # refusals() once closed
        self.num_received = 0
        # With keys every connection's User-Id is its rank; messages come as zmq.Frames.
        self._authenticated = keys is not None
        self._user_rank = {str(r): r for r in range(world_size)}
        self._open_sockets(keys, pub_endpoint, pull_endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._poller.register(self._pub, zmq.POLLIN)
        self._pull_only = [(self._pull, POLLIN)]
        self._next_subs = 0.0
        self._max_wait_ms = 100  # longest poll; shorter once a rank's SUB went away
        self._members = Membership(world_size, self.layout, self.layout_fingerprint,
                                   counts=self._counts, log=self._log, refuse=self._refuse,
                                   forged=self._forged_log, tell=self._publish_refused)
        self._ranks = self._members.ranks  # the same records (acks update them)
        self._lost: dict[int, str] = {}
        self._left: set[int] = set()  # of the lost: those that said bye
        self._in_flight: dict[int, _InFlight] = {}
        self._completed: list[BatchDone] = []
        self._next_seq = 0
        self._closing = False
        self._closed = False
        self._next_check = 0.0

    @classmethod
    def from_env(cls, world_size: int, layout: CacheLayout | str,
                 env: Mapping[str, str] | None = None, **kwargs: Any) -> Dispatcher:
        """The scheduler of a group ``zkvrun`` started (what its ``--scheduler`` command
        calls; the ranks' Sidecar reads the same variables): the endpoints
        (``ZKV_PUB_ENDPOINT``, ``ZKV_PULL_ENDPOINT``), the run's keyring (``ZKV_KEYS``:
        zkvrun makes one unless ``--insecure-tcp``; without it the ranks never join) and
        its flags (``ZKV_INSECURE``, ``ZKV_ALLOW_REMOTE``). ``kwargs``: the constructor's."""
        env = os.environ if env is None else env
        pub, pull = endpoints_from_env(env)
        return cls(pub, pull, world_size, layout, keys=security.keyring_from_env(env),
                   insecure=env.get("ZKV_INSECURE") == "1",
                   allow_remote=env.get("ZKV_ALLOW_REMOTE") == "1", **kwargs)

    def _open_sockets(self, keys: security.Keyring | None, pub_endpoint: str,
                      pull_endpoint: str) -> None:
        """The ZAP domain, the XPUB and the PULL, bound (their endpoints as bound: a port 0
        resolved); on a failure nothing is left open."""
        self._domain = f"zkv-{uuid.uuid4().hex[:12]}"
        opened: list[zmq.Socket[Any]] = []
        zap = None
        try:  # creating a socket fails too (the process's or the context's socket limit)
            zap = self._zap = security.ZapHandler.register(self._ctx, self._domain, keys)
            self._pub = security.new_socket(self._ctx, zmq.XPUB)
            opened.append(self._pub)
            self._pull = security.new_socket(self._ctx, zmq.PULL)
            opened.append(self._pull)
            self._setup_sockets(keys, pub_endpoint, pull_endpoint)
            for sock, endpoint in ((self._pub, pub_endpoint), (self._pull, pull_endpoint)):
                try:
                    sock.bind(endpoint)
                except zmq.ZMQError as e:  # a port in use, an address not this machine's
                    raise ConfigError(f"the scheduler cannot listen on {endpoint}: "
                                      f"{zmq.strerror(e.errno or 0)}") from None
        except BaseException:  # a socket error, a bad key, SystemExit from a signal
            for sock in opened:
                sock.close(0)
            if zap is not None:
                zap.unregister(self._domain)
            if self._own_context:  # (destroy: a socket a signal caught before ``opened``)
                self._ctx.destroy(linger=0)
            raise
        self.pub_endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.pull_endpoint = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)

    def _setup_sockets(self, keys: security.Keyring | None, pub_endpoint: str,
                       pull_endpoint: str) -> None:
        pub, pull = self._pub, self._pull
        for sock, endpoint in ((pub, pub_endpoint), (pull, pull_endpoint)):
            sock.setsockopt(zmq.LINGER, 0)
            allow_ipv6(sock, endpoint)
            security.setup_server(sock, self._domain, keys, endpoint)
        # A PUB drops at its high-water mark, and a drop is a seq gap: with NODROP a full
        # queue (a rank that stopped reading) makes send fail for every rank instead, and
        # publish declares that rank lost. Inbound: subscriptions only (small).
        pub.setsockopt(zmq.SNDHWM, self.send_hwm)
        pub.setsockopt(zmq.XPUB_NODROP, 1)
        # Every subscription, not a topic's first only: a key holder that subscribed to
        # another rank's ready marker first (refused as forged) hid that rank's own one,
        # which kept it from joining. (Unsubscriptions stay the last one's: a closed pipe's
        # are sent for each of its topics, forged ones included, without a sender.)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        pub.setsockopt(zmq.MAXMSGSIZE, 4096)
        pull.setsockopt(zmq.RCVHWM, P.RECV_HWM)
        pull.setsockopt(zmq.MAXMSGSIZE, P.MAX_WORKER_FRAME_BYTES)

    # ------------------------------------------------------------ public API

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def lost_ranks(self) -> frozenset[int]:
        return frozenset(self._lost)

    @property
    def left_ranks(self) -> frozenset[int]:
        """The lost ranks that said bye (closed in order), not died or went silent."""
        return frozenset(self._left)

    @property
    def num_lost(self) -> int:
        return len(self._lost)

    @property
    def next_seq(self) -> int:
        return self._next_seq

    @property
    def joined(self) -> bool:
        return self._members.started

    def refusals(self) -> dict[str, int]:
        """Messages refused so far, by reason (``unauthenticated``: connections the ZAP
        handler turned away; ``forged``: messages naming another rank than their sender's;
        ``hello``: hellos refused for a layout that differs or a group that started; a
        hello from a rank past the world size is ``unknown_rank``). Still there once
        closed (``zkv.metrics.watch_refusals`` reads it at the end of a run)."""
        if self._final_counts is None:
            refused = self._zap.num_refused(self._domain)
            if self._final_counts is None:  # (a close between: its domain reads 0 now)
                return {**self._counts, "unauthenticated": refused}
        return dict(self._final_counts)

    def wait_for_ranks(self, timeout_s: float) -> None:
        """Return once every rank joined (hello with our layout + subscription proven).

        Raises :class:`~zkv.errors.ConfigError` at once when a rank's layout differs
        (naming the fields), ``TimeoutError`` naming the missing ranks; ``RuntimeError``
        after :meth:`close` (a group that had not joined).
        """
        if self._members.started:
            return
        if self._closed:
            raise RuntimeError("wait_for_ranks() after close()")
        deadline = time.monotonic() + timeout_s
        while True:
            self._drain()
            members = self._members
            if members.any_refused():
                # Let the refused processes hear it (their subscribers may be on the way).
                tell_until = min(deadline, time.monotonic() + TELL_S)
                while members.refused_untold() and time.monotonic() < tell_until:
                    self._poller.poll(10)
                    self._drain(acks=False)
                raise ConfigError("; ".join(members.take_refused()))
            if members.all_joined():
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(members.missing(timeout_s))
            self._poller.poll(max(1, int(min(left, 0.1) * 1000)))
        now = time.monotonic()
        for r in self._ranks:
            r.last_seen = now
        self._members.started = True
        self._hot_log = getattr(self._log.bind(), self._batch_level)
        self._info = ev.enabled(ev.LEVELS[self._batch_level])
        self._log.info(ev.RANK_JOINED, num_ranks=self.world_size, all_joined=True)

    def publish(self, ops: Sequence[P.Op], step: int) -> int:
        """Send one batch with the next seq and return that seq.

        Raises :class:`RankLost` if a rank is lost (nothing is sent then). While a rank's
        batch queue is full it waits (at most ``send_timeout_s``; then that rank is lost: it
        stopped reading). ``RuntimeError``
        before :meth:`wait_for_ranks`, ``ValueError`` for duplicate op ids or a batch
        over the protocol's limits.
        """
        if not self._members.started or self._closed:
            raise RuntimeError("publish before wait_for_ranks() or after close()")
        if self._lost:
            rank, reason = next(iter(self._lost.items()))
            raise RankLost(rank, reason)
        seq = self._next_seq
        if ops:
            ops = tuple(ops)
            op_ids = {op.id for op in ops}
            if len(op_ids) != len(ops):
                raise ValueError(f"duplicate op ids in batch: {[op.id for op in ops]}")
            if len(ops) > P.MAX_OPS:
                raise ValueError(f"batch has {len(ops)} ops, more than {P.MAX_OPS}")
            frames = P.encode(P.CopyBlocks(seq, step, ops))
            if max(map(len, frames)) > P.MAX_BATCH_FRAME_BYTES:
                raise ValueError(f"batch has a frame over {P.MAX_BATCH_FRAME_BYTES} bytes; "
                                 "split its ops")
        else:  # an idle step: nothing to check
            frames = P.encode(P.CopyBlocks(seq, step, ()))
        t_pub = time.perf_counter()
        try:
            send_frames(self._pub, frames, DONTWAIT, copy=False)
        except zmq.Again:
            self._send_when_room(frames)
        self._in_flight[seq] = _InFlight(seq, step, ops, t_pub,
                                         time.monotonic() + self.ack_timeout_s)
        self._next_seq = seq + 1
        if self._info:
            self._hot_log(ev.BATCH_PUBLISHED, seq=seq, step=step, num_ops=len(ops))
        return seq

    def _send_when_room(self, frames: list[bytes]) -> None:
        """Some rank has ``send_hwm`` batches it did not read, so no rank got this one (no
        gaps). Wait up to ``send_timeout_s`` for room, taking acks and checking deadlines
        meanwhile (a stuck rank misses its ack deadline); then the ranks that acked least
        are lost (a rank that keeps up acks every batch). Raises RankLost."""
        deadline = time.monotonic() + self.send_timeout_s
        while not self._lost and time.monotonic() < deadline:
            self._drain()
            self._check_deadlines(time.monotonic())
            if self._lost:
                break
            try:
                send_frames(self._pub, frames, DONTWAIT, copy=False)
                return
            except zmq.Again:
                self._poller.poll(10)
        if not self._lost:
            live = [r for r in self._ranks if r.rank not in self._lost]
            behind = min(r.last_seq for r in live)
            for r in live:
                if r.last_seq == behind:
                    self._declare_lost(r.rank, f"its batch queue stayed full ({self.send_hwm} "
                                               f"batches) for {self.send_timeout_s} s: it "
                                               f"stopped reading after seq {behind}")
        rank = next(iter(self._lost))
        raise RankLost(rank, self._lost[rank])

    def poll(self, timeout_s: float = 0.0) -> list[BatchDone]:
        """Process incoming messages for at most ``timeout_s``; return completed batches.

        Returns as soon as at least one batch completed (after taking the messages already
        queued while batches are still in flight: their acks), so a tight loop of ``poll``
        calls adds no latency. With nothing left in flight it returns at once: what else
        is queued (a heartbeat) waits for the next call. After :meth:`close`: nothing
        (no batch completes any more).
        """
        if self._closed:
            return []
        deadline = time.monotonic() + timeout_s
        pull_only = self._pull_only
        taken = 0
        while True:
            now = time.monotonic()
            if now >= self._next_subs:  # joins and disconnects: on a clock (see below)
                self._next_subs = now + _SUBS_EVERY_S
                self._drain(acks=False)
            if now >= self._next_check:  # (every 5 ms, also for poll(0): a check scans
                self._check_deadlines(now)  # the batches waiting on storage I/O)
            if self._completed:
                if self._in_flight:  # acks of later batches already queued
                    self._drain(subscriptions=False)
                return self.take_completed()
            # zmq_poll returns at once when a message is queued, and takes whole
            # milliseconds (under one: a look, then a spin of this loop). Only the PULL:
            # each socket in a poll costs syscalls on every call, on every ack, and the
            # XPUB's messages (subscriptions) are rare, so they are read on a clock.
            wait_ms = max(0, int(min((deadline - now) * 1000,  # (a float: poll(inf) waits)
                                     (self._next_subs - now) * 1000 + 1, self._max_wait_ms)))
            if zmq_poll(pull_only, wait_ms):
                self._take_message()  # one, then the checks above (a completion returns)
                taken += 1
                if now < deadline or taken < _MAX_DRAIN:
                    continue
            elif now < deadline:
                continue
            return self.take_completed()

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

    def settled(self, seq: int) -> bool:
        """Whether batch ``seq`` was published and is in flight no more: every rank acked
        it (its copies ran), a rank loss failed it, or :meth:`close` forgot it. O(1), and
        nothing kept per batch: a batch stuck on a storage call that never returns holds
        one entry however many complete after it."""
        return seq < self._next_seq and seq not in self._in_flight

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, shutdown: bool = True, timeout_s: float = 1.0) -> None:
        """Publish ``Shutdown`` (and wait up to ``timeout_s`` for the ranks' ``Bye``), then
        close both sockets with linger 0. Batches still in flight are counted in the
        ``dispatcher.stopped`` line and forgotten: nothing completes them any more, so
        ``in_flight`` is 0 and :meth:`drain` returns at once. Idempotent."""
        if self._closed:
            return
        self._closing = True
        try:
            if shutdown:
                # A full queue (a rank that stopped reading) may drain within the timeout;
                # if not, the ranks see the disconnect instead.
                self._pub.setsockopt(zmq.SNDTIMEO, max(1, int(min(timeout_s, 3600) * 1000)))
                try:
                    self._pub.send_multipart(P.encode(P.Shutdown("scheduler closed")),
                                             copy=False)
                except zmq.Again:
                    pass
                self._wait_byes(timeout_s)
        finally:
            counts = self.refusals()
            self._closed = True
            self._final_counts = counts
            self._pub.close(0)
            self._pull.close(0)
            self._zap.unregister(self._domain)
            if self._own_context:
                self._ctx.term()
            self._refused_log.flush()
            self._forged_log.flush()
            self._members.flush_logs()
            self._log.info(ev.DISPATCHER_STOPPED, next_seq=self._next_seq,
                           num_in_flight=len(self._in_flight), **counts)
            self._in_flight.clear()

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ------------------------------------------------------------ receiving

    def _drain(self, acks: bool = True, subscriptions: bool = True) -> None:
        """Handle the messages already queued on the PULL (``acks``) and XPUB
        (``subscriptions``) sockets, at most ``_MAX_DRAIN`` per socket, without blocking."""
        pull, pub = self._pull, self._pub
        # EVENTS is cheaper than a NOBLOCK recv that raises zmq.Again.
        for _ in range(_MAX_DRAIN if acks else 0):
            if not readable(pull):
                break
            self._take_message()
        copy = not self._authenticated
        for _ in range(_MAX_DRAIN if subscriptions else 0):
            if not readable(pub):
                break
            frame: Any = pub.recv(DONTWAIT, copy=copy)  # bytes when copied, else a Frame
            if copy:
                self._on_subscription(frame, None)
            else:
                self._on_subscription(frame.bytes, self._sender(frame))

    def _on_subscription(self, sub: bytes, sender: int | None) -> None:
        if self._members.on_subscription(sub, sender, self._authenticated):
            # A joined rank's SUB went away: declared lost after a short grace, so that a
            # Bye sent just before the disconnect (say, a seq gap) gives the reason.
            self._max_wait_ms = int(_BYE_GRACE_S * 1000)  # wake to declare it lost

    def _take_message(self) -> None:
        """Receive and handle one queued message from a rank (there is one: a poll or an
        EVENTS check said so, and only this thread reads)."""
        copy = not self._authenticated
        try:
            frames = recv_frames(self._pull, DONTWAIT, copy=copy)
        except zmq.Again:  # with keys: a connection's credential frame, shown as a message
            return  # of its own while the first message still arrives (it raised from poll)
        try:
            self._on_message(frames, None if copy else self._sender(frames[0]))
        except Exception as e:  # a message must never take the scheduler down
            self._counts["malformed"] += 1
            self._refused_log(error=repr(e), type=_tag(frames))

    def _sender(self, frame: Any) -> int | None:
        """The rank whose CURVE key the connection authenticated with (its ``User-Id``).
        None for what libzmq made itself (the unsubscriptions of a closed connection)."""
        try:
            return self._user_rank.get(frame.get("User-Id"))
        except zmq.ZMQError:
            return None

    def _on_message(self, frames: list[Any], sender: int | None) -> None:
        self.num_received += 1
        try:
            msg = P.decode(frames)
        except ProtocolError as e:
            self._counts["malformed"] += 1
            self._refused_log(error=str(e), type=_tag(frames))
            return
        if type(msg) is P.BlocksCopied:  # an ack: every rank, every step (checks as below)
            if not self._authenticated or msg.rank == sender:
                self._on_ack(msg)
                return
        rank = msg.rank if type(msg) in P.WORKER_MESSAGES else None  # type: ignore[union-attr]
        if rank is None:
            self._counts["malformed"] += 1
            self._refused_log(error="not a worker message", type=_tag(frames))
            return
        if self._authenticated and rank != sender:
            self._counts["forged"] += 1
            self._forged_log(rank=rank, sender=sender, type=_tag(frames),
                             num_forged=self._counts["forged"])
            return
        if isinstance(msg, P.BlocksCopied):
            self._on_ack(msg)
        elif isinstance(msg, P.Heartbeat):
            self._on_heartbeat(msg)
        elif isinstance(msg, P.Hello):
            lost = self._members.on_hello(msg)
            if lost is not None and not self._closing:
                self._declare_lost(msg.rank, lost)
        elif isinstance(msg, P.Bye):
            self._on_bye(msg)

    def _refuse(self, reason: str, **fields: Any) -> None:
        self._counts[reason] += 1
        self._refused_log(**fields)

    def _publish_refused(self, rank: int, pid: int, reason: str) -> None:
        try:
            send_frames(self._pub, P.encode(P.Refused(rank, pid, reason)), DONTWAIT)
        except zmq.Again:  # a rank's full queue: publish's send timeout deals with that rank
            self._log.warning(ev.RANK_REFUSED, rank=rank, worker_pid=pid,
                              error="could not tell the process (a rank's queue is full)")

    def _on_heartbeat(self, msg: P.Heartbeat) -> None:
        r = self._members.rank_of(msg.rank, "heartbeat")
        if r is not None and msg.pid == (r.joined_pid or r.hello_pid):
            r.last_seen = time.monotonic()
            r.last_seq = msg.last_seq

    def _on_bye(self, msg: P.Bye) -> None:
        r = self._members.rank_of(msg.rank, "bye")
        if r is None or msg.pid != (r.joined_pid or r.hello_pid):
            return
        if not self._members.started:
            self._members.forget(r, msg.pid, msg.reason)
        elif not self._closing and msg.rank not in self._lost:
            self._left.add(msg.rank)  # (a warning: e.g. an engine stopping its workers first)
            self._declare_lost(msg.rank, f"it said bye: {msg.reason}")

    def _on_ack(self, ack: P.BlocksCopied) -> None:
        rank = ack.rank
        if rank < self.world_size:
            r = self._ranks[rank]
        else:
            self._members.rank_of(rank, "ack")  # refused, counted and logged
            return
        batch = self._in_flight.get(ack.seq)  # (last_seen: set by accepted acks only)
        if batch is None:
            if ack.seq < self._next_seq and (self._lost or rank in self._lost):
                return  # a late ack of a batch that already failed with a lost rank
            self._refuse("unknown_seq", seq=ack.seq, rank=rank,
                         error="ack for an unknown or completed seq")
            return
        bit = 1 << rank
        later = batch.acked & bit  # a follow-up: results of ops this rank left pending
        if not (later or batch.op_ids or ack.results or ack.pending):  # an idle step's
            batch.acked |= bit
            r.last_seen = time.monotonic()
            if ack.seq > r.last_seq:
                r.last_seq = ack.seq
            if batch.acked == self._all_mask and not batch.waiting:
                del self._in_flight[ack.seq]
                self._complete(batch)
            return
        expected = batch.waiting.get(rank, frozenset()) if later else batch.op_set
        if later and not expected:
            self._refuse("duplicate", seq=ack.seq, rank=rank, error="duplicate ack")
            return
        by_id = {res.id: res for res in ack.results}
        pending = set(ack.pending)
        why = acks.unexpected_ops(by_id.keys() | pending, expected, pending, batch.io_ops)
        if why is not None:
            self._refuse("malformed", seq=ack.seq, rank=rank, error=why)
            return
        why = acks.bad_result(ack.results, batch.sizes) if ack.results else None
        if why is not None:  # (the batch waits on: its ack deadline judges the rank)
            self._refuse("malformed", seq=ack.seq, rank=rank, error=why)
            return
        batch.acked |= bit
        r.last_seen = time.monotonic()
        r.last_seq = max(r.last_seq, ack.seq)
        left = (expected - by_id.keys()) if later else pending
        if left:
            batch.waiting[rank] = frozenset(left)
        else:
            batch.waiting.pop(rank, None)
        missing = () if later else (i for i in batch.op_ids if i not in by_id and i not in pending)
        for op_id in missing:
            by_id[op_id] = P.OpResult(op_id, False, 0, "no result")
        acks.merge(batch.results, by_id.values(), rank)
        if batch.acked == self._all_mask and not batch.waiting:
            del self._in_flight[ack.seq]
            self._complete(batch)

    def _complete(self, batch: _InFlight) -> None:
        latency = time.perf_counter() - batch.t_pub
        results = batch.results
        ok = not results or all(res.ok for res in results.values())
        self._completed.append(BatchDone(batch.seq, batch.step, ok, results,
                                         frozenset(self._lost) if self._lost else _NO_RANKS,
                                         latency))
        if self._info:
            self._hot_log(ev.BATCH_ACKED, seq=batch.seq, num_ops=len(batch.op_ids), ok=ok,
                          dur_ms=round(latency * 1e3, 3))

    # ------------------------------------------------------------ failure

    def _check_deadlines(self, now: float) -> None:
        self._next_check = now + _CHECK_INTERVAL_S
        if not self._members.started or self._closing:
            return
        if self._overdue(now) and self._drain_backlog():
            now = time.monotonic()  # judged by what they said last, not by the queue
        for r in self._ranks:
            if r.rank in self._lost:
                continue
            if r.disconnected_at is not None and now - r.disconnected_at >= _BYE_GRACE_S:
                self._declare_lost(r.rank, "its subscriber disconnected")
            elif now - r.last_seen > self.heartbeat_timeout_s:
                self._declare_lost(r.rank, f"no heartbeat for {now - r.last_seen:.2f} s "
                                           f"(timeout {self.heartbeat_timeout_s} s)")
        if self._in_flight:
            oldest = self._oldest_unacked()
            if oldest is not None and now > oldest.deadline:
                for rank in range(self.world_size):
                    if not oldest.acked & (1 << rank) and rank not in self._lost:
                        self._declare_lost(rank, f"no ack for seq {oldest.seq} within "
                                                 f"{self.ack_timeout_s} s")

    def _overdue(self, now: float) -> bool:
        """Whether a rank is past its heartbeat timeout, or the oldest unacked batch past
        its ack deadline (what ``_check_deadlines`` acts on)."""
        timeout = self.heartbeat_timeout_s
        if any(now - r.last_seen > timeout for r in self._ranks if r.rank not in self._lost):
            return True
        oldest = self._oldest_unacked()
        return oldest is not None and now > oldest.deadline

    def _oldest_unacked(self) -> _InFlight | None:
        """The oldest batch some rank has not acked (acked batches may wait on I/O)."""
        full = self._all_mask
        return next((b for b in self._in_flight.values() if b.acked != full), None)

    def _drain_backlog(self) -> bool:
        """Take every message already queued; True when there was one. A caller that did
        not poll for a while (an idle engine schedules nothing, so its connector polls
        nothing) leaves the ranks' heartbeats and acks in the queue: a rank is judged
        after they are read, not by the last one read before the gap."""
        before = self.num_received
        for _ in range(_MAX_BACKLOG_ROUNDS):
            taken = self.num_received
            self._drain()
            if self.num_received == taken:
                break
        return self.num_received != before

    def _declare_lost(self, rank: int, reason: str) -> None:
        if rank in self._lost:
            return
        self._lost[rank] = reason
        log = self._log.warning if rank in self._left else self._log.error
        log(ev.RANK_LOST, rank=rank, reason=reason, num_in_flight=len(self._in_flight))
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
            if not self._pull.poll(max(1, int(min(deadline - time.monotonic(), 3600) * 1000))):
                break
            copy = not self._authenticated
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK, copy=copy)
                msg = P.decode(frames)
            except (zmq.Again, ProtocolError):
                continue
            if not isinstance(msg, P.Bye) or msg.rank not in waiting:
                continue
            if (copy or self._sender(frames[0]) == msg.rank) and (
                    msg.pid == self._ranks[msg.rank].joined_pid):  # (not an old process's)
                waiting.discard(msg.rank)

def _tag(frames: Sequence[Any]) -> str:
    if not frames:
        return ""
    try:
        return bytes(memoryview(getattr(frames[0], "buffer", frames[0]))[:32]).decode(
            errors="replace")
    except Exception:
        return "?"
