"""zkv's Prometheus metrics, kept with ``prometheus_client`` in one registry, ``zkv:`` names.

::

    zkv:hit_blocks_total{tier="device|host|storage"}     prefix-cache hits (replay / engine)
    zkv:moved_blocks_total{direction="d2h|h2d|backup|s2h|h2s"}
    zkv:moved_bytes_total{direction=...}
    zkv:failed_blocks_total{direction=...}               blocks of ops that failed on a rank
    zkv:batches_total                                    batches published
    zkv:inflight_batches                                 published, not yet acked by all
    zkv:free_blocks{pool="device|host"}
    zkv:lost_ranks_total
    zkv:refused_messages_total{reason="malformed|forged|unknown_seq|duplicate|unknown_rank|
                                       hello|unauthenticated"}
                                                         what the scheduler's dispatcher
                                                         refused (see Dispatcher.refusals):
                                                         alert on forged / unauthenticated

All but the last are ``zkv replay``'s: they join :data:`REGISTRY` in its scheduler node
(:func:`register_replay`), never under an engine, where nothing would move them from 0 (a
scrape said ``zkv:free_blocks{pool="host"} 0`` beside the connector's 10 free). Engine
integrations add their own families to :data:`REGISTRY` (the vLLM connector's
``zkv:host_blocks``, ``zkv:requests_total`` etc., with model and rank labels).
``serve(port)`` exposes the registry on 127.0.0.1; ``render()`` returns the text
exposition.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import start_http_server

from zkv.errors import ConfigError

TIERS = ("device", "host", "storage")
DIRECTIONS = ("d2h", "h2d", "backup", "s2h", "h2s")
POOLS = ("device", "host")
#: The reasons ``Dispatcher.refusals()`` counts, each exported even at 0.
REFUSAL_REASONS = ("malformed", "forged", "unknown_seq", "duplicate", "unknown_rank", "hello",
                   "unauthenticated")

REGISTRY = CollectorRegistry(auto_describe=True)
# zkv replay's (registered by register_replay)
HITS_BLOCKS = Counter("zkv:hit_blocks", "Prefix-cache hits in blocks, by the tier that held "
                      "them.", ("tier",), registry=None)
BLOCKS_MOVED = Counter("zkv:moved_blocks", "Blocks copied between tiers, by direction (a "
                       "block once, when every rank copied its part; moved_bytes counts every "
                       "rank's bytes).", ("direction",), registry=None)
BYTES_MOVED = Counter("zkv:moved_bytes", "Bytes copied between tiers over all ranks, by "
                      "direction.", ("direction",), registry=None)
INFLIGHT_BATCHES = Gauge("zkv:inflight_batches", "Batches published and not yet acked by "
                         "every rank.", registry=None)
FREE_BLOCKS = Gauge("zkv:free_blocks", "Free blocks per pool.", ("pool",), registry=None)
FAILED_BLOCKS = Counter("zkv:failed_blocks", "Blocks of copies that failed on some rank (rolled "
                        "back; an L3 write dropped, a load recomputed), by direction.",
                        ("direction",), registry=None)
LOST_RANKS = Counter("zkv:lost_ranks", "Ranks declared lost.", registry=None)
BATCHES = Counter("zkv:batches", "Batches published.", registry=None)
_REPLAY = (HITS_BLOCKS, BLOCKS_MOVED, BYTES_MOVED, INFLIGHT_BATCHES, FREE_BLOCKS, FAILED_BLOCKS,
           LOST_RANKS, BATCHES)
_replay_registered = False
for _t in TIERS:
    HITS_BLOCKS.labels(tier=_t)
for _d in DIRECTIONS:
    BLOCKS_MOVED.labels(direction=_d)
    BYTES_MOVED.labels(direction=_d)
    FAILED_BLOCKS.labels(direction=_d)
for _p in POOLS:
    FREE_BLOCKS.labels(pool=_p)


class _Refusals:
    """``zkv:refused_messages_total``, read from the watched dispatchers at scrape time
    (nothing on the hot path). A dispatcher that closed is read one last time and its
    counts kept in ``retired``, so the counter never goes down (it went down once a
    closed engine's dispatcher was garbage-collected: Prometheus read a reset, and
    ``rate()`` a spurious increase). A watched dispatcher is held until it closes (then
    dropped at the next scrape or watch). Scrapes (the server's thread) and engines that
    start take turns on ``lock``: a source added during a scrape is kept."""

    def __init__(self) -> None:
        self.sources: list[Any] = []  # dispatchers, open (or closed since the last look)
        self.retired = dict.fromkeys(REFUSAL_REASONS, 0)
        self.folded: weakref.WeakSet[Any] = weakref.WeakSet()  # (watched again: no more)
        self.lock = threading.Lock()

    def retire_closed(self) -> list[Any]:
        """Fold the closed sources' counts into ``retired``; the open ones (under lock)."""
        open_ = []
        for d in self.sources:
            if d.closed:
                for reason, n in d.refusals().items():
                    self.retired[reason] = self.retired.get(reason, 0) + n
                self.folded.add(d)
            else:
                open_.append(d)
        self.sources = open_
        return list(open_)

    def collect(self) -> Iterator[CounterMetricFamily]:
        with self.lock:
            sources = self.retire_closed()
            totals = dict(self.retired)
        for d in sources:  # (one that closes meanwhile still reads its final counts)
            for reason, n in d.refusals().items():
                totals[reason] = totals.get(reason, 0) + n
        fam = CounterMetricFamily("zkv:refused_messages", "Messages the scheduler refused, by "
                                  "reason: malformed, forged (another rank's identity), "
                                  "unknown_seq, duplicate (acks), unknown_rank, hello (a rank "
                                  "refused at its hello), unauthenticated (connections the ZAP "
                                  "handler refused).", labels=["reason"])
        for reason, n in totals.items():
            fam.add_metric([reason], n)
        yield fam


_REFUSALS = _Refusals()
REGISTRY.register(_REFUSALS)


def register_replay() -> None:
    """Put ``zkv replay``'s families in :data:`REGISTRY` (its scheduler node; once)."""
    global _replay_registered
    if not _replay_registered:
        for m in _REPLAY:
            REGISTRY.register(m)
        _replay_registered = True


def watch_refusals(dispatcher: Any) -> None:
    """Export ``dispatcher.refusals()`` (added up over every dispatcher watched, those
    closed included) as ``zkv:refused_messages_total{reason}``; watching one again changes
    nothing. The dispatcher is held until it closes."""
    with _REFUSALS.lock:  # (those closed folded here too: a process may never be scraped)
        _REFUSALS.retire_closed()
        if dispatcher not in _REFUSALS.folded and not any(
                d is dispatcher for d in _REFUSALS.sources):  # (a half registered again)
            _REFUSALS.sources.append(dispatcher)  # (one closed already: folded at next look)


def record_move(direction: str, num_blocks: int, num_bytes: int) -> None:
    """Count one finished copy: ``num_blocks`` blocks, ``num_bytes`` bytes."""
    BLOCKS_MOVED.labels(direction=direction).inc(num_blocks)
    BYTES_MOVED.labels(direction=direction).inc(num_bytes)


def render(registry: CollectorRegistry | None = None) -> str:
    return generate_latest(registry or REGISTRY).decode()


def check_writable(flag: str, path: str) -> None:
    """ConfigError unless ``path`` can be written at the end of the run: a file (or none
    yet) in an existing directory this process may write."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or path.endswith(os.sep):  # (abspath drops a trailing '/': the
        raise ConfigError(f"{flag} {path}: is a directory")  # write failed, EISDIR, at the end)
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path}: no directory {folder}")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path)
                                                     and not os.access(path, os.W_OK)):
        raise ConfigError(f"{flag} {path}: not writable by this process")


@dataclass
class MetricsServer:
    """``/metrics`` served by prometheus_client on a daemon thread."""

    server: Any
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.server.server_address[0]}:{self.port}/metrics"

    def shutdown(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve(port: int, registry: CollectorRegistry | None = None,
          host: str = "127.0.0.1") -> MetricsServer:
    """Serve the registry on ``host:port`` (loopback; port 0 picks a free one).
    :class:`ConfigError` (one line) when it cannot listen there (the port is taken)."""
    try:
        server, thread = start_http_server(port, addr=host, registry=registry or REGISTRY)
    except OSError as e:
        raise ConfigError(f"metrics port {port}: cannot listen on {host}:{port} "
                          f"({e.strerror or e})") from None
    return MetricsServer(server, thread)
