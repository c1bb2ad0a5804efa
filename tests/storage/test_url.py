"""open_store: every scheme, and one clear line for every bad URL."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.servers import free_port, make_tls
from zkv.errors import ConfigError
from zkv.storage import LocalDirStore, file_url, open_store
from zkv.storage.url import parse_url


def test_file_url_opens_a_local_dir_store(tmp_path: Path) -> None:
    s = open_store(f"file://{tmp_path}?max_bytes=4096&fsync=1", "ns")
    assert isinstance(s, LocalDirStore)
    assert (s.root, s.namespace, s.max_bytes, s.fsync) == (str(tmp_path), "ns", 4096, True)
    assert file_url(tmp_path) == f"file://{tmp_path}"


@pytest.mark.parametrize("name", ["a#b", "q?max_gb=1", "p%41", "a\tb", "sp ace",
                                  os.fsdecode(b"caf\xe9#x")])  # not UTF-8
def test_a_store_dir_is_the_directory_named_whatever_its_characters(
        tmp_path: Path, name: str) -> None:
    """``--store-dir`` maps to ``file_url``: a ``#``, ``?`` or ``%`` in the path was read as
    URL syntax (a fragment, a query, an escape) and the blocks went to another directory."""
    s = open_store(file_url(tmp_path / name), "ns")
    try:
        assert isinstance(s, LocalDirStore) and s.root == str(tmp_path / name)
        s.put_many([bytes(18)], [bytes(64)])
        assert os.listdir(tmp_path) == [name]
    finally:
        s.close()


def test_redis_and_mooncake_urls_open_even_with_no_server() -> None:
    port = free_port()  # nothing listens: the store starts disconnected, no exception
    r = open_store(f"redis://127.0.0.1:{port}/3?timeout_s=0.5", "ns")
    assert r.url == f"redis://127.0.0.1:{port}/3" and not r.link.up  # type: ignore[attr-defined]
    m = open_store(f"mooncake://127.0.0.1:{port}?segment_mb=0&buffer_mb=8", "ns")
    assert m.url == f"mooncake://127.0.0.1:{port}" and not m.link.up  # type: ignore[attr-defined]
    r.close()
    m.close()


@pytest.mark.parametrize("query, connect", [
    ("", 0.5), ("?timeout_s=0.1", 0.1), ("?timeout_s=5", 0.5),
    ("?timeout_s=5&connect_timeout_s=3", 3.0), ("?connect_timeout_s=0.05", 0.05)])
def test_a_redis_connect_waits_its_own_timeout_never_past_a_calls(query: str,
                                                                  connect: float) -> None:
    """A TCP connect waits ``connect_timeout_s`` (the URL's), by default 0.5 s or the call's
    ``timeout_s`` when that is shorter. (Before, 0.5 s fixed: a ``timeout_s=0.1`` call that
    connected waited up to 0.5 s, and a server slower than 0.5 s to connect to was never
    reached.)"""
    r = open_store(f"redis://127.0.0.1:{free_port()}/0{query}", "ns")  # nothing listens
    try:
        kw = r._client.connection_pool.connection_kwargs  # type: ignore[attr-defined]
        assert kw["socket_connect_timeout"] == connect
    finally:
        r.close()


@pytest.mark.parametrize("url, why", [
    ("/tmp/x", "expected SCHEME://"),
    ("s3://bucket", "unknown scheme 's3'"),
    ("file://host/tmp", "file:///abs/path"),
    ("file:///tmp?max_gb=1&max_bytes=2", "not both"),
    ("file:///tmp?max_gb=big", "max_gb='big' is not a float"),
    # int() / float() read "1_0" as 10: a typo of 1.0 was a budget ten times as large
    ("file:///tmp?max_gb=1_0", "max_gb='1_0' is not a float"),
    # ... and other scripts' digits, and blanks at an end (an encoded tab): taken as numbers
    ("redis://127.0.0.1:6379/0?ttl_s=\u0661\u0660", "ttl_s='\u0661\u0660' is not a int"),
    ("file:///tmp?max_bytes=\uff11\uff10", "max_bytes='\uff11\uff10' is not a int"),
    ("redis://127.0.0.1:6379/0?timeout_s=%20%201", "timeout_s='  1' is not a float"),
    ("redis://127.0.0.1:6379/0?ttl_s=%0930", "ttl_s='\\t30' is not a int"),
    ("mooncake://127.0.0.1:50051?segment_mb=6_4", "segment_mb='6_4' is not a int"),
    ("file:///tmp?max_gb=nan", "max_gb='nan' is not a finite number"),
    ("file:///tmp?max_gb=inf", "max_gb='inf' is not a finite number"),
    ("file:///tmp?fsync=maybe", "fsync='maybe' is not a bool"),
    ("file:///tmp?colour=red", "unknown parameter 'colour'"),
    ("redis://127.0.0.1", "needs HOST:PORT"),
    ("redis://[::1", "Invalid IPv6 URL"),
    ("redis://127.0.0.1:6379/zero", "database must be a number"),
    ("redis://127.0.0.1:6379/\u00b2", "database must be a number"),  # was: ValueError from int()
    ("redis://127.0.0.1:6379/0?timeout_s=0", "timeout_s must be > 0"),
    ("redis://127.0.0.1:6379/0?timeout_s=NaN", "timeout_s='NaN' is not a finite number"),
    ("mooncake://:50051", "needs HOST:PORT"),
    ("mooncake://127.0.0.1:50051?segment_mb=-1", "segment_mb must be >= 0"),
    ("mooncake://127.0.0.1:50051/x", "master only"),
    ("redis://127.0.0.1:6379/0?ttl_s=99999999999999999999", "ttl_s must be <= 1000000000000000"),
    ("redis://127.0.0.1:6379/0?ttl_s=60&ttl_s=70", "ttl_s is given twice"),
    ("file:///tmp/a#b", "'#' starts a fragment"),
    ("file:///tmp/a#", "'#' starts a fragment"),
    ("file:///tmp/l3%00x", "the path holds a NUL byte"),
    ("redis://127.0.0.1:0/0", "port 0 is no server's port"),
    ("redis://127.0.0.1:6379/0?timeout_s=1e-9", "timeout_s must be >= 0.001"),
    ("redis://127.0.0.1:6379/0?connect_timeout_s=0", "connect_timeout_s must be > 0"),
    ("rediss://127.0.0.1:6379/0?connect_timeout_s=soon", "connect_timeout_s='soon' is not a float"),
    ("mooncake://127.0.0.1:50051?timeout_s=0.0001", "timeout_s must be >= 0.001"),
    # past a socket's or a lock wait's range: an OverflowError traceback at open (redis,
    # with no server too), a Mooncake client whose every RPC timed out (an outage for good)
    ("redis://127.0.0.1:6379/0?connect_timeout_s=1e10", "connect_timeout_s must be <= 86400"),
    ("redis://127.0.0.1:6379/0?timeout_s=1e10", "timeout_s must be <= 86400"),
    ("mooncake://127.0.0.1:50051?timeout_s=86401", "timeout_s must be <= 86400"),
    # past 64 bits in bytes: the client's setup raised TypeError, taken for an outage
    (f"mooncake://127.0.0.1:50051?segment_mb={1 << 44}", "segment_mb must be <= 4294967296"),
    (f"mooncake://127.0.0.1:50051?buffer_mb={(1 << 32) + 1}", "buffer_mb must be <= 4294967296"),
    # was: past this check, refused by the store's constructor (under vLLM: after the model
    # loaded; zkv-check-vllm-config said ok)
    ("mooncake://127.0.0.1:50051?protocol=bogus", "protocol must be one of tcp, rdma, got "
                                                  "'bogus'"),  # was: an outage, retried
    ("mooncake://127.0.0.1:50051?header=junk", "header must be one of auto, inline, split, "
                                               "got 'junk'"),
])
def test_bad_url_is_one_clear_line(url: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        open_store(url, "ns")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"bad store URL {url!r}: ") and why in msg


@pytest.mark.parametrize("url, shown", [
    ("redis://:S3cr3tPW", "redis://***"),
    ("redis://default:S3cr3tPW", "redis://***"),
    ("rediss://default:S3cr3tPW", "rediss://***"),
    ("redis://default:S3cr3tPW/0", "redis://***/0"),
    ("redis://default:S3cr3tPW?timeout_s=1", "redis://***?timeout_s=1"),
    ("redis://:S3cr3tPW%40h:6379/0", "redis://***/0"),
    ("redis://:123456", "redis://***"),  # (all digits: a port out of range)
    ("redis://u:S3cr3tPW@h:x/0", "redis://***@h:x/0"),
    ("redis://127.0.0.1:99999/0", "redis://***/0"),
])
def test_a_bad_port_never_shows_what_may_be_a_password(url: str, shown: str) -> None:
    """Without an '@' a password is read as the port (an unset host variable, an '@'
    percent-encoded): Python's error quoted it, and the URL was shown with it. Before:
    ``bad store URL 'redis://:S3cr3tPW': Port could not be cast to integer value as
    'S3cr3tPW'``."""
    with pytest.raises(ConfigError) as info:
        open_store(url, "ns")
    assert str(info.value) == (f"bad store URL {shown!r}: the port must be a number in "
                               "[1, 65535] ([USER:PASSWORD@]HOST:PORT)")


def test_a_mooncake_url_with_credentials_is_refused_without_showing_them() -> None:
    """Mooncake has no auth: a user and password there were ignored, silently."""
    with pytest.raises(ConfigError) as info:
        open_store("mooncake://u:s3cret@127.0.0.1:50051", "ns")
    assert str(info.value) == ("bad store URL 'mooncake://***@127.0.0.1:50051': a Mooncake "
                               "master takes no user or password (it has no auth: keep it on "
                               "a network only the engines reach)")


def test_bad_namespace_and_writers(tmp_path: Path) -> None:
    for ns in ("", "a/b", ".hidden", "x\n"):
        with pytest.raises(ValueError, match="bad namespace"):
            open_store(file_url(tmp_path), ns)
    with pytest.raises(ValueError, match="writers"):
        open_store(file_url(tmp_path), "ns", writers=0)


def _refused_at_open(url: str) -> str:
    """The one line of the ConfigError that opening ``url`` raises."""
    with pytest.raises(ConfigError) as info:
        open_store(url, "ns")
    return str(info.value)


@pytest.mark.parametrize("url, shown", [
    ("redis://:pw@127.0.0.1:6379/zero", "redis://***@127.0.0.1:6379/zero"),
    ("redis://user:p@ss@127.0.0.1:6379/0?ttl_s=0", "redis://***@127.0.0.1:6379/0?ttl_s=0"),
    ("REDIS://:pw@127.0.0.1/0", "REDIS://***@127.0.0.1/0"),
])
def test_a_bad_url_never_shows_its_password(url: str, shown: str) -> None:
    msg = _refused_at_open(url)
    assert msg.startswith(f"bad store URL {shown!r}: ") and "pw" not in msg and "ss@" not in msg


@pytest.mark.parametrize("url, shown", [
    ("redis://:sec ret@127.0.0.1:99999/0", "redis://***@127.0.0.1:99999/0"),
    ("rediss://u:a b c@h:6380/x", "rediss://***@h:6380/x"),
])
def test_a_password_with_a_blank_is_never_shown(url: str, shown: str) -> None:
    """A blank inside a password (not percent-encoded) ended the word the redaction
    looked at, so a bad URL's error showed what followed it: ``ret`` of ``sec ret``."""
    from zkv.security import redact_url

    msg = _refused_at_open(url)
    assert msg.startswith(f"bad store URL {shown!r}: "), msg
    password = url.split("://")[1].rsplit("@", 1)[0]
    assert password not in msg and password.split()[-1] + "@" not in msg, msg
    assert redact_url(url) == shown
    assert redact_url("file:///tmp/my cache") == "file:///tmp/my cache"


@pytest.mark.parametrize("password", ["se/cret", "se?cret", "se#cret", "s/e?c#r@et", "pw"])
def test_a_password_with_url_delimiters_is_never_shown(password: str) -> None:
    """A password with an unescaped ``/``, ``?`` or ``#`` (base64 ones have ``/``) makes a
    URL that does not parse; its error showed the password (the mask stopped at the first
    delimiter)."""
    from zkv.security import redact_credentials

    for url in (f"redis://:{password}@127.0.0.1:1/0", f"rediss://u:{password}@h:6380/1?x=1",
                f"mooncake://{password}@h:50051"):
        shown = redact_credentials(f"--storage {url} --then file:///tmp/a@b")
        assert password not in shown and "cret" not in shown, shown
        assert shown.endswith(" --then file:///tmp/a@b"), shown
        if password == "pw":
            continue
        with pytest.raises(ConfigError, match=r"its user or password holds '/', '\?' or '#': "
                                              r"percent-encode them") as info:
            open_store(url, "ns")
        assert password not in str(info.value) and "cret" not in str(info.value)
    # an @ in a query value is not a password's end: the host stays shown
    assert redact_credentials("rediss://:pw@h:6380/0?ca=/x/a@b.pem") == \
        "rediss://***@h:6380/0?ca=/x/a@b.pem"
    assert redact_credentials("redis://:pw@") == "redis://***@"
    # percent-encoded, the same password is taken as it is
    from zkv.storage.url import parse_url

    assert parse_url("redis://:se%2Fc%3Fr%23et@h:1/0")[1]["password"] == "se/c?r#et"


def test_tls_file_paths_with_an_at_or_a_plus_are_the_files_named(tmp_path: Path) -> None:
    """A ``@`` in a file parameter's path (``certs@prod``) is no password's end: the URL
    was refused as a password holding '/'. A ``+`` in one is a ``+``: form decoding made
    it a space, so the store refused a file that exists, or took another file."""
    from zkv.storage.url import parse_url

    folder = tmp_path / "certs@prod+1"
    tls = make_tls(str(folder))
    shutil.copy(tls.ca, folder / "ca+prod.pem")
    (folder / "ca prod.pem").write_text("another file\n")
    url = (f"rediss://127.0.0.1:6380/0?ca={folder}/ca+prod.pem&cert={tls.cert}"
           f"&key={tls.key}")
    kw = parse_url(url)[1]
    assert (kw["tls_ca"], kw["tls_cert"], kw["tls_key"]) == (
        f"{folder}/ca+prod.pem", tls.cert, tls.key)
    assert kw["host"] == "127.0.0.1" and kw["username"] is None and kw["password"] is None
    assert parse_url(f"rediss://u:pw@127.0.0.1:6380/0?ca={folder}/ca%2Bprod.pem")[1][
        "tls_ca"] == f"{folder}/ca+prod.pem"
    # an @ elsewhere is still taken for a password's end, and refused without showing it
    for bad in ("redis://u:1?x@h:6379/0", f"rediss://u:p/w@h:6380/0?ca={tls.ca}"):
        with pytest.raises(ConfigError, match="its user or password holds") as info:
            parse_url(bad)
        assert "p/w" not in str(info.value) and "1?x" not in str(info.value)


@pytest.mark.parametrize("password", ["se cret", "q1q w2w e3e", "'r4r t5t", "y6y\tu7u",
                                      ": i8i"])
def test_a_password_with_a_blank_in_free_text_is_never_shown(password: str) -> None:
    """A command line (zkvrun's log of a rank's, an error that quotes one) holding a URL
    whose password has a blank: the URL's word ended at the blank, so what followed it was
    shown (``redis://:a b@h`` gave ``redis://:a b@h``: nothing redacted). (Configured
    URLs, whose ends are known, are redacted whole: ``redact_url``.)"""
    from zkv.security import redact_credentials

    for url in (f"redis://:{password}@127.0.0.1:6379/0", f"rediss://u:{password}@h:6380",
                f"redis://user:{password}@[::1]:6379/0?x=1"):
        shown = redact_credentials(f"-m zkv.worker --storage {url} --then "
                                   "file:///tmp/a@b")
        for word in password.replace(":", " ").replace("'", " ").split():
            assert word not in shown, shown
        assert "***@" in shown and shown.endswith(" --then file:///tmp/a@b"), shown


def test_redact_credentials_looks_past_a_blank_only_for_a_password() -> None:
    """What stays: a URL whose word is a host and port (an address after it is no
    password's end), and a word with no ``@host`` on its line or another URL or ``@``
    between them."""
    from zkv.security import redact_credentials

    for text in ("redis://h:6379/0 failed; ask admin@example.com",
                 "redis://:a\nb@h:1/0", "redis://:a then mooncake://h:2 b@h:1",
                 "redis://:a b@ c@h:1", "redis://:a b"):
        assert redact_credentials(text) == text, text


def test_redact_credentials_leaves_everything_else() -> None:
    from zkv.security import redact_credentials

    cmd = "-m zkv.x --storage=redis://:a@b@h:1/0 --to mooncake://h:2 file:///tmp/a@b"
    assert redact_credentials(cmd) == ("-m zkv.x --storage=redis://***@h:1/0 --to mooncake://h:2 "
                                       "file:///tmp/a@b")


@pytest.mark.parametrize("url, why", [
    # a host the resolver cannot encode: UnicodeError (a ValueError) escaped the redis
    # store's open; Mooncake's reconnect thread retried it for good, as an outage
    ("redis://a..b:6379/0", "host 'a..b' is no host name"),
    (f"rediss://{'x' * 64}.example:6380/0", "is no host name"),
    ("mooncake://.master:50051", "host '.master' is no host name"),
    # past a C int: the server answered SELECT "value is out of range", not "no such
    # database": the store opened without a word and failed every call
    ("redis://127.0.0.1:6379/2147483648", "database must be <= 2147483647"),
])
def test_a_url_no_server_can_serve_is_refused_at_open(url: str, why: str) -> None:
    msg = _refused_at_open(url)
    assert "\n" not in msg and msg.startswith(f"bad store URL {url!r}: ") and why in msg
    from zkv.storage.url import parse_url

    assert parse_url("redis://127.0.0.1:6379/2147483647")[1]["db"] == 2**31 - 1
    assert parse_url("redis://[::1]:6379/0")[1]["host"] == "::1"


@pytest.mark.parametrize("url", [
    "file:///tmp/a\tb",          # was the store /tmp/ab (urlsplit drops a tab)
    "file:///tmp/x ",            # was the store '/tmp/x ' (a pasted variable's blank)
    " file:///tmp/x",
    "redis://:pa\nss@127.0.0.1:6379/0",  # was the password 'pass'
    "file:///tmp/x\x7f",
])
def test_a_url_with_a_control_character_or_an_outer_blank_is_refused(url: str) -> None:
    with pytest.raises(ConfigError, match="control character") as info:
        parse_url(url)
    assert "pa\nss" not in str(info.value) and "ss@" not in str(info.value)
    assert parse_url("file:///tmp/my dir")[1]["root"] == "/tmp/my dir"  # an inner blank: kept


def test_a_store_on_an_ipv6_address_shows_a_url_that_parses_back() -> None:
    """Was ``redis://::1:1/0``: the URL in the store's logs and the replay summary did not
    parse back (nor say which part was the port)."""
    store = open_store("redis://[::1]:1/0?timeout_s=0.2", "ns")  # (no server: misses)
    try:
        assert store.url == "redis://[::1]:1/0"
        assert parse_url(store.url) == parse_url("redis://[::1]:1/0")
    finally:
        store.close()
