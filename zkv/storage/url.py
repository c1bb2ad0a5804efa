"""``open_store(url, namespace)``: an L3 store chosen by URL.

::

    file:///abs/path[?max_gb=G|max_bytes=N][&fsync=1][&keep_days=D]   LocalDirStore (default)
                        [&query_timeout_s=Q]
    redis://[[user]:password@]HOST:PORT[/DB][?timeout_s=T][&connect_timeout_s=C][&ttl_s=S]
                                                                RedisStore (Redis / Valkey)
    rediss://...[?ca=CA.pem][&cert=C.pem&key=K.pem]             the same over TLS: the server's
                        certificate checked against ``ca`` (else the system's CAs) and its
                        host name; ``cert`` + ``key`` when the server asks for a client's
    mooncake://HOST:PORT[?segment_mb=M][&buffer_mb=B][&timeout_s=T][&protocol=tcp]
                        [&header=auto|inline|split]             MooncakeStore (master address)

``writers``: how many processes write the same local directory (the ranks of a group);
each gets ``max_bytes / writers`` of the budget, and ``rank`` names the writer: its store
indexes and evicts only its own rank's files (see zkv/storage/local.py). ``keep_days``
(7; 0: this store removes none): the other namespaces under a ``file://`` root that no
store has open and none used that long are removed when a store opens
(zkv/storage/namespaces.py). ``query_timeout_s``: the scheduler's existence query on the
directory waits at most this long (default: 1 s on a network or FUSE file system, where a
``stat`` can hang for good; unbounded on a local one; zkv/storage/query.py). A bad URL
raises :class:`~zkv.errors.ConfigError` with one line saying what is wrong.
"""

from __future__ import annotations

import math
import os
import ssl
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, unquote_to_bytes, urlsplit

from zkv.errors import ConfigError
from zkv.security import redact_url, userinfo_end
from zkv.storage.base import Store

SCHEMES = ("file", "redis", "rediss", "mooncake")
_REDIS_PARAMS: dict[str, type] = {"timeout_s": float, "connect_timeout_s": float, "ttl_s": int}
_TLS_FILES = ("ca", "cert", "key")
_PARAMS = {
    "file": {"max_gb": float, "max_bytes": int, "fsync": bool, "keep_days": float,
             "query_timeout_s": float},
    "redis": _REDIS_PARAMS,
    "rediss": {**_REDIS_PARAMS, **dict.fromkeys(_TLS_FILES, str)},
    "mooncake": {"segment_mb": int, "buffer_mb": int, "timeout_s": float, "protocol": str,
                 "header": str},
}
#: Parameters with a fixed set of values (checked here: before, a bad one passed the URL's
#: check and failed only in the store's constructor, under vLLM after the model loaded).
MOONCAKE_HEADER_MODES = ("auto", "inline", "split")
MOONCAKE_PROTOCOLS = ("tcp", "rdma")  # (another was an outage, retried for good)
_CHOICES = {("mooncake", "header"): MOONCAKE_HEADER_MODES,
            ("mooncake", "protocol"): MOONCAKE_PROTOCOLS}


# Upper bounds where the server would refuse every call: redis refuses an EX whose expiry in
# ms passes a 64-bit integer ("invalid expire time in 'set' command" on each SET; 9e15 was
# taken, 1e16 refused).
_MAX = {"ttl_s": 10**15,
        # a day: past a socket's or a lock wait's range, a store call that waits longer is
        # a hung store (1e10 was an OverflowError traceback at open, a Mooncake client whose
        # every RPC timed out at once: an outage for good, the master blamed)
        "timeout_s": 86400, "connect_timeout_s": 86400, "query_timeout_s": 86400,
        # 4 PiB: far past any host's memory (the client refuses what it cannot have), and
        # within 64 bits in bytes (a size past them broke the client's setup: an outage)
        "segment_mb": 1 << 32, "buffer_mb": 1 << 32}
# Lower bounds where every call would time out on a healthy server (and say it is down).
_MIN = {"timeout_s": 0.001, "connect_timeout_s": 0.001, "query_timeout_s": 0.001}
# Redis numbers databases with a C int: SELECT of a larger one is "value is out of range".
_MAX_DB = 2**31 - 1


def authority(host: str, port: int) -> str:
    """``host:port`` as a URL writes it: an IPv6 address in brackets (else the URL a store
    shows, in its logs and the replay summary, did not parse back)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bad(url: str, why: str) -> ConfigError:
    return ConfigError(f"bad store URL {redact_url(url)!r}: {why}")


def _params(url: str, scheme: str, query: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, raw in _query_pairs(query):
        kind = _PARAMS[scheme].get(name)
        if kind is None:
            raise _bad(url, f"unknown parameter {name!r} (known: {', '.join(_PARAMS[scheme])})")
        if name in out:
            raise _bad(url, f"{name} is given twice")
        try:
            if kind is bool:
                if raw not in ("0", "1", "true", "false"):
                    raise ValueError(raw)
                out[name] = raw in ("1", "true")
            elif kind in (int, float) and ("_" in raw or not raw.isascii()
                                           or raw != raw.strip()):
                # (int(), float(): "1_0" is 10, "١٠" and a full-width "１０" too, and they
                # take blanks at either end: an encoded tab, "%20%201")
                raise ValueError(raw)
            else:
                out[name] = kind(raw)
        except ValueError:
            raise _bad(url, f"{name}={raw!r} is not a {kind.__name__}") from None
        choices = _CHOICES.get((scheme, name))
        if choices is not None and out[name] not in choices:
            raise _bad(url, f"{name} must be one of {', '.join(choices)}, got {raw!r}")
        if kind is float and not math.isfinite(out[name]):
            raise _bad(url, f"{name}={raw!r} is not a finite number")
        if name in ("segment_mb", "keep_days"):  # 0: a client that mounts no segment
            if out[name] < 0:  # (others' segments serve it); a store that removes nothing
                raise _bad(url, f"{name} must be >= 0")
        elif kind in (int, float) and out[name] <= 0:
            raise _bad(url, f"{name} must be > 0")
        if name in _MAX and out[name] > _MAX[name]:
            raise _bad(url, f"{name} must be <= {_MAX[name]}")
        if name in _MIN and out[name] < _MIN[name]:
            raise _bad(url, f"{name} must be >= {_MIN[name]} (1 ms)")
    return out


def _check_credentials(url: str, parts: Any) -> None:
    """A user or password with an unescaped ``/``, ``?`` or ``#`` ends the URL's host part
    early: what follows parses as a host, port, path or query, and the error would quote a
    piece of the password. One line that says so, naming no piece of it."""
    if _ats_in_file_paths_only(parts):
        return
    rest = url.split("://", 1)[1]
    end = userinfo_end(rest)
    if end is not None and any(c in rest[:end] for c in "/?#"):
        raise _bad(url, "its user or password holds '/', '?' or '#': percent-encode them "
                        "(%2F, %3F, %23)")


def _ats_in_file_paths_only(parts: Any) -> bool:
    """Every ``@`` of the URL (``urlsplit``'s ``parts``) is in the value of a file parameter
    (``ca=/certs@prod/ca.pem``): no user or password there. (Such a URL was refused as a
    password holding '/'.)"""
    if "@" in parts.netloc or "@" in parts.path or "@" in parts.fragment:
        return False
    return all("@" not in name and ("@" not in value or name in _TLS_FILES)
               for name, value in _query_pairs(parts.query))


def _query_pairs(query: str) -> list[tuple[str, str]]:
    """The query's ``name=value`` pairs, percent-decoded; a ``+`` stays a ``+`` (a file
    name's: form decoding made it a space, naming another file)."""
    return parse_qsl(query.replace("+", "%2B"), keep_blank_values=True, strict_parsing=False)


def _check_characters(url: str) -> None:
    """urlsplit drops a tab or a newline anywhere in a URL and blanks before it, and keeps
    blanks after it: ``file:///tmp/a<TAB>b`` was the store ``/tmp/ab``, ``file:///tmp/x ``
    (a trailing space from a pasted variable) ``/tmp/x ``, a newline in a password another
    password. Refused: a control character anywhere, a blank at either end."""
    if url != url.strip() or any(ord(c) < 0x20 or ord(c) == 0x7F for c in url):
        # (shown percent-encoded: a blank or newline in a password hid it from the redaction)
        shown = "".join(c if 0x20 < ord(c) != 0x7F else f"%{ord(c):02X}" for c in url)
        raise _bad(shown, "it holds a control character (a tab, a newline) or a blank at an "
                          "end: percent-encode one that belongs to a path (%09, %20)")


def _host_port(url: str, parts: Any) -> tuple[str, int]:
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        # Not Python's words, which quote the port: without an '@' a password is read as
        # one (``redis://:PW``, ``redis://user:PW/0``), so the authority is not shown.
        shown = url if "@" in parts.netloc else url.replace(parts.netloc, "***", 1)
        raise _bad(shown, "the port must be a number in [1, 65535] "
                          "([USER:PASSWORD@]HOST:PORT)") from None
    if not host or port is None:
        raise _bad(url, "needs HOST:PORT")
    if port == 0:
        raise _bad(url, "port 0 is no server's port")
    try:  # as the resolver encodes it (a UnicodeError, not an OSError, escaped the store's
        host.encode("idna")  # open, or was retried for good as an outage)
    except UnicodeError:
        raise _bad(url, f"host {host!r} is no host name (a label empty or longer than 63 "
                        "characters)") from None
    return host, port


def parse_url(url: str, writers: int = 1) -> tuple[str, dict[str, Any]]:
    """``(scheme, constructor keywords)`` of a store URL, without connecting anywhere;
    :class:`ConfigError` (one line) if it is bad."""
    if not isinstance(url, str) or "://" not in url:
        raise _bad(str(url), f"expected SCHEME://..., one of {', '.join(SCHEMES)}")
    _check_characters(url)
    try:
        parts = urlsplit(url)
    except ValueError as e:  # "Invalid IPv6 URL" ("redis://[::1")
        raise _bad(url, str(e)) from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise _bad(url, f"unknown scheme {scheme!r} (one of {', '.join(SCHEMES)})")
    _check_credentials(url, parts)
    if parts.fragment or url.endswith("#"):  # dropped by urlsplit: a path cut short
        raise _bad(url, "'#' starts a fragment, which a store URL has none of "
                        "(percent-encode a '#' in a path as %23)")
    if writers < 1:
        raise ValueError(f"writers must be >= 1, got {writers}")
    params = _params(url, scheme, parts.query)
    if scheme == "file":
        return scheme, _file_kw(url, parts, params, writers)
    host, port = _host_port(url, parts)
    if scheme in ("redis", "rediss"):
        path = parts.path.strip("/") or "0"
        if not (path.isascii() and path.isdigit()):  # ('²' is a digit to str.isdigit)
            raise _bad(url, f"database must be a number, got {path!r}")
        if int(path) > _MAX_DB:  # (before, the store opened without a word and every
            raise _bad(url, f"database must be <= {_MAX_DB}")  # call failed: out of range)
        password = unquote(parts.password) if parts.password else None
        username = unquote(parts.username) if parts.username else None
        if scheme == "rediss":
            params = _tls_kw(url, params)
        return scheme, dict(host=host, port=port, db=int(path), username=username,
                            password=password, **params)
    if parts.path not in ("", "/"):
        raise _bad(url, "a mooncake URL names the master only (no path)")
    if parts.username or parts.password:
        raise _bad(url, "a Mooncake master takes no user or password (it has no auth: keep "
                        "it on a network only the engines reach)")
    if "segment_mb" in params:
        params["segment_bytes"] = params.pop("segment_mb") << 20
    if "buffer_mb" in params:
        params["buffer_bytes"] = params.pop("buffer_mb") << 20
    return scheme, dict(host=host, port=port, **params)


def _tls_kw(url: str, params: dict[str, Any]) -> dict[str, Any]:
    """``rediss://``'s files, each a readable file; ``cert`` and ``key`` go together."""
    for name in _TLS_FILES:
        path = params.get(name)
        if path is not None and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            raise _bad(url, f"{name}={path!r} is not a readable file")
    if ("cert" in params) != ("key" in params):
        raise _bad(url, "give cert and key together (a client certificate and its key)")
    _check_tls_files(url, params.get("ca"), params.get("cert"), params.get("key"))
    return {"tls": True, "tls_ca": params.pop("ca", None), "tls_cert": params.pop("cert", None),
            "tls_key": params.pop("key", None), **params}


def _check_tls_files(url: str, ca: str | None, cert: str | None, key: str | None) -> None:
    """Load the files as the client will. An encrypted key made OpenSSL ask for its
    passphrase on the terminal at every connect (an engine started from a shell hung at
    open; without a terminal the server was taken for down, retried for ever); a file
    that is not PEM, or a key not the certificate's, was an outage too."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca is not None:
        try:
            ctx.load_verify_locations(cafile=ca)
        except ssl.SSLError as e:
            raise _bad(url, f"ca={ca!r} holds no PEM certificate ({e.reason or e})") from None
    if cert is None or key is None:
        return
    asked: list[bool] = []

    def passphrase() -> str:
        asked.append(True)
        raise ValueError("encrypted")

    try:
        ctx.load_cert_chain(cert, key, password=passphrase)
    except (ssl.SSLError, ValueError) as e:
        if asked:
            raise _bad(url, f"key={key!r} is encrypted (a passphrase): give an unencrypted "
                            "key file, readable by the engine's user alone") from None
        raise _bad(url, f"cert={cert!r} and key={key!r} do not load as a certificate and "
                        f"its key ({getattr(e, 'reason', None) or e})") from None


def open_store(url: str, namespace: str, *, writers: int = 1, rank: int | None = None,
               block_bytes: int | None = None) -> Store:
    """The store ``url`` names, in ``namespace`` (the layout fingerprint); ``rank``: the
    rank whose blocks this process writes (a worker's), None for a reader (the scheduler).
    ``block_bytes``: one stored block, header included: a ``file://`` budget that holds
    none on each writer is refused (it would store nothing, silently).

    A redis or mooncake server that is down is no error here: the store starts
    disconnected, every call fails fast (a miss on the scheduler side) and it reconnects
    when the server is back.
    """
    scheme, kw = parse_url(url, writers)
    if scheme == "file":
        from zkv.storage.local import LocalDirStore

        check_budget(url, kw, writers, block_bytes)

        return LocalDirStore(kw.pop("root"), namespace, rank=rank, **kw)
    if scheme in ("redis", "rediss"):
        from zkv.storage.redis_store import RedisStore

        return RedisStore(kw.pop("host"), kw.pop("port"), kw.pop("db"), namespace, **kw)
    from zkv.storage.mooncake_store import MooncakeStore

    return MooncakeStore(kw.pop("host"), kw.pop("port"), namespace, **kw)


def check_budget(url: str, kw: dict[str, Any], writers: int, block_bytes: int | None
                 ) -> None:
    """Refuse a ``file://`` budget (``kw`` from :func:`parse_url`) that holds no block of
    ``block_bytes`` on each of ``writers``."""
    per_writer = kw.get("max_bytes")
    if block_bytes is not None and per_writer is not None and per_writer < block_bytes:
        raise _bad(url, f"a budget of {per_writer} bytes per writer ({writers} writers) "
                        f"holds no block of {block_bytes} bytes; give a larger max_gb")


def _file_kw(url: str, parts: Any, params: dict[str, Any], writers: int) -> dict[str, Any]:
    if parts.netloc not in ("", "localhost"):
        raise _bad(url, "file URLs name a local path: file:///abs/path")
    path = os.fsdecode(unquote_to_bytes(parts.path))  # a name not in UTF-8 too (file_url)
    if not path.startswith("/"):
        raise _bad(url, "the path must be absolute: file:///abs/path")
    if "\0" in path:
        raise _bad(url, "the path holds a NUL byte (%00)")
    max_bytes = params.get("max_bytes")
    if "max_gb" in params:
        if max_bytes is not None:
            raise _bad(url, "give max_gb or max_bytes, not both")
        max_bytes = int(params["max_gb"] * (1 << 30))
    if max_bytes is not None:
        max_bytes = max(1, max_bytes // writers)
    kw = dict(root=path, max_bytes=max_bytes, fsync=params.get("fsync", False),
              writers=writers)
    for name in ("keep_days", "query_timeout_s"):
        if name in params:
            kw[name] = params[name]
    return kw


def store_url_from_env(env: Mapping[str, str]) -> tuple[str, str] | None:
    """The L3 store a ``zkv.worker`` rank opens: ``(variable, URL)`` from
    ``ZKV_STORE_URL``, else the older ``ZKV_STORE_DIR`` (a directory); None without."""
    if env.get("ZKV_STORE_URL"):
        return "ZKV_STORE_URL", env["ZKV_STORE_URL"]
    if env.get("ZKV_STORE_DIR"):
        return "ZKV_STORE_DIR", file_url(env["ZKV_STORE_DIR"])
    return None


def file_url(path: str | os.PathLike[str]) -> str:
    """``file://`` URL of a local directory (what ``--store-dir`` maps to), its path
    percent-encoded: a ``#``, ``?`` or ``%`` in it stays part of the path."""
    return "file://" + quote(os.fsencode(os.path.abspath(os.fspath(path))), safe="/")
