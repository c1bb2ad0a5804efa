"""The L3 store interface, the stored block format, and the reconnect breaker.

Keys. A block key is packed bytes, ``digest (16) ‖ rank (2, big-endian)`` (:func:`pack_key`);
a store names it ``{namespace}/{digest.hex()}/{rank}`` (:func:`key_name`), where the
namespace is the layout fingerprint, so incompatible caches never mix in a shared store.

Stored block = a 64-byte header, then the payload (one page-first host block)::

    offset size  field
    0      4     magic  b"ZKVB"
    4      2     format version (1)                      all integers little-endian
    6      2     header size (64)
    8      8     payload length in bytes
    16     8     xxh3_64 of the payload
    24     18    the block key (digest ‖ rank)
    42     6     zero
    48     8     xxh3_64 of the namespace                a block of another namespace is refused
    56     8     xxh3_64 of bytes 0..55                  a damaged header is refused

A block that fails any check is a miss: it is never served, it is deleted, and it is
counted in :class:`StoreStats` (``corrupt``, ``truncated``, ``foreign``) with a
``storage.block_refused`` event. Deleted is the value that was read, not whatever the key
holds by then: another engine may have saved a good copy between the read and the delete
(``_delete_refused`` gets what identifies the value read: a file's inode, a redis value's
digest; Mooncake, which has no compare-and-delete, reads the block again first).

Errors. A missing block is not an error (a False in the result). A store that cannot be
reached raises :class:`~zkv.errors.StorageError`; the :class:`Link` breaker then fails
every later call at once (no timeout each) and reconnects on a thread of its own, so no
caller ever waits on a dead or hung store past the one call that found it so (a hung
server's reconnect attempt takes a whole timeout, and the scheduler's query runs inside
the engine's scheduling step)::

    UP ──transport error (one call: ≤ timeout_s)──► DOWN: every call StorageError at once
     ▲                                                │ reconnect thread: an attempt
     │                                                │ after min_backoff_s, doubling
     └──────────── an attempt succeeded ◄─────────────┘ to max_backoff_s per failure

``retry_now`` (another client, a rank, just reached the store) makes the thread try at
once, backoff reset: the scheduler's queries come back with the ranks' writes. ``close``
stops the thread.

Stores are called from the worker's I/O threads concurrently: implementations are
thread-safe. Closing is too: ``close`` refuses new calls (``StorageError``: closed) and
waits up to ``close_wait_s`` for the calls running (a networked store's: two of its
timeouts and a second) before it releases the connections. A backend whose client must
not be released under a call (Mooncake's native client: a segfault) keeps it when a call
still runs at the end of the wait, and says so (``storage.close_timeout``)::

    OPEN ──close()──► CLOSING: new calls StorageError; running ones finish
                         │ none left, or close_wait_s passed
                         ▼
                      CLOSED: connections released (unless a call still ran: kept)
"""

from __future__ import annotations

import abc
import functools
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import xxhash

from zkv import log as ev
from zkv.errors import StorageError

DIGEST_SIZE = 16
KEY_SIZE = DIGEST_SIZE + 2
MAGIC = b"ZKVB"
FORMAT_VERSION = 1
HEADER_SIZE = 64
_HEAD = struct.Struct("<4sHHQQ18s6xQ")  # bytes 0..55; the header checksum follows
_CHECK = struct.Struct("<Q")
assert _HEAD.size + _CHECK.size == HEADER_SIZE

CORRUPT, TRUNCATED, FOREIGN = "corrupt", "truncated", "foreign"


def pack_key(digest: bytes, rank: int) -> bytes:
    """The store key of one block of one rank."""
    if len(digest) != DIGEST_SIZE:
        raise ValueError(f"digest must be {DIGEST_SIZE} bytes, got {len(digest)}")
    return digest + rank.to_bytes(2, "big")


def key_name(namespace: str, key: bytes) -> str:
    """``{namespace}/{digest.hex()}/{rank}``: the key as a store (or a human) names it."""
    if len(key) != KEY_SIZE:
        raise ValueError(f"store key must be {KEY_SIZE} bytes, got {len(key)}")
    return f"{namespace}/{key[:DIGEST_SIZE].hex()}/{int.from_bytes(key[DIGEST_SIZE:], 'big')}"


def check_namespace(namespace: str) -> str:
    if (not namespace or "/" in namespace or namespace.startswith(".")
            or not namespace.isprintable() or len(namespace) > 128):
        raise ValueError(f"bad namespace {namespace!r}")
    return namespace


def namespace_id(namespace: str) -> int:
    return xxhash.xxh3_64_intdigest(namespace.encode())


def pack_header(ns_id: int, key: bytes, payload: Any) -> bytes:
    """The 64-byte header of ``payload`` (any buffer) stored under ``key``."""
    view = memoryview(payload).cast("B")
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, view.nbytes,
                      xxhash.xxh3_64_intdigest(view), key, ns_id)
    return head + _CHECK.pack(xxhash.xxh3_64_intdigest(head))


def check_header(raw: Any, ns_id: int, key: bytes, payload_len: int) -> tuple[str | None, int]:
    """``(refusal, payload checksum)``: refusal is None when the header is good for a
    ``payload_len``-byte block under ``key`` in namespace ``ns_id``."""
    view = memoryview(raw).cast("B")
    if view.nbytes < HEADER_SIZE:
        return TRUNCATED, 0
    head = view[: _HEAD.size]
    if _CHECK.unpack_from(view, _HEAD.size)[0] != xxhash.xxh3_64_intdigest(head):
        return CORRUPT, 0
    magic, version, size, length, checksum, got_key, got_ns = _HEAD.unpack(head)
    if magic != MAGIC or version != FORMAT_VERSION or size != HEADER_SIZE:
        return CORRUPT, 0
    if got_ns != ns_id:
        return FOREIGN, 0
    if got_key != key or length != payload_len:
        return CORRUPT, 0
    return None, checksum


def payload_ok(payload: Any, checksum: int) -> bool:
    return xxhash.xxh3_64_intdigest(memoryview(payload).cast("B")) == checksum


def as_bytes_view(buf: Any) -> memoryview:
    """A flat unsigned-byte view of any contiguous buffer."""
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


@dataclass(slots=True)
class StoreStats:
    """Counters of one store client (blocks unless named bytes). Read by tests and bench."""

    hits: int = 0
    misses: int = 0            # not there (including "gone after exists")
    corrupt: int = 0           # refused: bad header or payload checksum (deleted)
    truncated: int = 0         # refused: shorter than its header says (deleted)
    foreign: int = 0           # refused: another namespace's block (deleted)
    puts: int = 0
    put_failures: int = 0      # the store declined a block (full, lease, ...): dropped
    errors: int = 0            # calls that failed: unreachable, timed out
    query_failures: int = 0    # scheduler existence queries answered 0 because of an error
    evicted: int = 0           # local store: blocks removed by the byte budget
    bytes_read: int = 0
    bytes_written: int = 0

    def snapshot(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


FIRST_BLOCKS = 8  # blocks in the first chunk of Store.count_leading


def check_world_size(world_size: int) -> int:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return world_size


def failure_log(store: Store, event: str, call: str) -> ev.RateLimited:
    """The rate-limited logger of one kind of failed call (``call``: "put", "get" or
    "exists") on ``store``. Every line it writes, the summary of what it held back too,
    names the store (its URL, which never holds a password) and the call: an operator
    with two stores, or reads and writes failing at once, tells which one fails.
    (Bound on a lazy logger: it follows the configuration in force at each line.)"""
    return ev.repeating(ev.get_logger("storage", namespace=store.namespace, store=store.url,
                                      call=call), event)


class Link:
    """The reconnect breaker of one store client (see the module docstring).

    ``connect()`` makes the client usable again (or raises). While the link is down it
    runs on the link's own thread, one attempt at a time, never in a caller's; calls
    fail at once until an attempt succeeds.
    """

    def __init__(self, what: str, connect: Callable[[], None], *, min_backoff_s: float = 0.2,
                 max_backoff_s: float = 5.0, log: Any = None) -> None:
        self.what = what
        self._connect = connect
        self._min = min_backoff_s
        self._max = max_backoff_s
        self._log = log if log is not None else ev.get_logger("storage")
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._up = True
        self._down_at = time.monotonic()  # when it last went down (down_s when back)
        self._backoff = min_backoff_s
        self._retry_at = 0.0
        self._attempting = False
        self._thread: threading.Thread | None = None
        self._thread_pid = 0  # a forked child has no thread: it starts its own
        self._closed = False
        self.num_down = 0          # UP -> DOWN transitions
        self.num_reconnects = 0    # DOWN -> UP transitions
        self.num_attempts = 0      # reconnect attempts (each at most one client timeout)

    @property
    def up(self) -> bool:
        return self._up

    @property
    def closed(self) -> bool:
        """``close`` was called (an attempt still running may end after it)."""
        return self._closed

    @property
    def attempting(self) -> bool:
        """A reconnect attempt runs now (on the link's thread)."""
        return self._attempting

    @property
    def retry_in_s(self) -> float:
        """Seconds until the next reconnect attempt (0 while up or while one runs)."""
        if self._up or self._attempting:
            return 0.0
        return max(0.0, self._retry_at - time.monotonic())

    def before(self) -> None:
        """Gate one call: return when the store may be used, else raise StorageError."""
        if self._up:
            return
        if self._thread_pid != os.getpid():
            self._ensure_thread()
        if self._attempting:
            raise StorageError(f"{self.what} unreachable (reconnecting)")
        raise StorageError(f"{self.what} unreachable (next attempt in {self.retry_in_s:.2f} s)")

    def retry_now(self) -> None:
        """Another client just reached the store: while down, the next attempt runs at
        once (backoff reset) instead of at the end of the backoff."""
        if self._up:
            return
        with self._lock:
            self._retry_at = 0.0
            self._backoff = self._min
        self._wake.set()

    def down(self, error: BaseException | str, hint: str | None = None) -> None:
        """A call failed for a transport reason: fail calls at once and reconnect on the
        link's thread (started here, once per outage). ``hint``: what to do, in the line."""
        with self._lock:
            was_up = self._up
            self._up = False
            if was_up:
                self.num_down += 1
                self._down_at = time.monotonic()
                self._retry_at = self._down_at + self._backoff
        if was_up:
            self._log.error(ev.STORE_UNREACHABLE, store=self.what, error=str(error),
                            retry_in_s=round(self._backoff, 3),
                            **({} if hint is None else {"hint": hint}))
        self._ensure_thread()

    def _ensure_thread(self) -> None:
        """Start the reconnect thread unless it runs (or the link is closed). A forked
        child has none of its parent's threads: it starts its own."""
        with self._lock:
            pid = os.getpid()
            if self._closed or (self._thread is not None and self._thread_pid == pid):
                return
            self._attempting = False  # (a child's copy of its parent's attempt)
            thread = self._thread = threading.Thread(
                target=self._reconnect, daemon=True, name=f"zkv-reconnect {self.what}")
            self._thread_pid = pid
        thread.start()

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop the reconnect thread (waiting up to ``timeout_s`` for an attempt that is
        running); whether no attempt runs any more. Idempotent."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._wake.set()
        if thread is not None:
            thread.join(timeout_s)
            return not thread.is_alive()
        return True

    def _reconnect(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    self._thread = None
                    return
                wait = self._retry_at - time.monotonic()
                if wait <= 0:
                    self._attempting = True
                    self.num_attempts += 1
            if wait > 0:
                self._wake.wait(wait)
                self._wake.clear()  # retry_at and closed are read again under the lock
                continue
            try:
                self._connect()
            except Exception:  # still down: the next attempt after a longer backoff
                with self._lock:
                    self._attempting = False
                    self._backoff = min(self._max, self._backoff * 2)
                    self._retry_at = time.monotonic() + self._backoff
                continue
            with self._lock:
                self._attempting = False
                self._up = True
                self._backoff = self._min
                self.num_reconnects += 1
                self._thread = None
            self._log.warning(ev.STORE_RECONNECTED, store=self.what,
                              down_s=round(time.monotonic() - self._down_at, 3))
            return


_F = TypeVar("_F", bound=Callable[..., Any])


def check_counts(keys: Sequence[bytes], blocks: Sequence[Any]) -> None:
    """ValueError unless a batched call got one buffer per key (before any I/O: a call
    that answered for the pairs alone would leave the caller's last keys unanswered)."""
    if len(keys) != len(blocks):
        raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")


def store_call(fn: _F) -> _F:
    """A store's public call: refused once the store is closing (``StorageError``), and
    counted while it runs, so that ``close`` waits for it."""

    @functools.wraps(fn)
    def call(self: Store, *args: Any, **kwargs: Any) -> Any:
        tls = self._call_depth
        depth = getattr(tls, "n", 0)
        with self._calls_cv:
            if self._closed and not depth:  # (a call inside a running one goes on)
                raise StorageError(f"{self.url}: the store is closed")
            self._calls += 1
        tls.n = depth + 1
        try:
            return fn(self, *args, **kwargs)
        finally:
            tls.n = depth
            with self._calls_cv:
                self._calls -= 1
                if not self._calls:
                    self._calls_cv.notify_all()

    return call  # type: ignore[return-value]


class Store(abc.ABC):
    """An L3 key/value store of host blocks (see the module docstring).

    Batched calls take and return lists in key order. ``get_many_into`` fills each
    ``outs[i]`` (exactly the block's size) and returns whether it holds the verified
    block; ``put_many`` returns whether each block was stored (False: the store declined
    it, counted in ``stats.put_failures``). Transport failures raise StorageError.
    """

    namespace: str
    stats: StoreStats
    url: str  # what logs and errors name the store by: never with a password
    link: Link | None = None  # the reconnect breaker of a networked store
    timeout_s: float | None = None  # a networked store's per-call timeout (None: local)

    def __init__(self, namespace: str, url: str = "") -> None:
        self.namespace = check_namespace(namespace)
        self.url = url
        self.ns_id = namespace_id(namespace)
        self.stats = StoreStats()
        self._stats_lock = threading.Lock()
        self._log = ev.get_logger("storage", namespace=namespace)
        # A full store declines every put of every step: a few lines, then counts; a
        # holder gone fails every read of its blocks, an outage every existence query
        # (``leading_present`` without a logger of its own): the same
        self._write_failed_log = failure_log(self, ev.WRITE_FAILED, "put")
        self._read_failed_log = failure_log(self, ev.READ_FAILED, "get")
        #: where :func:`~zkv.storage.query.leading_present` logs a failed query by default
        self.query_failed_log = failure_log(self, ev.QUERY_FAILED, "exists")
        self._closed = False  # closing or closed: calls refused (store_call)
        self._calls = 0       # store_call calls running
        self._calls_cv = threading.Condition()
        self._call_depth = threading.local()  # store_call calls this thread is inside

    @property
    def num_calls(self) -> int:
        """Calls running now (``close`` waits for them)."""
        return self._calls

    #: How long the scheduler's existence query may take before it answers misses (None:
    #: unbounded; a networked store's own timeouts bound it): see zkv/storage/query.py.
    query_timeout_s: float | None = None

    @property
    def close_wait_s(self) -> float:
        """How long ``close`` waits for the calls running: two of a networked store's
        timeouts and a second, 5 s for a local one; a worker's shutdown waits this long
        for its I/O threads too."""
        return 5.0 if self.timeout_s is None else 2 * self.timeout_s + 1.0

    # ---------------------------------------------------------------- the interface

    @abc.abstractmethod
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """One batched existence query (one round trip where the backend allows)."""

    @store_call
    def count_leading(self, digests: Sequence[bytes], world_size: int) -> int:
        """How many leading blocks of ``digests`` are present for every rank
        ``0..world_size-1``: the scheduler's query, which runs inside the engine's
        scheduling step. The first :data:`FIRST_BLOCKS` blocks are asked about, then, if
        they were all there, the rest: a prompt that misses at once (most new prompts)
        costs one small query, not one over all its blocks and ranks, and a hit one round
        trip more. How one chunk is counted is the backend's :meth:`_count_present`."""
        w = check_world_size(world_size)
        done = 0
        for chunk in (digests[:FIRST_BLOCKS], digests[FIRST_BLOCKS:]):
            if not chunk:
                break
            found = self._count_present(chunk, w)
            done += found
            if found < len(chunk):
                break
        return done

    def _count_present(self, digests: Sequence[bytes], world_size: int) -> int:
        """Leading blocks of one chunk present for every rank: one ``exists`` over all its
        keys (a backend that can stop at the first miss itself overrides this)."""
        w = world_size
        keys = [pack_key(d, r) for d in digests for r in range(w)]
        found = self.exists(keys)
        if len(found) != len(keys):  # (a short answer would read as "all there")
            raise StorageError(f"{self.url} exists: {len(keys)} keys answered with "
                               f"{len(found)} results")
        for i in range(len(digests)):
            if not all(found[i * w : (i + 1) * w]):
                return i
        return len(digests)

    @abc.abstractmethod
    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[bool]:
        """Read verified blocks into ``outs``; False for a miss or a refused block."""

    @abc.abstractmethod
    def put_many(self, keys: Sequence[bytes], datas: Sequence[Any]) -> list[bool]:
        """Store blocks (header added here); each lands whole or not at all."""

    @abc.abstractmethod
    def remove(self, key: bytes) -> None:
        """Delete ``key``; a missing key is not an error."""

    def register_buffer(self, ptr: int, nbytes: int) -> None:  # noqa: B027
        """Memory that blocks will be read into / written from (zero copy where the
        backend needs registration, e.g. Mooncake's RDMA). Default: nothing to do."""

    def quiesce(self, timeout_s: float | None = None) -> bool:
        """Refuse new calls; wait up to ``timeout_s`` (default ``close_wait_s``) for the
        running ones, once: a later call, ``close``'s own included, waits no more. Whether
        none runs any more. A backend's close calls this before it releases its client; a
        rank that already waited for its store calls at its stop calls it with 0, so the
        close that follows does not wait for the calls it left a second time."""
        with self._calls_cv:
            if self._closed:
                return not self._calls
            self._closed = True
            wait = self.close_wait_s if timeout_s is None else timeout_s
            return self._calls_cv.wait_for(lambda: not self._calls, wait)

    def close(self) -> None:
        """Refuse new calls, wait for the running ones (see the module), release
        connections (a backend's own close quiesces first and calls this last).
        Idempotent."""
        self.quiesce()
        self._write_failed_log.flush()  # what the rate limits held back: their counts
        self._read_failed_log.flush()
        self.query_failed_log.flush()

    def retry_now(self) -> None:
        """Another client just reached the store (``Link.retry_now``); nothing to do for
        a store without a link."""
        if self.link is not None:
            self.link.retry_now()

    # ---------------------------------------------------------------- conveniences

    def put(self, key: bytes, data: Any) -> None:
        """Store one block; StorageError if it was not stored."""
        if not self.put_many([key], [data])[0]:
            raise StorageError(f"put {key_name(self.namespace, key)}: declined by the store")

    def get_into(self, key: bytes, out: Any) -> bool:
        return self.get_many_into([key], [out])[0]

    def name(self, key: bytes) -> str:
        return key_name(self.namespace, key)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ---------------------------------------------------------------- for backends

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            s = self.stats
            for name, n in deltas.items():
                setattr(s, name, getattr(s, name) + n)

    def _refuse(self, key: bytes, kind: str, detail: str = "", seen: Any = None) -> None:
        """A block failed its check: count it, say so, delete it (never served). ``seen``:
        what identifies the value that was read, for the backend's ``_delete_refused``."""
        self._count(**{kind: 1}, misses=1)
        self._log.error(ev.BLOCK_REFUSED, kind=kind, key=self.name(key), detail=detail,
                        store=self.url)
        try:
            self._delete_refused(key, seen)
        except Exception as e:  # the refusal stands; the next reader refuses it again
            self._log.warning(ev.BLOCK_REFUSED, kind=kind, key=self.name(key),
                              error=f"delete failed: {e!r}", store=self.url)

    def _declined(self, num_blocks: int, error: str) -> None:
        """The store declined ``num_blocks`` of a put (full, leases): say so, rate-limited
        (``stats.put_failures`` counts every one)."""
        self._write_failed_log(num_blocks=num_blocks, error=error)

    def _unreachable(self, link: Link, what: str, error: object,
                     hint: str | None = None) -> StorageError:
        """A transport failure: count it, take the link down, and give the error to raise."""
        self._count(errors=1)
        link.down(str(error), hint)
        return StorageError(f"{self.url} {what}: {error}")

    def _delete_refused(self, key: bytes, seen: Any) -> None:
        """Delete a refused block even if the store protects it (leases), and only the value
        that was read (``seen`` identifies it; None: whatever is there) where the backend
        can tell: a good copy saved since stays. Default: remove."""
        self.remove(key)

    def _verify(self, key: bytes, header: Any, payload: Any, seen: Any = None) -> bool:
        """Check a block read as (header, payload); refuse it (False) when bad."""
        nbytes = memoryview(payload).nbytes
        kind, checksum = check_header(header, self.ns_id, key, nbytes)
        if kind is None and not payload_ok(payload, checksum):
            kind = CORRUPT
        if kind is not None:
            self._refuse(key, kind, seen=seen)
            return False
        return True


def value_ok(raw: Any, ns_id: int, key: bytes, payload_len: int) -> bool:
    """Whether ``raw`` is a good stored block (header and payload) of ``payload_len`` bytes
    under ``key`` in namespace ``ns_id``."""
    view = memoryview(raw).cast("B")
    if view.nbytes != HEADER_SIZE + payload_len:
        return False
    kind, checksum = check_header(view[:HEADER_SIZE], ns_id, key, payload_len)
    return kind is None and payload_ok(view[HEADER_SIZE:], checksum)
