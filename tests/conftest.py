"""Shared fixtures: real L3 servers (see tests/servers.py), started once per session and
always stopped. A test that kills, pauses or restarts a server starts its own instead."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.servers import MooncakeServer, RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(str(tmp_path_factory.mktemp("redis"))) as srv:
        yield srv


@pytest.fixture(scope="session")
def mooncake_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeServer]:
    with MooncakeServer(str(tmp_path_factory.mktemp("mooncake"))) as srv:
        yield srv
