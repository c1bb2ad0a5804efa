"""A fixture over every backend, with raw access to what a store holds (to damage it), and
the RPCs a Mooncake master answered."""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.servers import HOST, MooncakeServer
from zkv.storage import Store, StoreStats, file_url, open_store
from zkv.storage.local import LocalDirStore

BACKENDS = ("file", "redis", "rediss", "mooncake", "mooncake-split")


class Backend:
    """One backend's URL, the stores a test opened on it, and raw get/set of a stored
    value by key name (bypassing every check)."""

    def __init__(self, kind: str, url: str, server: Any,
                 shared: dict[tuple[str, str], Store] | None = None) -> None:
        self.kind = kind
        self.url = url
        self.server = server
        # Tests never see each other's blocks: a namespace per test, or (Mooncake, whose
        # clients take ~1 s to close) one per session with keys salted per test.
        self.namespace = SESSION_NS if shared is not None else f"t{uuid.uuid4().hex[:12]}"
        self.stores: list[Store] = []
        self._shared = shared
        self._redis = server.client() if kind.startswith("redis") else None

    def open(self, namespace: str | None = None, **kw: Any) -> Store:
        ns = namespace or self.namespace
        if self._shared is not None:
            store = self._shared.get((self.url, ns))
            if store is None:
                store = self._shared[self.url, ns] = open_store(self.url, ns, **kw)
            store.stats = StoreStats()
            return store
        store = open_store(self.url, ns, **kw)
        self.stores.append(store)
        return store

    def raw_get(self, store: Store, key: bytes) -> bytes | None:
        if isinstance(store, LocalDirStore):
            try:
                with open(store.path(key), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None
        if self._redis is not None:
            return self._redis.get(store.name(key))  # type: ignore[no-any-return]
        value = store._client.get(store.name(key))  # type: ignore[attr-defined]
        return bytes(value) or None

    def raw_set(self, store: Store, key: bytes, value: bytes) -> None:
        if isinstance(store, LocalDirStore):
            with open(store.path(key), "wb") as f:
                f.write(value)
            return
        if self._redis is not None:
            self._redis.set(store.name(key), value)
            return
        client = store._client  # type: ignore[attr-defined]
        client.remove(store.name(key), True)
        assert client.put(store.name(key), value) == 0

    def close(self) -> None:
        for s in self.stores:
            s.close()
        if self._redis is not None:
            self._redis.close()


SESSION_NS = f"t{uuid.uuid4().hex[:12]}"


def master_replica_queries(mc: MooncakeServer) -> int:
    """Replica-list RPCs the master has answered (its metrics): one per ``get_size``, one
    per batched query (a batched get's own lookup among them)."""
    url = f"http://{HOST}:{mc.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    names = ("master_get_replica_list_requests_total",
             "master_batch_get_replica_list_requests_total")
    return sum(int(float(line.split()[1])) for line in text.splitlines()
               if line.split(" ", 1)[0] in names)


@pytest.fixture(scope="session")
def mooncake_stores() -> Iterator[dict[tuple[str, str], Store]]:
    """Mooncake clients by (URL, namespace), shared by the session's tests."""
    stores: dict[tuple[str, str], Store] = {}
    try:
        yield stores
    finally:
        for s in stores.values():
            s.close()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Backend]:
    kind = request.param
    server = shared = None
    if kind == "file":
        url = file_url(tmp_path / "l3")
    else:
        server = request.getfixturevalue(f"{kind.split('-')[0]}_server")
        url = server.url + ("?header=split" if kind == "mooncake-split" else "")
    if kind.startswith("mooncake"):
        shared = request.getfixturevalue("mooncake_stores")
    b = Backend(kind, url, server, shared)
    try:
        yield b
    finally:
        b.close()
