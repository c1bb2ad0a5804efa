"""What a zkvrun group started outside its process groups, found and killed at its end.

Every child runs in its own session, and zkvrun kills a child's whole group when the
child is reaped. A process the child started in another session (``setsid``, a daemon's
double fork) is in no group of zkvrun's and outlived the run, holding what it held (a
GPU's memory, a port) into the next run or the next restart of the group. Each child is
given a token in its environment (``ZKV_GROUP``, new for every start of the group), which
its descendants inherit; at the group's end every process of this user that still carries
it is SIGKILLed::

    start of the group ── token = "<launcher pid>-<attempt>-<random>" ─► every child's env
    group ends (all children reaped, their groups SIGKILLed)
        └─ /proc/*/environ holding ZKV_GROUP=<token> ─► SIGKILL, said once (pid, command)

A process that cleared its environment is not found (nor one of another user, whose
environment this user cannot read). Linux only (``/proc``); elsewhere nothing is found.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal

ENV = "ZKV_GROUP"


def new_token(attempt: int) -> str:
    """A token unique to one start of one launcher's group."""
    return f"{os.getpid()}-{attempt}-{secrets.token_hex(4)}"


def find(token: str) -> list[int]:
    """Pids of the live processes (this one aside) whose environment holds ``token``."""
    want = f"{ENV}={token}".encode()
    me = os.getpid()
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    out = []
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()  # (empty for a zombie: it holds nothing any more)
        except OSError:  # gone, or another user's
            continue
        if want in env.split(b"\0"):
            out.append(int(name))
    return out


def command(pid: int) -> str:
    """A process's command line, for the line that says it was killed ("" if gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return " ".join(a.decode(errors="replace") for a in f.read().split(b"\0") if a)
    except OSError:
        return ""


def kill(token: str) -> list[tuple[int, str]]:
    """SIGKILL every live process holding ``token``; ``(pid, command)`` of each. Two
    passes: one may have forked while the first ran."""
    killed: dict[int, str] = {}
    for _ in range(2):
        pids = [pid for pid in find(token) if pid not in killed]  # (one not yet dead: once)
        for pid in pids:
            cmd = command(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed[pid] = cmd
        if not pids:
            break
    return list(killed.items())
