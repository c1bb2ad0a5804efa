"""Who may talk to the scheduler: CURVE keys, the ZAP handler, per-rank identities, private dirs.

Trust model (the README's "Security" section says the same for users):

- **Trusted**: processes of the user that runs zkv, on the machine that runs them. They can
  read the key files, ptrace the workers and write the cache's memory anyway; zkv does not
  try to defend against them, only against their mistakes (a rank started with the wrong
  ``RANK`` cannot ack for another rank when keys are used).
- **Not trusted**: other users of the machine, and anything that reaches a ``tcp://`` port.

What enforces it::

    transport      who can connect                       how a message is bound to a rank
    ipc://         the user only: socket files live in   per-rank token derived from the rank's
                   a 0700 directory the user owns; the   key (zkvrun's default: a fresh keyring
                   ZAP handler also checks the peer uid  per run); without keys, ranks are not
                                                         told apart (the trusted user)
    tcp://         holders of a rank's CURVE secret key  per-rank CURVE key; plain tcp only with
                   (server key pinned by every rank)     ``insecure=True``, loopback binds only
                                                         unless ``allow_remote=True``

ZAP (ZeroMQ's authentication protocol) runs once per connection, in a thread of the
scheduler process (:class:`ZapHandler`); it maps the client's credential to its rank and
returns the rank as the connection's ``User-Id``, which libzmq attaches to every message
that arrives on it. The dispatcher compares that with the rank a message names: the
payload never decides who sent it. Nothing runs per message beyond that comparison.

The credential: on ``tcp://`` the rank's CURVE key (the connection is encrypted too). On
``ipc://`` a rank token derived from the rank's secret key (:func:`ipc_token`), sent with
ZeroMQ's PLAIN mechanism: no per-message encryption (measured: CURVE costs ~50 us per
batch at 4 ranks here), and nothing to encrypt against -- only this user can reach the
socket, and this user is trusted. The scheduler derives every rank's token, so on ipc it
needs every rank's secret key (zkvrun's per-run keyring, or a whole ``zkv keys`` dir).

Keyring directory (``zkv keys DIR --world-size N``; ZeroMQ certificate files)::

    DIR/                    0700
      server.key            server public key      every rank needs it (pins the scheduler)
      server.key_secret     server secret key      the scheduler node only            0600
      rank-{r}.key          rank r's public key    the scheduler node needs all of them
      rank-{r}.key_secret   rank r's secret key    rank r's node only                 0600

Run directories (ipc sockets, a per-run keyring, the replay's default L3 directory) live in
``{base}/zkv-{uid}/`` (0700, refused if it has another owner or mode), one
``{prefix}{pid}-{random}/`` per run with an ``owner`` file (pid and process start time);
:func:`clean_stale_runs` removes those whose owner is gone, so a launcher killed with
SIGKILL leaves nothing that the next start does not remove.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import os
import re
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils import z85

from zkv import log as ev
from zkv import stopsignals
from zkv.errors import ConfigError

KEYS_ENV = "ZKV_KEYS"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_SERVER = "server"
_OWNER_FILE = "owner"
#: What :func:`make_run_dir` names; :func:`clean_stale_runs` touches nothing else (an
#: engine's own directory in the same root, say).
_RUN_NAME = re.compile(r"^(run|l3|soak)-\d+-[0-9a-f]{8}$")
_MAX_WORLD_SIZE = 4096


# ---------------------------------------------------------------- keys


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """What one rank needs: the server's public key (pinned) and its own key pair (z85).
    The secret key is left out of ``repr`` (a logged or printed record never shows it)."""

    rank: int
    server_public: bytes
    public: bytes
    secret: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class Keyring:
    """Server key pair and one key pair per rank (z85 bytes). A node's copy may lack secrets
    it does not need: the scheduler node needs ``server_secret`` and every rank's public key,
    a rank's node only the server's public key and that rank's secret. Secret keys are left
    out of ``repr``."""

    server_public: bytes
    server_secret: bytes | None = field(repr=False)
    rank_publics: tuple[bytes, ...]
    rank_secrets: dict[int, bytes] = field(default_factory=dict, repr=False)

    @property
    def world_size(self) -> int:
        return len(self.rank_publics)

    @classmethod
    def generate(cls, world_size: int) -> Keyring:
        if not 0 < world_size <= _MAX_WORLD_SIZE:
            raise ConfigError(f"world size must be in [1, {_MAX_WORLD_SIZE}], got {world_size}")
        if not zmq.has("curve"):
            raise ConfigError("this libzmq has no CURVE support (pyzmq wheels have it)")
        server_public, server_secret = zmq.curve_keypair()
        pairs = [zmq.curve_keypair() for _ in range(world_size)]
        return cls(server_public, server_secret, tuple(p for p, _ in pairs),
                   {r: s for r, (_, s) in enumerate(pairs)})

    def for_rank(self, rank: int) -> ClientKeys:
        secret = self.rank_secrets.get(rank)
        if not 0 <= rank < self.world_size or secret is None:
            raise ConfigError(f"the keyring has no secret key for rank {rank} "
                              f"(world size {self.world_size})")
        return ClientKeys(rank, self.server_public, self.rank_publics[rank], secret)

    def rank_of_key(self) -> dict[bytes, int]:
        """Raw 32-byte public key -> rank (what a ZAP request carries)."""
        return {z85.decode(k): r for r, k in enumerate(self.rank_publics)}

    def save(self, path: str) -> str:
        """Write the keyring as certificate files in a new private directory ``path``.
        ConfigError when the file system cannot take them (full, read-only): what was
        written is removed, so that the same command works once there is room (a half
        keyring left behind was "already exists" for good)."""
        made = not os.path.lexists(path)
        make_private_dir(path)
        certs: list[tuple[str, bytes, bytes | None]] = []
        if self.server_secret is not None:
            certs.append((f"{_SERVER}.key_secret", self.server_public, self.server_secret))
        certs.append((f"{_SERVER}.key", self.server_public, None))
        for r, public in enumerate(self.rank_publics):
            certs.append((f"rank-{r}.key", public, None))
            if r in self.rank_secrets:
                certs.append((f"rank-{r}.key_secret", public, self.rank_secrets[r]))
        written: list[str] = []
        try:
            for name, public, secret in certs:
                cert = os.path.join(path, name)
                _write_cert(cert, public, secret)
                written.append(cert)
        except OSError as e:
            if not isinstance(e, FileExistsError):  # (made by this call, empty or short)
                written.append(os.path.join(path, name))
            for cert in written:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(cert)
            if made:
                os.rmdir(path)
            raise ConfigError(f"cannot write the keyring {path}: {e.strerror}") from None
        return path

    @classmethod
    def load(cls, path: str) -> Keyring:
        """Read a keyring directory; refused (ConfigError) when it holds secrets that other
        users could read, or when it is incomplete."""
        if not os.path.isdir(path):
            raise ConfigError(f"keyring {path!r} is not a directory (zkv keys DIR creates one)")
        check_private_dir(path, what="keyring directory")
        server_public, server_secret = _read_cert(path, _SERVER)
        if server_public is None:
            raise ConfigError(f"keyring {path!r} has no {_SERVER}.key")
        publics: list[bytes] = []
        secrets: dict[int, bytes] = {}
        while True:
            public, secret = _read_cert(path, f"rank-{len(publics)}")
            if public is None:
                break
            if secret is not None:
                secrets[len(publics)] = secret
            publics.append(public)
        named = [int(m.group(1)) for m in map(_RANK_FILE.fullmatch, os.listdir(path)) if m]
        if not publics or max(named, default=0) >= len(publics):
            raise ConfigError(
                f"keyring {path!r} has no rank-{len(publics)}.key: every node needs server.key "
                "and every rank's public key (rank-N.key, from zkv keys); a rank's node also "
                "its own rank-N.key_secret, the scheduler's node server.key_secret")
        return cls(server_public, server_secret, tuple(publics), secrets)


_RANK_FILE = re.compile(r"rank-(\d+)\.key(?:_secret)?")


def _write_cert(path: str, public: bytes, secret: bytes | None) -> None:
    """ZeroMQ's certificate format (``zmq.auth.load_certificate`` reads it)."""
    lines = ["#   zkv CURVE certificate", "metadata", "curve",
             f'    public-key = "{public.decode("ascii")}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode("ascii")}"')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o644)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write("\n".join(lines) + "\n")


def _read_cert(folder: str, name: str) -> tuple[bytes | None, bytes | None]:
    """(public, secret) of ``name``; secret from ``name.key_secret`` when present."""
    import zmq.auth

    public = secret = None
    for suffix in (".key_secret", ".key"):
        path = os.path.join(folder, name + suffix)
        if not os.path.exists(path):
            continue
        try:
            pub, sec = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"unreadable key file {path}: {e}") from None
        if len(pub) != 40 or (sec is not None and len(sec) != 40):
            raise ConfigError(f"key file {path} does not hold z85 CURVE keys")
        if suffix == ".key_secret":
            st = os.stat(path)
            if st.st_mode & 0o077:
                raise ConfigError(f"secret key file {path} is readable by others "
                                  f"(mode {stat.S_IMODE(st.st_mode):o}; chmod 600 it)")
            secret = sec
        public = public or pub
    return public, secret


def client_keys_from_env(rank: int, env: Mapping[str, str] | None = None) -> ClientKeys | None:
    """Rank ``rank``'s keys from the keyring named by ``$ZKV_KEYS``; None when unset."""
    env = os.environ if env is None else env
    path = env.get(KEYS_ENV)
    return Keyring.load(path).for_rank(rank) if path else None


def keyring_from_env(env: Mapping[str, str] | None = None) -> Keyring | None:
    env = os.environ if env is None else env
    path = env.get(KEYS_ENV)
    return Keyring.load(path) if path else None


# ---------------------------------------------------------------- socket setup


def ipc_token(rank: int, secret: bytes) -> str:
    """The ipc credential of a rank: a keyed digest of its secret key (never the key)."""
    return hashlib.blake2b(b"zkv-ipc-token/%d" % rank, key=secret, digest_size=24).hexdigest()


def new_socket(ctx: zmq.Context[Any], kind: int) -> zmq.Socket[Any]:
    """``ctx.socket(kind)``, whole or not at all when a stop signal comes (see
    :func:`zkv.stopsignals.atomic`): ``ctx.destroy`` / ``term`` then never wait on a
    socket that nobody holds."""
    return stopsignals.atomic(lambda: ctx.socket(kind), lambda sock: sock.close(0))


def setup_client(sock: zmq.Socket[Any], keys: ClientKeys | None, endpoint: str) -> None:
    """Make ``sock`` authenticate to the scheduler at ``endpoint`` (before ``connect``):
    PLAIN with the rank's ipc token on ``ipc://``, a CURVE client elsewhere."""
    if keys is None:
        return
    if endpoint.startswith("ipc://"):
        sock.plain_username = f"rank-{keys.rank}".encode()
        sock.plain_password = ipc_token(keys.rank, keys.secret).encode()
        return
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


def check_endpoint(endpoint: str, *, keys: object, insecure: bool = False,
                   allow_remote: bool = False, bind: bool = True) -> None:
    """Refuse (ConfigError, one line) an endpoint the trust model does not allow.

    ``ipc://``: the socket's directory must be private (:func:`check_private_dir`); on
    connect too: only this user can have made the socket, which is what tells a worker
    that the scheduler on the other end is ours (no key pins it on ipc, see
    :func:`setup_client`). A directory that does not exist yet at connect is made here
    (0700, as an engine's worker halves make theirs): before, it went unchecked, and
    whoever made it first (another user, in a shared parent) bound a scheduler there
    that the rank obeyed (batches, Shutdown) and sent its ipc token to.
    ``tcp://``: keys, unless ``insecure``; a bind address other than loopback needs
    ``allow_remote``. ``inproc://`` stays in the process. Anything else is refused.
    """
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        raise ConfigError(f"endpoint {endpoint!r} has no scheme (ipc:// or tcp://)")
    if scheme == "inproc":
        return
    if scheme == "ipc":
        if rest.startswith("@"):
            raise ConfigError(f"{endpoint}: abstract ipc sockets have no permissions; use a "
                              "path in a private directory")
        folder = os.path.dirname(os.path.abspath(rest)) or "."
        if bind or os.path.lexists(folder):
            check_private_dir(folder, what="ipc socket directory")
        else:  # a rank before its scheduler: made now, so that no one else makes it first
            make_private_dir(folder, what="ipc socket directory")
        return
    if scheme != "tcp":
        raise ConfigError(f"endpoint {endpoint!r}: only ipc:// and tcp:// are supported")
    if keys is None and not insecure:
        raise ConfigError(f"{endpoint}: plain tcp:// is refused: give CURVE keys (zkv keys "
                          "DIR creates them) or pass the insecure flag on a trusted network")
    host = rest.rsplit(":", 1)[0].strip("[]")
    if bind and not allow_remote and not is_loopback(host):
        raise ConfigError(f"{endpoint}: binding an address other than loopback needs the "
                          "allow-remote flag")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface name or hostname: not provably loopback


# ---------------------------------------------------------------- ZAP


@dataclass(slots=True)
class _Domain:
    ranks: dict[bytes, int] | None  # CURVE: raw public key -> rank; None: no keys (NULL)
    uid: int  # ipc peers must run as this user
    tokens: dict[str, int] = field(default_factory=dict)  # ipc (PLAIN): token -> rank
    num_refused: int = 0
    last_refusal: str = ""
    #: ``security.handshake_refused`` lines: a few a second, the rest counted
    refused_log: ev.RateLimited | None = None


class ZapHandler:
    """The ZAP handler of one ZeroMQ context: a thread answering libzmq's authentication
    requests for every registered domain (one per dispatcher).

    Per connection: CURVE -> the client key must be a rank's (``User-Id`` = that rank);
    NULL over ipc -> the peer's uid (from the kernel, ``SO_PEERCRED``) must be ours.
    Everything else is refused and counted (``num_refused``). Cost: one request per
    connection attempt, none per message. The thread exists while a domain is registered;
    it must run before a server socket binds (libzmq lets CURVE clients in unchecked when
    no handler answers).
    """

    _lock = threading.Lock()
    _by_context: dict[int, ZapHandler] = {}

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self._ctx = ctx
        self._domains: dict[str, _Domain] = {}
        stop_ep = f"inproc://zkv-zap-stop-{uuid.uuid4().hex}"
        opened: list[zmq.Socket[Any]] = []
        try:  # the stop socket too, now: at unregister the socket limit may be reached
            for kind in (zmq.REP, zmq.PAIR, zmq.PAIR):
                opened.append(new_socket(ctx, kind))
                opened[-1].linger = 0
            self._zap, self._stop_in, self._stop_out = opened
            _bind_when_free(self._zap, ZAP_ENDPOINT)
            self._stop_in.bind(stop_ep)
            self._stop_out.connect(stop_ep)
        except BaseException:  # a socket error, a stop signal
            for sock in opened:
                sock.close(0)
            raise
        self._thread = threading.Thread(target=self._serve, name="zkv-zap", daemon=True)
        self._thread.start()

    @classmethod
    def register(cls, ctx: zmq.Context[Any], domain: str, keys: Keyring | None) -> ZapHandler:
        with cls._lock:
            handler = cls._by_context.get(id(ctx))
            if handler is None:
                handler = cls._by_context[id(ctx)] = ZapHandler(ctx)
            tokens = {ipc_token(r, sec): r for r, sec in keys.rank_secrets.items()} if keys else {}
            handler._domains[domain] = _Domain(
                keys.rank_of_key() if keys else None, os.getuid(), tokens,
                refused_log=ev.RateLimited(ev.get_logger("security"), ev.HANDSHAKE_REFUSED,
                                           level="warning", burst=5))
            return handler

    def unregister(self, domain: str) -> None:
        with ZapHandler._lock:
            d = self._domains.pop(domain, None)
            if d is not None and d.refused_log is not None:
                d.refused_log.flush()
            if self._domains:
                return
            ZapHandler._by_context.pop(id(self._ctx), None)
            if self._stop_out.closed:  # the context ended first: the thread is gone
                return
        self._stop_out.send(b"stop")  # (one caller gets here: the last domain's)
        self._thread.join(5.0)
        self._stop_out.close(0)

    def num_refused(self, domain: str) -> int:
        d = self._domains.get(domain)
        return d.num_refused if d is not None else 0

    def last_refusal(self, domain: str) -> str:
        d = self._domains.get(domain)
        return d.last_refusal if d is not None else ""

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._stop_in, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(_ZAP_CHECK_MS))
                if self._stop_in in ready:
                    return
                if self._zap in ready:
                    req = self._zap.recv_multipart()
                    self._zap.send_multipart(self._answer(req))
                elif not ready and self._ended():
                    self._forget_context()
                    return
        except zmq.ZMQError as e:  # the context ended under a registered domain (its
            # owner stopped mid-construction, say): end with it. ``ctx.destroy`` closes
            # the sockets under this thread first (ENOTSOCK, not ContextTerminated).
            if not isinstance(e, zmq.ContextTerminated) and not self._ended():
                raise
            self._forget_context()
        finally:
            self._zap.close(0)
            self._stop_in.close(0)

    def _ended(self) -> bool:
        """Whether the context ended under this thread (``ctx.destroy``: its sockets closed
        from another thread, which a poll already waiting on them may never notice)."""
        return self._zap.closed or self._stop_in.closed or self._ctx.closed

    def _forget_context(self) -> None:
        with ZapHandler._lock:
            if ZapHandler._by_context.get(id(self._ctx)) is self:
                del ZapHandler._by_context[id(self._ctx)]
            self._domains.clear()
            self._stop_out.close(0)  # (no unregister will use it: it waits for term)

    def _answer(self, req: list[bytes]) -> list[bytes]:
        if len(req) < 6:
            return [b"1.0", req[1] if len(req) > 1 else b"", b"400", b"bad request", b"", b""]
        version, request_id, domain, address, _identity, mechanism = req[:6]
        d = self._domains.get(domain.decode(errors="replace"))
        user, reason = None, "unknown domain"
        if d is not None and version == b"1.0":
            user, reason = _authenticate(d, address.decode(errors="replace"), mechanism, req[6:])
            if user is None:
                peer = address.decode(errors="replace")
                d.num_refused += 1
                d.last_refusal = f"{reason} (peer {peer})"
                if d.refused_log is not None:  # who knocked, how, and why not
                    d.refused_log(peer=peer, mechanism=mechanism.decode(errors="replace"),
                                  reason=reason)
        if user is None:
            return [b"1.0", request_id, b"400", reason.encode(), b"", b""]
        return [b"1.0", request_id, b"200", b"OK", user.encode(), b""]


#: How often the ZAP thread wakes to look whether its context ended under it: a poll
#: waiting on sockets that ``ctx.destroy`` closes from another thread may never return
#: (the thread stayed, and its handler stayed registered under a dead context's id).
_ZAP_CHECK_MS = 100


def _bind_when_free(sock: zmq.Socket[Any], endpoint: str, timeout_s: float = 2.0) -> None:
    """Bind, waiting while a handler that just closed still holds the endpoint: libzmq
    releases an inproc name when its reaper thread has destroyed the old socket."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
        time.sleep(0.005)  # a retry interval: nothing to wait on but the reaper


def _authenticate(d: _Domain, address: str, mechanism: bytes,
                  credentials: list[bytes]) -> tuple[str | None, str]:
    """``(user id, "")`` for an accepted peer, ``(None, reason)`` otherwise."""
    uid = _ipc_peer_uid(address)
    if uid is not None and uid != d.uid:
        return None, f"ipc peer runs as uid {uid}, not {d.uid}"
    if d.ranks is None:
        if mechanism == b"NULL":
            return "", ""
        return None, f"mechanism {mechanism.decode(errors='replace')} not expected"
    if mechanism == b"PLAIN" and uid is not None and len(credentials) == 2:
        rank = d.tokens.get(credentials[1].decode(errors="replace"))
        if rank is None or credentials[0] != f"rank-{rank}".encode():
            return None, "ipc token of no rank"
        return str(rank), ""
    if mechanism != b"CURVE" or len(credentials) != 1:
        return None, "not a rank's CURVE key or ipc token"
    rank = d.ranks.get(credentials[0])
    if rank is None:
        return None, "CURVE key of no rank"
    return str(rank), ""


def _ipc_peer_uid(address: str) -> int | None:
    """libzmq names an ipc peer ``localhost:uid:gid:pid`` (SO_PEERCRED); tcp peers by IP."""
    parts = address.split(":")
    if len(parts) == 4 and parts[0] == "localhost" and parts[1].isdigit():
        return int(parts[1])
    return None


def setup_server(sock: zmq.Socket[Any], domain: str, keys: Keyring | None,
                 endpoint: str) -> None:
    """Make ``sock`` authenticate peers through the context's :class:`ZapHandler`
    (``domain`` registered there first). With keys: a PLAIN server on ``ipc://`` (rank
    tokens), a CURVE server elsewhere."""
    sock.zap_domain = domain.encode()
    if keys is None:
        return
    if endpoint.startswith("ipc://"):
        if len(keys.rank_secrets) != keys.world_size:
            raise ConfigError("on ipc:// the scheduler checks each rank's token, derived from "
                              "its secret key: give it the whole keyring (rank-*.key_secret)")
        sock.plain_server = True
        return
    if keys.server_secret is None:
        raise ConfigError("the keyring has no server secret key (server.key_secret): it is "
                          "a rank node's copy, not the scheduler's")
    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret


# ---------------------------------------------------------------- private directories


#: A word that starts as a URL with an authority: ``scheme://`` then no ``/``.
_URL_WORD = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)((?!/)[^\s\"']*)")
#: A host name or address, or an [IPv6] address.
_HOST = r"(?:[A-Za-z0-9._~-]+|\[[0-9A-Fa-f:.]*\])"
#: What follows a URL's ``user:password@``: a host, a port, then the end, a path, a query
#: or a fragment.
_HOST_TAIL = re.compile(_HOST + r"(?::\d*)?(?=[/?#]|$)")
#: A URL's word that is its authority alone (``host[:port]``, or nothing), not the start
#: of a ``user:password`` cut by a blank (``:pw``, ``user:pw``).
_AUTHORITY = re.compile(r"$|" + _HOST + r"(?::\d+)?(?=[/?#]|$)")
#: In free text: an ``@`` followed by a host and port, then a delimiter, a blank or a quote.
_AT_HOST = re.compile("@" + _HOST + r"(?::\d*)?(?=[/?#\s\"']|$)")


def userinfo_end(rest: str) -> int | None:
    """In a URL without its ``scheme://``, the index of the ``@`` that ends its
    ``user:password`` (None: none there). A password may hold an unescaped ``/``, ``?``,
    ``#`` or ``@`` (such a URL does not parse, and its error must not show it): the first
    ``@`` followed by a host and port, else the last ``@``."""
    if rest.startswith("/") or "@" not in rest:
        return None
    i = rest.find("@")
    while i >= 0:
        if _HOST_TAIL.match(rest, i + 1):
            return i
        i = rest.find("@", i + 1)
    return rest.rindex("@")


def redact_credentials(text: str) -> str:
    """``text`` with the ``user:password@`` of every URL in it written ``***@``
    (``redis://:pw@host:6379/0`` → ``redis://***@host:6379/0``), for what is logged or
    printed: a command line, a bad URL (see :func:`userinfo_end`). A URL's word that is
    no ``host[:port]`` and holds no ``@`` (``redis://:a`` of ``redis://:a b@h/0``: a
    password with a blank) runs on to the first ``@host[:port]`` of its line when no other
    ``@`` or URL comes before it. A userinfo whose first word reads as a host
    (``mooncake://se cret@h``) cannot be told from an address followed by text here: a
    URL whose ends are known goes through :func:`redact_url`."""
    parts: list[str] = []
    pos = 0
    while (m := _URL_WORD.search(text, pos)) is not None:
        rest = m.group(2)
        end = userinfo_end(rest)
        if end is not None:
            parts += [text[pos:m.start()], m.group(1), "***", rest[end:]]
            pos = m.end()
            continue
        if not _AUTHORITY.match(rest) and (at := _AT_HOST.search(text, m.end())) is not None:
            between = text[m.end():at.start()]
            if "\n" not in between and "@" not in between and "://" not in between:
                parts += [text[pos:m.start()], m.group(1), "***"]
                pos = at.start()
                continue
        parts.append(text[pos:m.end()])
        pos = m.end()
    parts.append(text[pos:])
    return "".join(parts)


def redact_url(url: str) -> str:
    """One URL (its ends known, not a word in a text) with its ``user:password@`` written
    ``***@``, whatever the password holds: a blank too, which ends a word for
    :func:`redact_credentials` (it looks past the blank only on the terms it says)."""
    scheme, sep, rest = url.partition("://")
    end = userinfo_end(rest) if sep else None
    return redact_credentials(url) if end is None else f"{scheme}://***{rest[end:]}"


def check_private_dir(path: str, *, what: str = "directory",
                      holds: str = "reach the sockets or keys") -> None:
    """Refuse (ConfigError) unless ``path`` is a real directory owned by this user that no
    one else can enter or list (mode 0700 or stricter). Symlinks are refused. ``holds``:
    what others could do in it otherwise, for the message."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise ConfigError(f"{what} {path}: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {path} is not a directory (a symlink or a file)")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"{what} {path} is owned by uid {st.st_uid}, not by this user "
                          f"(uid {os.geteuid()}); refusing to use it")
    if st.st_mode & 0o077:
        raise ConfigError(f"{what} {path} has mode {stat.S_IMODE(st.st_mode):o}; it must "
                          f"be 700 (others could {holds} in it)")


def make_private_dir(path: str, **check: str) -> str:
    """Create ``path`` (mode 0700), or check it when it exists (``check``: the wording of
    :func:`check_private_dir`); return it."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"cannot create {path}: {e.strerror}") from None
    check_private_dir(path, **check)
    return path


def user_root(base: str) -> str:
    """``{base}/zkv-{uid}``: this user's private root for run directories."""
    return make_private_dir(os.path.join(base, f"zkv-{os.geteuid()}"))


def make_run_dir(base: str, prefix: str = "run-") -> str:
    """A fresh private ``{base}/zkv-{uid}/{prefix}{pid}-{random}`` owned by this process.
    ConfigError (nothing left behind) when the file system cannot take it: full (a
    Docker container's 64 MB /dev/shm), out of inodes, read-only."""
    root = user_root(base)
    path = os.path.join(root, f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(path, 0o700)
        claim_dir(path)
    except OSError as e:
        shutil.rmtree(path, ignore_errors=True)
        raise ConfigError(f"cannot make a run directory in {root}: {e.strerror}") from None
    return path


def make_run_dir_in(bases: Sequence[str], prefix: str = "run-") -> str:
    """:func:`make_run_dir` in the first of ``bases`` that takes it (the fast /dev/shm,
    then the temporary directory); the last one's ConfigError when none does."""
    error = ConfigError("no directory to make a run directory in")
    for base in bases:
        try:
            return make_run_dir(base, prefix)
        except ConfigError as e:
            error = e
    raise error


def claim_dir(path: str) -> None:
    """Name this process the owner of the directory ``path`` (its owner file): once the
    process is gone, :func:`clean_stale_runs` may remove it."""
    owner = os.path.join(path, _OWNER_FILE)
    tmp = f"{owner}.{os.getpid()}"  # then renamed over it: never seen empty (unclaimed)
    with open(tmp, "w", encoding="ascii") as f:
        f.write(f"{os.getpid()} {_start_time(os.getpid())}\n")
    os.replace(tmp, owner)


#: A directory no process claimed for this long is a start that failed before its owner
#: claimed it (a vLLM engine's worker halves make its socket directory, its scheduler half
#: claims it: a scheduler half that failed at start never did): removed like a dead one.
UNCLAIMED_STALE_S = 3600.0


def clean_stale_runs(base: str, names: re.Pattern[str] | None = _RUN_NAME) -> list[str]:
    """Remove the directories under ``{base}/zkv-{uid}`` whose owner process is gone
    (killed with SIGKILL), or that no process claimed for ``UNCLAIMED_STALE_S``; return
    what was removed. Only directories with, unless ``names`` is None, a name it matches
    (what :func:`make_run_dir` makes); never follows symlinks."""
    root = os.path.join(base, f"zkv-{os.geteuid()}")
    if not os.path.isdir(root):
        return []
    check_private_dir(root)
    removed = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if ((names is not None and not names.match(name)) or os.path.islink(path)
                or not os.path.isdir(path) or not _stale(path)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def remove_run_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        shutil.rmtree(path)


def live_owner(path: str) -> int | None:
    """The pid of the live process other than this one that claimed ``path``
    (:func:`claim_dir`), or None (unclaimed, claimed by this process, or its owner gone)."""
    owner = _read_owner(path)
    if owner is None or owner[0] == os.getpid() or not _running(*owner):
        return None
    return owner[0]


def _stale(path: str) -> bool:
    """The run's owner file names a process that is gone (or was replaced by another with
    the same pid); or it has none (or none readable) and the directory has not changed for
    ``UNCLAIMED_STALE_S``."""
    owner = _read_owner(path)
    if owner is None:
        try:
            return time.time() - os.lstat(path).st_mtime > UNCLAIMED_STALE_S
        except OSError:
            return False
    return owner[0] != os.getpid() and not _running(*owner)


def _read_owner(path: str) -> tuple[int, str] | None:
    """(pid, start time) from ``path``'s owner file, None when it is missing or unreadable."""
    try:
        with open(os.path.join(path, _OWNER_FILE), encoding="ascii") as f:
            pid_text, start = f.read().split()
        return int(pid_text), start
    except (OSError, ValueError):
        return None


def _running(pid: int, start: str) -> bool:
    """Whether process ``pid`` is the one that started at ``start`` and still runs (another
    user's process: assumed so)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _start_time(pid) == start


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (Linux), ``"-"`` elsewhere."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "-"
