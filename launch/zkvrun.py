"""zkvrun: start the scheduler node and one worker per local rank, supervise, tear down.

::

    zkvrun --nproc-per-node 4 --scheduler "-m zkv.scheduler.main" -m zkv.worker.main
    zkvrun --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --insecure-tcp worker.py

Process tree (node rank 0; other nodes run no scheduler)::

    zkvrun ─┬─ scheduler  ZKV_ROLE=scheduler      binds PUB + PULL
            ├─ rank 0     ZKV_ROLE=worker RANK=0  connects SUB + PUSH
            └─ rank P-1   ...

Every child runs in its own session (process group), so a signal to a child's group
reaches the whole tree under it; on Linux each also gets ``PR_SET_PDEATHSIG=SIGKILL``
so a SIGKILLed zkvrun leaves no orphans. Exit codes: 0 (scheduler exited 0, or every
rank exited 0 on a node without one), the scheduler's code, 1 (a rank failed with no
restarts left), 2 (usage / refused configuration), 128+signum (SIGINT / SIGTERM / SIGHUP).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from zkv import log as zlog
from zkv.config import CacheLayout
from zkv.errors import ConfigError

WORKER = "worker"
SCHEDULER = "scheduler"
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Variables a rank gets from zkvrun and the scheduler must not inherit from zkvrun's env.
_RANK_ONLY_VARS = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")
_MAX_IPC_PATH = 100  # sockaddr_un.sun_path is 108 bytes on Linux, 104 on macOS


@dataclass(slots=True)
class LaunchConfig:
    """The flags of ``zkvrun``. ``run_id`` / ``log_dir`` left ``None`` are filled by
    :func:`run` (a random id; ``$ZKV_LOG_DIR`` or ``{tmp}/zkv-logs/{run_id}``)."""

    nnodes: int = 1
    nproc_per_node: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29511
    max_restarts: int = 0
    log_dir: str | None = None
    run_id: str | None = None
    insecure_tcp: bool = False
    grace_s: float = 5.0
    config: str | None = None  # CacheLayout JSON, or a path to a file holding it
    monitor_interval_s: float = 0.05

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def check(self) -> str | None:
        """The reason this configuration is refused, or None."""
        if self.nnodes < 1 or self.nproc_per_node < 1:
            return "--nnodes and --nproc-per-node must be >= 1"
        if not 0 <= self.node_rank < self.nnodes:
            return f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}"
        if self.max_restarts < 0 or self.grace_s < 0 or self.monitor_interval_s <= 0:
            return "--max-restarts and --grace-s must be >= 0"
        if self.nnodes > 1 and not 0 < self.master_port < 65535:
            return f"--master-port must be in [1, 65534] (PULL uses port+1), got {self.master_port}"
        if self.nnodes > 1 and not self.insecure_tcp:
            return (f"--nnodes {self.nnodes} needs tcp:// endpoints between machines and CURVE "
                    "(encrypted, authenticated) transport is not implemented yet; pass "
                    "--insecure-tcp to use plain tcp on a trusted network")
        return None


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where the scheduler binds PUB / PULL and the ranks connect SUB / PUSH."""

    pub: str
    pull: str
    ipc_dir: str | None = None  # removed by :func:`run` at exit


def make_endpoints(config: LaunchConfig) -> Endpoints:
    """``ipc://`` files in a fresh 0700 directory on one node, ``tcp://`` across nodes."""
    if config.nnodes > 1:
        host = config.master_addr
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # IPv6 literal
        return Endpoints(f"tcp://{host}:{config.master_port}",
                         f"tcp://{host}:{config.master_port + 1}")
    base = tempfile.gettempdir()
    if len(base) + len("/zkv-xxxxxxxx/pull") > _MAX_IPC_PATH:
        base = "/tmp"  # a long $TMPDIR would overflow sun_path
    ipc_dir = tempfile.mkdtemp(prefix="zkv-", dir=base)  # mode 0700 already
    os.chmod(ipc_dir, 0o700)
    return Endpoints(f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/pull", ipc_dir)


def _common_env(config: LaunchConfig, endpoints: Endpoints, role: str,
                base_env: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ if base_env is None else base_env)
    env.update({
        "WORLD_SIZE": str(config.world_size),
        "MASTER_ADDR": config.master_addr,
        "MASTER_PORT": str(config.master_port),
        "ZKV_PUB_ENDPOINT": endpoints.pub,
        "ZKV_PULL_ENDPOINT": endpoints.pull,
        "ZKV_ROLE": role,
    })
    if config.log_dir is not None:
        env["ZKV_LOG_DIR"] = config.log_dir
    if config.run_id is not None:
        env["ZKV_RUN_ID"] = config.run_id
    if config.config is not None:
        env["ZKV_CONFIG"] = load_layout(config).to_json()
    return env


def rank_env(config: LaunchConfig, local_rank: int, endpoints: Endpoints,
             base_env: dict[str, str] | None = None) -> dict[str, str]:
    """The full environment of local rank ``local_rank`` (``base_env`` defaults to ours)."""
    env = _common_env(config, endpoints, WORKER, base_env)
    env.update({
        "RANK": str(config.node_rank * config.nproc_per_node + local_rank),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
        "NODE_RANK": str(config.node_rank),
    })
    # Like torchrun: ranks that share a node's cores get one OpenMP thread each unless the
    # caller chose otherwise (oversubscribed OpenMP regions stall for whole time slices).
    if config.nproc_per_node > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def scheduler_env(config: LaunchConfig, endpoints: Endpoints,
                  base_env: dict[str, str] | None = None) -> dict[str, str]:
    """The scheduler's environment: like a rank's, without RANK / LOCAL_RANK / ..."""
    env = _common_env(config, endpoints, SCHEDULER, base_env)
    for name in _RANK_ONLY_VARS:
        env.pop(name, None)
    return env


def load_layout(config: LaunchConfig) -> CacheLayout:
    """Parse ``--config`` (JSON text or a file path); its world_size must match."""
    assert config.config is not None
    text = config.config
    if not text.lstrip().startswith("{"):
        try:
            with open(text, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"--config is neither layout JSON nor a readable file: {e}") from e
    layout = CacheLayout.from_json(text)
    if layout.world_size != config.world_size:
        raise ConfigError(f"--config has world_size={layout.world_size} but this job has "
                          f"WORLD_SIZE={config.world_size} (nnodes * nproc-per-node)")
    return layout


def resolve_cmd(cmd: list[str]) -> list[str]:
    """``-m mod ...``, ``-c code``, any leading Python flag, and ``path.py ...`` run with
    this Python (``sys.executable``); anything else runs as given."""
    if not cmd:
        raise ValueError("empty command")
    if cmd[0].startswith("-") or cmd[0].endswith(".py"):
        return [sys.executable, *cmd]
    return list(cmd)


def describe_exit(code: int) -> str:
    """``code 3`` or ``code -9 (SIGKILL)``."""
    if code < 0:
        try:
            return f"code {code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"code {code} (signal {-code})"
    return f"code {code}"


def _make_pdeathsig() -> Callable[[], None] | None:
    """A preexec_fn asking Linux to SIGKILL the child when zkvrun dies (no orphans)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    parent = os.getpid()

    def preexec() -> None:  # runs in the forked child: no locks, no allocation-heavy work
        prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # zkvrun died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


@dataclass(slots=True)
class _Child:
    role: str
    local_rank: int | None
    rank: int | None
    cmd: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    done: bool = False  # exited and will not be restarted

    @property
    def name(self) -> str:
        return SCHEDULER if self.role == SCHEDULER else f"rank {self.rank}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def fields(self) -> dict[str, object]:
        """Log fields naming this child (no ``rank`` on the scheduler: it is not one)."""
        if self.role == SCHEDULER:
            return {"role": SCHEDULER}
        return {"rank": self.rank, "local_rank": self.local_rank}

    def alive(self) -> bool:
        return self.proc is not None and not self.done and self.proc.returncode is None


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

    def __init__(self, config: LaunchConfig, log: zlog.FileLogger,
                 children: list[_Child]) -> None:
        self.config = config
        self.log = log
        self.children = children
        self.signals: list[int] = []
        self.wake = threading.Event()
        self._preexec = _make_pdeathsig()

    def on_signal(self, signum: int, _frame: object = None) -> None:
        self.signals.append(signum)
        self.wake.set()

    def _pause(self) -> None:
        self.wake.wait(self.config.monitor_interval_s)
        self.wake.clear()

    def start(self, child: _Child) -> None:
        child.proc = subprocess.Popen(  # noqa: S603 (the user's own command)
            child.cmd, env=child.env, start_new_session=True, preexec_fn=self._preexec)
        child.done = False
        event = zlog.SCHEDULER_STARTED if child.role == SCHEDULER else zlog.RANK_STARTED
        self.log.info(event, **child.fields(), child_pid=child.pid, restarts=child.restarts,
                      cmd=child.cmd)

    def _reaped(self, child: _Child, code: int) -> None:
        child.done = True
        _killpg(child.pid, signal.SIGKILL)  # whatever it left behind in its group
        event = zlog.SCHEDULER_EXITED if child.role == SCHEDULER else zlog.RANK_EXITED
        self.log.info(event, **child.fields(), child_pid=child.pid, code=code,
                      how=describe_exit(code))

    def _live(self) -> list[_Child]:
        return [c for c in self.children if c.alive()]

    def supervise(self) -> int:
        """Poll the children every monitor interval; return zkvrun's exit code."""
        has_scheduler = any(c.role == SCHEDULER for c in self.children)
        while True:
            if self.signals:
                return self._forward(self.signals[0])
            for child in self.children:
                if child.done or child.proc is None:
                    continue
                code = child.proc.poll()
                if code is not None:
                    self._reaped(child, code)
                    result = self._on_exit(child, code)
                    if result is not None:
                        return result
            if not has_scheduler and all(c.done for c in self.children):
                self.log.info(zlog.GROUP_STOPPED, reason="ranks_done", code=0)
                return 0
            self._pause()

    def _on_exit(self, child: _Child, code: int) -> int | None:
        """What a child's exit means: an exit code for zkvrun, or None to keep going."""
        if child.role == SCHEDULER and code == 0:
            self.log.info(zlog.GROUP_STOPPED, reason="scheduler_done", code=0,
                          num_torn_down=len(self._live()))
            self.teardown(signal.SIGTERM)
            return 0
        if child.role == WORKER and code == 0:
            return None
        head = f"zkvrun: {child.name} (pid {child.pid}) exited with {describe_exit(code)}"
        tail = "; no restarts left" if child.role == WORKER else ""
        if child.role == WORKER and child.restarts < self.config.max_restarts:
            child.restarts += 1
            print(f"{head}; restarting ({child.restarts}/{self.config.max_restarts})",
                  file=sys.stderr, flush=True)
            self.log.warning(zlog.RANK_RESTARTED, rank=child.rank, child_pid=child.pid, code=code,
                             restart=child.restarts, max_restarts=self.config.max_restarts)
            try:
                self.start(child)
                return None
            except OSError as e:  # e.g. the binary was removed meanwhile
                head, tail = f"zkvrun: cannot restart {child.name}: {e}", ""
        live = self._live()
        print(f"{head}{tail}; tearing down {len(live)} processes", file=sys.stderr, flush=True)
        self.log.error(zlog.GROUP_FAILED, **child.fields(), child_pid=child.pid, code=code,
                       how=describe_exit(code), restarts=child.restarts, num_torn_down=len(live))
        self.teardown(signal.SIGTERM)
        if child.role == SCHEDULER:
            return code if code > 0 else 1
        return 1

    def _forward(self, signum: int) -> int:
        name = signal.Signals(signum).name
        live = self._live()
        print(f"zkvrun: got {name}; forwarding to {len(live)} processes", file=sys.stderr,
              flush=True)
        self.log.warning(zlog.SIGNAL_FORWARDED, signal=name, num_children=len(live))
        self.teardown(signum)
        return 128 + signum

    def teardown(self, sig: int) -> None:
        """Send ``sig`` to every live child's group, wait up to grace, SIGKILL the rest.

        Another signal to zkvrun during the wait skips the rest of the grace period.
        """
        num_signals = len(self.signals)
        for child in self._live():
            _killpg(child.pid, sig)
        deadline = time.monotonic() + self.config.grace_s
        while (self._poll_live() and time.monotonic() < deadline
               and len(self.signals) == num_signals):
            self._pause()
        self.kill_all()

    def _poll_live(self) -> bool:
        """Reap the children that exited; True while some are still running."""
        running = False
        for child in self._live():
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


def _resolve_defaults(config: LaunchConfig) -> tuple[LaunchConfig, bool]:
    """Fill run_id and log_dir; True when the log dir was chosen here (so we say where)."""
    run_id = config.run_id or f"{uuid.uuid4().hex[:12]}"
    log_dir = config.log_dir or os.environ.get("ZKV_LOG_DIR") or None
    chosen = log_dir is None
    if log_dir is None:
        log_dir = os.path.join(tempfile.gettempdir(), "zkv-logs", run_id)
    return dataclasses.replace(config, run_id=run_id, log_dir=os.path.abspath(log_dir)), chosen


def _install_handlers(handler: Callable[[int, object], None]) -> dict[int, object]:
    if threading.current_thread() is not threading.main_thread():
        return {}  # signal.signal only works there; the caller's thread owns signals
    return {s: signal.signal(s, handler) for s in FORWARDED_SIGNALS}


def _refusal(config: LaunchConfig, worker_cmd: list[str]) -> tuple[LaunchConfig, str | None]:
    """Validate; the config with ``--config`` parsed once into canonical JSON."""
    problem = config.check() or (None if worker_cmd else "no per-rank command given")
    if problem is None and config.config is not None:
        try:
            config = dataclasses.replace(config, config=load_layout(config).to_json())
        except ConfigError as e:
            problem = str(e)
    return config, problem


def run(config: LaunchConfig, worker_cmd: list[str], scheduler_cmd: list[str] | None) -> int:
    """Launch and supervise this node's scheduler (node rank 0) and ranks; exit code.

    Installs SIGINT / SIGTERM / SIGHUP handlers while it runs when called from the main
    thread (restored on return). Does not modify ``config``.
    """
    config, problem = _refusal(config, worker_cmd)
    if problem is not None:
        print(f"zkvrun: error: {problem}", file=sys.stderr, flush=True)
        return 2
    config, chosen = _resolve_defaults(config)
    assert config.log_dir is not None
    if chosen:
        print(f"zkvrun: run {config.run_id}, logs in {config.log_dir}", file=sys.stderr, flush=True)
    name = "launcher" if config.nnodes == 1 else f"launcher-node{config.node_rank}"
    log = zlog.open_logger("launcher", config.log_dir, name=name, run_id=config.run_id,
                           node_rank=config.node_rank)
    endpoints: Endpoints | None = None
    group: _Group | None = None
    previous: dict[int, object] = {}
    try:
        endpoints = make_endpoints(config)
        group = _Group(config, log, _build_children(config, endpoints, worker_cmd, scheduler_cmd))
        previous = _install_handlers(group.on_signal)
        log.info(zlog.GROUP_STARTED, world_size=config.world_size, nnodes=config.nnodes,
                 nproc_per_node=config.nproc_per_node, pub=endpoints.pub, pull=endpoints.pull,
                 max_restarts=config.max_restarts)
        for child in group.children:
            try:
                group.start(child)
            except OSError as e:
                print(f"zkvrun: cannot start {child.name} ({shlex.join(child.cmd)}): {e}",
                      file=sys.stderr, flush=True)
                log.error(zlog.GROUP_FAILED, **child.fields(), error=str(e))
                group.teardown(signal.SIGTERM)
                return 1
        return group.supervise()
    finally:
        if group is not None:
            group.kill_all()
        for signum, old in previous.items():
            signal.signal(signum, old)  # type: ignore[arg-type]
        if endpoints is not None and endpoints.ipc_dir:
            shutil.rmtree(endpoints.ipc_dir, ignore_errors=True)
        log.close()


def build_parser() -> argparse.ArgumentParser:
    """zkvrun's options; the per-rank command is split off first (see :func:`split_argv`)."""
    p = argparse.ArgumentParser(
        prog="zkvrun", allow_abbrev=False, usage="%(prog)s [options] CMD [ARGS ...]",
        description="Start zkv's scheduler node and one worker per local rank; supervise them. "
                    "CMD starts at the first argument that is not a zkvrun option (or after "
                    "'--'); 'x.py ...', '-m mod ...' and '-c code' run with this Python.",
        epilog="Example: zkvrun --nproc-per-node 2 --scheduler '-m my.scheduler' -m my.worker")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1)
    p.add_argument("--node-rank", "--node_rank", type=int, default=0)
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1")
    p.add_argument("--master-port", "--master_port", type=int, default=29511,
                   help="PUB port with --nnodes > 1; PULL is port+1 (default 29511)")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="restarts per rank before the group is torn down (default 0)")
    p.add_argument("--log-dir", "--log_dir", default=None,
                   help="default $ZKV_LOG_DIR, else {tmp}/zkv-logs/{run_id}")
    p.add_argument("--run-id", "--run_id", default=None)
    p.add_argument("--insecure-tcp", action="store_true",
                   help="allow plain tcp:// between nodes (no CURVE yet)")
    p.add_argument("--grace-s", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL at teardown (default 5)")
    p.add_argument("--scheduler", default=None, metavar="CMD",
                   help="scheduler command (one string, shell-split), started on node rank 0; "
                        "'-m mod', '-c code' or 'x.py' run with this Python")
    p.add_argument("--config", default=None, metavar="LAYOUT_JSON",
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
    opts, cmd = split_argv(parser, list(sys.argv[1:] if argv is None else argv))
    ns = parser.parse_args(opts)
    if not cmd:
        parser.error("missing the per-rank command CMD")
    if ns.module:
        cmd = ["-m", *cmd]
    scheduler = shlex.split(ns.scheduler) if ns.scheduler else None
    config = LaunchConfig(
        nnodes=ns.nnodes, nproc_per_node=ns.nproc_per_node, node_rank=ns.node_rank,
        master_addr=ns.master_addr, master_port=ns.master_port, max_restarts=ns.max_restarts,
        log_dir=ns.log_dir, run_id=ns.run_id, insecure_tcp=ns.insecure_tcp, grace_s=ns.grace_s,
        config=ns.config)
    return config, cmd, scheduler


def main(argv: list[str] | None = None) -> int:
    try:
        config, worker_cmd, scheduler_cmd = parse_args(argv)
    except SystemExit as e:  # --help / usage error
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return run(config, worker_cmd, scheduler_cmd)


if __name__ == "__main__":
    sys.exit(main())
