"""The connector's Prometheus metrics (prometheus_client), ``zkv:`` namespace.

Counters are read from the scheduler half at scrape time (a custom collector: nothing is
added to the hot path); batch latency is a histogram observed on every all-ranks ack.
Labels: ``model`` (the model identity) and ``rank`` ("all" on the scheduler side, where
every number is the minimum-over-ranks outcome zkv commits on)::

    zkv:prompt_tokens_total{tier="vllm_local|zkv_host|zkv_store|computed"}
    zkv:requests_total
    zkv:request_events_total{event="preempted|aborted|awaited|await_expired"}
                                                          awaited: P/D consumer requests
                                                          that waited for the blocks their
                                                          producer promised; await_expired:
                                                          ... and computed some after all
    zkv:scheduler_seconds_total                          time in the scheduler-side calls
    zkv:blocks_total{op="load|save|store_write|store_read|failed_load"}
    zkv:bytes_total{op="load|save"}
    zkv:batch_seconds (histogram: publish -> every rank acked)
    zkv:host_blocks{state="free|used"}
    zkv:enabled                                           1; 0 once a lost rank turned zkv
                                                          off for the engine (alert on it)
    zkv:refused_messages_total{reason=...}               see zkv.metrics (no model label)
    zkv:in_flight{what="requests|cache_requests|ops|batches|steps|store_retry"}
                                                          requests the connector tracks,
                                                          requests holding tree nodes, ops
                                                          and batches not acked yet, steps
                                                          whose output has not come, blocks
                                                          whose L3 write waits for a retry:
                                                          an idle engine's settle at 0 (a
                                                          leak grows; steps: 1 under async
                                                          scheduling; store_retry while the
                                                          store is down)

They live in :data:`zkv.metrics.REGISTRY` (``serve(port)``: 127.0.0.1, ``render()``).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from zkv.metrics import REGISTRY, render, serve, watch_refusals
from zkv.protocol import H2S, S2H
from zkv.scheduler.records import SAVE

__all__ = ["BATCH_SECONDS", "REGISTRY", "register_half", "render", "serve"]

BATCH_SECONDS = Histogram("zkv:batch_seconds", "Publish to every rank's ack of a zkv batch.",
                          ("model", "rank"), registry=REGISTRY,
                          buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1, 5))


class _HalfCollector:
    def __init__(self, half: Any) -> None:
        self.half = half

    def collect(self) -> Any:
        h = self.half
        labels = [h.layout.model, "all"]
        c, s = h.counts, h.cm.stats
        tok = CounterMetricFamily("zkv:prompt_tokens", "Prompt tokens of scheduled requests "
                                  "by where their KV came from.", labels=["model", "rank", "tier"])
        for tier, v in (("vllm_local", c.vllm_local), ("zkv_host", c.zkv_host),
                        ("zkv_store", c.zkv_store), ("computed", c.computed)):
            tok.add_metric([*labels, tier], v)
        yield tok
        req = CounterMetricFamily("zkv:requests", "Requests scheduled through zkv.",
                                  labels=["model", "rank"])
        req.add_metric(labels, c.requests)
        yield req
        evt = CounterMetricFamily("zkv:request_events", "Requests vLLM preempted (their "
                                  "planned saves cancelled) or aborted (a client gone); P/D "
                                  "consumer requests that waited for their producer's blocks "
                                  "(awaited) and gave up on some (await_expired).",
                                  labels=["model", "rank", "event"])
        for event, v in (("preempted", c.preempted), ("aborted", c.aborted),
                         ("awaited", c.awaited), ("await_expired", c.await_expired)):
            evt.add_metric([*labels, event], v)
        yield evt
        sec = CounterMetricFamily("zkv:scheduler_seconds", "Wall time spent in the "
                                  "connector's scheduler-side calls.", labels=["model", "rank"])
        sec.add_metric(labels, c.sched_s)
        yield sec
        blk = CounterMetricFamily("zkv:blocks", "Blocks moved by zkv, per op.",
                                  labels=["model", "rank", "op"])
        for op, v in (("load", s.loaded_external), ("save", s.saved_external),
                      ("store_write", s.stored), ("store_read", s.loaded),
                      ("failed_load", c.failed_load_blocks),
                      ("failed_store_write", s.failed_by_kind.get(H2S, 0)),
                      ("failed_store_read", s.failed_by_kind.get(S2H, 0)),
                      ("failed_save", s.failed_by_kind.get(SAVE, 0))):
            blk.add_metric([*labels, op], v)
        yield blk
        per_block = h.layout.block_bytes * h.layout.world_size
        byt = CounterMetricFamily("zkv:bytes", "Bytes moved by zkv over all ranks, per op.",
                                  labels=["model", "rank", "op"])
        byt.add_metric([*labels, "load"], s.loaded_external * per_block)
        byt.add_metric([*labels, "save"], s.saved_external * per_block)
        yield byt
        pool = GaugeMetricFamily("zkv:host_blocks", "zkv host pool blocks per rank.",
                                 labels=["model", "rank", "state"])
        pool.add_metric([*labels, "free"], h.cm.host.num_free)
        pool.add_metric([*labels, "used"], h.cm.host.num_used)
        yield pool
        on = GaugeMetricFamily("zkv:enabled", "1 while zkv serves this engine; 0 once a "
                               "lost rank turned it off (vLLM goes on without it).",
                               labels=["model", "rank"])
        on.add_metric(labels, 0 if h.disabled else 1)
        yield on
        fly = GaugeMetricFamily("zkv:in_flight", "Requests the connector tracks (requests), "
                                "requests holding zkv blocks (cache_requests), ops and batches "
                                "not acked by every rank yet, steps whose output has not come "
                                "back (steps), blocks whose L3 write failed and waits to be "
                                "tried again (store_retry).", labels=["model", "rank", "what"])
        for what, v in h.in_flight().items():
            fly.add_metric([*labels, what], v)
        yield fly


_registered: list[_HalfCollector] = []


def register_half(half: Any) -> None:
    """Expose a scheduler half's counters (one per process)."""
    for col in _registered:
        REGISTRY.unregister(col)
    _registered.clear()
    col = _HalfCollector(half)
    REGISTRY.register(col)
    _registered.append(col)
    watch_refusals(half.dp)

