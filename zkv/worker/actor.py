"""The per-rank worker actor: receive batches, run their copies in order, ack them.

::

    SUB ──► decode(limits) ──► seq check ──► execute ──────────────────────────► PUSH ack
     │        │ malformed: refuse, ack failed     1. d2h + backup, all layers (one merged copy;
     │        │                                      none of a save the engine abandoned)
     │        │ (if its seq is the expected one)  2. h2d layer by layer, event + counter.mark
     │        │                                      (a layer the engine abandoned: not run)
     │        └ gap: Bye("seq gap ..."), stop     3. fill / check (simulated forward pass)
     ├ Shutdown: Bye("shutdown"), stop            4. s2h / h2s started on I/O threads; the
     └ Refused(this rank, this pid): worker.refused, stop (exit 4); another's: ignored
                                                     ack names them ``pending``
    wake fd (StorageIO) ──► take_done ──────────────────────────────────────────► PUSH ack
                                                  (same seq: the I/O ops' results, done = prefix)

One thread owns the SUB socket and runs batches. Batches run strictly in seq order; a seq
gap is a rank failure (never a silent skip). A failing op becomes an error result in the
ack and the actor keeps running. Storage I/O never blocks the loop (see
zkv/worker/storage_io.py): a slow store delays only its own ops' results, never a later
batch's copies or ack. Every receive polls with a timeout, so ``stop()`` takes effect
within ~0.1 s.

Heartbeats go out every ``heartbeat_interval_s`` from their own thread (sharing the PUSH
socket under a lock), so no wait of the actor thread -- a long copy, a GPU synchronize,
storage I/O -- can make a live rank look dead. They stop when the actor stops; a rank that
hangs while alive is caught by the dispatcher's ack deadline instead.

Errors in a batch::

    op fails (bad ids, one copy)   error result for that op; an h2d that fails at layer i
                                   fails wait_layer of layers i.. (never marked done)
    batch fails outside an op      every op failed; the transfer stream is drained first,
                                   so the ack never precedes the work the batch started
    DeviceFault (sticky CUDA)      fatal: worker.device_failed, waiters released, no ack,
                                   Bye("fatal error: DeviceFault(...)"): the scheduler
                                   fails the rank's ops at once. Nothing touches the
                                   dead context again.

A scheduler that is gone for good: with ``scheduler_timeout_s`` the actor stops (exit 5,
``EXIT_SCHEDULER_GONE``, the reason naming the endpoint) once no scheduler was connected
for that long, none reached since the start or none since the connection dropped
(``worker.scheduler_lost``); libzmq's pings turn a dead host into a disconnect. Without it
(the default) the actor waits for a scheduler forever.

Trust: with :class:`~zkv.security.ClientKeys` both sockets authenticate as this rank
(CURVE pinning the scheduler's key on tcp, the rank's ipc token on ipc, where the private
socket directory vouches for the scheduler), so only this rank can ack as this rank.
Refusals are counted (``num_refused``) and logged at most a few lines a second. A
scheduler that restarts (a new connection after the first) is joined again: the actor
starts over at seq 0 and says hello, the new scheduler's tree is empty. A new connection
to the same running scheduler (a link that dropped and came back) looks the same from
here; that scheduler refuses the hello (exit 4: batches it published meanwhile are lost),
and one of its batches read before the refusal is a seq gap whose reason says so.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from zkv import log as ev
from zkv import protocol as P
from zkv import security
from zkv.config import CacheLayout
from zkv.errors import ConfigError, DeviceFault, ProtocolError
from zkv.exit_codes import EXIT_FATAL, EXIT_OK, EXIT_REFUSED, EXIT_SCHEDULER_GONE, EXIT_SEQ_GAP
from zkv.kernels.layout import describe_for_layout
from zkv.storage import Store
from zkv.worker.copies import merged_copy, run_loads, run_sim
from zkv.worker.layers import SAVES, LayerDoneCounter
from zkv.worker.storage_io import IO_KINDS, StorageIO
from zkv.zmqio import DONTWAIT, POLLIN, allow_ipv6, readable, recv_frames, send_frames, zmq_poll

#: How often the actor looks at its connection monitor (a scheduler restart) between batches.
_MONITOR_EVERY_S = 0.1
_BYE_LINGER_MS = 250
_ACK_HISTORY = 1024
_new = tuple.__new__  # a NamedTuple built without its Python-level __new__
_ACK_SEND_TIMEOUT_MS = 10_000
_COPY_KINDS = (P.D2H, P.BACKUP)
# Gated actors hold a batch until release only if it writes the engine's KV cache (h2d,
# fill) or stands for a forward (check). d2h / backup read blocks whose forward ended
# (an engine confirms a block before saving it); s2h / h2s touch no engine block.
_GATED_KINDS = frozenset((P.H2D, P.FILL, P.CHECK))


class WorkerActor:
    """One rank's actor. Build it anywhere, then call :meth:`run` in the thread that will
    own its sockets (the :class:`~zkv.worker.sidecar.Sidecar` runs it as a daemon thread,
    ``python -m zkv.worker`` in the main thread).

    ``kv_caches``: per layer ``(K, V)``, each ``[num_device_blocks, kv_heads, block_size,
    head_dim]``; ``host_pool``: ``[num_host_blocks, num_layers, num_kv_parts, kv_heads,
    block_size, head_dim]``. Their first dimensions bound the ids a batch may name.

    ``kv_caches`` may be any layout :mod:`zkv.kernels.layout` describes (NHD, fused, MLA)
    or a :class:`~zkv.kernels.layout.KVSpec`; it is validated once, here, against
    ``layout`` and the host pool (a ``ConfigError`` names the tensor).

    ``compute_stream`` (a raw ``cudaStream_t``) is the model's stream that each batch's
    copies wait on first (``backend.begin_batch``), so a d2h never reads a block the
    previous step's forward still writes; ``None`` means the current stream of the thread
    that builds the actor (the model's thread), never the actor thread's own. An engine
    that moves to another stream later calls :meth:`follow_compute_stream` from its thread.

    ``keys``: this rank's CURVE keys (needed for ``tcp://`` unless ``insecure``); the
    endpoints are checked at construction (:func:`zkv.security.check_endpoint`).
    """

    def __init__(
        self,
        rank: int,
        layout: CacheLayout,
        kv_caches: Sequence[tuple[Any, Any]],
        host_pool: Any,
        backend: Any,
        *,
        pub_endpoint: str,
        pull_endpoint: str,
        store: Store | None = None,
        context: zmq.Context[Any] | None = None,
        heartbeat_interval_s: float = 0.25,
        io_threads: int = 4,
        compute_stream: int | None = None,
        gated: bool = False,
        gate_timeout_s: float = 60.0,
        keys: security.ClientKeys | None = None,
        insecure: bool = False,
        scheduler_timeout_s: float | None = None,
    ) -> None:
        if scheduler_timeout_s is not None and not 0 < scheduler_timeout_s < float("inf"):
            raise ConfigError(f"scheduler_timeout_s must be a finite number > 0 or None, got "
                              f"{scheduler_timeout_s!r}")
        if len(kv_caches) != layout.num_layers:
            raise ConfigError(f"kv_caches has {len(kv_caches)} layers, layout has "
                              f"{layout.num_layers}")
        if keys is not None and keys.rank != rank:
            raise ConfigError(f"rank {rank} was given the keys of rank {keys.rank}")
        for ep in (pub_endpoint, pull_endpoint):
            security.check_endpoint(ep, keys=keys, insecure=insecure, bind=False)
        self.rank = rank
        self.layout = layout
        # Validated once: layout, strides and device (a ConfigError names the tensor).
        self.kv_caches = backend.register(describe_for_layout(kv_caches, layout), host_pool)
        self.host_pool = host_pool
        self.backend = backend
        self.store = store
        self.pub_endpoint = pub_endpoint
        self.pull_endpoint = pull_endpoint
        self.heartbeat_interval_s = heartbeat_interval_s
        # Resolved in the constructing (model) thread: the actor thread's current stream
        # is its own default stream, which the forward does not run on.
        self.compute_stream = (compute_stream if compute_stream is not None
                               else backend.current_stream())
        self.limits = P.Limits(int(self.kv_caches[0][0].shape[0]), int(host_pool.shape[0]))
        self.counter = LayerDoneCounter(layout.num_layers, backend)
        self.exit_code: int | None = None
        self.exit_reason: str | None = None
        self._ctx = context
        self._io_threads = io_threads
        self._io: StorageIO | None = None
        self._stop = threading.Event()
        self._stop_reason = "stopped"
        self._expected = 0
        self._last_seq = -1
        self._pid = os.getpid()
        self._log = ev.get_logger("worker", rank=rank)
        self._hot_log = self._log  # bound in run(), once logging is configured
        self._debug = True  # whether debug lines pass (set with _hot_log)
        self._push: zmq.Socket[Any] | None = None
        self._send_lock = threading.Lock()  # the actor and the heartbeat thread share PUSH
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        # Gate (engine sidecar): a batch that writes engine blocks runs only once the engine
        # released its seq, i.e. the forward passes before it are done (see :meth:`release`).
        self.gated = gated
        self.gate_timeout_s = gate_timeout_s
        self._gate_lock = threading.RLock()
        self._gate = threading.Condition(self._gate_lock)
        self._gate_waiting = 0  # threads waiting on the gate (no waiter: nothing to notify)
        self._released = -1
        # Saves the engine gave up waiting for (abandon_saves): batches <= this seq copy no
        # d2h / backup; the seq whose d2h runs now (-1: none); the event after the latest
        # d2h issued (a forward that stops waiting waits on it: on GPU it may be queued yet).
        self._saves_abandoned = -1
        self._saving = -1
        self._last_save: Any = None
        self._saves_overrun = -1  # ... and <= this, one ran past the engine's wait: failed
        self._acks: dict[int, P.BlocksCopied] = {}  # recent acks by seq (bounded)
        self._keys = keys
        self._num_handshakes = 0
        self.scheduler_timeout_s = scheduler_timeout_s
        #: since when no scheduler is connected (monotonic; None while one is)
        self._lost_since: float | None = None
        self._refused_log = ev.RateLimited(self._log, ev.BATCH_REFUSED, burst=10)
        # A store that is down fails every s2h / h2s of every step: a few lines, then counts.
        self._io_failed_log = ev.repeating(self._log, ev.COPY_FAILED)

    @property
    def last_seq(self) -> int:
        """Seq of the last batch acked (-1 before the first)."""
        return self._last_seq

    def follow_compute_stream(self) -> None:
        """Take the calling (model) thread's current stream as the compute stream that later
        batches start after (thread-safe; call it before :meth:`release`). An engine may
        change streams after the actor is built: vLLM on CUDA makes a stream of its own at
        its first CUDA graph capture, after the KV caches are registered, and a batch that
        waited on the stream of registration would not wait for the forward's writes.
        O(1); a change is logged (``worker.compute_stream``)."""
        stream = self.backend.current_stream()
        if stream is not None and stream != self.compute_stream:
            self._log.info(ev.COMPUTE_STREAM, stream=hex(stream),
                           was=None if self.compute_stream is None else hex(self.compute_stream))
            self.compute_stream = stream

    def release(self, seq: int) -> None:
        """The engine allows batches up to ``seq`` to write its KV cache (thread-safe).

        CPU twin of the start event on the compute stream: the engine calls it before the
        forward that reads batch ``seq``'s loads, after the forwards before it finished, so
        a load never writes a block a forward still uses. Only gated actors wait for it,
        and only batches that write engine blocks (``_GATED_KINDS``); saves read blocks
        the engine confirmed (their forward ended) and run as they come.
        """
        with self._gate:
            if seq > self._released:
                self._released = seq
                if self._gate_waiting:
                    self._gate.notify_all()

    def wait_acked(self, seq: int, timeout: float | None = None) -> P.BlocksCopied | None:
        """This rank's ack of batch ``seq`` once it is sent (None after ``timeout``, when the
        actor stopped, or when it rejoined a restarted scheduler meanwhile: that scheduler's
        seqs start over, and its batch ``seq`` is another). Acks older than the last ~1024
        seqs are forgotten (None)."""
        with self._gate:
            acks = self._acks  # (a rejoin starts a new dict)
            self._gate_wait_until(lambda: seq in acks or self._last_seq >= seq
                                  or self.exit_code is not None or self._acks is not acks,
                                  timeout)
            return acks.get(seq)

    def _gate_wait_until(self, done: Callable[[], bool], timeout: float | None) -> bool:
        """(``self._gate`` held) Wait until ``done()`` holds, at most ``timeout`` seconds
        (None: no limit), waking at least every 0.1 s; whether it holds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._gate_wait(left if left is None else min(left, 0.1))
        return True

    def _gate_wait(self, timeout: float | None) -> None:
        """``self._gate.wait`` (the lock held), counted so that notifiers can skip the
        call when nobody waits."""
        self._gate_waiting += 1
        try:
            self._gate.wait(timeout)
        finally:
            self._gate_waiting -= 1

    def _wait_released(self, seq: int) -> str | None:
        """Block until ``seq`` is released; None, or why it never was."""
        deadline = time.monotonic() + self.gate_timeout_s
        while True:
            with self._gate:
                if self._released >= seq:
                    return None
                self._gate_wait(min(self.heartbeat_interval_s, 0.05))
                if self._released >= seq:
                    return None
            if self._stop.is_set():
                return f"actor stopping ({self._stop_reason})"
            if time.monotonic() > deadline:
                return f"the engine did not release batch {seq} within {self.gate_timeout_s} s"

    @property
    def num_refused(self) -> int:
        """Messages refused so far (malformed, old seq, not for a worker)."""
        return self._refused_log.total

    def stop(self, reason: str = "stopped") -> None:
        """Ask the loop to stop (thread-safe, returns at once; the loop exits within ~0.1 s)."""
        self._stop_reason = reason
        self._stop.set()

    # ------------------------------------------------------------ loop

    def run(self) -> int:
        """Serve until Shutdown, :meth:`stop`, a seq gap or a fatal error; return an exit code
        (``EXIT_OK``, ``EXIT_SEQ_GAP``, ``EXIT_REFUSED``, ``EXIT_FATAL``)."""
        own_ctx = self._ctx is None
        ctx: Any = None
        sub: Any = None
        push: Any = None
        monitor: Any = None
        code, reason = EXIT_FATAL, "fatal error"
        try:  # (sockets made inside: a failure there, EMFILE, stops the actor as any other)
            ctx = zmq.Context() if own_ctx else self._ctx
            sub = ctx.socket(zmq.SUB)
            push = ctx.socket(zmq.PUSH)
            self._push = push
            self._setup_sockets(sub, push)
            monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                             | zmq.EVENT_DISCONNECTED)
            self._lost_since = time.monotonic()  # until the first handshake
            push.connect(self.pull_endpoint)
            sub.connect(self.pub_endpoint)
            # Catch-all first, then the marker: the dispatcher seeing the marker proves the
            # catch-all is in place (see zkv.protocol.ready_topic).
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.SUBSCRIBE, P.ready_topic(self.rank, self._pid))
            self._hello()
            self._start_heartbeats()
            self.backend.bind_thread()  # every CUDA call of this thread: the rank's device
            self._log.info(ev.BACKEND_READY, **self.backend.startup_info())
            self._log.info(ev.WORKER_STARTED, pub=self.pub_endpoint, pull=self.pull_endpoint,
                           num_device_blocks=self.limits.num_device_blocks,
                           num_host_blocks=self.limits.num_host_blocks,
                           curve=self._keys is not None)
            code, reason = self._loop(sub, monitor)
        except Exception as e:
            self._log.exception(ev.WORKER_STOPPED, reason="fatal error", error=repr(e))
            code, reason = EXIT_FATAL, f"fatal error: {e!r}"
        finally:
            self._stop_heartbeats()
            with self._gate:
                self.exit_code, self.exit_reason = code, reason
                if self._gate_waiting:
                    self._gate.notify_all()
            self.counter.close(f"rank {self.rank} worker stopped: {reason}")
            if monitor is not None:
                sub.disable_monitor()
                monitor.close(0)
            if sub is not None:
                sub.close(0)
            if push is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._send(P.Bye(self.rank, self._pid, reason[:P.MAX_ERROR_CHARS]),
                               zmq.NOBLOCK)
                push.close(_BYE_LINGER_MS)
            self._push = None
            if self._io is not None and self._io.close() and self.store is not None:
                self.store.quiesce(0)  # (calls left: the store's close would wait again)
            if own_ctx and ctx is not None:
                ctx.term()
            self._refused_log.flush()
            self._io_failed_log.flush()
            self._log.info(ev.WORKER_STOPPED, reason=reason, exit_code=code,
                           last_seq=self._last_seq, num_refused=self.num_refused)
        return code

    def _setup_sockets(self, sub: zmq.Socket[Any], push: zmq.Socket[Any]) -> None:
        """Bounded queues and frames, CURVE when keys were given (see zkv.protocol)."""
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, P.RECV_HWM)  # a full queue stops reading: no drop here
        sub.setsockopt(zmq.MAXMSGSIZE, P.MAX_BATCH_FRAME_BYTES)
        push.setsockopt(zmq.LINGER, _BYE_LINGER_MS)
        push.setsockopt(zmq.SNDHWM, P.RECV_HWM)
        push.setsockopt(zmq.SNDTIMEO, _ACK_SEND_TIMEOUT_MS)
        if self.scheduler_timeout_s is not None:
            # libzmq's own pings: a scheduler host that died without closing the connection
            # (no FIN) is a disconnect after the ping timeout, not never.
            t = self.scheduler_timeout_s
            sub.setsockopt(zmq.HEARTBEAT_IVL, int(min(max(t / 4, 0.1), 5.0) * 1000))
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(min(max(t / 2, 0.2), 30.0) * 1000))
        for sock, endpoint in ((sub, self.pub_endpoint), (push, self.pull_endpoint)):
            allow_ipv6(sock, endpoint)
            security.setup_client(sock, self._keys, endpoint)

    def _hello(self) -> None:
        self._send(P.Hello(self.rank, self._pid, self.layout.fingerprint(),
                           self.layout.to_json()))

    def _loop(self, sub: zmq.Socket[Any], monitor: zmq.Socket[Any]) -> tuple[int, str]:
        # A per-batch event must cost ~nothing when filtered out: bind once (a lazy proxy
        # resolves the configuration on every call).
        self._hot_log = self._log.bind()
        self._debug = ev.debug_enabled()
        stop = self._stop
        # The hot loop polls the batch socket alone (plus the storage thread's wake-up fd):
        # every socket in a zmq_poll costs syscalls on each call, and the monitor's events
        # (a scheduler restart) are rare, so it is looked at on a clock instead.
        items: list[tuple[Any, int]] = [(sub, POLLIN)]
        if self.store is not None:
            self._io = self._new_io()
            items.append((self._io.wake_fd, POLLIN))
        next_monitor = 0.0
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_monitor:
                next_monitor = now + _MONITOR_EVERY_S
                if readable(monitor):
                    done = self._on_monitor(monitor, sub)
                    if self._io is not None:  # a rejoin starts the I/O anew
                        items[1] = (self._io.wake_fd, POLLIN)
                    if done is not None:
                        return done
                gone = self._scheduler_gone(now)
                if gone is not None:
                    return gone
                if self._io is not None:
                    self._io.check_stuck(now)
            # A queued batch returns at once; else sleep until one comes (or the clock).
            ready = zmq_poll(items, int((next_monitor - now) * 1000) + 1)
            if not ready:
                continue
            if ready[-1][0] is not sub:  # the I/O threads woke us: results to ack
                self._send_io_results()  # (and the wake-up drained, so the poll sleeps)
                if ready[0][0] is not sub:
                    continue
            frames = recv_frames(sub, DONTWAIT)  # this thread is the only reader: it is there
            done = self._on_frames(frames)
            if done is not None:
                return done
        return EXIT_OK, self._stop_reason

    def _on_monitor(self, monitor: zmq.Socket[Any],
                    sub: zmq.Socket[Any]) -> tuple[int, str] | None:
        """A new connection to the scheduler after the first: it restarted. Join it anew
        (its subscriptions are resent by libzmq; its tree knows none of our blocks)."""
        from zmq.utils.monitor import recv_monitor_message

        while readable(monitor):
            if recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
                if self._lost_since is None:
                    self._lost_since = time.monotonic()
                    self._log.warning(ev.SCHEDULER_LOST, last_seq=self._last_seq,
                                      timeout_s=self.scheduler_timeout_s)
                continue
            self._lost_since = None
            self._num_handshakes += 1
            if self._num_handshakes == 1:
                continue
            self._log.warning(ev.SCHEDULER_REJOINED, last_seq=self._last_seq,
                              num_handshakes=self._num_handshakes)
            self.counter.close(f"rank {self.rank}: the scheduler restarted")
            self.counter = LayerDoneCounter(self.layout.num_layers, self.backend)
            with self._gate:  # the new scheduler's seqs start at 0 (so do the engine's)
                self._expected, self._last_seq, self._released = 0, -1, -1
                self._saves_abandoned, self._last_save, self._saves_overrun = -1, None, -1
                self._acks = {}  # (a wait_acked on the old one ends: see there)
                if self._gate_waiting:
                    self._gate.notify_all()
            if self._io is not None:
                self._restart_io()
            if self._stop.is_set():  # (while the old I/O ran)
                return None
            if (done := self._drop_stale_batches(sub)) is not None:
                return done
            self._hello()
        return None

    def _drop_stale_batches(self, sub: zmq.Socket[Any]) -> tuple[int, str] | None:
        """(Rejoining, before the hello.) Queued batches are the old scheduler's (the new one
        publishes none before this hello; read now, one was a seq gap): dropped."""
        dropped = 0
        while readable(sub):
            frames = recv_frames(sub, DONTWAIT)
            if frames[0] == P.T_BATCH:
                dropped += 1
            elif (done := self._on_frames(frames)) is not None:
                return done
        if dropped:
            self._refused_log(num_batches=dropped,
                              error="batches of the previous scheduler (it restarted)")
        return None

    def _scheduler_gone(self, now: float) -> tuple[int, str] | None:
        """(exit code, reason) once no scheduler was connected for ``scheduler_timeout_s``
        (none reached since the start, or none since the connection dropped); else None."""
        t = self.scheduler_timeout_s
        if t is None or self._lost_since is None or now - self._lost_since < t:
            return None
        what = ("no scheduler reached" if self._num_handshakes == 0
                else "the scheduler has been unreachable")
        return EXIT_SCHEDULER_GONE, (f"{what} for {now - self._lost_since:.1f} s "
                                     f"(scheduler timeout {t:g} s) at {self.pub_endpoint}")

    def _new_io(self) -> StorageIO:
        assert self.store is not None
        return StorageIO(self.store, self.rank, self.backend, self.host_pool,
                         io_threads=self._io_threads, log=self._log)

    def _restart_io(self) -> None:
        """(Rejoining, before the hello.) The old scheduler's s2h / h2s go with it: queued
        chunks dropped, running ones end (store timeouts; a hung one is said, and a stop
        still stops), results no one's. Seqs and op ids restart at 0: an old result would
        pass for a new op's, an old s2h write free blocks."""
        assert self._io is not None
        old, self._io = self._io, None
        dropped = old.num_pending
        drained = old.drain(self._stop, _MONITOR_EVERY_S)
        if old.close(wait=drained) and not drained and self.store is not None:
            self.store.quiesce(0)  # stopping with calls left: the store's close waits no more
        self._io = self._new_io()
        if dropped:
            self._log.warning(ev.IO_DROPPED, num_ops=dropped, reason="the scheduler restarted")

    def _start_heartbeats(self) -> None:
        self._hb_stop.clear()
        self._hb_thread = threading.Thread(target=self._heartbeats, daemon=True,
                                           name=f"zkv-heartbeat-{self.rank}")
        self._hb_thread.start()

    def _stop_heartbeats(self) -> None:
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join()

    def _heartbeats(self) -> None:
        """A heartbeat every interval, whatever the actor thread is waiting on; skipped
        while the queue to the scheduler is full (it is not reading)."""
        while not self._hb_stop.wait(self.heartbeat_interval_s):
            try:
                self._send(P.Heartbeat(self.rank, self._pid, self._last_seq), zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return

    def _send(self, msg: P.Message, flags: int = 0) -> None:
        """Send to the scheduler; blocks at most ``_ACK_SEND_TIMEOUT_MS`` (then zmq.Again:
        the scheduler stopped reading and the actor stops)."""
        frames = P.encode(msg)
        with self._send_lock:
            assert self._push is not None
            send_frames(self._push, frames, int(flags))

    def _on_frames(self, frames: list[bytes]) -> tuple[int, str] | None:
        t_recv = time.time()
        try:
            msg = P.decode(frames, self.limits)
        except ProtocolError as e:
            return self._refuse(frames, e)
        if isinstance(msg, P.CopyBlocks):
            if msg.seq == self._expected:
                if msg.ops:
                    self._run_batch(msg, t_recv)
                else:
                    self._idle_step(msg.seq, t_recv)
                return None
            if msg.seq > self._expected:
                return self._seq_gap(msg.seq)
            self._refused_log(seq=msg.seq, error=f"old seq (expected {self._expected})")
            return None
        if isinstance(msg, P.Shutdown):
            return EXIT_OK, "shutdown"
        if isinstance(msg, P.Refused):
            if msg.rank != self.rank or msg.pid != self._pid:
                return None  # another process's hello (every rank reads the XPUB)
            self._log.error(ev.WORKER_REFUSED, error=msg.reason)
            return EXIT_REFUSED, f"refused by the scheduler: {msg.reason}"
        self._refused_log(error=f"unexpected {type(msg).__name__} on the batch channel")
        return None

    def _seq_gap(self, seq: int) -> tuple[int, str]:
        reason = f"seq gap: expected {self._expected} got {seq}"
        if self._expected == 0 and self._num_handshakes > 1:  # rejoined, no batch since
            reason += (": the link to the scheduler dropped and came back to the same "
                       "running scheduler (a restarted one starts at seq 0); batches "
                       "published meanwhile are lost, and a rank cannot resume")
        self._log.error(ev.SEQ_GAP, expected=self._expected, seq=seq, error=reason)
        return EXIT_SEQ_GAP, reason

    def _refuse(self, frames: Sequence[Any], error: ProtocolError) -> tuple[int, str] | None:
        """A malformed message never touches the cache. If it is the batch we expect, ack
        it as failed so the scheduler fails its ops now rather than at a timeout."""
        seq = P.peek_seq(frames) if frames and bytes(frames[0]) == P.T_BATCH else None
        self._refused_log(seq=seq, expected=self._expected, error=str(error))
        if seq is None or seq < self._expected:
            return None
        if seq > self._expected:
            return self._seq_gap(seq)  # the batch we expect never came
        msg = f"batch refused: {error}"
        results = tuple(P.OpResult(i, False, 0, msg) for i in P.peek_op_ids(frames))
        self.counter.fail(seq, msg)
        self._ack(P.BlocksCopied(seq, self.rank, False, results, time.time(), time.time()))
        return None

    def _ack(self, ack: P.BlocksCopied) -> None:
        self._expected = ack.seq + 1
        with self._gate_lock:  # before the send: whoever sees the ack sees last_seq too
            self._last_seq = ack.seq
            self._acks[ack.seq] = ack
            self._acks.pop(ack.seq - _ACK_HISTORY, None)
            if self._gate_waiting:
                self._gate.notify_all()
        self._send(ack)

    # ------------------------------------------------------------ one batch

    def _idle_step(self, seq: int, t_recv: float) -> None:
        """A batch without ops (every step of an idle cache): its layers are done at once
        and it is acked, ``_ack``'s steps inlined. One function on purpose: on this path
        each Python call counts (a process that slept in zmq_poll runs from cold caches,
        and the step waits for every rank's ack). ``seq``: the expected one."""
        backend = self.backend
        try:
            backend.begin_batch(self.compute_stream)
            self.counter.begin_done(seq, backend.record_event())
        except DeviceFault as e:  # (the model's own kernel faulted, most often: seen here)
            raise self._device_failed(seq, e) from None
        except Exception as e:  # as for a batch with ops: this batch fails, the rank lives
            self._log.exception(ev.COPY_FAILED, seq=seq, error=repr(e))
            self.counter.fail(seq, repr(e))
            self._drain(seq)
            self._ack(P.BlocksCopied(seq, self.rank, False, (), t_recv, time.time()))
            return
        t_done = time.time()
        rank = self.rank
        self._expected = seq + 1
        with self._gate_lock:  # before the send: whoever sees the ack sees last_seq too
            self._last_seq = seq
            acks = self._acks
            acks[seq] = _new(P.BlocksCopied, (seq, rank, True, (), t_recv, t_done, ()))
            acks.pop(seq - _ACK_HISTORY, None)
            if self._gate_waiting:
                self._gate.notify_all()
        frames = [P.T_ACK, P.idle_ack_header(seq, rank, True, t_recv, t_done)]
        with self._send_lock:
            send_frames(self._push, frames)  # type: ignore[arg-type]
        if self._debug:
            self._hot_log.debug(ev.BATCH_DONE, seq=seq, num_ops=0, ok=True)

    def _run_batch(self, batch: P.CopyBlocks, t_recv: float) -> None:
        """A batch with ops (``_idle_step`` takes those without)."""
        seq = batch.seq
        results: dict[int, P.OpResult] = {}
        pending: tuple[int, ...] = ()
        self.counter.begin(seq)
        # Only a batch that writes engine blocks waits (_GATED_KINDS): a save of the last
        # request to finish runs although no step comes after it to release it.
        gate = self.gated and any(op.kind in _GATED_KINDS for op in batch.ops)
        why = self._wait_released(seq) if gate else None
        if why is not None:  # (at a shutdown, the engine ran no forward for it: no error)
            report = self._log.info if self._stop.is_set() else self._log.error
            report(ev.COPY_FAILED, seq=seq, error=why)
            self.counter.fail(seq, why)
            res = tuple(P.OpResult(op.id, False, 0, why) for op in batch.ops)
            self._ack(P.BlocksCopied(seq, self.rank, False, res, t_recv, time.time()))
            return
        try:
            handle = self._run_copies(batch, results)
            run_sim(self._log, batch, results, handle, self.backend, self.kv_caches,
                    self.compute_stream, self.rank)
            if handle is not None:  # before the I/O too: an h2s may read what a d2h wrote
                self.backend.synchronize_event(handle)
            pending = self._start_io(batch, results)
        except DeviceFault as e:
            raise self._device_failed(seq, e) from None
        except Exception as e:  # a backend that breaks outside any one op
            self._log.exception(ev.COPY_FAILED, seq=seq, error=repr(e))
            self.counter.fail(seq, repr(e))
            self._drain(seq)
            for op in batch.ops:
                if op.id not in pending and (op.id not in results or results[op.id].ok):
                    results[op.id] = P.OpResult(op.id, False, 0, f"batch failed: {e!r}")
        ordered = tuple(results[op.id] for op in batch.ops if op.id in results)
        ok = all(r.ok for r in ordered)
        t_done = time.time()
        self._ack(P.BlocksCopied(seq, self.rank, ok, ordered, t_recv, t_done, pending))
        self._hot_log.debug(ev.BATCH_DONE, seq=seq, num_ops=len(ordered), ok=ok,
                            dur_ms=round((t_done - t_recv) * 1e3, 3))

    def _device_failed(self, seq: int, error: DeviceFault) -> DeviceFault:
        """A sticky CUDA error: say so, release every waiter; the caller re-raises and the
        actor stops (Bye). Nothing is drained or acked: the dead context runs nothing."""
        self._log.error(ev.DEVICE_FAILED, seq=seq, status=error.status, error=str(error))
        why = f"rank {self.rank}: device fault: {error}"
        self.counter.fail(seq, why)  # its layers' events will never complete
        self.counter.close(why)
        return error

    def _drain(self, seq: int) -> None:
        """Before a failure ack: the stream work the batch started has finished (its
        blocks may be reused once the scheduler sees the ack)."""
        try:
            self.backend.synchronize()
        except DeviceFault as e:
            raise self._device_failed(seq, e) from None

    def _run_copies(self, batch: P.CopyBlocks, results: dict[int, P.OpResult]) -> Any:
        """d2h/backup (all layers), then h2d layer by layer with an event per layer."""
        b, seq = self.backend, batch.seq
        b.begin_batch(self.compute_stream)
        d2h = [op for op in batch.ops if op.kind in _COPY_KINDS]
        h2d = [op for op in batch.ops if op.kind == P.H2D]
        if d2h:
            self._run_saves(seq, d2h, results)
        if not h2d:
            handle = b.record_event()
            self.counter.mark_all(seq, handle)
            return handle
        return run_loads(self._log, seq, h2d, results, self.counter, b, self.host_pool,
                         self.kv_caches)

    def _run_saves(self, seq: int, ops: list[P.Op], results: dict[int, P.OpResult]) -> None:
        """The batch's d2h / backup, unless the engine stopped waiting for them
        (:meth:`abandon_saves`, or for the batch's load: ``counter.abandon``): it may have
        given their blocks to another request, whose KV a late copy would save under these
        blocks' hashes."""
        b, kv, host, counter = self.backend, self.kv_caches, self.host_pool, self.counter
        started = counter.start_layer(seq, SAVES)  # (no: the engine abandoned the load)
        with self._gate:
            abandoned = seq <= self._saves_abandoned or not started
            if not abandoned:
                self._saving = seq
        if abandoned:
            if started:
                counter.end_layer(seq)
            why = "save abandoned by the engine (it stopped waiting for it)"
            for op in ops:
                results[op.id] = P.OpResult(op.id, False, 0, why)
            return
        try:
            merged_copy(self._log, seq, ops, lambda s, d: b.copy_d2h(kv, host, s, d), results)
            handle = b.record_event()
        except BaseException:  # (a dead device: no event to record)
            counter.end_layer(seq)
            with self._gate:
                self._saving = -1
                if self._gate_waiting:
                    self._gate.notify_all()
            raise
        overrun = counter.end_layer(seq, handle)
        with self._gate:
            self._saving = -1
            self._last_save = handle
            if overrun or seq <= self._saves_overrun:  # it may have read what the forward wrote
                why = "save abandoned by the engine while it ran"
                for op in ops:
                    results[op.id] = P.OpResult(op.id, False, 0, why)
            if self._gate_waiting:
                self._gate.notify_all()

    def abandon_saves(self, upto: int, timeout: float | None = None) -> tuple[bool, Any]:
        """(Engine thread, its wait for batch ``upto`` timed out and its forward goes on.)
        No d2h / backup of a batch up to ``upto`` starts later: they fail, so nothing the
        forward writes into blocks vLLM freed is saved under another request's hashes.
        One running now is waited for (at most ``timeout``). Returns ``(quiet, handle)``:
        ``quiet`` False if it still ran at the timeout; ``handle``, the event after the
        latest d2h issued, which the compute stream must wait on (on GPU a d2h issued is
        only queued: its batch's ack, which the engine gave up on, comes once it ran; the
        stream runs in order, so this covers every earlier one). A save still running at
        the timeout fails when it ends: it may have read what the forward wrote.
        """
        with self._gate:
            self._saves_abandoned = max(self._saves_abandoned, upto)
            self._gate_wait_until(lambda: not 0 <= self._saving <= upto
                                  or self.exit_code is not None, timeout)
            quiet = not 0 <= self._saving <= upto
            if not quiet:
                self._saves_overrun = max(self._saves_overrun, self._saving)
            handle = self._last_save
        return quiet, handle

    # ------------------------------------------------------------ storage

    def _start_io(self, batch: P.CopyBlocks, results: dict[int, P.OpResult]) -> tuple[int, ...]:
        """Start the batch's s2h / h2s on the I/O threads; return the ids left pending."""
        ios = [op for op in batch.ops if op.kind in IO_KINDS]
        if not ios:
            return ()
        if self._io is None:
            for op in ios:
                results[op.id] = P.OpResult(op.id, False, 0, "no L3 store on this worker")
            return ()
        now, pending = self._io.start(batch.seq, ios)
        for r in now:
            results[r.id] = r
        return pending

    def _send_io_results(self) -> None:
        """Ack the I/O ops that finished since the last call (one message per seq)."""
        assert self._io is not None
        for seq, results, left in self._io.take_done():
            for r in results:
                if not r.ok:
                    self._io_failed_log(seq=seq, op_id=r.id, done=r.done, error=r.error)
            ok = all(r.ok for r in results)
            self._send(P.BlocksCopied(seq, self.rank, ok, tuple(results), 0.0, time.time(), left))
            self._hot_log.debug(ev.IO_DONE, seq=seq, num_ops=len(results), ok=ok,
                                num_pending=len(left))

