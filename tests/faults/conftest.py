"""Fixtures of the fault tests: a short private ipc directory, a ZeroMQ context."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from tests.worker.helpers import short_ipc_dir


@pytest.fixture
def folder() -> Iterator[str]:
    with short_ipc_dir() as d:
        yield d


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.term()
