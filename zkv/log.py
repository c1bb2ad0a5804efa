"""structlog setup: JSON lines, one event name per thing that happens.

Event names are ``component.noun_pastverb`` constants defined here so that tests and
``zkv logs`` filters refer to one spelling. Each process writes one file
``{log_dir}/{component}-{rank}.jsonl`` (or stderr when no directory is given).
"""

from __future__ import annotations

import logging
import os
import sys
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
# launcher
RANK_STARTED = "launch.rank_started"
RANK_EXITED = "launch.rank_exited"
RANK_RESTARTED = "launch.rank_restarted"
GROUP_FAILED = "launch.group_failed"

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}


def _add_ts(_: Any, __: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    event_dict.setdefault("ts", time.time())
    return event_dict


def _dumps(obj: Any, **_: Any) -> str:
    return orjson.dumps(obj, default=str).decode()


def configure(
    component: str,
    rank: int | None = None,
    log_dir: str | None = None,
    level: str | None = None,
    stream: TextIO | None = None,
) -> str | None:
    """Route structlog to one JSON-lines file per process; return its path (or None).

    ``log_dir`` defaults to ``$ZKV_LOG_DIR``; without one, lines go to ``stream``/stderr.
    """
    log_dir = log_dir or os.environ.get("ZKV_LOG_DIR") or None
    level = (level or os.environ.get("ZKV_LOG_LEVEL") or "info").lower()
    path = None
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        name = component if rank is None else f"{component}-{rank}"
        path = os.path.join(log_dir, f"{name}.jsonl")
        out: TextIO = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (lives as long as the process)
    else:
        out = stream or sys.stderr
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _add_ts,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_dumps),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    binds: dict[str, Any] = {"component": component, "pid": os.getpid()}
    if rank is not None:
        binds["rank"] = rank
    structlog.contextvars.bind_contextvars(**binds)
    return path
