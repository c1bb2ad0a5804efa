"""zkvrun: start the scheduler node and one worker per local rank, supervise, tear down.

::

    zkvrun --nproc-per-node 4 --config layout.json --scheduler my_scheduler.py -m zkv.worker
    zkvrun --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --insecure-tcp worker.py

Process tree (node rank 0; other nodes run no scheduler)::

    zkvrun ─┬─ scheduler  ZKV_ROLE=scheduler      binds PUB + PULL
            ├─ rank 0     ZKV_ROLE=worker RANK=0  connects SUB + PUSH
            └─ rank P-1   ...

Every child runs in its own session (process group), so a signal to a child's group
reaches the whole tree under it: at teardown, and when a child exits (what it left in its
group is SIGKILLed). On Linux each child also gets ``PR_SET_PDEATHSIG=SIGKILL``, so a
SIGKILLed zkvrun takes its children with it; not what they started (PDEATHSIG is not
inherited across fork, and the group kill is zkvrun's own, which a SIGKILL does not let
run): a child's own children outlive a SIGKILLed zkvrun. What a child started in another
session (``setsid``, a double fork), out of its group's reach, is found by a token in its
environment and SIGKILLed when the group ends (``launch/strays.py``). Exit codes: 0
(scheduler exited 0, or every rank exited 0 on a node without one), the scheduler's
code, 1 (a rank failed with no restarts left), 2 (usage / refused configuration, a ``-m
zkv.worker`` rank's included: the rank environment it reads, ``zkv.config.check_rank_env``,
and its store URL are checked before anything starts), 128+signum (SIGINT / SIGTERM /
SIGHUP).
A child's exit is reported as ``code N``; for ranks that run ``-m zkv.worker`` with what N
means there (``code 4 (refused by the scheduler)``, ``zkv.exit_codes``).

Restarts (``--max-restarts N``) restart the whole group, like torchrun: a scheduler that
lost a rank cannot take it back (the rank's cache died with it and the scheduler's tree
still points into it), so any child's failure tears every child down and starts all of
them again, up to N times; a fresh scheduler starts from an empty tree. Not after an exit
that a rerun cannot change: a ``-m zkv.worker`` rank's 2 (bad configuration), 4 (refused
by the scheduler) or 5 (no scheduler reachable for ``ZKV_SCHEDULER_TIMEOUT_S``, default
300 s: on a node whose scheduler node died for good), or a scheduler code named by
``--final-codes`` (default 2: a usage or configuration error, by convention).

Logs: ``--log-dir``, else ``$ZKV_LOG_DIR``, else ``{tmp}/zkv-logs-{uid}/{run_id}`` (the
per-user directory is made 0700, and refused if it is not this user's private directory).

Files (single node): ``{tmp}/zkv-{uid}/run-{pid}-{random}/`` (0700) holds the ipc
sockets and, unless ``--keys`` names a keyring, a fresh per-run CURVE keyring (every
rank authenticates with its own key). It is removed at exit; one left by a zkvrun that
was SIGKILLed is removed by the next start (see :func:`zkv.security.clean_stale_runs`).
Across nodes: ``tcp://`` with ``--keys DIR`` (``zkv keys``), or ``--insecure-tcp``;
a ``--master-addr`` other than loopback also needs ``--allow-remote`` on node rank 0 (its
scheduler listens there; the other nodes only connect).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from launch import strays
from launch.env import (
    RANKS_PER_CORE,
    SCHEDULER,
    WORKER,
    Endpoints,
    LaunchConfig,
    check_keys,
    keys_for,
    load_layout,
    make_endpoints,
    max_local_ranks,
    rank_env,
    resolve_cmd,
    run_base,
    scheduler_env,
)
from zkv import __version__, security, streams
from zkv import log as zlog
from zkv.argtypes import integer, nonempty
from zkv.config import check_rank_env
from zkv.errors import ConfigError
from zkv.exit_codes import EXIT_CONFIG, EXIT_REFUSED, EXIT_SCHEDULER_GONE, WORKER_EXITS

__all__ = ["Endpoints", "LaunchConfig", "describe_exit", "exit_meanings", "main", "make_endpoints",
           "max_local_ranks", "parse_args", "pdeathsig_preexec", "rank_env", "resolve_cmd", "run",
           "scheduler_env"]

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# A zkv.worker rank's exits that a rerun cannot change: no restart after them.
FINAL_WORKER_EXITS = frozenset({EXIT_CONFIG, EXIT_REFUSED, EXIT_SCHEDULER_GONE})


def describe_exit(code: int, meanings: Mapping[int, str] | None = None) -> str:
    """``code 3``, ``code -9 (SIGKILL)``, or with the program's own ``meanings`` of its
    codes ``code 4 (refused by the scheduler)``."""
    if code < 0:
        try:
            return f"code {code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"code {code} (signal {-code})"
    meaning = meanings.get(code) if meanings else None
    return f"code {code} ({meaning})" if meaning else f"code {code}"


def exit_meanings(cmd: list[str]) -> Mapping[int, str] | None:
    """What the exit codes of ``cmd`` mean where zkvrun knows the program: ``-m zkv.worker``
    (zkv's own rank); None for any other command (its codes are its own)."""
    return WORKER_EXITS if any(a == "-m" and b == "zkv.worker"
                               for a, b in zip(cmd, cmd[1:])) else None


def pdeathsig_preexec(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to send ``sig`` to the child when this process dies
    (zkvrun's children get SIGKILL; the child's own children do not inherit it). None
    where there is no ``prctl``, and off the main thread: Linux sends it when the *thread*
    that started the child exits, which for another thread can be long before the process
    does."""
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    parent = os.getpid()

    def preexec() -> None:  # runs in the forked child: no locks, no allocation-heavy work
        prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)

    return preexec


@dataclass(slots=True)
class _Child:
    role: str
    local_rank: int | None
    rank: int | None
    cmd: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    done: bool = False  # exited and will not be restarted

    @property
    def name(self) -> str:
        return SCHEDULER if self.role == SCHEDULER else f"rank {self.rank}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def how(self, code: int) -> str:
        """Its exit ``code`` in words (with zkv.worker's meanings where it runs that)."""
        return describe_exit(code, exit_meanings(self.cmd))

    def fields(self) -> dict[str, object]:
        """Log fields naming this child (no ``rank`` on the scheduler: it is not one)."""
        if self.role == SCHEDULER:
            return {"role": SCHEDULER}
        return {"rank": self.rank, "local_rank": self.local_rank}

    def is_final(self, code: int, final_codes: tuple[int, ...]) -> bool:
        """Whether exit ``code`` is one no restart can change: a zkv.worker rank's bad
        configuration or refusal, or a scheduler code in ``final_codes``."""
        if self.role == SCHEDULER:
            return code in final_codes
        return code in FINAL_WORKER_EXITS and exit_meanings(self.cmd) is not None

    def alive(self) -> bool:
        return self.proc is not None and not self.done and self.proc.returncode is None


class _Signals:
    """SIGINT / SIGTERM / SIGHUP received by zkvrun, in order (seen within a monitor
    interval). Installed before anything starts, so a signal during start-up is never lost.

    The handler only appends (takes no lock): it runs between two bytecodes of the main
    thread, and a ``threading.Event.set()`` here, which it once did to wake the waits,
    deadlocked zkvrun for good when the signal came while that thread held the Event's
    lock inside its own ``wait`` (a Ctrl-C hung it, its children left as zombies).
    """

    def __init__(self) -> None:
        self.received: list[int] = []

    def on_signal(self, signum: int, _frame: object = None) -> None:
        self.received.append(signum)


def _say(line: str) -> None:
    """``line`` on zkvrun's stderr. A stderr that is gone (a closed terminal: EIO; a pipe
    whose reader exited, as ``| tee`` on a Ctrl-C: EPIPE) must not stop the supervision:
    it raised out of the loop, so the children were SIGKILLed with no grace, a restart
    was skipped and zkvrun exited 1 (a forwarded SIGHUP never forwarded). The launcher's
    log has every such line; from then on stderr is /dev/null, so the line left in its
    buffer does not fail the interpreter's exit (status 120) and later lines go nowhere
    (``zkv.streams``)."""
    streams.say(line, sys.stderr)


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Group:
    """The children of one node and the loop that supervises them.

    Invariant: every started child is reaped before :meth:`supervise` returns (also on
    an exception, through :meth:`kill_all`); a reaped child's leftover process group is
    SIGKILLed at once, so nothing it started outlives it.
    """

    def __init__(self, config: LaunchConfig, log: zlog.FileLogger, children: list[_Child],
                 signals: _Signals | None = None, attempt: int = 0) -> None:
        self.config = config
        self.log = log
        self.children = children
        self.sig = signals or _Signals()
        self.signals = self.sig.received
        self.attempt = attempt
        self.failed = False  # a child failed (rather than: done, or a signal to zkvrun)
        self.final = False  # ... with an exit no restart can change
        self._preexec = pdeathsig_preexec()
        self.token = strays.new_token(attempt)  # in every child's environment (see strays)

    def on_signal(self, signum: int, _frame: object = None) -> None:
        self.sig.on_signal(signum, _frame)

    def start_all(self) -> int | None:
        """Start every child; None when all started. A signal to zkvrun meanwhile stops the
        starting at once and forwards it (its exit code); a child that cannot be started
        tears the group down (1)."""
        for child in self.children:
            if self.signals:
                return self._forward(self.signals[0])
            try:
                self.start(child)
            except OSError as e:
                _say(f"zkvrun: cannot start {child.name} ({shlex.join(child.cmd)}): {e}")
                self.log.error(zlog.GROUP_FAILED, **child.fields(), error=str(e))
                self.teardown(signal.SIGTERM)
                return 1
        return None

    def _pause(self) -> None:
        time.sleep(self.config.monitor_interval_s)  # (a signal's handler runs meanwhile)

    def start(self, child: _Child) -> None:
        child.proc = subprocess.Popen(  # noqa: S603 (the user's own command)
            child.cmd, env={**child.env, strays.ENV: self.token}, start_new_session=True,
            preexec_fn=self._preexec)
        child.done = False
        event = zlog.SCHEDULER_STARTED if child.role == SCHEDULER else zlog.RANK_STARTED
        self.log.info(event, **child.fields(), child_pid=child.pid, restarts=self.attempt,
                      cmd=[security.redact_credentials(a) for a in child.cmd])

    def _reaped(self, child: _Child, code: int) -> None:
        child.done = True
        _killpg(child.pid, signal.SIGKILL)  # whatever it left behind in its group
        event = zlog.SCHEDULER_EXITED if child.role == SCHEDULER else zlog.RANK_EXITED
        self.log.info(event, **child.fields(), child_pid=child.pid, code=code,
                      how=child.how(code))

    def _live(self) -> list[_Child]:
        return [c for c in self.children if c.alive()]

    def supervise(self) -> int:
        """Poll the children every monitor interval; return zkvrun's exit code."""
        has_scheduler = any(c.role == SCHEDULER for c in self.children)
        while True:
            if self.signals:
                return self._forward(self.signals[0])
            exited = []
            for child in self.children:
                if child.done or child.proc is None:
                    continue
                code = child.proc.poll()
                if code is not None:
                    self._reaped(child, code)
                    exited.append((child, code))
            # Failures first: a rank that died in the same poll interval as the scheduler
            # finished is a failed group, not one the scheduler's success tore down.
            exited.sort(key=_succeeded)
            for child, code in exited:
                result = self._on_exit(child, code)
                if result is not None:
                    return result
            if not has_scheduler and all(c.done for c in self.children):
                self.log.info(zlog.GROUP_STOPPED, reason="ranks_done", code=0)
                return 0
            self._pause()

    def _on_exit(self, child: _Child, code: int) -> int | None:
        """What a child's exit means: an exit code for zkvrun, or None to keep going.
        Any failure tears the whole group down (``failed``; :func:`run` may restart it)."""
        if child.role == SCHEDULER and code == 0:
            self.log.info(zlog.GROUP_STOPPED, reason="scheduler_done", code=0,
                          num_torn_down=len(self._live()))
            self.teardown(signal.SIGTERM)
            return 0
        if child.role == WORKER and code == 0:
            return None
        self.failed = True
        self.final = child.is_final(code, self.config.final_codes)
        live = self._live()
        left = self.config.max_restarts - self.attempt
        head = f"zkvrun: {child.name} (pid {child.pid}) exited with {child.how(code)}"
        if left > 0 and self.final:
            which = ", one of --final-codes" if child.role == SCHEDULER else ""
            tail = f"{which}: not restarting; tearing down {len(live)} processes"
        elif left > 0:
            tail = (f"; tearing down {len(live)} processes, then restarting the group "
                    f"({self.attempt + 1}/{self.config.max_restarts})")
        else:
            tail = ("; no restarts left" if self.config.max_restarts or child.role == WORKER
                    else "") + f"; tearing down {len(live)} processes"
        _say(head + tail)
        self.log.error(zlog.GROUP_FAILED, **child.fields(), child_pid=child.pid, code=code,
                       how=child.how(code), restarts=self.attempt,
                       num_torn_down=len(live), final=self.final)
        self.teardown(signal.SIGTERM)
        if child.role == SCHEDULER:
            return code if code > 0 else 1
        # a zkv.worker rank's bad configuration is the run's: 2, as zkvrun's own
        return EXIT_CONFIG if self.final and code == EXIT_CONFIG else 1

    def _forward(self, signum: int) -> int:
        name = signal.Signals(signum).name
        live = self._live()
        _say(f"zkvrun: got {name}; forwarding to {len(live)} processes")
        self.log.warning(zlog.SIGNAL_FORWARDED, signal=name, num_children=len(live))
        self.teardown(signum)
        return 128 + signum

    def teardown(self, sig: int) -> None:
        """Send ``sig`` to every live child's group, wait up to grace, SIGKILL the rest.

        The scheduler node is signalled first and alone, for up to half the grace period:
        its own stop sends the ranks Shutdown, which they obey (status 0). Signalled with
        it, a rank could say bye before the node, not yet run, took its own signal, and the
        node failed the run for a lost rank ("rank 0 is dead: ... it said bye: sighup")
        instead of stopping as signalled. The ranks still alive then get ``sig`` too.
        Another signal to zkvrun during the wait skips the rest of the grace period.
        """
        num_signals = len(self.signals)
        deadline = time.monotonic() + self.config.grace_s
        live = self._live()
        first = [c for c in live if c.role == SCHEDULER] if len(live) > 1 else []
        for child in first:
            _killpg(child.pid, sig)
        half = time.monotonic() + self.config.grace_s / 2
        while (first and self._poll_live(first) and time.monotonic() < half
               and len(self.signals) == num_signals):
            self._pause()
        for child in self._live():
            if child not in first:  # (once: a second signal would cut the node's own stop)
                _killpg(child.pid, sig)
        while (self._poll_live(self._live()) and time.monotonic() < deadline
               and len(self.signals) == num_signals):
            self._pause()
        self.kill_all()

    def _poll_live(self, children: list[_Child]) -> bool:
        """Reap those of ``children`` that exited; True while some are still running."""
        running = False
        for child in children:
            if not child.alive():
                continue
            code = child.proc.poll() if child.proc else None
            if code is None:
                running = True
            else:
                self._reaped(child, code)
        return running

    def kill_all(self) -> None:
        """SIGKILL and reap every child still running (also the exception path)."""
        for child in self._live():
            _killpg(child.pid, signal.SIGKILL)
        for child in self._live():
            assert child.proc is not None
            while True:
                try:
                    code = child.proc.wait(timeout=1.0)
                    break
                except subprocess.TimeoutExpired:  # uninterruptible sleep; keep trying
                    _killpg(child.pid, signal.SIGKILL)
            self._reaped(child, code)
        left = strays.kill(self.token)  # what they started outside their groups (setsid)
        if left:
            cmds = [security.redact_credentials(cmd)[:200] for _, cmd in left]
            shown = "; ".join(f"pid {pid} ({c[:80]})" for (pid, _), c in zip(left, cmds))
            _say(f"zkvrun: killed {len(left)} processes the group left outside its process "
                 f"groups: {shown}")
            self.log.warning(zlog.STRAYS_KILLED, pids=[pid for pid, _ in left], cmds=cmds)


def _succeeded(exited: tuple[_Child, int]) -> bool:
    return exited[1] == 0


def _build_children(config: LaunchConfig, endpoints: Endpoints, worker_cmd: list[str],
                    scheduler_cmd: list[str] | None) -> list[_Child]:
    children = []
    if scheduler_cmd and config.node_rank == 0:
        children.append(_Child(SCHEDULER, None, None, resolve_cmd(scheduler_cmd),
                               scheduler_env(config, endpoints)))
    for lr in range(config.nproc_per_node):
        children.append(_Child(WORKER, lr, config.node_rank * config.nproc_per_node + lr,
                               resolve_cmd(worker_cmd), rank_env(config, lr, endpoints)))
    return children


def _given_log_dir(config: LaunchConfig) -> str | None:
    """``--log-dir``, else ``$ZKV_LOG_DIR``, else None (zkvrun picks one)."""
    return config.log_dir or os.environ.get("ZKV_LOG_DIR") or None


def _default_log_root() -> str:
    """``{tmp}/zkv-logs-{uid}``, where runs without a given log directory log."""
    return os.path.join(tempfile.gettempdir(), f"zkv-logs-{os.geteuid()}")


def _make_default_log_root() -> str:
    """:func:`_default_log_root`, made 0700; ConfigError (one line) unless it is, or can
    be made, this user's private directory (not a file, not another user's)."""
    root = _default_log_root()
    zlog.check_log_dir(root)  # a file in the way: "not a directory"
    return security.make_private_dir(root, what="log directory", holds="read the logs")


def _resolve_defaults(config: LaunchConfig) -> tuple[LaunchConfig, bool]:
    """Fill run_id and log_dir; True when the log dir was chosen here (so we say where)."""
    run_id = config.run_id or f"{uuid.uuid4().hex[:12]}"
    log_dir = _given_log_dir(config)
    chosen = log_dir is None
    if log_dir is None:
        log_dir = os.path.join(_default_log_root(), run_id)
    return dataclasses.replace(config, run_id=run_id, log_dir=os.path.abspath(log_dir)), chosen


def _install_handlers(handler: Callable[[int, object], None]) -> dict[int, object]:
    """``handler`` for the signals zkvrun forwards. A SIGHUP it was started with ignored
    stays ignored, as in its children (which inherit it so): ``nohup zkvrun ... &``
    survives the SIGHUP of a logout, which tore the whole group down (nohup's one job)."""
    if threading.current_thread() is not threading.main_thread():
        return {}  # signal.signal only works there; the caller's thread owns signals
    return {s: signal.signal(s, handler) for s in FORWARDED_SIGNALS
            if s != signal.SIGHUP or signal.getsignal(s) is not signal.SIG_IGN}


def _check_store_env(config: LaunchConfig) -> None:
    """The L3 store every ``-m zkv.worker`` rank opens (``ZKV_STORE_URL``, else
    ``ZKV_STORE_DIR``), checked as a rank checks it, without connecting (a ``file://``
    budget against the layout's block when ``--config`` gives it): a bad one is one line
    here, not one a rank after its torch import."""
    from zkv.storage import HEADER_SIZE
    from zkv.storage.url import check_budget, parse_url, store_url_from_env

    found = store_url_from_env(os.environ)
    if found is None:
        return
    name, url = found
    layout = load_layout(config) if config.config is not None else None
    writers = config.world_size if layout is None else layout.world_size
    try:
        scheme, kw = parse_url(url, writers)
        if scheme == "file" and layout is not None:
            check_budget(url, kw, writers, HEADER_SIZE + layout.block_bytes)
    except ConfigError as e:
        raise ConfigError(f"{name}: {e}") from None


def _check_resolves(host: str, node_rank: int) -> None:
    """``--master-addr`` that does not resolve: on node rank 0, which listens there, a
    ConfigError; on the others one warning line, and the ranks wait for it as before (a
    leader's DNS record may appear only once it starts, as on Kubernetes; libzmq resolves
    a connect's address again until it does). Before, they waited in silence."""
    try:
        socket.getaddrinfo(host.strip("[]"), None)
    except (socket.gaierror, UnicodeError) as e:
        if node_rank == 0:
            raise ConfigError(f"--master-addr {host}: not an address this machine can "
                              f"resolve ({e})") from None
        _say(f"zkvrun: warning: --master-addr {host} does not resolve yet ({e}); the ranks "
             "wait for the scheduler there up to ZKV_SCHEDULER_TIMEOUT_S")


def _refusal(config: LaunchConfig, worker_cmd: list[str]) -> tuple[LaunchConfig, str | None]:
    """Validate (the default log root made here: it is checked as it is made); the config
    with ``--config`` parsed once into canonical JSON."""
    problem = config.check() or (None if worker_cmd else "no per-rank command given")
    try:
        if problem is None and config.config is not None:
            config = dataclasses.replace(config, config=load_layout(config).to_json())
        if problem is None and config.keys is not None:
            check_keys(config)
        log_dir = _given_log_dir(config)
        if problem is None and log_dir is not None:
            zlog.check_log_dir(log_dir)
        elif problem is None:
            _make_default_log_root()
        if problem is None:
            zlog.check_level()  # ZKV_LOG_LEVEL, which every child reads
        if problem is None and exit_meanings(worker_cmd) is not None:
            check_rank_env()  # what every -m zkv.worker rank reads: one line, not one a rank
            _check_store_env(config)
        if problem is None and config.nnodes > 1:
            _check_resolves(config.master_addr, config.node_rank)
    except ConfigError as e:
        problem = str(e)
    return config, problem


def run(config: LaunchConfig, worker_cmd: list[str], scheduler_cmd: list[str] | None) -> int:
    """Launch and supervise this node's scheduler (node rank 0) and ranks; exit code.

    Installs SIGINT / SIGTERM / SIGHUP handlers while it runs when called from the main
    thread (restored on return). Does not modify ``config``. With ``max_restarts`` a
    failed group is torn down and started again (a fresh run directory each time).
    """
    config, problem = _refusal(config, worker_cmd)
    if problem is not None:
        _say(f"zkvrun: error: {problem}")
        return 2
    signals = _Signals()
    previous = _install_handlers(signals.on_signal)
    try:
        config, chosen = _resolve_defaults(config)
        assert config.log_dir is not None
        if chosen:
            _say(f"zkvrun: run {config.run_id}, logs in {config.log_dir}")
        name = "launcher" if config.nnodes == 1 else f"launcher-node{config.node_rank}"
        log = zlog.open_logger("launcher", config.log_dir, name=name, run_id=config.run_id,
                               node_rank=config.node_rank)
        try:
            _clean_stale_runs(log)
            for attempt in range(config.max_restarts + 1):
                code, restart = _run_group(config, log, signals, attempt, worker_cmd,
                                           scheduler_cmd)
                if not restart or attempt == config.max_restarts or signals.received:
                    return code
                log.warning(zlog.GROUP_RESTARTED, restart=attempt + 1, code=code,
                            max_restarts=config.max_restarts)
            return code
        finally:
            log.close()
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)  # type: ignore[arg-type]


def _clean_stale_runs(log: zlog.FileLogger) -> None:
    """Remove what a SIGKILLed zkvrun left (its run directory: sockets, keys)."""
    try:
        removed = security.clean_stale_runs(run_base())
    except ConfigError:
        return  # make_run_dir reports the bad root in one line
    if removed:
        _say(f"zkvrun: removed {len(removed)} run directories left by dead launchers")
        log.info(zlog.RUN_DIRS_CLEANED, paths=removed)


def _run_group(config: LaunchConfig, log: zlog.FileLogger, signals: _Signals, attempt: int,
               worker_cmd: list[str], scheduler_cmd: list[str] | None) -> tuple[int, bool]:
    """One start of the group: ``(exit code, whether a restart may help)``: a child failed,
    with an exit that is not final."""
    endpoints: Endpoints | None = None
    group: _Group | None = None
    try:
        endpoints = make_endpoints(config)
        endpoints = dataclasses.replace(endpoints, keys=keys_for(config, endpoints))
        group = _Group(config, log, _build_children(config, endpoints, worker_cmd,
                                                    scheduler_cmd), signals, attempt)
        log.info(zlog.GROUP_STARTED, world_size=config.world_size, nnodes=config.nnodes,
                 nproc_per_node=config.nproc_per_node, pub=endpoints.pub, pull=endpoints.pull,
                 max_restarts=config.max_restarts, attempt=attempt,
                 curve=endpoints.keys is not None)
        code = group.start_all()
        if code is None:
            code = group.supervise()
        return code, group.failed and not group.final
    except ConfigError as e:
        _say(f"zkvrun: error: {e}")
        return 2, False
    finally:
        if group is not None:
            group.kill_all()
        if endpoints is not None and endpoints.ipc_dir:
            security.remove_run_dir(endpoints.ipc_dir)


def _exit_codes(text: str) -> tuple[int, ...]:
    """``--final-codes``: comma-separated exit codes in [1, 255]; '' for none."""
    try:
        codes = tuple(integer(c.strip()) for c in text.split(",")) if text.strip() else ()
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated exit codes, got {text!r}") from None
    if not all(0 < c < 256 for c in codes):
        raise argparse.ArgumentTypeError(f"must be exit codes in [1, 255], got {text!r}")
    return codes


def build_parser() -> argparse.ArgumentParser:
    """zkvrun's options; the per-rank command is split off first (see :func:`split_argv`)."""
    p = argparse.ArgumentParser(
        prog="zkvrun", allow_abbrev=False, usage="%(prog)s [options] CMD [ARGS ...]",
        description="Start zkv's scheduler node and one worker per local rank; supervise them. "
                    "CMD starts at the first argument that is not a zkvrun option (or after "
                    "'--'); 'x.py ...', '-m mod ...' and '-c code' run with this Python.",
        epilog="Example: zkvrun --nproc-per-node 2 --scheduler '-m my.scheduler' -m my.worker")
    p.add_argument("--version", action="version", version=f"zkvrun (zkv {__version__})")
    p.add_argument("--nnodes", type=integer, default=1,
                   help="machines in the group (default 1)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=integer, default=1,
                   help="ranks (worker processes) on this machine (default 1)")
    p.add_argument("--node-rank", "--node_rank", type=integer, default=0,
                   help="this machine's index; node 0 runs the scheduler (default 0)")
    p.add_argument("--master-addr", "--master_addr", type=nonempty, default="127.0.0.1",
                   help="node 0's address, where the scheduler listens (default 127.0.0.1)")
    p.add_argument("--master-port", "--master_port", type=integer, default=29511,
                   help="PUB port with --nnodes > 1; PULL is port+1; exported as "
                        "MASTER_PORT (default 29511)")
    p.add_argument("--max-restarts", "--max_restarts", type=integer, default=0,
                   help="times the whole group (scheduler and ranks) is started again after "
                        "a child fails (default 0); not after a final exit: see "
                        "--final-codes")
    p.add_argument("--final-codes", type=_exit_codes, default=(2,), metavar="N[,N...]",
                   help="the scheduler's exit codes that are results, not failures: no "
                        "restart after them (comma-separated; default 2, a usage or "
                        "configuration error; '' for none). A -m zkv.worker rank's 2 (bad "
                        "configuration), 4 (refused) and 5 (no scheduler reachable) are "
                        "always final")
    p.add_argument("--log-dir", "--log_dir", type=nonempty, default=None,
                   help="default $ZKV_LOG_DIR, else {tmp}/zkv-logs-{uid}/{run_id} (made "
                        "0700)")
    p.add_argument("--run-id", "--run_id", type=nonempty, default=None,
                   help="names the log directory (default: a fresh one per run)")
    p.add_argument("--insecure-tcp", "--insecure", action="store_true",
                   help="allow plain tcp:// between nodes (no CURVE keys)")
    p.add_argument("--keys", type=nonempty, default=None, metavar="DIR",
                   help="CURVE keyring (zkv keys DIR --world-size N); default on one node: "
                        "a fresh keyring per run")
    p.add_argument("--allow-remote", action="store_true",
                   help="let the scheduler listen on a --master-addr that is not loopback")
    p.add_argument("--force-ranks", action="store_true",
                   help=f"allow --nproc-per-node above {RANKS_PER_CORE} per core")
    p.add_argument("--grace-s", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL at teardown (default 5)")
    p.add_argument("--scheduler", default=None, metavar="CMD",
                   help="scheduler command (one string, shell-split), started on node rank 0; "
                        "'-m mod', '-c code' or 'x.py' run with this Python")
    p.add_argument("--config", type=nonempty, default=None, metavar="LAYOUT_JSON",
                   help="CacheLayout JSON (or a file) exported as $ZKV_CONFIG")
    p.add_argument("-m", "--module", action="store_true",
                   help="CMD is a Python module, run as 'python -m CMD ...'")
    return p


def split_argv(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """``(zkvrun options, CMD)``: CMD starts at the first token that is not one of
    zkvrun's options (``-c code`` included), or after ``--``. argparse's REMAINDER
    cannot do this: it refuses a command that starts with an unknown ``-x``.

    Options come back as ``--opt=value`` so a value that starts with ``-``
    (``--scheduler "-m mod"``) is not mistaken for an option.
    """
    actions = parser._option_string_actions
    opts: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return opts, argv[i + 1:]
        action = actions.get(tok.split("=", 1)[0]) if tok.startswith("-") else None
        if action is None:
            return opts, argv[i:]
        if "=" in tok or action.nargs == 0 or i + 1 == len(argv):
            opts.append(tok)
            i += 1
        else:
            opts.append(f"{tok}={argv[i + 1]}")
            i += 2
    return opts, []


def parse_args(argv: list[str] | None = None) -> tuple[LaunchConfig, list[str], list[str] | None]:
    """``(config, worker_cmd, scheduler_cmd)``; usage errors raise SystemExit(2)."""
    parser = build_parser()
    args = list(sys.argv[1:] if argv is None else argv)
    opts, cmd = split_argv(parser, args)
    ns = parser.parse_args(opts)
    if not cmd:
        parser.error("missing the per-rank command CMD")
    if cmd[0].startswith("--") and "--" not in args[: len(args) - len(cmd)]:
        # not one of zkvrun's options: a typo of one, far more often than a command
        parser.error(f"unknown option {cmd[0].split('=', 1)[0]} (a command that starts with "
                     f"'--' goes after a '--' of its own)")
    if ns.module:
        cmd = ["-m", *cmd]
    scheduler = _scheduler_cmd(parser, ns.scheduler)
    config = LaunchConfig(
        nnodes=ns.nnodes, nproc_per_node=ns.nproc_per_node, node_rank=ns.node_rank,
        master_addr=ns.master_addr, master_port=ns.master_port, max_restarts=ns.max_restarts,
        log_dir=ns.log_dir, run_id=ns.run_id, insecure_tcp=ns.insecure_tcp, grace_s=ns.grace_s,
        config=ns.config, keys=ns.keys, allow_remote=ns.allow_remote,
        force_ranks=ns.force_ranks, final_codes=ns.final_codes)
    return config, cmd, scheduler


def _scheduler_cmd(parser: argparse.ArgumentParser, text: str | None) -> list[str] | None:
    """``--scheduler`` split like a shell would; a usage error (SystemExit 2) when it
    cannot be split or is empty (the ranks would wait for a scheduler that never starts)."""
    if text is None:
        return None
    try:
        cmd = shlex.split(text)
    except ValueError as e:
        parser.error(f"argument --scheduler: cannot split {text!r}: {e}")
    if not cmd:
        parser.error("argument --scheduler: an empty command (leave the option out for "
                     "no scheduler)")
    return cmd


def main(argv: list[str] | None = None) -> int:
    try:
        config, worker_cmd, scheduler_cmd = parse_args(argv)
    except SystemExit as e:  # --help / usage error
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return run(config, worker_cmd, scheduler_cmd)


if __name__ == "__main__":
    sys.exit(main())
