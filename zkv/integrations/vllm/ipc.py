"""Where an engine's zkv sockets live: ``{tmp}/zkv-{uid}/{engine_id}`` (mode 0700, this
user's only), one directory per engine, shared by its scheduler half (which binds and owns
it) and its worker halves (which connect)::

    worker halves: ipc_endpoints(create=True)      (vLLM registers caches first)
    scheduler half: ipc_endpoints(create=True) ─► claim_engine_dir: owner file = its pid,
                    and the directories of engines whose scheduler was killed are removed;
                    a directory a live engine owns stops this one (the same engine_id)
    shutdown: the scheduler half removes its directory

The directory's name is the engine_id when it fits (40 characters: a socket path has a
length limit), else its first 27 characters and a digest of the whole, so engine_ids that
differ only past the 40th character (vLLM's ``<uuid>_dp1`` and ``<uuid>_dp10``) do not
share sockets.

No vLLM import here (tests use it without an engine).
"""

from __future__ import annotations

import hashlib
import os
import tempfile

from zkv import log as zlog
from zkv import security
from zkv.errors import ConfigError
from zkv.integrations.vllm import events as E

_NAME_CHARS = 40  # {tmp}/zkv-{uid}/{name}/pull stays well inside a socket path's limit
_SOCKET_PATH_MAX = 107  # sun_path's 108 bytes, less the NUL (Linux)


def ipc_endpoints(engine_id: str, create: bool) -> tuple[str, str, str]:
    """(pub, pull, directory) of an engine: ``{tmp}/zkv-{uid}/{engine_id}``, mode 0700."""
    base = os.path.join(tempfile.gettempdir(), f"zkv-{os.getuid()}")
    d = os.path.join(base, engine_dir_name(engine_id))
    longest = len(os.fsencode(os.path.join(d, "pull")))
    if longest > _SOCKET_PATH_MAX:  # (the bind said "File name too long", nothing more)
        raise ConfigError(f"zkv: socket path {d}/pull is {longest} bytes, past the "
                          f"{_SOCKET_PATH_MAX} a Unix socket takes: set TMPDIR to a shorter "
                          f"directory (it is {tempfile.gettempdir()})")
    if create:
        for path in (base, d):  # (a symlink, even to a private directory of ours: refused)
            try:
                security.make_private_dir(path, what="zkv: socket directory")
            except ConfigError as e:
                raise ConfigError(f"{e} (TMPDIR names where it is made)") from None
    return f"ipc://{d}/pub", f"ipc://{d}/pull", d


def engine_dir_name(engine_id: str) -> str:
    """The socket directory's name for ``engine_id`` (unique per engine_id, <= 40 bytes,
    never ``""``, ``.`` or ``..``: those would name the user's socket root or its parent).
    Bytes, as the socket path's limit counts them: a 39-character CJK id (117 bytes) was
    kept whole, and the engine refused with advice to shorten TMPDIR."""
    name = engine_id.replace("/", "_").replace("\0", "_")
    raw = name.encode("utf-8", "surrogatepass")
    if len(raw) <= _NAME_CHARS and name.strip("."):
        return name
    digest = hashlib.blake2b(engine_id.encode("utf-8", "surrogatepass"),
                             digest_size=6).hexdigest()
    head = raw[:_NAME_CHARS - len(digest) - 1].decode("utf-8", "ignore")  # (whole characters)
    return f"{head}-{digest}"


def claim_engine_dir(path: str, engine_id: str | None = None) -> list[str]:
    """The scheduler half owns its engine's socket directory (it removes it at shutdown);
    the directories of engines whose scheduler process was killed are removed here, at the
    next engine's start. Returns what was removed. A directory a live engine owns is the
    same ``engine_id`` on this machine twice: :class:`ConfigError` (the engine stops at
    start), where before the second engine's ranks never joined and it died two minutes
    later on a timeout."""
    pid = security.live_owner(path)
    if pid is not None:
        raise ConfigError(
            f"zkv: another engine (pid {pid}) on this machine uses engine_id "
            f"{os.path.basename(path)!r}: give each engine its own "
            f"kv_transfer_config.engine_id, or leave it unset")
    security.claim_dir(path)
    removed = security.clean_stale_runs(tempfile.gettempdir(), names=None)
    if removed:
        zlog.get_logger("connector", role="scheduler", engine_id=engine_id).info(
            E.STALE_DIRS_REMOVED, paths=removed)
    return removed
