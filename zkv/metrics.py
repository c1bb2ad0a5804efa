"""Counters and gauges in the Prometheus text exposition format 0.0.4, no dependency.

::

    reg = Registry()
    moved = reg.counter("zkv_blocks_moved_total", "Blocks copied.", ("direction",))
    moved.inc(8, direction="d2h")
    reg.render()   # '# HELP zkv_blocks_moved_total Blocks copied.\\n# TYPE ... counter\\n...'
    server = serve(0, reg); server.port; server.shutdown()

:data:`REGISTRY` holds zkv's own metrics (hits per tier, blocks and bytes moved per
direction, in-flight batches, free blocks per pool, lost ranks, batches). Every update
takes one lock per metric (O(1)); ``render`` copies each metric's samples under its lock.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(v: float) -> str:
    """Integers without a decimal point, ``+Inf`` / ``-Inf`` / ``NaN``, else ``repr``."""
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if float(v).is_integer() and abs(v) < 2**53:
        return str(int(v))
    return repr(float(v))


class Metric:
    """One metric family: samples keyed by their label values (a tuple in ``labelnames``
    order). A metric without labels always has its one sample (starting at 0)."""

    kind = "untyped"

    def __init__(self, name: str, help: str, labelnames: Iterable[str] = ()) -> None:
        labelnames = tuple(labelnames)
        if not _NAME_RE.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        for label in labelnames:
            if not _LABEL_RE.match(label) or label.startswith("__"):
                raise ValueError(f"invalid label name {label!r} for {name}")
        if len(set(labelnames)) != len(labelnames):
            raise ValueError(f"duplicate label names for {name}: {labelnames}")
        self.name = name
        self.help = help
        self.labelnames = labelnames
        self._lock = threading.Lock()
        self._values: dict[tuple[str, ...], float] = {} if labelnames else {(): 0.0}

    def _key(self, labels: dict[str, object]) -> tuple[str, ...]:
        if labels.keys() != set(self.labelnames):
            raise ValueError(
                f"{self.name} takes labels {list(self.labelnames)}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def _add(self, amount: float, labels: dict[str, object]) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def get(self, **labels: object) -> float:
        key = self._key(labels)
        with self._lock:
            return self._values.get(key, 0.0)

    def touch(self, **labels: object) -> None:
        """Create the sample at 0 so it is exported before its first update."""
        key = self._key(labels)
        with self._lock:
            self._values.setdefault(key, 0.0)

    def samples(self) -> list[tuple[tuple[str, ...], float]]:
        with self._lock:
            return sorted(self._values.items())

    def render(self) -> str:
        lines = [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]
        for key, value in self.samples():
            if key:
                inner = ",".join(
                    f'{n}="{_escape_label(v)}"' for n, v in zip(self.labelnames, key))
                lines.append(f"{self.name}{{{inner}}} {format_value(value)}")
            else:
                lines.append(f"{self.name} {format_value(value)}")
        return "\n".join(lines) + "\n"


class Counter(Metric):
    """Only goes up."""

    kind = "counter"

    def inc(self, amount: float = 1, **labels: object) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot decrease (inc({amount}))")
        self._add(amount, labels)


class Gauge(Metric):
    """Goes up and down, or is set."""

    kind = "gauge"

    def inc(self, amount: float = 1, **labels: object) -> None:
        self._add(amount, labels)

    def dec(self, amount: float = 1, **labels: object) -> None:
        self._add(-amount, labels)

    def set(self, value: float, **labels: object) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)


class Registry:
    """Metric families by name, rendered in registration order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics: dict[str, Metric] = {}

    def _register(self, cls: type[Metric], name: str, help: str,
                  labelnames: Iterable[str]) -> Metric:
        metric = cls(name, help, labelnames)
        with self._lock:
            old = self._metrics.get(name)
            if old is None:
                self._metrics[name] = metric
                return metric
        if type(old) is cls and old.labelnames == metric.labelnames:
            return old
        raise ValueError(f"metric {name} already registered as {old.kind} {old.labelnames}")

    def counter(self, name: str, help: str, labelnames: Iterable[str] = ()) -> Counter:
        """Register (or return the same) counter."""
        return self._register(Counter, name, help, labelnames)  # type: ignore[return-value]

    def gauge(self, name: str, help: str, labelnames: Iterable[str] = ()) -> Gauge:
        """Register (or return the same) gauge."""
        return self._register(Gauge, name, help, labelnames)  # type: ignore[return-value]

    def get(self, name: str) -> Metric:
        return self._metrics[name]

    def render(self) -> str:
        with self._lock:
            metrics = list(self._metrics.values())
        return "".join(m.render() for m in metrics)


TIERS = ("device", "host", "storage")
DIRECTIONS = ("d2h", "h2d", "backup", "s2h", "h2s")
POOLS = ("device", "host")

REGISTRY = Registry()
HITS_BLOCKS = REGISTRY.counter(
    "zkv_hits_blocks_total", "Prefix-cache hits in blocks, by the tier that held them.", ("tier",))
BLOCKS_MOVED = REGISTRY.counter(
    "zkv_blocks_moved_total", "Blocks copied between tiers, by direction.", ("direction",))
BYTES_MOVED = REGISTRY.counter(
    "zkv_bytes_moved_total", "Bytes copied between tiers, by direction.", ("direction",))
INFLIGHT_BATCHES = REGISTRY.gauge(
    "zkv_inflight_batches", "Batches published and not yet acked by every rank.")
FREE_BLOCKS = REGISTRY.gauge("zkv_free_blocks", "Free blocks per pool.", ("pool",))
LOST_RANKS = REGISTRY.counter("zkv_lost_ranks_total", "Ranks declared lost.")
BATCHES = REGISTRY.counter("zkv_batches_total", "Batches published.")
for _t in TIERS:
    HITS_BLOCKS.touch(tier=_t)
for _d in DIRECTIONS:
    BLOCKS_MOVED.touch(direction=_d)
    BYTES_MOVED.touch(direction=_d)
for _p in POOLS:
    FREE_BLOCKS.touch(pool=_p)


def record_move(direction: str, num_blocks: int, num_bytes: int) -> None:
    """Count one finished copy in :data:`REGISTRY`: ``num_blocks`` blocks, ``num_bytes`` bytes."""
    BLOCKS_MOVED.inc(num_blocks, direction=direction)
    BYTES_MOVED.inc(num_bytes, direction=direction)


class MetricsServer(ThreadingHTTPServer):
    """``GET /metrics`` on a daemon thread; :meth:`shutdown` stops it and closes the socket."""

    daemon_threads = True
    registry: Registry

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.server_address[0]}:{self.port}/metrics"

    def shutdown(self) -> None:
        super().shutdown()
        self.server_close()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer

    def do_GET(self) -> None:
        self._respond(body=True)

    def do_HEAD(self) -> None:
        self._respond(body=False)

    def _respond(self, body: bool) -> None:
        if self.path.split("?", 1)[0] not in ("/metrics", "/metrics/"):
            self.send_error(404, "only /metrics here")
            return
        data = self.server.registry.render().encode()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass  # scrapes every few seconds would flood stderr


def serve(port: int, registry: Registry | None = None, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``/metrics`` on ``host:port`` (loopback by default; port 0 picks a free one,
    read it back from ``server.port``) in a daemon thread. Stop with ``server.shutdown()``."""
    server = MetricsServer((host, port), _Handler)
    server.registry = registry or REGISTRY
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                              name=f"zkv-metrics-{server.port}", daemon=True)
    server._thread = thread  # type: ignore[attr-defined]
    thread.start()
    return server
