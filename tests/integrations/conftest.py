"""A scheduler half against a real worker process (``test_vllm_rank_loss.Group``), fresh
for each test; a module may override ``group`` (the rank-loss tests start with a document
saved)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.test_vllm_rank_loss import Group
from tests.worker.helpers import short_ipc_dir


@pytest.fixture
def group() -> Iterator[Group]:
    with short_ipc_dir() as folder:
        g = Group(folder)
        try:
            yield g
        finally:
            g.close()


@contextlib.contextmanager
def two_engines_on_one_store(tmp_path: Path, second: dict[str, Any]
                             ) -> Iterator[tuple[Group, Group]]:
    """Two scheduler halves, each with its worker process, on one ``file://`` store: a
    writer with the defaults and a second one with the ``second`` extra config."""
    url = f"file://{tmp_path / 'l3'}"
    with short_ipc_dir() as one, short_ipc_dir() as two:
        first = Group(one, store_url=url)
        try:
            other = Group(two, store_url=url, extra=second)
            try:
                yield first, other
            finally:
                other.close()
        finally:
            first.close()
