"""Shared fixtures: ``folder`` (a short private ipc directory), ``stack`` (an ExitStack
closed after the test), real L3 servers (see tests/servers.py), started once per session and
always stopped. A test that kills, pauses or restarts a server starts its own instead.

A failing test's report gets the stderr of the worker processes it ran (WorkerGroup), so a
failure in CI says what the ranks saw."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
import structlog

from tests.integration.vllm_server import vllm_sockets_here
from tests.servers import MooncakeServer, RedisServer, make_tls
from tests.worker.helpers import STDERR_TAILS, short_ipc_dir
from zkv import log as zlog

# Everything the tests talk to is on loopback (servers, metrics, vllm serve): a proxy that
# CI sets (http_proxy) must not get those requests (urllib sends 127.0.0.1 through it
# unless no_proxy names it). Children inherit it.
for _var in ("no_proxy", "NO_PROXY"):
    os.environ[_var] = ",".join(filter(None, [os.environ.get(_var), "127.0.0.1,localhost,::1"]))


@pytest.fixture
def folder() -> Iterator[str]:
    """A short private directory for ipc:// sockets, removed after the test."""
    with short_ipc_dir() as d:
        yield d


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    """Cleanups a test registers (``stack.callback``), run after it, last first."""
    with ExitStack() as s:
        yield s


_FAILED = pytest.StashKey[pytest.TestReport]()

# The session's vLLM engines put their ipc sockets in one directory, removed at its end.
_SESSION = ExitStack()
_SESSION.enter_context(vllm_sockets_here())


def pytest_unconfigure(config: pytest.Config) -> None:
    _SESSION.close()


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, vllm: ~600k objects) is moved out of the garbage
    collector's reach: a full collection scanned it all, 0.4-0.6 s during which this
    process's threads stood still, rank heartbeats among them, and the rigs that judge a
    rank lost after 0.3 s lost one (5 of 10 runs with one collection forced mid-test)."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    STDERR_TAILS.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report gets the ranks' stderr: kept by a WorkerGroup closed in the
    failing phase (ranks that never joined: setup) or later, by its fixture's teardown."""
    outcome = yield
    report = outcome.get_result()
    failed = item.stash.get(_FAILED, None)
    if failed is None and report.failed:
        item.stash[_FAILED] = failed = report
    if failed is not None:
        for title, text in STDERR_TAILS:
            failed.sections.append((title, text))
        STDERR_TAILS.clear()


@pytest.fixture(autouse=True)
def _zkv_logging() -> None:
    """Unless a test configured it, zkv's logging is structlog's default (every level, so
    ``capture_logs`` sees debug events) but written as an entry point writes it: JSON
    lines to the current stderr, which pytest captures per test. structlog's own default
    prints to the stdout pytest had at startup, past its capture: after a test reset
    structlog, in-process workers printed debug lines into the test report."""
    if not structlog.is_configured():
        zlog.configure("tests", level="debug")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(str(tmp_path_factory.mktemp("redis"))) as srv:
        yield srv


@pytest.fixture(scope="session")
def rediss_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """redis-server over TLS only, with an ACL user (the default user off)."""
    folder = str(tmp_path_factory.mktemp("rediss"))
    with RedisServer(folder, tls=make_tls(os.path.join(folder, "tls")),
                     user=("zkv", "s3cret")) as srv:
        yield srv


@pytest.fixture(scope="session")
def mooncake_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeServer]:
    with MooncakeServer(str(tmp_path_factory.mktemp("mooncake"))) as srv:
        yield srv
