"""A scheduler half against a real worker process (``test_vllm_rank_loss.Group``), fresh
for each test; a module may override ``group`` (the rank-loss tests start with a document
saved)."""

from __future__ import annotations

from collections.abc import Iterator

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
