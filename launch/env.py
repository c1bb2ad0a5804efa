"""What zkvrun gives each child: the launch configuration, the endpoints and keys of a run,
and the environment of the scheduler and of every rank.

::

    LaunchConfig ──check()──► make_endpoints ──► keys_for ──► rank_env / scheduler_env
    (flags)        refusals   ipc run dir or     --keys, or      RANK, WORLD_SIZE, ZKV_*
                              tcp (multi-node)   a per-run one   (ZKV_KEYS, ZKV_INSECURE, ...)
"""

from __future__ import annotations

import math
import os
import re
import stat
import sys
import tempfile
from dataclasses import dataclass

from zkv import security
from zkv.config import CacheLayout
from zkv.errors import ConfigError

WORKER = "worker"
SCHEDULER = "scheduler"
# Variables a rank gets from zkvrun and the scheduler must not inherit from zkvrun's env.
_RANK_ONLY_VARS = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")
_RUN_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")  # a file name: no '/', '.', '..'
_MAX_IPC_PATH = 100  # sockaddr_un.sun_path is 108 bytes on Linux, 104 on macOS
RANKS_PER_CORE = 4  # --nproc-per-node above this many per core (or GPU) needs --force-ranks


def max_local_ranks() -> int:
    """Ranks one node may start without ``--force-ranks``: 4 per core, at least one per
    GPU (``/dev/nvidia<N>``; looked up without importing a CUDA library)."""
    gpus = sum(1 for n in os.listdir("/dev") if n.startswith("nvidia") and n[6:].isdigit()) \
        if os.path.isdir("/dev") else 0
    return max(RANKS_PER_CORE * (os.cpu_count() or 1), gpus)


@dataclass(slots=True)
class LaunchConfig:
    """The flags of ``zkvrun``. ``run_id`` / ``log_dir`` left ``None`` are filled by
    :func:`run` (a random id; ``$ZKV_LOG_DIR`` or ``{tmp}/zkv-logs-{uid}/{run_id}``)."""

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
    keys: str | None = None  # keyring directory (zkv keys); default: one per run (one node)
    allow_remote: bool = False  # the scheduler may bind a non-loopback --master-addr
    force_ranks: bool = False  # allow more than max_local_ranks() ranks
    # The scheduler's exit codes that are results, not failures: no restart after them
    # (2: usage / configuration error, by convention; a rerun cannot succeed).
    final_codes: tuple[int, ...] = (2,)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def check(self) -> str | None:
        """The reason this configuration is refused, or None."""
        for flag, n in (("--nnodes", self.nnodes), ("--nproc-per-node", self.nproc_per_node)):
            if n < 1:
                return f"{flag} must be >= 1, got {n}"
        if not 0 <= self.node_rank < self.nnodes:
            return f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}"
        if self.max_restarts < 0:
            return f"--max-restarts must be >= 0, got {self.max_restarts}"
        for code in self.final_codes:
            if not 0 < code < 256:
                return f"--final-codes must be exit codes in [1, 255], got {code}"
        if not 0 <= self.grace_s < math.inf:  # NaN fails too
            return f"--grace-s must be a finite number >= 0, got {self.grace_s}"
        if not 0 < self.monitor_interval_s < math.inf:  # no flag: set by code
            return f"monitor_interval_s must be a finite number > 0, got {self.monitor_interval_s}"
        if self.run_id is not None and not _RUN_ID.fullmatch(self.run_id):
            return ("--run-id must be 1-64 letters, digits, '_', '.' or '-', not starting "
                    f"with '.' (it names the log directory), got {self.run_id!r}")
        if self.nproc_per_node > max_local_ranks() and not self.force_ranks:
            return (f"--nproc-per-node {self.nproc_per_node} is more than {RANKS_PER_CORE} "
                    f"per core ({max_local_ranks()} on this machine); pass --force-ranks if "
                    "you mean it")
        if self.nnodes > 1 and not 0 < self.master_port < 65535:
            return f"--master-port must be in [1, 65534] (PULL uses port+1), got {self.master_port}"
        if not 0 < self.master_port < 65536:  # one node: only exported, as MASTER_PORT
            return (f"--master-port must be in [1, 65535] (it is exported as MASTER_PORT), "
                    f"got {self.master_port}")
        if self.nnodes > 1 and not self.insecure_tcp and self.keys is None:
            return (f"--nnodes {self.nnodes} needs tcp:// between machines: give CURVE keys "
                    f"with --keys DIR (zkv keys DIR --world-size {self.world_size}), or pass "
                    "--insecure-tcp for plain tcp on a trusted network")
        # node rank 0 only: its scheduler binds there; the others only connect to it
        if self.nnodes > 1 and self.node_rank == 0 and not self.allow_remote and not \
                security.is_loopback(self.master_addr):
            return (f"--master-addr {self.master_addr} is not a loopback address: the "
                    "scheduler would listen on the network; pass --allow-remote")
        return None


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where the scheduler binds PUB / PULL and the ranks connect SUB / PUSH."""

    pub: str
    pull: str
    ipc_dir: str | None = None  # the run directory, removed by :func:`run` at exit
    keys: str | None = None  # keyring directory exported as $ZKV_KEYS


def make_endpoints(config: LaunchConfig) -> Endpoints:
    """``ipc://`` files in a fresh private run directory on one node, ``tcp://`` across."""
    if config.nnodes > 1:
        host = config.master_addr
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # IPv6 literal
        return Endpoints(f"tcp://{host}:{config.master_port}",
                         f"tcp://{host}:{config.master_port + 1}")
    run_dir = security.make_run_dir(run_base())
    return Endpoints(f"ipc://{run_dir}/pub", f"ipc://{run_dir}/pull", run_dir)


def run_base() -> str:
    """Where run directories go: ``$TMPDIR`` unless its path would overflow ``sun_path``."""
    base = tempfile.gettempdir()
    if len(base) + len("/zkv-4294967295/run-4194304-12345678/pull") > _MAX_IPC_PATH:
        base = "/tmp"
    return base


def check_keys(config: LaunchConfig) -> None:
    """``--keys`` must be a private keyring for this world size (ConfigError otherwise)."""
    assert config.keys is not None
    keyring = security.Keyring.load(config.keys)
    if keyring.world_size != config.world_size:
        raise ConfigError(f"--keys {config.keys} has keys for {keyring.world_size} ranks, "
                          f"this job has WORLD_SIZE={config.world_size}")


def keys_for(config: LaunchConfig, endpoints: Endpoints) -> str | None:
    """The keyring directory the group uses: ``--keys``, else a fresh one in the run
    directory (one node), else none (``--insecure-tcp``)."""
    if config.keys is not None:
        check_keys(config)
        return config.keys
    if endpoints.ipc_dir is None:
        return None
    path = os.path.join(endpoints.ipc_dir, "keys")
    security.Keyring.generate(config.world_size).save(path)
    return path


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
    for name in ("ZKV_KEYS", "ZKV_INSECURE", "ZKV_ALLOW_REMOTE"):
        env.pop(name, None)
    if endpoints.keys is not None:
        env["ZKV_KEYS"] = endpoints.keys
    if config.insecure_tcp:
        env["ZKV_INSECURE"] = "1"
    if config.allow_remote:
        env["ZKV_ALLOW_REMOTE"] = "1"
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


#: A layout is a few hundred bytes of JSON.
_MAX_CONFIG_BYTES = 1 << 20


def load_layout(config: LaunchConfig) -> CacheLayout:
    """Parse ``--config`` (JSON text or a file path); its world_size must match."""
    assert config.config is not None
    text = path = config.config
    if not text.lstrip().startswith("{"):
        try:
            # A regular file, read to a bound: a FIFO without a writer hung the start, and
            # /dev/zero grew the launcher until memory ran out.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise ConfigError(f"--config {path}: not a regular file (a directory, a "
                                  "pipe or a device): give layout JSON or a JSON file")
            with open(fd, encoding="utf-8") as f:
                text = f.read(_MAX_CONFIG_BYTES + 1)
            if len(text) > _MAX_CONFIG_BYTES:
                raise ConfigError(f"--config {path}: larger than {_MAX_CONFIG_BYTES >> 10} KiB: "
                                  "not a layout")
        except OSError as e:
            raise ConfigError(f"--config is neither layout JSON nor a readable file: {e}") from e
        except UnicodeDecodeError as e:  # (was a traceback, status 1)
            raise ConfigError(f"--config {path}: not layout JSON (not UTF-8 text: {e.reason} "
                              f"at byte {e.start})") from None
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
