"""structlog setup: JSON lines, one event name per thing that happens.

Event names are ``component.noun_pastverb`` constants defined here so that tests and
``zkv logs`` filters refer to one spelling. Each process writes one file
``{log_dir}/{component}-{rank}.jsonl`` (or stderr when no directory is given).

Every line carries ``ts`` (epoch seconds, float), ``level``, ``event``, ``component``,
``pid``, and ``rank`` / ``seq`` where they apply. Three ways to get a logger:

- :func:`configure` once per process, then ``structlog.get_logger()``: component, pid
  and rank come from contextvars bound by ``configure`` -- in the thread that called it.
- :func:`get_logger` from any thread (contextvars are per thread, so a sidecar worker
  thread inside a model process binds its own ``component`` / ``rank``).
- :func:`open_logger`: a logger on its own file that leaves structlog's global
  configuration alone (the launcher uses it, since ``zkv replay`` runs it in-process).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any, TextIO

import orjson
import structlog

# scheduler / dispatcher
BATCH_PUBLISHED = "dispatcher.batch_published"
BATCH_ACKED = "dispatcher.batch_acked"
RANK_JOINED = "dispatcher.rank_joined"
RANK_LOST = "dispatcher.rank_lost"
ACK_REFUSED = "dispatcher.ack_refused"
OP_FAILED = "scheduler.op_failed"
BLOCKS_EVICTED = "scheduler.blocks_evicted"
STEP_DONE = "scheduler.step_done"
# worker
WORKER_STARTED = "worker.started"
WORKER_STOPPED = "worker.stopped"
BATCH_DONE = "worker.batch_done"
BATCH_REFUSED = "worker.batch_refused"
SEQ_GAP = "worker.seq_gap"
COPY_FAILED = "worker.copy_failed"
DEVICE_FAILED = "worker.device_failed"
BACKEND_READY = "worker.backend_ready"
IO_DONE = "worker.io_done"
# storage (L3)
BLOCK_REFUSED = "storage.block_refused"
STORE_UNREACHABLE = "storage.store_unreachable"
STORE_RECONNECTED = "storage.store_reconnected"
STORE_OPENED = "storage.store_opened"
QUERY_FAILED = "storage.query_failed"
WRITE_FAILED = "storage.write_failed"
STORE_EVICTED = "storage.blocks_evicted"
# launcher
RANK_STARTED = "launch.rank_started"
RANK_EXITED = "launch.rank_exited"
RANK_RESTARTED = "launch.rank_restarted"
GROUP_FAILED = "launch.group_failed"
GROUP_STARTED = "launch.group_started"
GROUP_STOPPED = "launch.group_stopped"
SCHEDULER_STARTED = "launch.scheduler_started"
SCHEDULER_EXITED = "launch.scheduler_exited"
SIGNAL_FORWARDED = "launch.signal_forwarded"

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR, "critical": logging.CRITICAL}
_LEVELS = LEVELS  # older spelling


def _add_ts(_: Any, __: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    event_dict.setdefault("ts", time.time())
    return event_dict


def _dumps(obj: Any, **_: Any) -> str:
    return orjson.dumps(obj, default=str).decode()


def _processors(contextvars: bool) -> list[Any]:
    procs: list[Any] = [structlog.contextvars.merge_contextvars] if contextvars else []
    return procs + [
        structlog.processors.add_log_level,
        _add_ts,
        structlog.processors.format_exc_info,
        structlog.processors.JSONRenderer(serializer=_dumps),
    ]


def _level_no(level: str | None) -> int:
    level = (level or os.environ.get("ZKV_LOG_LEVEL") or "info").lower()
    return LEVELS.get(level, logging.INFO)


class _Sink:
    """The one stream every configured logger writes to; ``configure`` swaps its target.

    Loggers bound before a reconfiguration (``get_logger().bind(...)`` captures the
    output stream) keep writing to the current file instead of a closed one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._target: TextIO | None = None
        self._owned = False

    def swap(self, target: TextIO | None, owned: bool) -> None:
        with self._lock:
            old, old_owned = self._target, self._owned
            self._target, self._owned = target, owned
        if old is not None and old_owned and old is not target:
            old.close()

    def write(self, text: str) -> int:
        with self._lock:
            out = self._target or sys.stderr
            return out.write(text)

    def flush(self) -> None:
        with self._lock:
            (self._target or sys.stderr).flush()


_SINK = _Sink()


def configure(
    component: str,
    rank: int | None = None,
    log_dir: str | None = None,
    level: str | None = None,
    stream: TextIO | None = None,
) -> str | None:
    """Route structlog to one JSON-lines file per process; return its path (or None).

    ``log_dir`` defaults to ``$ZKV_LOG_DIR``; without one, lines go to ``stream``/stderr.
    Calling it again closes the file the previous call opened.
    """
    log_dir = log_dir or os.environ.get("ZKV_LOG_DIR") or None
    path = None
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        name = component if rank is None else f"{component}-{rank}"
        path = os.path.join(log_dir, f"{name}.jsonl")
        _SINK.swap(open(path, "a", buffering=1, encoding="utf-8"), owned=True)  # noqa: SIM115
    else:
        _SINK.swap(stream, owned=False)
    structlog.configure(
        processors=_processors(contextvars=True),
        wrapper_class=structlog.make_filtering_bound_logger(_level_no(level)),
        logger_factory=structlog.WriteLoggerFactory(file=_SINK),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    binds: dict[str, Any] = {"component": component, "pid": os.getpid()}
    if rank is not None:
        binds["rank"] = rank
    structlog.contextvars.bind_contextvars(**binds)
    return path


def close() -> None:
    """Close the file :func:`configure` opened; later lines go to stderr."""
    _SINK.swap(None, owned=False)


def get_logger(component: str, **binds: Any) -> Any:
    """A logger bound to ``component`` (and ``pid`` and ``binds``), safe from any thread.

    Values are bound on the logger itself, not in contextvars (which a new thread does
    not inherit). It is a lazy proxy: it follows the configuration in force at each
    call, so a module-level ``log = get_logger(...)`` made before :func:`configure`
    still writes to the configured file.
    """
    return structlog.get_logger(component=component, pid=os.getpid(), **binds)


class FileLogger:
    """A JSON-lines logger on its own file, independent of structlog's global config.

    ``with FileLogger(path, "launcher") as log: log.info(RANK_STARTED, rank=0)``.
    Thread-safe (one lock per file); the file is line-buffered.
    """

    def __init__(self, path: str | None, component: str, level: str | None = None,
                 **binds: Any) -> None:
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            out: TextIO = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
            self._file: TextIO | None = out
        else:
            self._file, out = None, sys.stderr
        self.path = path
        self.log = structlog.wrap_logger(
            structlog.WriteLogger(out),
            processors=_processors(contextvars=False),
            wrapper_class=structlog.make_filtering_bound_logger(_level_no(level)),
            cache_logger_on_first_use=True,
            component=component,
            pid=os.getpid(),
            **binds,
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.log, name)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            self.log = structlog.wrap_logger(structlog.ReturnLogger())

    def __enter__(self) -> FileLogger:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def open_logger(component: str, log_dir: str | None = None, name: str | None = None,
                level: str | None = None, **binds: Any) -> FileLogger:
    """:class:`FileLogger` on ``{log_dir}/{name or component}.jsonl`` (stderr without a dir)."""
    path = os.path.join(log_dir, f"{name or component}.jsonl") if log_dir else None
    return FileLogger(path, component, level=level, **binds)
