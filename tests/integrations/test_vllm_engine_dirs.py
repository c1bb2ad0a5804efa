"""The connector's socket directories (``{tmp}/zkv-{uid}/{engine_id}``): the scheduler
half owns its engine's and removes it at shutdown; one left by an engine whose scheduler
process was killed is removed when the next engine starts, and nothing else is."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from zkv import security
from zkv.errors import ConfigError
from zkv.integrations.vllm.ipc import claim_engine_dir, engine_dir_name, ipc_endpoints

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
    # its workers made it an hour ago and its scheduler half failed before it claimed it
    # (it was kept for good: only an owner file that names a dead process let it go)
    failed = ipc_endpoints("engine-failed-start", create=True)[2]
    old = time.time() - security.UNCLAIMED_STALE_S - 60
    os.utime(failed, (old, old))
    with _owner(dead) as killed:
        killed.kill()  # SIGKILL: its shutdown never ran
    with _owner(live) as running:
        ours = ipc_endpoints("engine-new", create=True)[2]
        assert sorted(claim_engine_dir(ours)) == sorted([dead, failed])
        assert not os.path.exists(dead) and not os.path.exists(failed)
        assert all(os.path.isdir(d) for d in (live, unclaimed, ours))
        assert claim_engine_dir(ours) == []  # ours is claimed by this (live) process
        assert running.stdin is not None
        running.stdin.close()  # (leaving the block waits for it)


def test_an_engine_id_a_live_engine_owns_stops_the_engine_at_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two engines on one machine with the same ``kv_transfer_config.engine_id`` (a fixed
    id copied into both configs) would share one socket directory: the second's ranks
    joined the first's sockets (refused there), and it died two minutes later on a join
    timeout. Now its start stops with one line naming the other engine."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    d = ipc_endpoints("fixed-id", create=True)[2]
    with _owner(d) as first:
        with pytest.raises(ConfigError, match=rf"another engine \(pid {first.pid}\) on this "
                                              r"machine uses engine_id 'fixed-id'"):
            claim_engine_dir(d)
        assert os.path.isdir(d)  # the first engine's sockets stay
        assert first.stdin is not None
        first.stdin.close()
    assert claim_engine_dir(d) == []  # its owner gone: the next engine takes it
    assert claim_engine_dir(d) == []  # and claims again in its own process


def test_engine_ids_that_differ_past_forty_characters_get_their_own_directories() -> None:
    """vLLM names data-parallel engines ``<uuid>_dp<rank>``: 36 + 4 characters up to rank
    9, 41 from rank 10, where the old 40-character cut gave ``_dp10`` rank 1's sockets."""
    uid = "0f8fad5b-d9cb-469f-a165-70867728950e"
    names = [engine_dir_name(f"{uid}_dp{r}") for r in range(16)]
    assert len(set(names)) == 16 and all(len(n) <= 40 for n in names)
    assert names[1] == f"{uid}_dp1"  # ids that fit keep their name
    long = [engine_dir_name(f"prefill-node-{i}-" + "x" * 40) for i in range(3)]
    assert len(set(long)) == 3 and all(len(n) == 40 for n in long)
    assert engine_dir_name("a/b") == "a_b"


def test_an_engine_id_of_multibyte_characters_is_measured_in_bytes() -> None:
    """The socket path's limit counts bytes: a 39-character CJK id (117 bytes) was kept
    whole and the engine refused ("set TMPDIR to a shorter directory", which cannot fix
    it). Now a name of at most 40 bytes, cut at a whole character, unique per id."""
    ids = ["预填充节点" * 7 + "甲" * 4, "预填充节点" * 7 + "乙" * 4]
    names = [engine_dir_name(i) for i in ids]
    assert len(set(names)) == 2 and all(len(n.encode()) <= 40 for n in names), names
    assert names[0].startswith("预填充节点")
    assert engine_dir_name("预填") == "预填"  # (6 bytes: kept)


@pytest.mark.parametrize("engine_id", ["", ".", "..", "...", "a\0b"])
def test_an_engine_id_never_names_the_socket_root_or_above(engine_id: str) -> None:
    name = engine_dir_name(engine_id)
    assert name.strip(".") and "/" not in name and "\0" not in name and len(name) <= 40
    assert name not in (engine_dir_name(other) for other in ("", ".", "..", "...", "a\0b")
                        if other != engine_id)


def test_a_socket_root_that_is_a_symlink_is_refused(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``{tmp}/zkv-{uid}`` has a name anyone can guess: a symlink planted there, even to a
    private directory of ours (``~/.ssh``), must not put an engine's sockets in it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    target = tmp_path / "private"
    target.mkdir(mode=0o700)
    os.symlink(target, tmp_path / f"zkv-{os.getuid()}")
    with pytest.raises(ConfigError, match=r"^zkv: socket directory .*/zkv-\d+ is not a "
                                          r"directory \(a symlink or a file\) \(TMPDIR names "
                                          r"where it is made\)$"):
        ipc_endpoints("engine", create=True)
    assert os.listdir(target) == []


def test_a_tmpdir_too_long_for_a_socket_path_is_one_line_that_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A socket path has a length limit: a long ``TMPDIR`` stopped the engine with "cannot
    listen on ipc://...: File name too long" and no word of TMPDIR."""
    long = tmp_path / ("d" * 60)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    with pytest.raises(ConfigError, match=r"^zkv: socket path .*/pull is \d+ bytes, past the "
                                          r"107 a Unix socket takes: set TMPDIR to a shorter "
                                          r"directory \(it is .*d{60}\)$"):
        ipc_endpoints("0f8fad5b-d9cb-469f-a165-70867728950e", create=True)
    assert os.listdir(long) == []  # nothing made
