"""``python -m zkv.worker``: one rank's worker actor as its own process.

Environment (zkvrun sets it): ``RANK``, ``ZKV_CONFIG`` (layout JSON), ``ZKV_PUB_ENDPOINT``,
``ZKV_PULL_ENDPOINT``, ``ZKV_KEYS`` (keyring directory; zkvrun makes one per run),
``ZKV_INSECURE=1`` (plain tcp allowed); optional ``ZKV_BACKEND`` (auto | cpu | cupy),
``ZKV_SCHEDULER_TIMEOUT_S`` (stop once no scheduler was reachable for that long: none
reached since the start, or none since the connection dropped; default 300, ``inf`` to
wait forever),
``ZKV_STORE_URL`` (an L3 store: ``file:///path``, ``redis://HOST:PORT/DB``,
``mooncake://HOST:PORT``; see :func:`zkv.storage.open_store`) or the older ``ZKV_STORE_DIR``
(= ``file://`` that directory), ``ZKV_HEARTBEAT_S``, ``ZKV_LOG_DIR``, ``ZKV_LOG_LEVEL``. A
local store's byte budget is shared by the group's ranks (each gets ``1 / world_size`` of it).

A rank that seems stuck prints every thread's Python stack to its stderr on ``SIGUSR1``
(``kill -USR1 PID``; :mod:`faulthandler`, which works even while a thread holds the GIL
or waits in C) and goes on.

Exit status: 0 after Shutdown or SIGTERM / SIGINT / SIGHUP, 3 after a seq gap, 4 when the scheduler
refused the rank's hello (a layout that differs, a rank outside the world, a group that
started without it: the reason is in the log's ``worker.refused`` line and on stderr), 5
when no scheduler was reachable for ``ZKV_SCHEDULER_TIMEOUT_S`` (a node whose scheduler
node died for good: the reason on stderr), 2 on a bad configuration, 1 on any other fatal
error. The worker also stops when its parent process
goes away, so an orphan never lingers.
"""

from __future__ import annotations

import os

#: Read before anything heavy loads (torch, the kernels: a second or more): a parent that
#: exits while this process starts is still seen as gone by the watcher. (Read later, the
#: pid would be init's or a subreaper's already, and the worker would wait forever.)
_PARENT_PID = os.getppid()

import signal  # noqa: E402

# (SIGHUP among them: zkvrun forwards a hangup, a closed terminal, to every rank, which
# then closed nothing: its store unclosed, no ``actor.stopped`` line.)
from zkv.stopsignals import STOP_SIGNALS  # noqa: E402  (signal and sys only)


def _stop_while_starting(_signum: int, _frame: object) -> None:
    """A stop signal before the actor runs (a Ctrl-C in the first seconds reaches every
    rank of the terminal's process group while torch imports): exit 0 through the
    ``finally`` blocks, quietly (a ``KeyboardInterrupt`` traceback from deep in torch's
    import per rank, 25-79 lines, buried zkv's one line)."""
    raise SystemExit(0)


if __name__ == "__main__":  # (run as the rank, not imported: the importer's signals stay)
    for _sig in STOP_SIGNALS:
        signal.signal(_sig, _stop_while_starting)

import contextlib  # noqa: E402
import faulthandler  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from collections.abc import Mapping  # noqa: E402

from zkv import log as zlog
from zkv.config import (
    CacheLayout,
    endpoints_from_env,
    heartbeat_from_env,
    scheduler_timeout_from_env,
)
from zkv.errors import ConfigError
from zkv.exit_codes import EXIT_CONFIG, EXIT_FATAL, EXIT_REFUSED, EXIT_SCHEDULER_GONE
from zkv.storage import HEADER_SIZE, Store, open_store
from zkv.storage.url import store_url_from_env
from zkv.worker.actor import WorkerActor
from zkv.worker.sidecar import (
    rank_from_env,
    resolve_backend,
    security_from_env,
)

_PARENT_CHECK_S = 0.5


def _watch_parent(actor: WorkerActor, stopped: threading.Event) -> None:
    while True:
        if os.getppid() != _PARENT_PID:
            actor.stop("parent process exited")
            return
        if stopped.wait(_PARENT_CHECK_S):
            return


def store_from_env(layout: CacheLayout, rank: int, env: Mapping[str, str] | None = None
                   ) -> Store | None:
    """Rank ``rank``'s L3 store from ``ZKV_STORE_URL`` (or ``ZKV_STORE_DIR``); None
    without."""
    found = store_url_from_env(os.environ if env is None else env)
    if found is None:
        return None
    return open_store(found[1], layout.fingerprint(), writers=layout.world_size, rank=rank,
                      block_bytes=HEADER_SIZE + layout.block_bytes)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args:  # configured by its environment alone (zkvrun sets it)
        if args[0] in ("-h", "--help"):
            print(__doc__.strip())
            return 0
        print(f"zkv.worker: error: takes no arguments (its environment configures it; see "
              f"--help), got {args[0]!r}", file=sys.stderr)
        return EXIT_CONFIG
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        zlog.check_level()  # ZKV_LOG_LEVEL
        rank = rank_from_env()
        layout = CacheLayout.from_env()
        if rank >= layout.world_size:
            raise ConfigError(f"RANK {rank} is not below the layout's world_size "
                              f"{layout.world_size}")
        pub, pull = endpoints_from_env()
        heartbeat_s = heartbeat_from_env()  # (NaN, -1, 1e-9: a heartbeat flood, refused)
        keys, insecure = security_from_env(rank)
        scheduler_timeout_s = scheduler_timeout_from_env()
    except (ConfigError, ValueError) as e:
        print(f"zkv.worker: {e}", file=sys.stderr)
        return EXIT_CONFIG
    zlog.configure("worker", rank)
    try:
        backend = resolve_backend(os.environ.get("ZKV_BACKEND", "auto"))  # LOCAL_RANK's device
        backend.bind_thread()  # before any allocation
        kv_caches = backend.allocate_device_cache(layout)
        host_pool = backend.allocate_host_pool(layout)
    except ConfigError as e:  # an unknown backend, a LOCAL_RANK with no device
        print(f"zkv.worker: rank {rank}: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except Exception as e:
        print(f"zkv.worker: rank {rank}: cannot allocate the cache: {e!r}", file=sys.stderr)
        return EXIT_FATAL
    # Stop signals are held from the store's open until the actor's handlers are in, then
    # stop the actor, which closes the store (a SystemExit inside the open left a half-open
    # store unclosed). Recorded by the handler, not blocked: a thread that does not block
    # them takes the signal, and Python runs the handler in the main thread all the same.
    held: list[int] = []
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, _frame: held.append(signum))
    store = None
    try:
        store = store_from_env(layout, rank)
        actor = WorkerActor(rank, layout, kv_caches, host_pool, backend, pub_endpoint=pub,
                            pull_endpoint=pull, store=store, heartbeat_interval_s=heartbeat_s,
                            keys=keys, insecure=insecure,
                            scheduler_timeout_s=scheduler_timeout_s)
    except BaseException as e:
        if store is not None:
            store.close()
        if not isinstance(e, ConfigError):
            raise
        print(f"zkv.worker: rank {rank}: {e}", file=sys.stderr)
        return EXIT_CONFIG
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, _frame: actor.stop(signal.Signals(signum).name.lower()))
    if held:  # (one that came after the line above went to the actor itself)
        actor.stop(signal.Signals(held[0]).name.lower())
    stopped = threading.Event()
    watcher = threading.Thread(target=_watch_parent, args=(actor, stopped), daemon=True)
    watcher.start()
    try:
        code = actor.run()
        if code in (EXIT_REFUSED, EXIT_SCHEDULER_GONE):  # the one line a launcher's log shows
            print(f"zkv.worker: rank {rank}: {actor.exit_reason}", file=sys.stderr)
        return code
    finally:
        stopped.set()
        # Joined, so the actor (its tensors) is freed here, not by the watcher dropping its
        # argument once Python's exit has begun: a daemon thread freeing a tensor then took
        # the GIL in finalization, which ends the thread with a forced unwind through torch's
        # C++ frames: "terminate called without an active exception", status -6 (SIGABRT),
        # about one exit in twenty on a busy machine.
        watcher.join()
        if store is not None:
            store.close()


def _ignore_late_stop_signals() -> None:
    """The rank is ending: a stop signal now (zkvrun forwards one to the ranks once the
    scheduler node stopped, and they may be exiting on its Shutdown) must not kill it.
    Python's exit puts its handlers back to the defaults before the modules are torn down
    (torch's take a while), and a SIGHUP there ended a rank that had stopped in order as
    "code -1 (SIGHUP)". Ignored is left as it is."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _exit_past_left_threads(code: int) -> None:
    """End the process now if a thread is left: one in a store call that never returned
    (the actor left it at its stop: ``worker.io_abandoned``). Python's exit would free
    what it holds with the GIL taken back in finalization, which ends such a thread with a
    forced unwind (an abort through C++ frames, e.g. Mooncake's client). Every log line is
    written already (unbuffered); stdout and stderr are flushed."""
    if any(t is not threading.main_thread() for t in threading.enumerate()):
        for f in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                f.flush()
        os._exit(code)


if __name__ == "__main__":
    try:
        _code = main()
    finally:
        _ignore_late_stop_signals()
    _exit_past_left_threads(_code)
    sys.exit(_code)
