"""L3 on a Redis (or Valkey) server: ``redis://HOST:PORT/DB``, or ``rediss://`` over TLS
(the server's certificate and host name checked; an ACL user with ``user:password@``).

One value per block, ``64-byte header ‖ payload`` (see base.py), under the key name
``{namespace}/{hex}/{rank}``. Every batched call is one round trip::

    count_leading       a Lua script: STRLEN k1, k2, ... on the server, up to the first miss
    exists(keys)        STRLEN k1; GETRANGE k1 0 15; ...  (a pipeline)
    get_many_into       MGET k1 k2 ...                -> verify, copy payload into the host block
    put_many            SET k1 v1 [EX ttl]; ...       (a pipeline; header and payload joined:
                                                        one copy)

Gets are one ``MGET``, not a pipeline of ``GET``: redis-py builds and parses one command
instead of one per key (bench/storage.py, 32 blocks of 32 KiB a call on loopback: 0.67 ->
0.78 GB/s). A key that is missing, or holds something that is not a string, is nil there:
a miss.

A key counts as present only when it holds a string of a block's stored length (64-byte
header + payload; the length the header of the query's first key gives): a value of another
type or length under a block key (another client's, a torn write) never loads, and
counted as present it cost a failed load per request, again each ``negative_cache_s``.

A refused block is deleted by a script only if the key still holds the value that was read
(its SHA-1): a good copy another engine saved meanwhile stays. (Where scripts are not
allowed: a plain ``DEL``, said once.)

redis-py hands values back as ``bytes``, so a get costs one copy into the host block and a
put one join; zero copy is not possible with this client. Eviction is the server's: run
it with ``maxmemory`` and ``maxmemory-policy allkeys-lru`` (a key evicted between exists
and get is an ordinary miss), or ``volatile-ttl`` with ``ttl_s``. Either evicts single
blocks, not chains: a block whose predecessor went is kept but unreachable (the query
stops at the first gap). A prompt's blocks are touched together, so they tie on redis's
LRU clock, and the best of ``maxmemory-samples`` sampled keys may be a chain's first
block: sampling 32 keys (redis's default is 5) strands fewer chains. On the bundled trace,
through a server that holds about a quarter of its blocks, zkv loads 0.75-0.77x of what an
exact LRU of the same size would give with 5 samples, 0.85x with 10 and 0.91-0.94x with 32
(64: no better), at the same put throughput; ``volatile-ttl`` 0.74x, ``allkeys-lfu`` 0.26x
(``bench/store_eviction.py``). A server that refuses writes when
full (``noeviction``, or a ``volatile-*`` policy while ``ttl_s`` is not set) is said at
open in one warning (``storage.store_misconfigured``, where ``CONFIG GET`` is allowed), and
each declined put's line says what to configure; an LRU one that samples fewer than 32
keys, in one info line (``storage.store_tuning``).

Outages: every call has a socket timeout and no client-side retry; a connection or timeout
error marks the :class:`~zkv.storage.base.Link` down, later calls fail at once until its
backoff passes, then one ``PING`` decides (the connection pool reconnects by itself). A
URL's database the server lacks is a ConfigError at open; found only when a server that was
down at open answers, the store stays down and says so once (``storage.store_misconfigured``).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

from zkv import log as ev
from zkv.errors import ConfigError, StorageError
from zkv.storage.base import (
    CORRUPT,
    HEADER_SIZE,
    MAGIC,
    TRUNCATED,
    Link,
    Store,
    as_bytes_view,
    check_counts,
    check_header,
    pack_header,
    pack_key,
    payload_ok,
    store_call,
)
from zkv.storage.url import authority

# KEYS: the keys of n blocks, ARGV[1] (ranks) keys a block; returns the leading blocks
# whose keys all hold a block: a string of the stored length the first key's header gives
# (magic, then the payload length at bytes 8..15, little-endian), one length for all (one
# namespace, one block size). STRLEN is 0 for a missing key and an error for another type.
_COUNT_LEADING = """
local g = tonumber(ARGV[1])
local want = -1
for i = 1, #KEYS do
  local n = redis.pcall('STRLEN', KEYS[i])
  if type(n) ~= 'number' then return math.floor((i - 1) / g) end
  if want < 0 then
    if n < %(header)d then return 0 end
    local h = redis.call('GETRANGE', KEYS[i], 0, 15)
    if string.sub(h, 1, 4) ~= '%(magic)s' then return 0 end
    want = %(header)d
    for j = 9, 16 do want = want + string.byte(h, j) * 256 ^ (j - 9) end
  end
  if n ~= want then return math.floor((i - 1) / g) end
end
return math.floor(#KEYS / g)
""" % {"header": HEADER_SIZE, "magic": MAGIC.decode()}

# Delete KEYS[1] only if it holds the value whose SHA-1 is ARGV[1] (a refused block), not a
# good copy saved since. 1 if deleted.
_DELETE_IF_SAME = """
local v = redis.pcall('GET', KEYS[1])
if type(v) == 'string' and redis.sha1hex(v) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class RedisStore(Store):
    """Blocks in one Redis database (see the module docstring). Thread-safe: redis-py's
    connection pool hands each concurrent pipeline its own connection."""

    link: Link  # always one (made in __init__): a networked store
    timeout_s: float  # (set in __init__: the URL's timeout_s)

    def __init__(self, host: str, port: int, db: int, namespace: str, *, timeout_s: float = 2.0,
                 connect_timeout_s: float | None = None, ttl_s: int | None = None,
                 password: str | None = None, username: str | None = None, tls: bool = False,
                 tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None) -> None:
        super().__init__(namespace,
                         f"{'rediss' if tls else 'redis'}://{authority(host, port)}/{db}")
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:
            raise ConfigError("redis:// needs the redis client: pip install 'zkv[redis]'") from e
        self._errors = redis.RedisError
        self._transport_errors = (redis.ConnectionError, redis.TimeoutError, OSError)
        self._auth_errors = (redis.AuthenticationError, redis.exceptions.AuthorizationError)
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        if connect_timeout_s is None:  # a TCP connect: short, and never past a call's timeout
            connect_timeout_s = min(_CONNECT_TIMEOUT_S, timeout_s)
        tls_kw: dict[str, Any] = {}
        if tls:
            tls_kw = dict(ssl=True, ssl_cert_reqs="required", ssl_check_hostname=True,
                          ssl_ca_certs=tls_ca, ssl_certfile=tls_cert, ssl_keyfile=tls_key)
        self._client = redis.Redis(
            host=host, port=port, db=db, username=username, password=password,
            socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0, **tls_kw)
        self._script: Any = self._client.register_script(_COUNT_LEADING)
        self._delete_script: Any = self._client.register_script(_DELETE_IF_SAME)
        self.policy: str | None = None  # maxmemory-policy, once CONFIG GET told it
        self._memory_checked = False
        self.link = Link(self.url, self._ping, log=self._log)
        self._no_db_said = False
        self._noperm = redis.exceptions.NoPermissionError
        try:  # a server down at start is no error: the store degrades to misses
            self._call("ping", self._probe)
        except StorageError as e:
            if _no_database(e.__cause__):  # the URL's /DB: a bad URL
                self.close()
                raise ConfigError(self._no_database_text()) from None
        else:
            self._log.info(ev.STORE_OPENED, store=self.url)
            self._check_memory()

    def _no_database_text(self) -> str:
        return (f"{self.url}: the server has no database {self.url.rsplit('/', 1)[1]} "
                "(CONFIG GET databases: it numbers them from 0)")

    def _probe(self) -> None:
        """PING. A user the server's ACL denies it (``@connection``: a least-privilege user
        allowed reads, writes and scripts, what the store runs) got an answer all the same:
        the server is up. (Before, that refusal failed every reconnect attempt: after its
        first outage the store stayed down for the life of the engine.)"""
        try:
            self._client.ping()
        except self._noperm:
            pass

    def _ping(self) -> None:
        """The link's reconnect attempt. A server that was down at open and answers without
        the URL's database stays down, said once (else only the first outage's line)."""
        try:
            self._probe()
        except self._errors as e:
            if _no_database(e) and not self._no_db_said:
                self._no_db_said = True
                self._log.error(ev.STORE_MISCONFIGURED, store=self.url,
                                error=self._no_database_text())
            raise
        if self.link.closed:  # the store closed while this attempt ran: the connection
            self._client.close()  # it opened goes too (else left open to the server)
            return
        self._check_memory()  # (a server that was down at open: checked once it answers)

    def _check_memory(self) -> None:
        """Once: warn when the server will refuse writes once full (``maxmemory`` set, and
        ``noeviction``, or a ``volatile-*`` policy while this store sets no TTL: nothing to
        evict) or grow until the host's memory runs out (no ``maxmemory``, no TTL), and say
        when an LRU one samples too few keys to keep chains whole; where ``CONFIG GET`` is
        allowed (an ACL or a managed redis may refuse it: then nothing is said)."""
        if self._memory_checked:
            return
        self._memory_checked = True
        try:
            conf = self._client.config_get("maxmemory*")
        except (self._errors, OSError):
            return
        self.policy = conf.get("maxmemory-policy")
        maxmemory = int(conf.get("maxmemory") or 0)
        policy = self.policy or ""
        if maxmemory and (policy == "noeviction"
                          or policy.startswith("volatile-") and self.ttl_s is None):
            self._log.warning(ev.STORE_MISCONFIGURED, store=self.url, maxmemory=maxmemory,
                              policy=policy, ttl_s=self.ttl_s,
                              error=f"redis will refuse writes once full: {_FULL_HINT}")
        elif not maxmemory and self.ttl_s is None:  # (20 KiB a 16 KiB block, for good)
            self._log.warning(ev.STORE_MISCONFIGURED, store=self.url, maxmemory=0,
                              policy=policy, ttl_s=None, error=_UNBOUNDED)
        samples = int(conf.get("maxmemory-samples") or _LRU_SAMPLES)
        if maxmemory and policy.endswith("-lru") and samples < _LRU_SAMPLES:
            self._log.info(ev.STORE_TUNING, store=self.url, policy=policy,
                           maxmemory_samples=samples,
                           hint=f"set maxmemory-samples {_LRU_SAMPLES}: redis then evicts "
                                "closer to LRU and breaks fewer prompts' chains of blocks "
                                "(a load stops at the first block evicted)")

    def _call(self, what: str, fn: Any) -> Any:
        self.link.before()
        try:
            return fn()
        except self._transport_errors as e:
            auth = isinstance(e, self._auth_errors)  # (tried again all the same: ACLs change)
            raise self._unreachable(self.link, what, e, _AUTH_HINT if auth else None) from e
        except self._errors as e:
            self._count(errors=1)
            raise StorageError(f"{self.url} {what}: {e}") from e

    def _pipeline(self, what: str, build: Any) -> list[Any]:
        def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            build(pipe)
            return pipe.execute(raise_on_error=False)

        out = self._call(what, run)
        for r in out:  # a lost connection mid-pipeline comes back per command
            if isinstance(r, self._transport_errors):
                raise self._unreachable(self.link, what, r)
        return out

    # ---------------------------------------------------------------- interface

    @store_call
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key holds a block: a string of the stored length its own header
        gives (as the query's script, key by key)."""
        if not keys:
            return []
        names = [self.name(k) for k in keys]

        def build(pipe: Any) -> None:
            for n in names:
                pipe.strlen(n)
                pipe.getrange(n, 0, 15)

        out = self._pipeline("exists", build)
        found = []
        for n, head in zip(out[::2], out[1::2], strict=True):
            error = next((r for r in (n, head) if isinstance(r, Exception)), None)
            if error is not None and "WRONGTYPE" not in str(error):
                self._count(errors=1)
                raise StorageError(f"{self.url} exists: {error}")
            found.append(error is None and n >= HEADER_SIZE and n == _stored_len(head))
        return found

    def _count_present(self, digests: Sequence[bytes], world_size: int) -> int:
        """A Lua script runs ``STRLEN`` key by key on the server and stops at the first
        block with a key missing (or not a block): one round trip a chunk. (A pipeline of
        one ``EXISTS`` per key cost ~15 us of Python per key here: 34 ms for a 256-block
        prompt at 8 ranks, all of it in the engine's scheduling step, even when the first
        block missed.) Where scripts are not allowed (an ACL without ``@scripting``): the
        ``exists`` pipeline of the base class, said once."""
        if self._script is None:
            return super()._count_present(digests, world_size)
        names = [self.name(pack_key(d, r)) for d in digests for r in range(world_size)]
        try:
            found = int(self._call("exists",
                                   lambda: self._script(keys=names, args=[world_size])))
        except StorageError as e:
            if self.link is not None and not self.link.up or not _scripts_refused(e):
                raise  # unreachable, or a passing error (BUSY, failover): the caller's
            self._script = None  # refused (NOPERM, scripts off): pipelines from now on
            self._log.warning(ev.QUERY_FAILED, store=self.url, error=str(e),
                              fallback="chunked STRLEN pipelines")
            return super()._count_present(digests, world_size)
        return min(len(digests), max(0, found))

    @store_call
    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[bool]:
        check_counts(keys, outs)
        if not keys:
            return []
        names = [self.name(k) for k in keys]
        values = self._call("get", lambda: self._client.mget(names))
        if (not isinstance(values, list) or len(values) != len(keys)
                or not all(v is None or isinstance(v, bytes) for v in values)):
            self._count(errors=1)  # a proxy's or a module's reply, not MGET's
            raise StorageError(f"{self.url} get: MGET of {len(keys)} keys answered "
                               f"{_shape(values)}, not {len(keys)} strings or nils")
        return [self._take(k, v, as_bytes_view(o))
                for k, v, o in zip(keys, values, outs, strict=True)]

    def _take(self, key: bytes, value: Any, out: memoryview) -> bool:
        if value is None:
            self._count(misses=1)
            return False
        want = out.nbytes
        view = memoryview(value)
        kind, checksum = check_header(view[:HEADER_SIZE], self.ns_id, key, want)
        if kind is None and view.nbytes != HEADER_SIZE + want:
            kind = TRUNCATED if view.nbytes < HEADER_SIZE + want else CORRUPT
        payload = view[HEADER_SIZE:]
        if kind is None and not payload_ok(payload, checksum):
            kind = CORRUPT
        if kind is not None:
            self._refuse(key, kind, f"value {view.nbytes} bytes, block {want} bytes",
                         seen=hashlib.sha1(view).hexdigest())
            return False
        out[:] = payload
        self._count(hits=1, bytes_read=want)
        return True

    @store_call
    def put_many(self, keys: Sequence[bytes], datas: Sequence[Any]) -> list[bool]:
        check_counts(keys, datas)
        if not keys:
            return []
        views = [as_bytes_view(d) for d in datas]
        values = [b"".join((pack_header(self.ns_id, k, v), v))
                  for k, v in zip(keys, views, strict=True)]
        names = [self.name(k) for k in keys]

        def build(pipe: Any) -> None:
            for n, v in zip(names, values):
                pipe.set(n, v, ex=self.ttl_s)

        out = self._pipeline("put", build)
        ok = [r is True for r in out]
        stored = sum(ok)
        self._count(puts=stored, put_failures=len(ok) - stored,
                    bytes_written=sum(v.nbytes for v, good in zip(views, ok) if good))
        if stored < len(ok):
            err = next(r for r in out if r is not True)
            self._declined(len(ok) - stored, self._why_declined(err))
        return ok

    def _why_declined(self, err: Any) -> str:
        """A declined SET's error; an OOM one (the server is full and evicts nothing for
        this store) says what to configure."""
        from redis.exceptions import OutOfMemoryError

        if not isinstance(err, OutOfMemoryError):
            return str(err)
        return (f"{err} (redis is full: maxmemory-policy {self.policy or 'unknown'}; "
                f"{_FULL_HINT})")

    @store_call
    def remove(self, key: bytes) -> None:
        self._call("remove", lambda: self._client.delete(self.name(key)))

    def _delete_refused(self, key: bytes, seen: Any) -> None:
        """Delete the refused value only (``seen``: its SHA-1), by a script: a good copy
        that another engine saved since the read stays. Where scripts are not allowed:
        ``DEL``, whatever the key holds (said once)."""
        if seen is None or self._delete_script is None:
            self.remove(key)
            return
        name = self.name(key)
        try:
            self._call("remove", lambda: self._delete_script(keys=[name], args=[seen]))
        except StorageError as e:
            if not self.link.up or not _scripts_refused(e):
                raise
            self._delete_script = None
            self._log.warning(ev.BLOCK_REFUSED, store=self.url, error=str(e),
                              fallback="DEL: a good copy saved since the read goes too")
            self.remove(key)

    def close(self) -> None:
        """Quiesce (see base), stop the reconnect thread within what is left of that one
        wait, then close the pool. A call or a reconnect attempt still running after the
        wait fails on its closed connection, which is harmless here. (Before, the link's
        own 5 s came on top: a stop with the server hung took ``close_wait_s`` + 5 s.)"""
        t0 = time.monotonic()
        self.quiesce()
        self.link.close(max(0.0, self.close_wait_s - (time.monotonic() - t0)))
        self._client.close()
        super().close()

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r}, {self.namespace!r})"


# A TCP connect's default wait (the URL's ``connect_timeout_s``), at most ``timeout_s``: a
# call that connects (the first, one after an outage) waits no longer than one that does not.
# (Before, 0.5 s whatever ``timeout_s``: a call with ``timeout_s=0.1`` could wait 0.5 s, and
# a server farther than 0.5 s to connect to could not be used at all.)
_CONNECT_TIMEOUT_S = 0.5

# maxmemory-samples that keeps chains loadable (redis's default is 5; 64 gains no more, and
# neither costs put throughput with blocks this large): bench/store_eviction.py
_LRU_SAMPLES = 32
_AUTH_HINT = ("the server refused the URL's credentials: check its user and password "
              "(give them in $ZKV_STORE_URL, not on a command line)")
_FULL_HINT = ("set maxmemory-policy allkeys-lru (or volatile-ttl with the store's ttl_s), "
              "or raise maxmemory")
_UNBOUNDED = ("redis has no maxmemory and the store sets no ttl_s: it keeps every block "
              "until the host's memory runs out; set maxmemory and maxmemory-policy "
              "allkeys-lru (or give the store a ttl_s)")


def _no_database(error: BaseException | None) -> bool:
    """A redis error that says the connection's ``SELECT`` named a database the server lacks."""
    return error is not None and "DB index is out of range" in str(error)


def _stored_len(head: Any) -> int:
    """The stored length (header + payload) a value's first 16 bytes say, -1 if they are no
    block header's."""
    if not isinstance(head, bytes) or len(head) < 16 or head[:4] != MAGIC:
        return -1
    return HEADER_SIZE + int.from_bytes(head[8:16], "little")


def _scripts_refused(e: StorageError) -> bool:
    """Whether a script call failed because this server or user runs no scripts (an ACL
    without ``@scripting``, ``EVALSHA`` renamed or off), for good, not for this once: a
    ``BUSY`` (another client's slow script), a failover or a loading server pass, and
    the script must stay."""
    from redis.exceptions import NoPermissionError, ResponseError

    cause = e.__cause__
    if isinstance(cause, NoPermissionError):
        return True
    text = str(cause).lower()
    return isinstance(cause, ResponseError) and ("unknown command" in text
                                                 or "scripting" in text and "disabled" in text)


def _shape(reply: Any) -> str:
    """What a reply is, for an error line (never its bytes: they are KV)."""
    if isinstance(reply, list):
        kinds = sorted({type(v).__name__ for v in reply})
        return f"a list of {len(reply)} ({', '.join(kinds)})"
    return f"a {type(reply).__name__}"
