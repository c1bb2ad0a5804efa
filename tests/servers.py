"""Real L3 servers for tests: redis-server and a Mooncake Store (master + a memory holder),
each on free 127.0.0.1 ports, started and always stopped by the test that owns them.

::

    with RedisServer(tmp_dir) as srv:          srv.url  -> redis://127.0.0.1:PORT/0
    RedisServer(tmp_dir, tls=make_tls(d), user=("zkv", "pw"))
                                               rediss://zkv:pw@127.0.0.1:PORT/0?ca=...
        srv.pause() / srv.resume()             SIGSTOP / SIGCONT (a hung server)
        srv.stop() / srv.start()               killed and restarted on the same port

    with MooncakeServer(tmp_dir) as mc:        mc.url   -> mooncake://127.0.0.1:PORT
        mc.stop_master() / mc.start_master()   the holder's segment comes back with it

    KillableStore("redis" | "mooncake", dir)   either one: kill / restart / pause / num_keys

Readiness is polled with a deadline (a TCP connect, PING, the master's capacity metric);
nothing sleeps for synchronization. Every child is reaped in ``close`` (also on errors).
Install: ``apt-get install -y --no-install-recommends redis-server libibverbs1 openssl`` and
``pip install -e '.[test,redis,mooncake]'``.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from typing import IO, Any, NamedTuple

from launch.zkvrun import pdeathsig_preexec
from tests.waiting import holds_within
from zkv import stopsignals

HOST = "127.0.0.1"
_START_TIMEOUT_S = 20.0


def free_port() -> int:
    """A loopback port that is free now, below the kernel's ephemeral range and not handed
    out before by this process. A port from ``bind(0)`` is an ephemeral one: until the
    server binds it, any outgoing connection or other ``bind(0)`` (vLLM's own ports, a
    health check) may take it (a ``vllm serve`` failed so once: "Address already in use")."""
    low = _ephemeral_low()
    for _ in range(200):
        port = _rng.randrange(10_000, low)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in 10000..{low} after 200 tries")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return max(20_000, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        return 32_768


_rng = random.SystemRandom()  # no state: forked processes pick apart
_given: set[int] = set()


def sigstop(pid: int) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped: the signal is
    delivered asynchronously, and a thread that runs on meanwhile may still answer (a
    Mooncake master answered a query sent just after ``kill`` returned)."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: all(_thread_state(pid, t) in ("T", "t", "")
                         for t in os.listdir(f"/proc/{pid}/task")), f"process {pid} stopped")


def _thread_state(pid: int, tid: str) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""  # the thread ended


def binary(name: str) -> str:
    """A server binary from the venv or PATH; a missing one fails loudly, never skips."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    path = here if os.access(here, os.X_OK) else shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} not found: install it (see tests/servers.py) - these "
                           "tests run against real servers in CI")
    return path


def wait_for(pred: Callable[[], bool], what: str, proc: subprocess.Popen[bytes] | None = None,
             timeout_s: float = _START_TIMEOUT_S) -> None:
    def ready() -> bool:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}")
        return pred()

    if not holds_within(ready, timeout_s, interval=0.02):
        raise RuntimeError(f"{what}: not ready within {timeout_s} s")


def port_open(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.2):
            return True
    except OSError:
        return False


def stop_process(proc: subprocess.Popen[bytes] | None, timeout_s: float = 5.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.kill(proc.pid, signal.SIGCONT)  # a paused server takes its SIGTERM too
        proc.terminate()
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class _Server:
    def __init__(self, folder: str) -> None:
        self.folder = folder
        os.makedirs(folder, exist_ok=True)
        self._logs: list[IO[bytes]] = []

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None,
               ) -> subprocess.Popen[bytes]:
        log = open(os.path.join(self.folder, f"{name}.log"), "ab")  # noqa: SIM115
        self._logs.append(log)
        # It dies with the process that started it, however that dies: a test run or a
        # bench killed by a timeout's SIGTERM runs no cleanup.
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                env=env, start_new_session=True,
                                preexec_fn=pdeathsig_preexec(signal.SIGKILL))
        stopsignals.check()  # (a bench's SIGTERM during the fork: its exception was dropped)
        return proc

    def log_text(self, name: str) -> str:
        with open(os.path.join(self.folder, f"{name}.log"), "rb") as f:
            return f.read().decode(errors="replace")

    def close(self) -> None:
        for log in self._logs:
            log.close()
        self._logs = []

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class Tls(NamedTuple):
    """A test CA and a server certificate it signed for 127.0.0.1 (PEM files)."""

    ca: str
    cert: str
    key: str
    other_ca: str  # a CA that signed nothing here: a client trusting it must refuse


def make_tls(folder: str) -> Tls:
    """Certificates made with the ``openssl`` command (EC P-256, valid two days)."""
    os.makedirs(folder, exist_ok=True)
    f = {n: os.path.join(folder, n) for n in (
        "ca.pem", "ca.key", "other.pem", "other.key", "srv.csr", "srv.pem", "srv.key", "ext")}
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    with open(f["ext"], "w") as ext:
        ext.write("subjectAltName=IP:127.0.0.1\n")

    def openssl(*args: str) -> None:
        subprocess.run([binary("openssl"), *args], check=True, capture_output=True, timeout=30)

    for name in ("ca", "other"):
        openssl("req", "-x509", *ec, "-keyout", f[f"{name}.key"], "-out", f[f"{name}.pem"],
                "-days", "2", "-subj", f"/CN=zkv test {name}")
    openssl("req", *ec, "-keyout", f["srv.key"], "-out", f["srv.csr"], "-subj", f"/CN={HOST}")
    openssl("x509", "-req", "-in", f["srv.csr"], "-CA", f["ca.pem"], "-CAkey", f["ca.key"],
            "-CAcreateserial", "-out", f["srv.pem"], "-days", "2", "-extfile", f["ext"])
    return Tls(f["ca.pem"], f["srv.pem"], f["srv.key"], f["other.pem"])


class RedisServer(_Server):
    """One redis-server, no persistence, LRU eviction past ``maxmemory`` (or ``policy``:
    ``noeviction`` refuses writes past it, a full store). ``tls``: TLS only (no plain
    port; clients are not asked for certificates); ``user``: an ACL user and its password,
    the default user off."""

    def __init__(self, folder: str, maxmemory: str = "256mb", port: int | None = None,
                 policy: str = "allkeys-lru", tls: Tls | None = None,
                 user: tuple[str, str] | None = None) -> None:
        super().__init__(folder)
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.policy = policy
        self.tls = tls
        self.user = user
        self.proc: subprocess.Popen[bytes] | None = None
        try:
            self.start()
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        auth = f"{self.user[0]}:{self.user[1]}@" if self.user else ""
        if self.tls is None:
            return f"redis://{auth}{HOST}:{self.port}/0"
        return f"rediss://{auth}{HOST}:{self.port}/0?ca={self.tls.ca}"

    def start(self) -> None:
        ports = ["--port", str(self.port)]
        if self.tls is not None:
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file",
                     self.tls.cert, "--tls-key-file", self.tls.key, "--tls-ca-cert-file",
                     self.tls.ca, "--tls-auth-clients", "no"]
        users = []
        if self.user is not None:
            users = ["--user", "default", "off", "--user", self.user[0], "on",
                     f">{self.user[1]}", "~*", "&*", "+@all"]
        self.proc = self._spawn("redis", [
            binary("redis-server"), "--bind", HOST, *ports, "--dir",
            self.folder, "--save", "", "--appendonly", "no", "--maxmemory", self.maxmemory,
            "--maxmemory-policy", self.policy, "--protected-mode", "yes", *users])
        wait_for(self._pong, f"redis-server on port {self.port}", self.proc)

    def _pong(self) -> bool:
        try:
            with contextlib.ExitStack() as stack:
                s = stack.enter_context(socket.create_connection((HOST, self.port), timeout=0.5))
                if self.tls is not None:
                    ctx = ssl.create_default_context(cafile=self.tls.ca)
                    s = stack.enter_context(ctx.wrap_socket(s, server_hostname=HOST))
                s.sendall(b"PING\r\n")
                reply = s.recv(64)  # an ACL without the default user: NOAUTH, but up
                return reply.startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def stop(self) -> None:
        stop_process(self.proc)

    def pause(self) -> None:
        assert self.proc is not None
        sigstop(self.proc.pid)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL (also while paused): connections reset, nothing is saved."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def client(self) -> Any:
        import redis

        tls = {} if self.tls is None else {"ssl": True, "ssl_ca_certs": self.tls.ca}
        user = {} if self.user is None else {"username": self.user[0], "password": self.user[1]}
        return redis.Redis(host=HOST, port=self.port, socket_timeout=5, **tls, **user)

    def close(self) -> None:
        self.stop()
        super().close()


class MooncakeServer(_Server):
    """A Mooncake master and one ``mooncake_client`` that mounts ``segment_mb`` of memory
    (where blocks live; zkv clients mount none, so blocks outlive them)."""

    def __init__(self, folder: str, segment_mb: int = 256,
                 master_args: tuple[str, ...] = ()) -> None:
        """``master_args``: more ``mooncake_master`` flags (``--default_kv_lease_ttl=1``)."""
        super().__init__(folder)
        self.port, self.metrics_port, self.holder_port = free_port(), free_port(), free_port()
        self.segment_mb = segment_mb
        self.master_args = master_args
        self.master: subprocess.Popen[bytes] | None = None
        self.holder: subprocess.Popen[bytes] | None = None
        self.env = dict(os.environ, MC_TCP_BIND_ADDRESS=HOST, MC_LOG_LEVEL="ERROR")
        try:
            self.start_master()
            self.holder = self._spawn("holder", [
                binary("mooncake_client"), f"--host={HOST}", f"--port={self.holder_port}",
                f"--global_segment_size={segment_mb}MB", "--local_buffer_size=16MB",
                f"--master_server_address={HOST}:{self.port}", "--metadata_server=P2PHANDSHAKE",
                "--protocol=tcp", "--logtostderr=true"], env=self.env)
            self.wait_capacity()
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"mooncake://{HOST}:{self.port}"

    def start_master(self) -> None:
        self.master = self._spawn("master", [
            binary("mooncake_master"), f"--rpc_address={HOST}", f"--rpc_port={self.port}",
            f"--metrics_host={HOST}", f"--metrics_port={self.metrics_port}",
            "--logtostderr=true", *self.master_args], env=self.env)
        wait_for(lambda: port_open(self.port) and port_open(self.metrics_port),
                 f"mooncake_master on port {self.port}", self.master)

    def stop_master(self) -> None:
        stop_process(self.master)

    def pause_master(self) -> None:
        assert self.master is not None
        sigstop(self.master.pid)

    def resume_master(self) -> None:
        assert self.master is not None
        os.kill(self.master.pid, signal.SIGCONT)

    def kill_master(self) -> None:
        """SIGKILL (also while paused): every object's metadata is gone."""
        assert self.master is not None
        self.master.kill()
        self.master.wait()

    def capacity(self) -> int:
        try:
            text = urllib.request.urlopen(f"http://{HOST}:{self.metrics_port}/metrics",
                                          timeout=1).read().decode()
        except OSError:
            return 0
        for line in text.splitlines():
            if line.startswith("master_total_capacity_bytes "):
                return int(float(line.split()[1]))
        return 0

    def wait_capacity(self) -> None:
        """Until the holder's segment is mounted (after a start or a master restart)."""
        wait_for(lambda: self.capacity() > 0, "mooncake segment mount", self.holder)

    def close(self) -> None:
        stop_process(self.holder)
        stop_process(self.master)
        super().close()


class KillableStore:
    """Either server behind one interface, for tests that take the store away mid-run:
    ``kind`` "redis" or "mooncake"; ``kill`` (SIGKILL: a redis-server without persistence
    and a Mooncake master both come back empty), ``restart``, ``pause`` (SIGSTOP) and
    ``resume``,
    ``num_keys`` (objects the server holds)."""

    def __init__(self, kind: str, folder: str) -> None:
        self.kind = kind
        self.srv: Any = RedisServer(folder) if kind == "redis" else MooncakeServer(folder)

    @property
    def url(self) -> str:
        return self.srv.url

    def pause(self) -> None:
        self.srv.pause() if self.kind == "redis" else self.srv.pause_master()

    def resume(self) -> None:
        self.srv.resume() if self.kind == "redis" else self.srv.resume_master()

    def kill(self) -> None:
        self.srv.kill() if self.kind == "redis" else self.srv.kill_master()

    def restart(self) -> None:
        if self.kind == "redis":
            self.srv.start()
        else:
            self.srv.start_master()
            self.srv.wait_capacity()

    def num_keys(self) -> int:
        if self.kind == "redis":
            return int(self.srv.client().dbsize())
        url = f"http://{HOST}:{self.srv.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return next(int(float(line.split()[1])) for line in text.splitlines()
                    if line.startswith("master_key_count "))

    def close(self) -> None:
        self.srv.close()
