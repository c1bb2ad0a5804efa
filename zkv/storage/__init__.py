"""L3 storage: one interface, three backends, chosen by URL.

::

    zkv/storage/base.py             Store interface, key naming, the 64-byte block header and
                                    its checks, StoreStats counters, the reconnect breaker
    zkv/storage/local.py            file:///path          LocalDirStore (embedded default)
    zkv/storage/localfs.py          its file-system calls (private folders, free space, room)
    zkv/storage/namespaces.py       its dead namespaces (unused for keep_days), removed at open
    zkv/storage/redis_store.py      redis://HOST:PORT/DB  RedisStore    (pip install 'zkv[redis]')
                                    (rediss://... over TLS)
    zkv/storage/mooncake_store.py   mooncake://HOST:PORT  MooncakeStore
                                    (pip install 'zkv[mooncake]')
    zkv/storage/url.py              open_store(url, namespace, writers=1)
    zkv/storage/query.py            leading_present(store, hashes, world_size), StorageQuery

For an engine integration::

    from zkv.storage import open_store, leading_present, pack_key

    store = open_store("redis://127.0.0.1:6379/0", layout.fingerprint())   # ConfigError if bad
    n = leading_present(store, block_hashes, layout.world_size)   # scheduler: one round trip,
                                                                  # 0 (and an event) on error
    ok = store.get_many_into([pack_key(h, rank) for h in hs], host_block_views)   # worker
    ok = store.put_many([pack_key(h, rank) for h in hs], host_block_views)

A block that fails its header or checksum is never served: it is a miss, deleted, and
counted (``store.stats``). A server that is down (at start or later) makes calls fail
fast with :class:`~zkv.errors.StorageError` (``leading_present`` returns 0), and the
store reconnects by itself when the server is back.
"""

from zkv.storage.base import (
    DIGEST_SIZE,
    HEADER_SIZE,
    KEY_SIZE,
    Store,
    StoreStats,
    key_name,
    pack_key,
)
from zkv.storage.local import LocalDirStore
from zkv.storage.query import StorageQuery, leading_present
from zkv.storage.url import file_url, open_store

__all__ = [
    "DIGEST_SIZE", "HEADER_SIZE", "KEY_SIZE", "LocalDirStore", "StorageQuery", "Store",
    "StoreStats", "file_url", "key_name", "leading_present", "open_store", "pack_key",
]
