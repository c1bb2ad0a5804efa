"""A pytest plugin that breaks one stream ordering of the CuPy backend, to show that the GPU
tests catch it (a test that cannot fail proves nothing)::

    ZKV_MUTANT=no_compute_wait python3 -m pytest -p bench.gpu_mutants tests/worker/test_actor_gpu.py
    ZKV_MUTANT=no_start_wait   python3 -m pytest -p bench.gpu_mutants tests/worker/test_actor_gpu.py
    ZKV_MUTANT=no_follow       python3 -m pytest -p bench.gpu_mutants tests/worker/test_actor_gpu.py
    ZKV_MUTANT=no_abandon_wait python3 -m pytest -p bench.gpu_mutants tests/worker/test_actor_gpu.py

``no_compute_wait``: ``wait_event_on_compute`` enqueues nothing (the model reads a layer
while its copy runs). ``no_start_wait``: ``begin_batch`` does not make the transfer stream
wait for the model's stream (a d2h reads before the model's writes, an h2d overwrites a
block the model still reads). ``no_follow``: the actor keeps the stream it was built on
when the model moves to another (a d2h reads before the writes on the new stream).
``no_abandon_wait``: an abandoned load or save gives no event for the compute stream to wait
on (the recompute, or the next request's writes, run before the queued copies). Each must
fail tests there; bench/gpu_checks.sh runs each.
"""

from __future__ import annotations

import os
from typing import Any


def pytest_configure(config: Any) -> None:
    from zkv.kernels import cupy_backend

    mutant = os.environ.get("ZKV_MUTANT", "")
    if mutant == "no_compute_wait":
        def wait_event_on_compute(self: Any, handle: Any, compute_stream: Any = None) -> None:
            return None

        cupy_backend.CupyBackend.wait_event_on_compute = wait_event_on_compute  # type: ignore
    elif mutant == "no_start_wait":
        def begin_batch(self: Any, compute_stream: Any = None) -> None:
            return None

        cupy_backend.CupyBackend.begin_batch = begin_batch  # type: ignore
    elif mutant == "no_follow":
        from zkv.worker.actor import WorkerActor

        def follow_compute_stream(self: Any) -> None:
            return None

        WorkerActor.follow_compute_stream = follow_compute_stream  # type: ignore
    elif mutant == "no_abandon_wait":
        from zkv.worker.actor import WorkerActor
        from zkv.worker.layers import LayerDoneCounter

        saves, load = WorkerActor.abandon_saves, LayerDoneCounter.abandon

        def abandon_saves(self: Any, *a: Any, **kw: Any) -> tuple[bool, Any]:
            return saves(self, *a, **kw)[0], None

        def abandon(self: Any, *a: Any, **kw: Any) -> tuple[bool, Any]:
            return load(self, *a, **kw)[0], None

        WorkerActor.abandon_saves = abandon_saves  # type: ignore
        LayerDoneCounter.abandon = abandon  # type: ignore
    else:
        raise SystemExit("ZKV_MUTANT must be no_compute_wait, no_start_wait, no_follow or "
                         f"no_abandon_wait, got {mutant!r}")
