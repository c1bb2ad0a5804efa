"""L3 on Mooncake Store: ``mooncake://MASTER_HOST:PORT``.

The master keeps metadata; the bytes live in memory segments that clients mount
(``segment_bytes``; 0 here by default: the memory comes from dedicated holders such as
``mooncake_client --global_segment_size=...`` next to the master, so blocks outlive any
one serving instance). Every client talks P2PHANDSHAKE over TCP; on a loopback master the
transfer engine advertises 127.0.0.1 (``MC_TCP_BIND_ADDRESS``).

How the header travels: in the same object as the payload, so a block is written,
evicted and removed whole (a separate header key could be evicted on its own, and costs
a second object per block: measured slower than both forms below). Two ways to build the
object ``header (64) ‖ payload``, chosen per block size (``header="auto"``)::

    inline (TCP, blocks <= 256 KiB): the I/O thread stages header ‖ payload in its own
        registered area (8 MiB) and moves one buffer per object: batch_put_from /
        batch_get_into, then verify and copy the payload into the host block
    split  (RDMA, or bigger blocks):  [header slot, host block] per object:
        batch_put_from_multi_buffers / batch_get_into_multi_buffers, zero copy

Why: over TCP the bytes are copied through socket buffers anyway, and a second buffer
per object costs the transfer engine a second slice. Measured here with 32 KiB blocks
(bench/storage.py and its "mooncake, split header" row): split took 1.2-1.7x (up to ~3x
on a loaded machine) the time of payload-only objects, inline about 1.0x; from 128 KiB
up the two are equal. Zero copy is what RDMA needs (both buffers registered with
``register_buffer``), so RDMA always splits. Both forms store identical objects: clients
in either mode read each other's blocks.

Capacity: the master's allocator rounds each object up to a size class an eighth of a
power of two apart, and KV blocks are powers of two, so the 64-byte header puts each one in
the next class: a 32 MiB segment held 910 blocks of 32 KiB (+ header) where 1,024 objects
of exactly 32 KiB fit, and 227 of 128 KiB where 256 fit (12.5% of the store). Any byte
added does the same; payload-only objects would drop the checksum and the key check that
every get makes (see base.py). Not done: the header stays.

Return codes (ints): a size = read OK; -704 not found (a normal miss, also after exists);
-600 the object is larger than the block (refused); -800 on a get may be a shorter object
(its stored size decides: refused) or a transfer failure; -706 lease (refused blocks are
removed with ``force=True``, at the end of the get call, in one batch, after one batched
read again: a good copy saved meanwhile stays, see ``_remove_refused``); -707 the lease
ran out during the read (a master run with a lease shorter than a read: that block
misses, with a rate-limited line, and the store stays up; it was taken for an outage,
and every get failed whole); -200 no space
(the put is declined and counted); -900 / -901 RPC failure or timeout: the link goes
down (see base.py). The stored sizes of a call's failed blocks come from one batched
query to the master (``_stored_sizes``), not a ``get_size`` round trip each. ``put`` on an
existing key keeps the stored value and returns 0 (blocks are content-addressed: same
key, same bytes), so there is no ``upsert`` and a batch can be sent again whole.

A restarted master. The client keeps a pool of RPC connections, one per thread that
called at once. After the master restarts, each pooled connection fails once with -900
(at once: "End of file") before the pool opens a new one, and ``health_check`` does
not touch them. So a -900 is taken as "maybe stale": the stale connections are used up
on a cheap existence query (``_drop_stale``: after a port probe, at most ``MAX_STALE``
of them, each failing within ``STALE_S``, all within ``timeout_s``) and the call is sent
once more; only then does the link go down. A reconnect
drops them the same way before it calls the link up. Measured before this: with 8
pooled connections, up to 8 calls in a row failed after the master came back, each
taking the link down again.

Process-wide settings (environment, first client wins): ``MC_RPC_TIMEOUT_MS`` (from
``timeout_s``: a stopped master costs one call this long, not 30 s),
``MC_TCP_STATUS_TIMEOUT_SEC`` and ``MC_TCP_PROGRESS_TIMEOUT_SEC`` (``timeout_s`` rounded up
to whole seconds: a holder that stopped answering costs a get or a put that long; before,
30 s each, a core busy all along),
``MC_STORE_CLIENT_SETUP_RETRIES=1`` (the master port is probed before ``setup``, so a
dead master costs ~0 s instead of ~90 s), ``MC_LOG_LEVEL=ERROR``.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from zkv import log as ev
from zkv.errors import ConfigError, StorageError
from zkv.storage.base import (
    CORRUPT,
    HEADER_SIZE,
    TRUNCATED,
    Link,
    Store,
    as_bytes_view,
    check_counts,
    pack_header,
    store_call,
    value_ok,
)
from zkv.storage.url import MOONCAKE_HEADER_MODES, authority

MAX_BATCH = 256
#: On TCP, blocks up to this size travel as one staged object (see the module docstring).
INLINE_MAX = 256 << 10
STAGE_BYTES = 8 << 20  # per I/O thread
NOT_FOUND = -704
RPC_FAIL = -900
#: Pooled connections a call or a reconnect uses up at most (see the module docstring).
MAX_STALE = 64
#: A probe failing slower than this is no stale connection (those fail at once).
STALE_S = 0.1
_PROBE = ["zkv-probe"]
TOO_SMALL = -600
INVALID_PARAMS = -600  # (the same code from setup: the client's sizes or protocol)
TRANSFER_FAIL = -800
LEASE_EXPIRED = -707  # the object's lease ran out while it was read: that block misses
#: Codes about one object; anything else negative means the store is not answering.
_PER_OBJECT = frozenset({NOT_FOUND, TOO_SMALL, TRANSFER_FAIL, LEASE_EXPIRED, -200, -703, -705,
                         -706, -10})


def _transport_error(rcs: list[int]) -> int | None:
    """The first code that says the store is not answering, if any."""
    return next((rc for rc in rcs if rc < 0 and rc not in _PER_OBJECT), None)


def _size_of(client: Any, name: str) -> int:
    try:
        return int(client.get_size(name))
    except Exception:
        return -1


def _ptr(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class MooncakeStore(Store):
    """Blocks in a Mooncake Store (see the module docstring). Thread-safe: the client is
    shared; each I/O thread has its own header arena."""

    link: Link  # always one (made in __init__): a networked store
    timeout_s: float  # (set in __init__: the URL's timeout_s)

    def __init__(self, host: str, port: int, namespace: str, *, segment_bytes: int = 0,
                 buffer_bytes: int = 16 << 20, timeout_s: float = 2.0,
                 local_hostname: str | None = None, protocol: str = "tcp",
                 header: str = "auto") -> None:
        super().__init__(namespace, f"mooncake://{authority(host, port)}")
        if header not in MOONCAKE_HEADER_MODES:
            raise ConfigError(f"mooncake header mode must be one of {MOONCAKE_HEADER_MODES}, "
                              f"got {header!r}")
        self.header = header
        self.host, self.port = host, port
        loopback = host in ("127.0.0.1", "localhost", "::1")
        self.local_hostname = local_hostname or ("127.0.0.1" if loopback else socket.gethostname())
        if loopback:
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(max(1, int(timeout_s * 1000))))
        # the transfer engine's own waits on a peer (a holder) that stopped answering: 30 s
        # each by default, a core spinning all along (whole seconds only)
        transfer_s = str(max(1, math.ceil(timeout_s)))
        os.environ.setdefault("MC_TCP_STATUS_TIMEOUT_SEC", transfer_s)
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", transfer_s)
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ConfigError("mooncake:// needs the Mooncake client: pip install "
                              f"'zkv[mooncake]' (and Debian's libibverbs1): {e}") from e
        self._factory = MooncakeDistributedStore
        self.segment_bytes, self.buffer_bytes, self.protocol = segment_bytes, buffer_bytes, protocol
        self.timeout_s = timeout_s
        self._client: Any = None
        self._setup_lock = threading.Lock()
        self._regions: list[tuple[int, int]] = []
        self._arenas: list[np.ndarray] = []
        # the buffers each thread took, and by kind those of threads that ended (an I/O
        # pool remade at a scheduler restart): registered memory is never freed, so the
        # next threads take these
        self._owned: dict[threading.Thread, list[tuple[str, np.ndarray]]] = {}
        self._spare: dict[str, list[np.ndarray]] = {"headers": [], "stage": []}
        self._tls = threading.local()
        self.link = Link(self.url, self._connect, log=self._log)
        self._refused_said = False  # the client's refusal of the URL's sizes, said once
        try:  # a master down at start is no error: the store degrades to misses
            self.link.before()
            self._connect()
        except ConfigError:  # (before, an outage: the engine served without L3, retrying)
            self.close()
            raise
        except Exception as e:
            self.link.down(e)
        else:
            self._log.info(ev.STORE_OPENED, store=self.url)

    # ---------------------------------------------------------------- connection

    def _probe_master(self) -> None:
        """OSError unless the master's port accepts a connection: a dead master then
        costs no RPC (setup would sit in its own retry loop, a call in a ~4 s connect)."""
        with socket.create_connection((self.host, self.port), timeout=min(0.5, self.timeout_s)):
            pass

    def _connect(self) -> None:
        self._probe_master()
        with self._setup_lock:
            if self._closed:  # (an attempt that outlived close: no client after it)
                raise StorageError("the store is closed")
            if self._client is None:
                client = self._factory()
                try:
                    rc = client.setup(self.local_hostname, "P2PHANDSHAKE", self.segment_bytes,
                                      self.buffer_bytes, self.protocol, "",
                                      f"{self.host}:{self.port}")
                    why = f"setup returned {rc}"
                except (MemoryError, OverflowError, TypeError) as e:  # a buffer this host
                    # cannot allocate (std::bad_alloc), a size the binding cannot convert:
                    # the URL's sizes too (before, an outage, retried for good)
                    rc, why = INVALID_PARAMS, f"setup raised {type(e).__name__}: {e}"
                if rc == INVALID_PARAMS:  # the URL's sizes, not the master: no outage
                    error = ConfigError(
                        f"{self.url}: the Mooncake client refused its parameters ({why}): "
                        f"segment_mb={self.segment_bytes >> 20}, buffer_mb="
                        f"{self.buffer_bytes >> 20}, protocol={self.protocol}")
                    if not self.link.up and not self._refused_said:
                        # (a master down at open: found by a reconnect attempt, which stays
                        # down; before, in silence, every call's error blaming the master)
                        self._refused_said = True
                        self._log.error(ev.STORE_MISCONFIGURED, store=self.url, error=str(error))
                    raise error
                if rc != 0:
                    raise StorageError(f"setup returned {rc}")
                for ptr, n in self._regions:
                    client.register_buffer(ptr, n)
                self._client = client
                return
            client = self._client
        dropped = self._drop_stale(client)
        if dropped < 0:
            raise StorageError("the master does not answer queries")

    def _drop_stale(self, client: Any) -> int:
        """Use up pooled connections to a master that restarted (each fails once with
        RPC_FAIL); the number dropped once a query succeeds, -1 if none does. The caller
        probed the master's port."""
        deadline = time.monotonic() + self.timeout_s
        for dropped in range(MAX_STALE):
            t0 = time.monotonic()
            rc = client.batch_is_exist(_PROBE)[0]
            if rc >= 0:
                return dropped
            t1 = time.monotonic()
            # A stale connection fails at once; a slow failure is the master itself (the
            # pool's connect to a dead one took ~4 s here) and ends the loop.
            if rc != RPC_FAIL or t1 - t0 > STALE_S or t1 > deadline:
                return -1
        return -1

    @property
    def registered_bytes(self) -> int:
        """Memory registered with the client: host pools and the I/O threads' buffers."""
        with self._setup_lock:
            return sum(n for _, n in self._regions)

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        with self._setup_lock:
            if (ptr, nbytes) in self._regions:  # (a host pool again: an I/O pool restarted)
                return
            self._regions.append((ptr, nbytes))
            if self._client is not None:
                rc = self._client.register_buffer(ptr, nbytes)
                if rc != 0:
                    raise StorageError(f"{self.url}: register_buffer returned {rc}")

    def _headers(self) -> np.ndarray:
        """This thread's header slots (split mode), registered once."""
        arena = getattr(self._tls, "headers", None)
        if arena is None:
            arena = self._tls.headers = self._thread_buffer("headers", MAX_BATCH * HEADER_SIZE)
        return arena

    def _stage(self, nbytes: int) -> np.ndarray:
        """This thread's staging area (inline mode), at least ``nbytes``, registered once."""
        stage = getattr(self._tls, "stage", None)
        if stage is None or stage.nbytes < nbytes:  # (an outgrown one: spare once it ends)
            stage = self._tls.stage = self._thread_buffer("stage", max(STAGE_BYTES, nbytes))
        return stage

    def _thread_buffer(self, kind: str, nbytes: int) -> np.ndarray:
        """A registered buffer of at least ``nbytes`` for this thread: one a thread that
        ended left, else a new one. Registered memory is never freed: without the reuse
        each I/O pool a scheduler restart made registered ~32 MiB more. O(threads that
        took buffers), once per buffer a thread takes."""
        me = threading.current_thread()
        with self._setup_lock:
            for t in [t for t in self._owned if not t.is_alive()]:  # (joined: deterministic)
                for k, a in self._owned.pop(t):
                    self._spare[k].append(a)
            spare = self._spare[kind]
            i = next((i for i, a in enumerate(spare) if a.nbytes >= nbytes), None)
            arena = spare.pop(i) if i is not None else None
        if arena is None:
            arena = np.zeros(nbytes, dtype=np.uint8)
            self._arenas.append(arena)  # kept alive: registered memory never goes away
            self.register_buffer(int(arena.ctypes.data), arena.nbytes)
        with self._setup_lock:
            self._owned.setdefault(me, []).append((kind, arena))
        return arena

    def _call(self, what: str, fn: Any) -> list[int]:
        self.link.before()
        client = self._client
        if client is None:
            raise StorageError(f"{self.url} {what}: not connected")
        rcs = list(fn(client))
        bad = _transport_error(rcs)
        if bad == RPC_FAIL:
            try:
                self._probe_master()
                dropped = self._drop_stale(client)
            except OSError:
                dropped = -1
            if dropped >= 0:  # the master answers: a stale connection failed, send again
                self._log.warning(ev.STORE_RECONNECTED, store=self.url, call=what,
                                  stale_connections=dropped + 1)
                rcs = list(fn(client))
                bad = _transport_error(rcs)
        if bad is not None:
            raise self._unreachable(self.link, what, f"returned {bad}")
        return rcs

    # ---------------------------------------------------------------- interface

    @store_call
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        names = [self.name(k) for k in keys]
        rcs = self._call("exists", lambda c: c.batch_is_exist(names))
        return [rc == 1 for rc in rcs]

    @store_call
    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[bool]:
        check_counts(keys, outs)
        views = [as_bytes_view(o) for o in outs]
        found: list[bool] = []
        self._tls.refused = []  # this call's refused blocks (_delete_refused)
        try:
            for lo, hi, inline in self._chunks(views):
                get = self._get_inline if inline else self._get_split
                found += get(keys[lo:hi], views[lo:hi])
        finally:
            self._remove_refused()
        return found

    @store_call
    def put_many(self, keys: Sequence[bytes], datas: Sequence[Any]) -> list[bool]:
        check_counts(keys, datas)
        views = [as_bytes_view(d) for d in datas]
        stored: list[bool] = []
        for lo, hi, inline in self._chunks(views):
            put = self._put_inline if inline else self._put_split
            stored += self._put_done(views[lo:hi], put(keys[lo:hi], views[lo:hi]))
        return stored

    def _inline(self, nbytes: int) -> bool:
        if self.header == "auto":
            return self.protocol == "tcp" and HEADER_SIZE + nbytes <= INLINE_MAX
        return self.header == "inline"

    def _chunks(self, views: Sequence[memoryview]) -> list[tuple[int, int, bool]]:
        """Runs of blocks for one batched call each: at most MAX_BATCH, one header mode,
        inline runs within the staging area."""
        out: list[tuple[int, int, bool]] = []
        lo = 0
        while lo < len(views):
            inline = self._inline(views[lo].nbytes)
            hi, used = lo, 0
            while (hi < len(views) and hi - lo < MAX_BATCH
                   and self._inline(views[hi].nbytes) == inline):
                size = HEADER_SIZE + views[hi].nbytes
                if inline and hi > lo and used + size > STAGE_BYTES:
                    break
                used += size
                hi += 1
            out.append((lo, hi, inline))
            lo = hi
        return out

    # -- header inline: one buffer per object, staged (TCP copies the bytes anyway)

    def _offsets(self, views: Sequence[memoryview]) -> tuple[np.ndarray, list[int]]:
        offs, used = [], 0
        for v in views:
            offs.append(used)
            used += HEADER_SIZE + v.nbytes
        return self._stage(used), offs

    def _get_inline(self, keys: Sequence[bytes], views: Sequence[memoryview]) -> list[bool]:
        stage, offs = self._offsets(views)
        base = int(stage.ctypes.data)
        names = [self.name(k) for k in keys]
        sizes = [HEADER_SIZE + v.nbytes for v in views]
        rcs = self._call("get", lambda c: c.batch_get_into(names, [base + o for o in offs], sizes))
        stored = self._stored_sizes(names, rcs)
        out = []
        for key, view, off, size, rc, name in zip(keys, views, offs, sizes, rcs, names):
            ok = False
            if rc == size:
                payload = stage[off + HEADER_SIZE : off + size]
                ok = self._verify(key, stage[off : off + HEADER_SIZE], payload, view.nbytes)
                if ok:
                    view[:] = payload
                    self._count(hits=1, bytes_read=view.nbytes)
            else:
                self._get_failed(key, name, view.nbytes, rc, stored)
            out.append(ok)
        return out

    def _put_inline(self, keys: Sequence[bytes], views: Sequence[memoryview]) -> list[int]:
        stage, offs = self._offsets(views)
        base = int(stage.ctypes.data)
        for key, view, off in zip(keys, views, offs):
            stage[off : off + HEADER_SIZE] = np.frombuffer(pack_header(self.ns_id, key, view),
                                                           dtype=np.uint8)
            stage[off + HEADER_SIZE : off + HEADER_SIZE + view.nbytes] = np.frombuffer(
                view, dtype=np.uint8)
        names = [self.name(k) for k in keys]
        sizes = [HEADER_SIZE + v.nbytes for v in views]
        return self._call("put", lambda c: c.batch_put_from(names, [base + o for o in offs], sizes))

    # -- header split: [header slot, host block] per object, zero copy (RDMA, big blocks)

    def _get_split(self, keys: Sequence[bytes], views: Sequence[memoryview]) -> list[bool]:
        arena = self._headers()
        base = int(arena.ctypes.data)
        names = [self.name(k) for k in keys]
        ptrs = [[base + i * HEADER_SIZE, _ptr(v)] for i, v in enumerate(views)]
        sizes = [[HEADER_SIZE, v.nbytes] for v in views]
        rcs = self._call("get", lambda c: c.batch_get_into_multi_buffers(names, ptrs, sizes))
        stored = self._stored_sizes(names, rcs)
        out = []
        for i, (key, view, rc) in enumerate(zip(keys, views, rcs)):
            ok = False
            if rc == HEADER_SIZE + view.nbytes:
                ok = self._verify(key, arena[i * HEADER_SIZE : (i + 1) * HEADER_SIZE], view,
                                  view.nbytes)
                if ok:
                    self._count(hits=1, bytes_read=view.nbytes)
            else:
                self._get_failed(key, names[i], view.nbytes, rc, stored)
            out.append(ok)
        return out

    def _put_split(self, keys: Sequence[bytes], views: Sequence[memoryview]) -> list[int]:
        arena = self._headers()
        base = int(arena.ctypes.data)
        for i, (key, view) in enumerate(zip(keys, views)):
            arena[i * HEADER_SIZE : (i + 1) * HEADER_SIZE] = np.frombuffer(
                pack_header(self.ns_id, key, view), dtype=np.uint8)
        names = [self.name(k) for k in keys]
        ptrs = [[base + i * HEADER_SIZE, _ptr(v)] for i, v in enumerate(views)]
        sizes = [[HEADER_SIZE, v.nbytes] for v in views]
        return self._call("put", lambda c: c.batch_put_from_multi_buffers(names, ptrs, sizes))

    # -- both

    def _get_failed(self, key: bytes, name: str, nbytes: int, rc: int,
                    stored: dict[str, int]) -> None:
        want = HEADER_SIZE + nbytes
        if rc == NOT_FOUND:
            self._count(misses=1)
            return
        size = rc if rc >= 0 else stored.get(name, -1)
        if size >= 0 and size != want:
            self._refuse(key, TRUNCATED if size < want else CORRUPT,
                         f"object {size} bytes, block {want} bytes", seen=nbytes)
            return
        self._count(errors=1, misses=1)  # a line per failed block (before): rate-limited
        self._read_failed_log(key=name, error=f"get returned {rc}")

    def _stored_sizes(self, names: Sequence[str], rcs: Sequence[int]) -> dict[str, int]:
        """The stored size of every object whose get failed in a way its size explains
        (TOO_SMALL, TRANSFER_FAIL: a refused block, or a holder gone), by name; absent:
        unknown (gone, or the master did not answer). One batched query to the master for
        all of them (a ``get_size`` each was a round trip per block: a dead holder's 40
        blocks cost the call 42 replica queries, now 2); the size as ``get_size`` gives
        it, from the first replica."""
        ask = [n for n, rc in zip(names, rcs) if rc in (TOO_SMALL, TRANSFER_FAIL)]
        if not ask:
            return {}
        try:
            found = self._client.batch_get_replica_desc(ask)
        except Exception:
            return {}
        sizes: dict[str, int] = {}
        for name, replicas in found.items():
            if not replicas:
                continue
            first = replicas[0]
            if first.is_memory_replica():
                sizes[name] = int(first.get_memory_descriptor().buffer_descriptor.size)
            elif first.is_disk_replica():
                sizes[name] = int(first.get_disk_descriptor().object_size)
            else:  # (a local disk replica: the binding shows no size) as get_size says
                size = _size_of(self._client, name)
                if size >= 0:
                    sizes[name] = size
        return sizes

    def _put_done(self, views: Sequence[memoryview], rcs: list[int]) -> list[bool]:
        ok = [rc == 0 for rc in rcs]
        n = sum(ok)
        self._count(puts=n, put_failures=len(ok) - n,
                    bytes_written=sum(v.nbytes for v, good in zip(views, ok) if good))
        if n < len(ok):
            rc = next(rc for rc in rcs if rc != 0)
            hint = (" (no space: the segments are full and the master has not evicted yet, "
                    "or none is mounted: mount memory, e.g. mooncake_client)"
                    if rc == -200 else "")
            self._declined(len(ok) - n, f"put returned {rc}{hint}")
        return ok

    def _delete_refused(self, key: bytes, seen: Any) -> None:
        """Remove a refused object (``seen``: the block's payload bytes) at the end of the
        get call (:meth:`_remove_refused`), unless a good block is there by then."""
        refused = getattr(self._tls, "refused", None)
        if refused is None or seen is None:
            self.remove(key)
        else:
            refused.append((key, seen))

    def _remove_refused(self) -> None:
        """Remove the objects a get call refused, unless a good block is there now.
        Mooncake has no compare-and-delete, but a put never replaces an object (it keeps
        the stored one): a good copy is there only if the refused object was removed
        (another reader refused it too) and a block put since. So the objects are read
        again just before the remove (one batch), and those that are good blocks now
        stay. The window left (narrowed, not closed): a good copy that lands between
        that read and the remove (one batch each: two RPCs a call, however many blocks)
        goes too."""
        refused, self._tls.refused = self._tls.refused, None
        if not refused:
            return
        names = [self.name(k) for k, _ in refused]
        try:
            self.link.before()
            client = self._client
            if client is None:
                raise StorageError("not connected")
            raws = client.get_batch(names)
            bad = [name for name, (key, nbytes), raw in zip(names, refused, raws, strict=True)
                   if not (raw and value_ok(raw, self.ns_id, key, nbytes))]
            if not bad:
                return
            rcs = self._call("remove", lambda c: c.batch_remove(bad, True))
            failed = [rc for rc in rcs if rc not in (0, NOT_FOUND)]
            if failed:
                raise StorageError(f"remove returned {failed[0]} ({len(failed)} blocks)")
        except Exception as e:  # the refusals stand; the next reader refuses them again
            self._log.warning(ev.BLOCK_REFUSED, num_blocks=len(names), store=self.url,
                              error=f"delete failed: {e!r}")

    @store_call
    def remove(self, key: bytes) -> None:
        name = self.name(key)
        rc = self._call("remove", lambda c: [c.remove(name, True)])[0]
        if rc not in (0, NOT_FOUND):
            raise StorageError(f"{self.url} remove {name}: returned {rc}")

    def close(self) -> None:
        """Quiesce (see base), stop the reconnect thread, then close the native client,
        unless a call or a reconnect attempt (which uses the client too) still runs:
        closing it under one crashes the process (SIGSEGV), so it is kept (and said)."""
        t0 = time.monotonic()
        quiet = self.quiesce()  # then the attempt, within what is left of the one wait
        left = max(0.0, self.close_wait_s - (time.monotonic() - t0))
        quiet = self.link.close(left) and quiet
        with self._setup_lock:
            client, self._client = self._client, None
        if client is not None and quiet:
            client.close()
        elif client is not None:
            self._kept_client = client  # (no destructor runs under the call either)
            self._log.warning(ev.STORE_CLOSE_TIMEOUT, store=self.url,
                              waited_s=self.close_wait_s, num_calls=self.num_calls,
                              detail="a call or a reconnect attempt still ran: the client "
                                     "is kept open")
        super().close()

    def __repr__(self) -> str:
        return f"MooncakeStore({self.url!r}, {self.namespace!r})"
