"""The connector's Prometheus metrics (prometheus_client), ``zkv:`` namespace.

Counters are read from the scheduler halves at scrape time (a custom collector: nothing is
added to the hot path); batch latency is a histogram observed on every all-ranks ack.
Labels: ``model`` (the model identity), ``engine_id`` (vLLM's
``kv_transfer_config.engine_id``: engines of one model in one process, such as two
``LLM`` objects, are told apart by it) and ``rank`` ("all" on the scheduler side, where
every number is the minimum-over-ranks outcome zkv commits on)::

    zkv:prompt_tokens_total{tier="vllm_local|zkv_host|zkv_store|computed"}
    zkv:requests_total
    zkv:request_events_total{event="preempted|aborted|awaited|await_expired"}
                                                          awaited: P/D consumer requests
                                                          that waited for the blocks their
                                                          producer promised; await_expired:
                                                          ... and computed some after all
    zkv:scheduler_seconds_total                          time in the scheduler-side calls
    zkv:blocks_total{op="load|save|store_write|store_read|failed_load|failed_store_write|
                         failed_store_read|failed_save"}
    zkv:bytes_total{op="load|save"}
    zkv:batch_seconds (histogram: publish -> every rank acked)
    zkv:store_query_failures_total                       L3 existence queries that failed
                                                          (an outage on the read path)
    zkv:host_blocks{state="free|used"}
    zkv:enabled                                           1; 0 once a lost rank turned zkv
                                                          off for the engine (alert on it)
    zkv:refused_messages_total{reason=...}               see zkv.metrics (no model label)
    zkv:in_flight{what="requests|held|cache_requests|ops|batches|steps|store_retry"}
                                                          requests the connector tracks,
                                                          finished ones whose blocks vLLM
                                                          keeps for their saves (held),
                                                          requests holding tree nodes, ops
                                                          and batches not acked yet, steps
                                                          whose output has not come, blocks
                                                          whose L3 write waits for a retry:
                                                          an idle engine's settle at 0 (a
                                                          leak grows; steps: 1 under async
                                                          scheduling; store_retry while the
                                                          store is down)

They live in :data:`zkv.metrics.REGISTRY` (``render()``). Every engine of the process
shows there, each under its own ``engine_id``, from its start to its close (a closed
engine's series go, the others' stay). ``serve(port)`` serves the registry on 127.0.0.1;
engines of one process given one port share that server, which stops with the last.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from zkv import metrics as zmetrics
from zkv.metrics import REGISTRY, render, watch_refusals
from zkv.protocol import H2S, S2H
from zkv.scheduler.records import SAVE

__all__ = ["BATCH_SECONDS", "REGISTRY", "half_labels", "register_half", "render", "serve",
           "unregister_half"]

#: The labels every family of a scheduler half starts with.
LABELS = ["model", "engine_id", "rank"]

BATCH_SECONDS = Histogram("zkv:batch_seconds", "Publish to every rank's ack of a zkv batch.",
                          LABELS, registry=REGISTRY,
                          buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1, 5))


def half_labels(half: Any) -> list[str]:
    """The values of :data:`LABELS` for a scheduler half."""
    return [half.layout.model, half.engine_id, "all"]


class _Halves:
    """The counters of every scheduler half registered and not closed yet, one set of
    samples per half in each family (a family is one name: two collectors of one name
    cannot both be registered). Scrapes run on the server's thread while engines start
    and stop: they read a copy of the list. Register and unregister O(halves)."""

    def __init__(self) -> None:
        self.halves: list[Any] = []

    def collect(self) -> Iterator[Metric]:
        halves = list(self.halves)
        if not halves:
            return
        fams = _families()
        for h in halves:
            _add_samples(fams, h)
        yield from fams.values()


def _families() -> dict[str, Any]:
    c, g = CounterMetricFamily, GaugeMetricFamily
    return {
        "tok": c("zkv:prompt_tokens", "Prompt tokens of scheduled requests by where their KV "
                 "came from.", labels=[*LABELS, "tier"]),
        "req": c("zkv:requests", "Requests scheduled through zkv.", labels=LABELS),
        "evt": c("zkv:request_events", "Requests vLLM preempted (their planned saves "
                 "cancelled) or aborted (a client gone); P/D consumer requests that waited "
                 "for their producer's blocks (awaited) and gave up on some (await_expired).",
                 labels=[*LABELS, "event"]),
        "sec": c("zkv:scheduler_seconds", "Wall time spent in the connector's scheduler-side "
                 "calls.", labels=LABELS),
        "blk": c("zkv:blocks", "Blocks moved by zkv, per op.", labels=[*LABELS, "op"]),
        "byt": c("zkv:bytes", "Bytes moved by zkv over all ranks, per op.",
                 labels=[*LABELS, "op"]),
        "pool": g("zkv:host_blocks", "zkv host pool blocks per rank.",
                  labels=[*LABELS, "state"]),
        "qry": c("zkv:store_query_failures", "L3 existence queries that failed (answered as "
                 "misses): a store outage on the read path, which writes may not show (a P/D "
                 "consumer writes nothing).", labels=LABELS),
        "on": g("zkv:enabled", "1 while zkv serves this engine; 0 once a lost rank turned it "
                "off (vLLM goes on without it).", labels=LABELS),
        "fly": g("zkv:in_flight", "Requests the connector tracks (requests), finished ones "
                 "whose blocks vLLM keeps for the rest of their saves (held), requests holding "
                 "zkv blocks (cache_requests), ops and batches not acked by every rank yet, "
                 "steps whose output has not come back (steps), blocks whose L3 write failed "
                 "and waits to be tried again (store_retry).", labels=[*LABELS, "what"]),
    }


def _add_samples(fams: dict[str, Any], h: Any) -> None:
    labels = half_labels(h)
    c, s = h.counts, h.cm.stats
    for tier, v in (("vllm_local", c.vllm_local), ("zkv_host", c.zkv_host),
                    ("zkv_store", c.zkv_store), ("computed", c.computed)):
        fams["tok"].add_metric([*labels, tier], v)
    fams["req"].add_metric(labels, c.requests)
    for event, v in (("preempted", c.preempted), ("aborted", c.aborted),
                     ("awaited", c.awaited), ("await_expired", c.await_expired)):
        fams["evt"].add_metric([*labels, event], v)
    fams["sec"].add_metric(labels, c.sched_s)
    for op, v in (("load", s.loaded_external), ("save", s.saved_external),
                  ("store_write", s.stored), ("store_read", s.loaded),
                  ("failed_load", c.failed_load_blocks),
                  ("failed_store_write", s.failed_by_kind.get(H2S, 0)),
                  ("failed_store_read", s.failed_by_kind.get(S2H, 0)),
                  ("failed_save", s.failed_by_kind.get(SAVE, 0))):
        fams["blk"].add_metric([*labels, op], v)
    per_block = h.layout.block_bytes * h.layout.world_size
    fams["byt"].add_metric([*labels, "load"], s.loaded_external * per_block)
    fams["byt"].add_metric([*labels, "save"], s.saved_external * per_block)
    fams["pool"].add_metric([*labels, "free"], h.cm.host.num_free)
    fams["pool"].add_metric([*labels, "used"], h.cm.host.num_used)
    fams["qry"].add_metric(labels, 0 if h.store is None else h.store.stats.query_failures)
    fams["on"].add_metric(labels, 0 if h.disabled else 1)
    for what, v in h.in_flight().items():
        fams["fly"].add_metric([*labels, what], v)


_HALVES = _Halves()
REGISTRY.register(_HALVES)
_lock = threading.Lock()  # register / unregister / serve / release (engines start and stop)


def register_half(half: Any) -> None:
    """Expose a scheduler half's counters beside those of the process's other halves until
    :func:`unregister_half` (registering it again changes nothing). ValueError when another
    half has the same model and ``engine_id``: their series would be one."""
    with _lock:
        if any(h is half for h in _HALVES.halves):
            return
        key = half_labels(half)
        if any(half_labels(h) == key for h in _HALVES.halves):
            raise ValueError(f"zkv: a scheduler half of model {key[0]!r} with engine_id "
                             f"{key[1]!r} is registered already; give each engine its own "
                             "kv_transfer_config.engine_id")
        _HALVES.halves = [*_HALVES.halves, half]  # (a scrape reads the old list or this)
    watch_refusals(half.dp)


def unregister_half(half: Any) -> None:
    """Drop a closed half's series (its counters and its batch latency); the others stay."""
    with _lock:
        if not any(h is half for h in _HALVES.halves):
            return
        _HALVES.halves = [h for h in _HALVES.halves if h is not half]
        BATCH_SECONDS.remove(*half_labels(half))


@dataclass(slots=True)
class _Served:
    server: zmetrics.MetricsServer
    num_engines: int = 0


_servers: dict[int, _Served] = {}  # by port


class SharedServer:
    """One engine's use of the ``/metrics`` server on its port: engines of one process that
    are given one port share one server (the registry holds them all); ``shutdown`` stops
    it with the last of them."""

    def __init__(self, served: _Served) -> None:
        self._served: _Served | None = served
        self.port = served.server.port
        self.url = served.server.url

    def shutdown(self) -> None:
        with _lock:
            served, self._served = self._served, None
            if served is None:
                return
            served.num_engines -= 1
            if served.num_engines == 0:
                del _servers[self.port]
                served.server.shutdown()


def serve(port: int) -> SharedServer:
    """Serve :data:`REGISTRY` on 127.0.0.1:``port`` for one engine: the server this process
    runs there already, or a new one (port 0: a new one on a free port).
    :class:`~zkv.errors.ConfigError` when the port is taken by someone else."""
    with _lock:
        served = _servers.get(port) if port else None
        if served is None:
            server = zmetrics.serve(port)
            served = _servers[server.port] = _Served(server)
        served.num_engines += 1
        return SharedServer(served)
