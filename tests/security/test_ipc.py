"""ipc://: sockets live in a 0700 directory of this user; anything else is refused, and
another user can connect neither through the file system nor past the ZAP uid check."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.waiting import wait_exited
from zkv import protocol as P
from zkv import security
from zkv.errors import ConfigError
from zkv.scheduler.dispatcher import Dispatcher

FP = "layout-fp"
NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")


def test_socket_directory_must_be_private(folder: str) -> None:
    os.chmod(folder, 0o755)
    with pytest.raises(ConfigError, match="mode 755; it must be 700"):
        Dispatcher(f"ipc://{folder}/pub", f"ipc://{folder}/pull", 1, FP)
    for mode in (0o750, 0o710, 0o701):  # the group's bits count as much as the others'
        os.chmod(folder, mode)
        with pytest.raises(ConfigError, match=f"mode {mode:o}; it must be 700"):
            security.check_private_dir(folder)
    os.chmod(folder, 0o700)
    link = folder + "-link"
    os.symlink(folder, link)
    try:
        with pytest.raises(ConfigError, match="not a directory"):
            Dispatcher(f"ipc://{link}/pub", f"ipc://{link}/pull", 1, FP)
    finally:
        os.unlink(link)
    with pytest.raises(ConfigError, match="abstract"):
        Dispatcher("ipc://@zkv-abstract", f"ipc://{folder}/pull", 1, FP)
    Dispatcher(f"ipc://{folder}/pub", f"ipc://{folder}/pull", 1, FP).close(shutdown=False)


def test_directory_of_another_owner_is_refused(folder: str) -> None:
    if os.geteuid() == 0:
        os.chown(folder, NOBODY, NOBODY)
        target = folder
    else:
        target = "/"  # owned by root, not by this user
    with pytest.raises(ConfigError, match=r"owned by uid \d+, not by this user"):
        security.check_private_dir(target)
    with pytest.raises(ConfigError, match="owned by uid"):
        Dispatcher(f"ipc://{target}/zkv-pub", f"ipc://{target}/zkv-pull", 1, FP)


def test_user_root_is_refused_when_someone_else_made_it(tmp_path: Path) -> None:
    root = tmp_path / f"zkv-{os.geteuid()}"
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)  # made by someone who wants to watch our sockets
    with pytest.raises(ConfigError, match="mode 777"):
        security.make_run_dir(str(tmp_path))
    os.chmod(root, 0o700)
    run = security.make_run_dir(str(tmp_path))
    assert stat.S_IMODE(os.stat(run).st_mode) == 0o700


def _as_nobody(body: Any) -> int:
    """Run ``body()`` in a forked child that switched to uid/gid nobody; its exit code
    (0: body returned True). Fork, not exec: nobody may not read this interpreter's files."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 3
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            code = 0 if body() else 1
        finally:
            os._exit(code)
    try:
        wait_exited([pid], 30, "the child as nobody")
    except AssertionError:
        os.kill(pid, 9)
        raise
    finally:
        _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@needs_root
def test_stale_run_dirs_are_those_whose_owner_is_gone(tmp_path: Path) -> None:
    """``clean_stale_runs`` removes a run directory whose owner process is gone, also when
    its pid names another process now (a different start time: the pid was reused after
    a SIGKILLed launcher); it keeps a live owner's, and never touches a directory it did
    not make (another name: an engine's own, say), whatever its owner file says."""
    base = str(tmp_path)
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True, timeout=60)
    dead, ppid = int(child.stdout), os.getppid()  # (reaped: gone)

    def run_dir(owner: str, name: str | None = None) -> str:
        path = security.make_run_dir(base)
        if name is not None:
            os.rename(path, os.path.join(os.path.dirname(path), name))
            path = os.path.join(os.path.dirname(path), name)
        Path(path, "owner").write_text(owner)
        return path

    mine = security.make_run_dir(base)
    live = run_dir(f"{ppid} {security._start_time(ppid)}\n")
    gone = run_dir(f"{dead} 1\n")
    reused = run_dir(f"{ppid} 1\n")
    other = run_dir(f"{dead} 1\n", name="engine-1234")
    starting = run_dir("")  # no owner yet: one starting now, kept ...
    failed = run_dir("")  # ... but not one that no process claimed for an hour
    for path in (starting, failed):
        os.unlink(os.path.join(path, "owner"))
    old = time.time() - security.UNCLAIMED_STALE_S - 60
    os.utime(failed, (old, old))
    assert sorted(security.clean_stale_runs(base)) == sorted([gone, reused, failed])
    assert [os.path.isdir(p) for p in (mine, live, gone, reused, other, starting, failed)] \
        == [True, True, False, False, True, True, False]


def test_another_user_cannot_reach_the_socket_files(folder: str) -> None:
    d = Dispatcher(f"ipc://{folder}/pub", f"ipc://{folder}/pull", 1, FP)
    try:
        def connect() -> bool:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(f"{folder}/pull")
            except PermissionError:
                return True  # EACCES: the 0700 directory stops it
            finally:
                s.close()
            return False

        assert _as_nobody(connect) == 0
    finally:
        d.close(shutdown=False)


@needs_root
def test_zap_refuses_another_user_even_where_the_directory_lets_it_in(folder: str) -> None:
    """Defence in depth: with the directory and socket opened up after the bind (a bad
    umask, a chmod by mistake), the kernel's peer uid still makes ZAP refuse the peer."""
    d = Dispatcher(f"ipc://{folder}/pub", f"ipc://{folder}/pull", 1, FP)
    try:
        os.chmod(folder, 0o711)
        for name in ("pub", "pull"):
            os.chmod(os.path.join(folder, name), 0o777)

        def join_as_rank_0() -> bool:
            ctx: zmq.Context[Any] = zmq.Context()
            push = ctx.socket(zmq.PUSH)
            sub = ctx.socket(zmq.SUB)
            try:
                sub.connect(f"ipc://{folder}/pub")
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.setsockopt(zmq.SUBSCRIBE, P.ready_topic(0, os.getpid()))
                push.connect(f"ipc://{folder}/pull")
                try:
                    push.send_multipart(P.encode(P.Hello(0, os.getpid(), FP)), zmq.NOBLOCK)
                except zmq.Again:
                    pass
                return sub.poll(1000) == 0  # nothing ever arrives
            finally:
                push.close(0)
                sub.close(0)
                ctx.term()

        assert _as_nobody(join_as_rank_0) == 0
        deadline = time.monotonic() + 10
        while d.refusals()["unauthenticated"] < 2:
            assert time.monotonic() < deadline, d.refusals()
            d.poll(0.05)
        with pytest.raises(TimeoutError, match="rank 0: no hello"):
            d.wait_for_ranks(0.2)
        assert d.num_received == 0
    finally:
        d.close(shutdown=False)


def test_a_rank_makes_its_socket_directory_when_it_is_not_there_yet(folder: str) -> None:
    """A rank started before its scheduler, its socket directory not made yet (in a shared
    parent like /tmp): the rank makes it (0700, its own) at once, so no one else can make
    it first, and the scheduler that binds there later is joined. (Before, a missing
    directory was not checked at all: another user could make it, bind a scheduler there
    and have the rank run its batches, or stop on its Shutdown.)"""
    import zkv.kernels as kernels
    from zkv.config import CacheLayout
    from zkv.worker import Sidecar

    layout = CacheLayout(num_layers=1, kv_heads=1, block_size=4, head_dim=8, dtype="float16",
                         num_device_blocks=4, num_host_blocks=4, world_size=1)
    shared = os.path.join(folder, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o1777)  # (sticky and open to all, like /tmp)
    run = os.path.join(shared, "run")
    pub, pull = f"ipc://{run}/pub", f"ipc://{run}/pull"
    kv = kernels.get_backend("cpu").allocate_device_cache(layout)
    sc = Sidecar(kv, layout=layout, rank=0, pub_endpoint=pub, pull_endpoint=pull,
                 backend="cpu", heartbeat_interval_s=0.05)
    try:
        made = False
        try:
            os.mkdir(run, 0o755)  # another user's try (refused by the checks if it were in time)
            made = True
        except FileExistsError:
            pass
        assert not made, "the rank's socket directory was left for anyone to make"
        st = os.lstat(run)
        assert (stat.S_ISDIR(st.st_mode), st.st_uid, stat.S_IMODE(st.st_mode)) == (
            True, os.geteuid(), 0o700)
        d = Dispatcher(pub, pull, 1, layout)
        try:
            d.wait_for_ranks(10)
        finally:
            d.close()
    finally:
        sc.close()
