"""The connector's socket directories (``{tmp}/zkv-{uid}/{engine_id}``): the scheduler
half owns its engine's and removes it at shutdown; one left by an engine whose scheduler
process was killed is removed when the next engine starts, and nothing else is."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


from zkv.integrations.vllm.ipc import claim_engine_dir, ipc_endpoints

ROOT = Path(__file__).resolve().parents[2]
CLAIM = "import sys; from zkv import security; security.claim_dir(sys.argv[1]); " \
        "sys.stdout.write('claimed\\n'); sys.stdout.flush(); sys.stdin.read()"


def _owner(path: str) -> subprocess.Popen[str]:
    """A process that claims ``path`` and lives until its stdin closes."""
    p = subprocess.Popen([sys.executable, "-c", CLAIM, path], cwd=ROOT, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == "claimed\n"
    return p


def test_a_killed_engines_directory_goes_at_the_next_start(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = ipc_endpoints("engine-killed", create=True)[2]
    live = ipc_endpoints("engine-running", create=True)[2]
    unclaimed = ipc_endpoints("engine-starting", create=True)[2]  # its workers made it
    with _owner(dead) as killed:
        killed.kill()  # SIGKILL: its shutdown never ran
    with _owner(live) as running:
        ours = ipc_endpoints("engine-new", create=True)[2]
        assert claim_engine_dir(ours) == [dead]
        assert not os.path.exists(dead)
        assert all(os.path.isdir(d) for d in (live, unclaimed, ours))
        assert claim_engine_dir(ours) == []  # ours is claimed by this (live) process
        assert running.stdin is not None
        running.stdin.close()  # (leaving the block waits for it)
