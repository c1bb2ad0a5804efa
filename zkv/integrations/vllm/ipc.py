"""Where an engine's zkv sockets live: ``{tmp}/zkv-{uid}/{engine_id}`` (mode 0700, this
user's only), one directory per engine, shared by its scheduler half (which binds and owns
it) and its worker halves (which connect)::

    worker halves: ipc_endpoints(create=True)      (vLLM registers caches first)
    scheduler half: ipc_endpoints(create=True) ─► claim_engine_dir: owner file = its pid,
                    and the directories of engines whose scheduler was killed are removed
    shutdown: the scheduler half removes its directory

No vLLM import here (tests use it without an engine).
"""

from __future__ import annotations

import os
import stat
import tempfile

from zkv import log as zlog
from zkv import security
from zkv.errors import ConfigError


def ipc_endpoints(engine_id: str, create: bool) -> tuple[str, str, str]:
    """(pub, pull, directory) of an engine: ``{tmp}/zkv-{uid}/{engine_id}``, mode 0700."""
    base = os.path.join(tempfile.gettempdir(), f"zkv-{os.getuid()}")
    d = os.path.join(base, engine_id.replace("/", "_")[:40])
    if create:
        for path in (base, d):
            os.makedirs(path, mode=0o700, exist_ok=True)
            st = os.stat(path)
            if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
                raise ConfigError(f"zkv: {path} must be owned by uid {os.getuid()} with mode "
                                  f"0700 (it is uid {st.st_uid}, mode "
                                  f"{oct(stat.S_IMODE(st.st_mode))})")
    return f"ipc://{d}/pub", f"ipc://{d}/pull", d


def claim_engine_dir(path: str) -> list[str]:
    """The scheduler half owns its engine's socket directory (it removes it at shutdown);
    the directories of engines whose scheduler process was killed are removed here, at the
    next engine's start. Returns what was removed."""
    security.claim_dir(path)
    removed = security.clean_stale_runs(tempfile.gettempdir(), names=None)
    if removed:
        zlog.get_logger("connector").info("connector.stale_dirs_removed", paths=removed)
    return removed
