"""How the worker actor runs a batch's copy ops: one merged copy per kind (per layer for
h2d, :func:`run_loads`), op by op only when the merged one fails; and the simulated forward
pass (fill / check) that ``zkv replay`` and the tests run in place of a model.

::

    merged_copy(ops) ─ one copy over every op's ids ── ok ──► each op ok (d2h reports them)
                          │ raises (not a DeviceFault)
                          ▼
                       op by op: each op its own outcome (copies are idempotent, so
                       redoing the ones the merged copy did is harmless)
    a DeviceFault anywhere: raised as it is (the context is lost; not one op's failure)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from zkv import log as ev
from zkv import protocol as P
from zkv.errors import DeviceFault

SIM_KINDS = (P.FILL, P.CHECK)


def merged_copy(log: Any, seq: int, ops: list[P.Op],
                copy: Callable[[np.ndarray, np.ndarray], None], out: dict[int, P.OpResult],
                layer: int | None = None) -> None:
    """One merged copy for ``ops`` (see the module). For d2h (``layer`` None) ``out``
    gets every op's result; for one h2d layer only the failures."""
    report_ok = layer is None
    try:
        if len(ops) == 1:
            copy(ops[0].src, ops[0].dst)
        else:
            copy(np.concatenate([op.src for op in ops]), np.concatenate([op.dst for op in ops]))
    except DeviceFault:
        raise
    except Exception:
        for op in ops:
            try:
                copy(op.src, op.dst)
            except DeviceFault:
                raise
            except Exception as e:
                log.error(ev.COPY_FAILED, seq=seq, op_id=op.id, kind=op.kind, layer=layer,
                          num_blocks=op.num_blocks, error=repr(e))
                out[op.id] = P.OpResult(op.id, False, 0, f"{op.kind} failed: {e!r}")
            else:
                if report_ok:
                    out[op.id] = P.OpResult(op.id, True, op.num_blocks)
        return
    if report_ok:
        for op in ops:
            out[op.id] = P.OpResult(op.id, True, op.num_blocks)


def run_loads(log: Any, seq: int, h2d: list[P.Op], results: dict[int, P.OpResult],
              counter: Any, backend: Any, host: Any, kv: Any) -> Any:
    """A batch's h2d, layer by layer: each layer's copy asked of ``counter`` (a
    :class:`~zkv.worker.layers.LayerDoneCounter`; the engine may have abandoned it), an
    event after it, the layer marked (or failed from it on, if an op lacks blocks). Returns
    the last layer's event."""
    failed: dict[int, P.OpResult] = {}
    handle = None
    for layer in range(counter.num_layers):
        live = [op for op in h2d if op.id not in failed]
        if live and not counter.start_layer(seq, layer):
            # the engine stopped waiting and recomputes these layers: never write them
            why = f"h2d abandoned by the engine from layer {layer}"
            for op in live:
                failed[op.id] = P.OpResult(op.id, False, 0, why)
            live = []
        if live:
            try:  # the event too: a copy that raised there must not stay "copying" (the
                # engine's abandon_load would wait its whole timeout for it)
                merged_copy(log, seq, live,
                            lambda s, d, i=layer: backend.copy_h2d(host, kv, s, d, i),  # type: ignore[misc]
                            failed, layer=layer)
                handle = backend.record_event()
            except BaseException:
                counter.end_layer(seq)
                raise
            counter.end_layer(seq, handle)
        else:
            handle = backend.record_event()
        if not failed:
            counter.mark(seq, layer, handle)
        else:  # a layer that lacks blocks: it and every later layer fail (idempotent)
            errors = "; ".join(sorted({str(r.error) for r in failed.values()}))
            counter.fail_from(seq, layer, errors)
    for op in h2d:
        results[op.id] = failed.get(op.id) or P.OpResult(op.id, True, op.num_blocks)
    return handle


def run_sim(log: Any, batch: P.CopyBlocks, results: dict[int, P.OpResult], handle: Any,
            backend: Any, kv_caches: Any, compute_stream: Any, rank: int) -> None:
    """fill / check: the simulated forward pass (replay, tests), on the compute stream
    after the batch's copies (``handle``: their event)."""
    sims = [op for op in batch.ops if op.kind in SIM_KINDS]
    if not sims:
        return
    from zkv.kernels import reference

    if handle is not None:
        backend.synchronize_event(handle)
    for op in sims:
        try:
            if op.kind == P.FILL:
                with backend.on_compute(compute_stream):  # the "forward"
                    reference.fill_pattern(kv_caches, op.dst, op.keys, rank)
                results[op.id] = P.OpResult(op.id, True, op.num_blocks)
                continue
            with backend.on_compute(compute_stream):
                n = int(reference.check_pattern(kv_caches, op.src, op.keys, rank))
            if n == op.num_blocks:
                results[op.id] = P.OpResult(op.id, True, n)
            else:
                err = (f"check: block {n} (device block {int(op.src[n])}) does not hold "
                       "the expected pattern")
                log.error(ev.COPY_FAILED, seq=batch.seq, op_id=op.id, kind=op.kind,
                          num_blocks=op.num_blocks, done=n, error=err)
                results[op.id] = P.OpResult(op.id, False, n, err)
        except Exception as e:
            log.error(ev.COPY_FAILED, seq=batch.seq, op_id=op.id, kind=op.kind,
                      num_blocks=op.num_blocks, error=repr(e))
            results[op.id] = P.OpResult(op.id, False, 0, f"{op.kind} failed: {e!r}")
