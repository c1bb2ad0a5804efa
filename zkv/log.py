"""structlog setup: JSON lines, one event name per thing that happens.

Event names are ``component.noun_pastverb`` constants defined here (the vLLM connector's
``connector.*`` ones in :mod:`zkv.integrations.vllm.events`) so that tests and ``zkv logs``
filters refer to one spelling; ``tests/test_static.py`` finds any log call that names its
event with a string instead. Each process writes one file
``{log_dir}/{component}-{rank}.jsonl`` (or stderr when no directory is given).

Every line carries ``ts`` (epoch seconds, float), ``level``, ``event``, ``component``,
``pid``, and ``rank`` / ``seq`` where they apply. Three ways to get a logger:

- :func:`configure` once per process, then ``structlog.get_logger()``: component, pid
  and rank come from contextvars bound by ``configure`` -- in the thread that called it.
- :func:`get_logger` from any thread (contextvars are per thread, so a sidecar worker
  thread inside a model process binds its own ``component`` / ``rank``).
- :func:`open_logger`: a logger on its own file that leaves structlog's global
  configuration alone (the launcher uses it, since ``zkv replay`` runs it in-process).

Logging never takes a process down. Files are written through :class:`LineFile`: a line
that cannot be written (disk full, ``ulimit -f``, an I/O error) is dropped and counted,
one warning goes to stderr, and later lines are tried again (the disk may free up).
``SIGXFSZ`` is ignored so a file-size limit is an error return, not a kill. Events that
can repeat at an attacker's pace go through :class:`RateLimited`.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import stat
import sys
import threading
import time
from typing import Any, TextIO

import orjson
import structlog

from zkv.errors import ConfigError

# scheduler / dispatcher
BATCH_PUBLISHED = "dispatcher.batch_published"
BATCH_ACKED = "dispatcher.batch_acked"
RANK_JOINED = "dispatcher.rank_joined"
RANK_LOST = "dispatcher.rank_lost"
RANK_REFUSED = "dispatcher.rank_refused"
RANK_LEFT = "dispatcher.rank_left"
DISPATCHER_STOPPED = "dispatcher.stopped"
ACK_REFUSED = "dispatcher.ack_refused"
OP_FAILED = "scheduler.op_failed"
STEP_DONE = "scheduler.step_done"
# worker
WORKER_STARTED = "worker.started"
WORKER_STOPPED = "worker.stopped"
BATCH_DONE = "worker.batch_done"
BATCH_REFUSED = "worker.batch_refused"
SEQ_GAP = "worker.seq_gap"
WORKER_REFUSED = "worker.refused"
COPY_FAILED = "worker.copy_failed"
SCHEDULER_REJOINED = "worker.scheduler_rejoined"
DEVICE_FAILED = "worker.device_failed"
BACKEND_READY = "worker.backend_ready"
IO_DONE = "worker.io_done"
IO_DROPPED = "worker.io_dropped"
IO_STUCK = "worker.io_stuck"
IO_UNSTUCK = "worker.io_unstuck"
IO_ABANDONED = "worker.io_abandoned"
COMPUTE_STREAM = "worker.compute_stream"
SCHEDULER_LOST = "worker.scheduler_lost"
# storage (L3)
BLOCK_REFUSED = "storage.block_refused"
STORE_UNREACHABLE = "storage.store_unreachable"
STORE_RECONNECTED = "storage.store_reconnected"
STORE_OPENED = "storage.store_opened"
QUERY_FAILED = "storage.query_failed"
QUERY_STUCK = "storage.query_stuck"
QUERY_UNSTUCK = "storage.query_unstuck"
WRITE_FAILED = "storage.write_failed"
READ_FAILED = "storage.read_failed"
STORE_EVICTED = "storage.blocks_evicted"
STORE_DISK_FULL = "storage.disk_full"
STORE_BUDGET_REGROWN = "storage.budget_regrown"
STORE_NAMESPACE_PRUNED = "storage.namespace_pruned"
STORE_MISCONFIGURED = "storage.store_misconfigured"
STORE_TUNING = "storage.store_tuning"
STORE_CLOSE_TIMEOUT = "storage.close_timeout"
STOP_TIMEOUT = "worker.stop_timeout"
# launcher
RANK_STARTED = "launch.rank_started"
RANK_EXITED = "launch.rank_exited"
GROUP_FAILED = "launch.group_failed"
GROUP_STARTED = "launch.group_started"
GROUP_STOPPED = "launch.group_stopped"
SCHEDULER_STARTED = "launch.scheduler_started"
SCHEDULER_EXITED = "launch.scheduler_exited"
SIGNAL_FORWARDED = "launch.signal_forwarded"
RUN_DIRS_CLEANED = "launch.run_dirs_cleaned"
GROUP_RESTARTED = "launch.group_restarted"
STRAYS_KILLED = "launch.strays_killed"
# security
HANDSHAKE_REFUSED = "security.handshake_refused"
IDENTITY_FORGED = "security.identity_forged"
# logging itself

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR, "critical": logging.CRITICAL}
_LEVELS = LEVELS  # older spelling


def _add_ts(_: Any, __: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    event_dict.setdefault("ts", time.time())
    return event_dict


def _dumps(obj: Any, **_: Any) -> str:
    try:
        return orjson.dumps(obj, default=str).decode()
    except TypeError:  # a str orjson refuses, an int past 64 bits, a key that is no str
        return orjson.dumps(_plain(obj), default=str).decode()


def _plain(obj: Any) -> Any:
    """``obj`` with what orjson refuses made printable: a str holding surrogates (a path
    decoded with surrogateescape) gets ``\\xNN`` escapes, an int past 64 bits and a dict
    key that is no str become their str."""
    if isinstance(obj, str):
        return _printable_str(obj) if _has_surrogate(obj) else obj
    if isinstance(obj, bool) or obj is None or isinstance(obj, float):
        return obj
    if isinstance(obj, int):
        return obj if -(1 << 63) <= obj < (1 << 64) else str(obj)
    if isinstance(obj, dict):
        return {_plain(k if isinstance(k, str) else str(k)): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return _plain(str(obj))


def _printable_str(text: str) -> str:
    try:  # the bytes a surrogateescape decode stood in for, as \\xNN
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # another lone surrogate: \\udNNN
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


#: The configured process's fields (component, rank), for lines of threads that did not
#: inherit the contextvars :func:`configure` bound (a store's I/O and reconnect threads).
_PROCESS: dict[str, Any] = {}


def _add_process(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    for k, v in _PROCESS.items():
        event_dict.setdefault(k, v)  # a logger's own binds win (component="storage")
    return event_dict


def _add_pid(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    # The writing process's, always: a pid bound before a fork (by configure, on a logger)
    # was the parent's on every line of the child.
    event_dict["pid"] = os.getpid()
    return event_dict


def _processors(contextvars: bool) -> list[Any]:
    procs: list[Any] = [structlog.contextvars.merge_contextvars, _add_process] \
        if contextvars else []
    return procs + [
        _add_pid,
        structlog.processors.add_log_level,
        _add_ts,
        structlog.processors.format_exc_info,
        structlog.processors.JSONRenderer(serializer=_dumps),
    ]


def _level_no(level: str | None) -> int:
    level = (level or os.environ.get("ZKV_LOG_LEVEL") or "info").lower()
    return LEVELS.get(_LEVEL_ALIASES.get(level, level), logging.INFO)


_LEVEL_ALIASES = {"warn": "warning", "fatal": "critical"}


def level_name(name: str) -> str | None:
    """The level ``name`` names (any case; ``warn``, ``fatal`` for ``warning``,
    ``critical``), None when it names none."""
    lower = name.lower()
    lower = _LEVEL_ALIASES.get(lower, lower)
    return lower if lower in LEVELS else None


def check_level(level: str | None = None) -> None:
    """``level`` (default ``$ZKV_LOG_LEVEL``) names a level, or ConfigError (one line): a
    typo used to log at info, silently."""
    name = level if level is not None else os.environ.get("ZKV_LOG_LEVEL")
    if name and level_name(name) is None:
        what = "log level" if level is not None else "ZKV_LOG_LEVEL"
        raise ConfigError(f"{what} must be one of {', '.join(LEVELS)}, got {name!r}")


ROTATE_CHECK_S = 1.0  # how often a log file's writer looks for a rotation by rename


class LineFile:
    """An append-only JSON-lines file that never raises on write.

    Each line is one ``write(2)`` (``O_APPEND``: lines of concurrent writers never
    interleave, and logrotate's ``copytruncate`` works). A failed write drops the line and
    counts it (``num_dropped``); the first failure prints one warning to stderr. A short
    write (a size limit hit mid-line) is ended with a newline before the next line, so
    readers skip one broken line at most; so is a cut line a previous writer left at the
    end of the file (a rank restarted once the disk freed up). Rotation by rename
    (logrotate's default ``create``; ``mv`` then a new file, or none): at most every
    ``check_s`` a write looks at ``path``, and when it no longer names the open file, the
    file there (made if missing) takes the lines from then on, like ``logging``'s
    ``WatchedFileHandler``. Calls are serialized by the caller (the sink's lock).
    """

    def __init__(self, path: str, check_s: float | None = None) -> None:
        self.path = path
        self.num_dropped = 0
        self._partial = False
        self._warned = False
        self._check_s = ROTATE_CHECK_S if check_s is None else check_s
        self._fd: int | None = None
        self._id: tuple[int, int] | None = None
        self._next_check = 0.0
        self._open()

    def _open(self) -> None:
        """(Re)open ``path``, made if missing; the previous file is closed once the new one
        is open (OSError: nothing changes)."""
        flags = os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        try:  # (read too: the last byte, below)
            fd = os.open(self.path, os.O_RDWR | flags, 0o644)
        except PermissionError:
            fd = os.open(self.path, os.O_WRONLY | flags, 0o644)
        st = os.fstat(fd)
        old, self._fd, self._id = self._fd, fd, (st.st_dev, st.st_ino)
        self._partial = _ends_mid_line(fd, st)
        self._next_check = time.monotonic() + self._check_s
        if old is not None:
            os.close(old)

    def _follow_rename(self) -> None:
        self._next_check = time.monotonic() + self._check_s
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._id:
                return
        except OSError:
            pass  # moved away and not made again yet: make it
        try:
            self._open()
        except OSError:
            pass  # (its directory is gone): the old file goes on; tried again later

    def write(self, text: str) -> int:
        if self._fd is not None and time.monotonic() >= self._next_check:
            self._follow_rename()
        fd = self._fd
        if fd is None:
            self.num_dropped += 1
            return len(text)
        data = text.encode("utf-8", "replace")
        if self._partial:
            data = b"\n" + data
        try:
            n = os.write(fd, data)
        except OSError as e:
            self._dropped(e)
            return len(text)
        self._partial = n < len(data)
        if self._partial:
            self._dropped(OSError(errno.EFBIG, "short write"))
        return len(text)

    def _dropped(self, e: OSError) -> None:
        self.num_dropped += 1
        if not self._warned:
            self._warned = True
            _warn(f"zkv: cannot write log file {self.path} ({e.strerror or e}); dropping log "
                  "lines (counted) and trying again later")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        if self.num_dropped:
            _warn(f"zkv: {self.num_dropped} log lines dropped ({self.path})")


def _ends_mid_line(fd: int, st: os.stat_result) -> bool:
    """Whether the regular file ``fd`` ends in a cut line (a previous writer's, at a size
    limit or a full disk): the next line then starts with a newline, not glued to it."""
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        return False
    try:
        return os.pread(fd, 1, st.st_size - 1) != b"\n"
    except OSError:  # (opened write-only)
        return False


def _warn(text: str) -> None:
    """One line to stderr; nothing happens if stderr cannot be written either."""
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # AttributeError: stderr closed (None)
        pass


def check_log_dir(path: str) -> None:
    """ConfigError unless ``path`` is, or could be made, a directory this process may write
    log files in. Entry points call it on a ``--log-dir`` before they start anything: a
    file there, or a directory that cannot be made, is a bad flag (one line), where a
    process that meets it later only falls back to stderr. Nothing is made here: the
    nearest existing ancestor must be a directory this process may write in."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ConfigError(f"log directory {path}: not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"log directory {path}: not writable by this process")
        return
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ConfigError(f"log directory {path}: cannot make it ({ancestor} is not a "
                          "directory)")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"log directory {path}: cannot make it ({ancestor} is not "
                          "writable by this process)")


def open_line_file(path: str) -> LineFile | None:
    """A :class:`LineFile` on ``path`` (its directory created), or None with one warning on
    stderr when it cannot be opened: the caller logs to stderr instead."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        return LineFile(path)
    except OSError as e:
        _warn(f"zkv: cannot open log file {path} ({e.strerror or e}); logging to stderr")
        return None


def ignore_file_size_signal() -> None:
    """Make a ``ulimit -f`` overrun an EFBIG error instead of a SIGXFSZ kill (main thread
    only; elsewhere the process's setting stays)."""
    if hasattr(signal, "SIGXFSZ") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


class _Sink:
    """The one stream every configured logger writes to; ``configure`` swaps its target.

    Loggers bound before a reconfiguration (``get_logger().bind(...)`` captures the
    output stream) keep writing to the current file instead of a closed one. A write that
    fails on a stream (stderr closed or full) is dropped.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._target: Any = None
        self._owned = False

    def swap(self, target: Any, owned: bool) -> None:
        with self._lock:
            old, old_owned = self._target, self._owned
            self._target, self._owned = target, owned
        if old is not None and old_owned and old is not target:
            old.close()

    @property
    def num_dropped(self) -> int:
        return getattr(self._target, "num_dropped", 0)

    def write(self, text: str) -> int:
        with self._lock:
            out = self._target or sys.stderr
            try:
                return out.write(text)
            except (OSError, ValueError, AttributeError):  # stderr closed: sys.stderr is None
                return len(text)

    def flush(self) -> None:
        with self._lock:
            try:
                (self._target or sys.stderr).flush()
            except (OSError, ValueError, AttributeError):
                pass


_SINK = _Sink()


def configure(
    component: str,
    rank: int | None = None,
    log_dir: str | None = None,
    level: str | None = None,
    stream: TextIO | None = None,
    dp_rank: int | None = None,
) -> str | None:
    """Route structlog to one JSON-lines file per process; return its path (or None).

    ``log_dir`` defaults to ``$ZKV_LOG_DIR``; without one, lines go to ``stream``/stderr.
    Calling it again closes the file the previous call opened. ``dp_rank``: the
    data-parallel engine this process serves, where one log directory holds several
    (``scheduler-dp1.jsonl``, ``connector-dp1-0.jsonl``; a ``dp_rank`` field on each line).
    """
    log_dir = log_dir or os.environ.get("ZKV_LOG_DIR") or None
    ignore_file_size_signal()
    path = None
    target = None
    if log_dir:
        name = component if dp_rank is None else f"{component}-dp{dp_rank}"
        name = name if rank is None else f"{name}-{rank}"
        path = os.path.join(log_dir, f"{name}.jsonl")
        target = open_line_file(path)
        if target is None:
            path = None
    if target is not None:
        _SINK.swap(target, owned=True)
        _close_at_exit()
    else:
        _SINK.swap(stream, owned=False)
    structlog.configure(
        processors=_processors(contextvars=True),
        wrapper_class=structlog.make_filtering_bound_logger(_level_no(level)),
        logger_factory=structlog.WriteLoggerFactory(file=_SINK),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    binds: dict[str, Any] = {"component": component}  # (pid: each line's, _add_pid)
    if rank is not None:
        binds["rank"] = rank
    if dp_rank is not None:
        binds["dp_rank"] = dp_rank
    structlog.contextvars.bind_contextvars(**binds)
    _PROCESS.clear()
    _PROCESS.update(binds)
    return path


_AT_EXIT: list[bool] = []


def _close_at_exit() -> None:
    """Close the file at interpreter exit (it reports dropped lines on stderr), once."""
    if not _AT_EXIT:
        import atexit

        atexit.register(close)
        _AT_EXIT.append(True)


def close() -> None:
    """Close the file :func:`configure` opened; later lines go to stderr."""
    _SINK.swap(None, owned=False)


def num_dropped_lines() -> int:
    """Lines the configured file could not take so far (disk full, size limit)."""
    return _SINK.num_dropped


_enabled_for: dict[int, tuple[object, bool]] = {}  # level -> (wrapper class, enabled) last seen


def enabled(level: int) -> bool:
    """Whether structlog's configuration in force passes lines of ``level``: a lookup
    instead of a filtered call through a lazy logger (~5 us), for hot paths that log once
    per step (they check once, when their loop starts, and skip the call, its arguments
    included, when it would be dropped)."""
    wrapper = structlog.get_config()["wrapper_class"]
    seen = _enabled_for.get(level)
    if seen is None or seen[0] is not wrapper:
        try:
            on = bool(wrapper(None, [], {}).is_enabled_for(level))
        except (AttributeError, TypeError):  # not a filtering logger: assume it logs
            on = True
        seen = _enabled_for[level] = (wrapper, on)
    return seen[1]


def debug_enabled() -> bool:
    """``enabled(logging.DEBUG)``."""
    return enabled(logging.DEBUG)


def get_logger(component: str, **binds: Any) -> Any:
    """A logger bound to ``component`` (and ``binds``), safe from any thread.

    Values are bound on the logger itself, not in contextvars (which a new thread does
    not inherit). It is a lazy proxy: it follows the configuration in force at each
    call, so a module-level ``log = get_logger(...)`` made before :func:`configure`
    still writes to the configured file. The ``pid`` is each line's process's (bound
    here, a module-level logger made before a fork wrote its parent's).
    """
    return structlog.get_logger(component=component, **binds)


class FileLogger:
    """A JSON-lines logger on its own file, independent of structlog's global config.

    ``with FileLogger(path, "launcher") as log: log.info(RANK_STARTED, rank=0)``.
    Thread-safe (structlog's lock per file); one ``write(2)`` per line (:class:`LineFile`),
    stderr when ``path`` is None or cannot be opened.
    """

    def __init__(self, path: str | None, component: str, level: str | None = None,
                 **binds: Any) -> None:
        ignore_file_size_signal()
        self._file: LineFile | None = open_line_file(path) if path else None
        out: Any = self._file if self._file is not None else _Sink()
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

    @property
    def num_dropped(self) -> int:
        return self._file.num_dropped if self._file is not None else 0

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


#: Failures that repeat every step while their cause lasts (a store down or full): lines
#: per window, the rest counted (:func:`repeating`).
REPEAT_BURST = 3
REPEAT_WINDOW_S = 10.0


def repeating(log: Any, event: str, level: str = "error") -> RateLimited:
    """The logger for a failure that repeats every step while its cause lasts."""
    return RateLimited(log, event, level=level, burst=REPEAT_BURST, window_s=REPEAT_WINDOW_S)


class RateLimited:
    """Logs a repeating event at most ``burst`` times per ``window_s``; the rest are only
    counted. The next line that gets through carries ``num_suppressed``; :meth:`flush`
    writes what is still pending. ``total`` counts every call. O(1) per call.
    """

    __slots__ = ("log", "event", "level", "burst", "window_s", "total", "_left", "_end",
                 "_suppressed")

    def __init__(self, log: Any, event: str, *, level: str = "error", burst: int = 10,
                 window_s: float = 1.0) -> None:
        self.log = log
        self.event = event
        self.level = level
        self.burst = burst
        self.window_s = window_s
        self.total = 0
        self._left = burst
        self._end = 0.0
        self._suppressed = 0

    def __call__(self, **fields: Any) -> None:
        self.total += 1
        now = time.monotonic()
        if now >= self._end:
            self._end = now + self.window_s
            self._left = self.burst
        if self._left <= 0:
            self._suppressed += 1
            return
        self._left -= 1
        if self._suppressed:
            fields["num_suppressed"] = self._suppressed
            self._suppressed = 0
        getattr(self.log, self.level)(self.event, **fields)

    def flush(self) -> None:
        if self._suppressed:
            getattr(self.log, self.level)(self.event, num_suppressed=self._suppressed,
                                          num_total=self.total, summary=True)
            self._suppressed = 0
