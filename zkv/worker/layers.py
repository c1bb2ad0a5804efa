"""Per-layer completion of a batch's copies, for the model forward to wait on.

The actor runs a batch as ``d2h/backup (all layers) → h2d layer 0 → h2d layer 1 → ...`` on
one transfer stream and records one event after each h2d layer::

    transfer stream:  [d2h ... ][h2d L0] e0 [h2d L1] e1 ... [h2d Ln-1] en-1
    compute stream:          wait(e0) [layer 0] wait(e1) [layer 1] ...

Because the stream is in order, ``e_i`` done implies every d2h of the batch is done: a
device block evicted in this step may be reused by this step's forward, and it must not
be written before its d2h read it. With no h2d ops every layer gets the event recorded
right after the d2h.

A layer whose h2d failed is never marked done: ``fail_from(seq, i)`` makes ``wait_layer``
of layers ``i, i+1, ...`` raise (the engine recomputes them), while the layers before it,
whose copies all succeeded, stay usable::

    layer:    0      1      2       3       ...
    state:    marked marked FAILED  FAILED  (fail_from(seq, 2): an h2d of layer 2 failed)

An engine that stops waiting (its ``layer_timeout_s`` ran out) recomputes the layers it did
not get, into the same blocks. A copy that lands after that would overwrite them, or the
blocks of another request once the engine reused them. So the engine abandons the load
(``abandon(seq, i)``): layers ``i..`` fail, and no layer that was not copied yet starts
later (the engine recomputes the whole block); the actor asks before each layer's copy
(``start_layer``). The batch's d2h / backup count as a copy before layer 0 (``SAVES``):
once no layer waits on them, the forward may write a block they still read (one evicted
and reused in the same step), so they do not start either, and one that ran past the
abandon's wait fails (``end_layer`` says so)::

    actor:   start_layer(L) ──yes──► copy L ──► end_layer(handle) ──► mark / fail_from
                 │ no (abandoned): its ops fail ("abandoned ...")
    engine:  abandon(seq, i) = fail_from(seq, i) + wait until no copy of the batch runs
             → the event after the latest copy issued (compute waits on it)
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass
from typing import Any

from zkv.errors import TransferError

SAVES = -1  # start_layer / end_layer: the batch's d2h / backup, which run before layer 0


@dataclass(slots=True)
class _Batch:
    handles: list[Any]
    num_marked: int = 0
    error: str | None = None
    failed_from: int = 0  # with ``error``: layers >= failed_from raise
    abandoned_from: int = 1 << 30  # the engine gave up on layers >= this (abandon)
    copying: int | None = None  # the layer the actor is copying now (SAVES: its saves)
    overrun: bool = False  # an abandon stopped waiting while that copy ran
    last: Any = None  # event recorded after the latest layer copy the actor issued

    def usable(self, layer: int) -> bool:
        return layer < self.num_marked and (self.error is None or layer < self.failed_from)


class LayerDoneCounter:
    """Which layers of which batch (``seq``) have their copies recorded.

    ``mark`` is O(1) (O(log history) for a batch's last layer) and layers are marked in
    order (0, 1, ...). The history of finished batches is bounded (``history`` seqs, lowest
    forgotten first, and none above the last seq begun); waiting on a forgotten seq returns
    at once: every seq up to it began and finished long ago. Waiting on a seq that has not
    begun yet blocks until it begins and the layer is marked (the forward may run ahead of
    the batch's arrival). Thread-safe; waiters block on one condition.

    Seqs do not finish in seq order: an abandon (or fail) of a seq that has not begun
    finishes it at once, maybe far ahead (an engine's late abandon of the seq of a scheduler
    that restarted since). Forgetting by finish order then counted every seq up to it as
    done long ago: a wait on a batch not run yet returned at once, and its begin raised.
    """

    def __init__(self, num_layers: int, backend: Any = None, *, history: int = 1024) -> None:
        if num_layers <= 0:
            raise ValueError(f"num_layers must be > 0, got {num_layers}")
        self.num_layers = num_layers
        self._backend = backend
        self._history = max(1, history)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._waiting = 0  # threads in wait_layer: every notify is skipped when none
        self._batches: dict[int, _Batch] = {}
        self._finished: list[int] = []  # a min-heap of the finished seqs not forgotten
        self._forgotten_upto = -1
        self._top = -1  # the highest seq begun
        self._closed: str | None = None

    def begin(self, seq: int) -> None:
        with self._cond:
            self._top = max(self._top, seq)
            batch = self._batches.get(seq)
            if batch is not None and batch.abandoned_from == 0:
                return  # abandoned before it began: start_layer says no
            if batch is not None or seq <= self._forgotten_upto:
                raise ValueError(f"batch {seq} already began")
            self._batches[seq] = _Batch([None] * self.num_layers)

    def start_layer(self, seq: int, layer: int) -> bool:
        """(Actor, before copying layer ``layer`` of a begun ``seq``, or its saves: ``SAVES``.)
        False if the engine abandoned that layer: do not copy it. Else the copy counts as
        running until :meth:`end_layer`, and :meth:`abandon` waits for it."""
        with self._cond:
            batch = self._batches.get(seq)
            if batch is None or max(layer, 0) >= batch.abandoned_from:
                return False
            batch.copying = layer
            return True

    def end_layer(self, seq: int, event_handle: Any = None) -> bool:
        """(Actor, after a copy that :meth:`start_layer` allowed.) ``event_handle``: the
        event recorded after it, kept for :meth:`abandon`. True if an abandon stopped
        waiting for the copy while it ran (a save may have read what the forward wrote)."""
        with self._cond:
            batch = self._batches.get(seq)
            if batch is None:
                return False
            overrun, batch.copying, batch.overrun = batch.overrun, None, False
            if event_handle is not None:
                batch.last = event_handle
            if self._waiting:
                self._cond.notify_all()
            return overrun

    def abandon(self, seq: int, layer: int, reason: str,
                timeout: float | None = None) -> tuple[bool, Any]:
        """(Engine, its wait for ``layer`` of ``seq`` timed out.) Fail layers ``layer..``,
        let no copy of a layer not copied yet start later (nor the batch's saves, before
        layer 0 is marked), and wait (at most ``timeout``) for a copy that is running now.
        Returns ``(quiet, handle)``: ``quiet`` False if a copy still ran at the timeout;
        ``handle``, the event recorded after the latest copy issued, which the compute
        stream must wait on (on GPU the copy was only queued)."""
        with self._cond:
            self.fail_from(seq, layer, reason)
            batch = self._batches.get(seq)
            if batch is None:
                return True, None
            # every layer not copied yet, not only ``layer``: vLLM recomputes the whole block
            batch.abandoned_from = min(batch.abandoned_from, layer, batch.num_marked)
            self._waiting += 1
            try:
                self._cond.wait_for(
                    lambda: batch.copying is None or self._closed is not None, timeout)
            finally:
                self._waiting -= 1
            batch.overrun = batch.copying is not None
            # The latest copy issued, not only one that ended after this call: a layer the
            # wait gave up on may have been issued (and marked) since, its event never
            # waited on by compute; the stream runs in order, so this covers every earlier.
            return not batch.overrun, batch.last

    def mark(self, seq: int, layer: int, event_handle: Any = None) -> None:
        """Layer ``layer`` of ``seq`` is recorded (its copies are queued before the event)."""
        with self._cond:
            batch = self._batches[seq]
            if batch.error is not None:
                return  # failed: later layers stay failed, never done
            if layer != batch.num_marked:
                raise ValueError(f"batch {seq}: layer {layer} marked out of order "
                                 f"(next is {batch.num_marked})")
            batch.handles[layer] = event_handle
            batch.num_marked = layer + 1
            if batch.num_marked == self.num_layers:
                self._finish(seq)
            if self._waiting:
                self._cond.notify_all()

    def begin_done(self, seq: int, event_handle: Any = None) -> None:
        """``begin`` + ``mark_all`` under one lock (a batch without h2d ops)."""
        with self._lock:  # (the condition's lock, without its Python-level __enter__)
            if seq > self._top:
                self._top = seq
            batch = self._batches.get(seq)
            if batch is not None and batch.abandoned_from == 0:
                return  # abandoned before it came (an engine's late abandon of a seq number
                #         a restarted scheduler gave an idle batch): nothing to copy
            if batch is not None or seq <= self._forgotten_upto:
                raise ValueError(f"batch {seq} already began")
            self._batches[seq] = _Batch([event_handle] * self.num_layers, self.num_layers)
            self._finish(seq)
            if self._waiting:
                self._cond.notify_all()

    def mark_all(self, seq: int, event_handle: Any = None) -> None:
        """Every remaining layer of ``seq`` is recorded by one event (no h2d in the batch)."""
        with self._cond:
            batch = self._batches[seq]
            if batch.error is not None:
                return
            for layer in range(batch.num_marked, self.num_layers):
                batch.handles[layer] = event_handle
            if batch.num_marked < self.num_layers:
                batch.num_marked = self.num_layers
                self._finish(seq)
            if self._waiting:
                self._cond.notify_all()

    def fail(self, seq: int, error: str) -> None:
        """``seq`` cannot complete; its waiters (present and future) raise TransferError."""
        self.fail_from(seq, 0, error)

    def fail_from(self, seq: int, layer: int, error: str) -> None:
        """Layers ``layer`` and later of ``seq`` failed (their waiters, present and future,
        raise TransferError); the layers already marked before ``layer`` stay usable.
        Marks that come later are ignored. O(1)."""
        with self._cond:
            batch = self._batches.get(seq)
            if batch is None:
                if seq <= self._forgotten_upto:
                    return
                batch = self._batches[seq] = _Batch([None] * self.num_layers)
            finished = batch.error is not None or batch.num_marked == self.num_layers
            first = min(layer, batch.num_marked)  # an unmarked layer will not be marked now
            if batch.error is None or first < batch.failed_from:
                batch.error, batch.failed_from = error, first
            if not finished:
                self._finish(seq)
            if self._waiting:
                self._cond.notify_all()

    def close(self, reason: str) -> None:
        """The actor stopped: every waiter on an unfinished seq raises TransferError."""
        with self._cond:
            self._closed = reason
            if self._waiting:
                self._cond.notify_all()

    def is_done(self, seq: int, layer: int) -> bool:
        with self._cond:
            batch = self._batches.get(seq)
            if batch is None:
                return seq <= self._forgotten_upto
            return batch.usable(layer)

    def wait_layer(self, seq: int, layer: int, timeout: float | None = None) -> None:
        """Block until layer ``layer`` of ``seq`` is recorded, then make compute wait on it.

        On GPU the compute stream waits on the layer's event (the host does not block on
        the copy); on CPU the copy ran synchronously and is done. Raises TransferError if
        the batch failed or the actor stopped, TimeoutError after ``timeout`` seconds.
        """
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        with self._cond:
            self._waiting += 1
            try:
                ok = self._cond.wait_for(lambda: self._ready(seq, layer), timeout)
            finally:
                self._waiting -= 1
            if not ok:
                raise TimeoutError(f"layer {layer} of batch {seq} not done within {timeout} s")
            batch = self._batches.get(seq)
            if batch is None:
                if seq <= self._forgotten_upto:
                    return  # finished long ago
                raise TransferError(f"batch {seq} will not run: {self._closed}")
            if batch.error is not None and layer >= batch.failed_from:
                where = f" from layer {batch.failed_from}" if batch.failed_from else ""
                raise TransferError(f"batch {seq} failed{where}: {batch.error}")
            if batch.num_marked <= layer:
                raise TransferError(f"batch {seq} will not complete: {self._closed}")
            handle = batch.handles[layer]
        if handle is not None and self._backend is not None:
            self._backend.wait_event_on_compute(handle)

    def _ready(self, seq: int, layer: int) -> bool:
        batch = self._batches.get(seq)
        if batch is None:
            return seq <= self._forgotten_upto or self._closed is not None
        return batch.num_marked > layer or batch.error is not None or self._closed is not None

    def _finish(self, seq: int) -> None:
        """Called with the lock held, once per seq: keep at most ``history`` finished, but
        never forget one above the last seq begun (every seq up to a forgotten one began)."""
        finished = self._finished
        heapq.heappush(finished, seq)
        while len(finished) > self._history and finished[0] <= self._top:
            old = heapq.heappop(finished)
            del self._batches[old]
            self._forgotten_upto = max(self._forgotten_upto, old)
