"""``rediss://``: Redis over TLS with an ACL user, against a real TLS-only redis-server
(tests/conftest.py ``rediss_server``; every backend test runs on it too). What must not
work does not: a plain client, a CA that did not sign the server's certificate, no
password; and the URL's files are checked before anything connects."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from tests.replay_run import summary
from tests.servers import HOST, RedisServer, binary
from zkv.errors import ConfigError, StorageError
from zkv.storage import open_store, pack_key
from zkv.storage.redis_store import RedisStore

KEY = pack_key(b"\x07" * 16, 0)
BLOCK = np.arange(4096, dtype=np.uint16).view(np.uint8)


def _refused(url: str, hint: str | None = None) -> str:
    """The store opens (a server it cannot use is no error at open), logs why once, and
    every call fails fast; the logged error. ``hint``: what the line must say to do (else
    it says nothing more)."""
    with capture_logs() as logs:
        store = open_store(url, "ns")
    try:
        with pytest.raises(StorageError, match="unreachable"):
            store.put(KEY, BLOCK)
        [event] = [e for e in logs if e["event"] == "storage.store_unreachable"]
        assert (hint is None and "hint" not in event) or hint in event["hint"], event
        return str(event["error"])
    finally:
        store.close()


def test_a_round_trip_over_tls_is_bit_identical(rediss_server: RedisServer) -> None:
    store = open_store(rediss_server.url, "ns")
    try:
        assert isinstance(store, RedisStore)
        assert store.url == f"rediss://{HOST}:{rediss_server.port}/0"  # no password shown
        store.put(KEY, BLOCK)
        out = np.zeros_like(BLOCK)
        assert store.get_into(KEY, out) and out.tobytes() == BLOCK.tobytes()
    finally:
        store.close()
    assert rediss_server.client().exists(store.name(KEY)) == 1  # on that server


def test_what_must_not_connect_does_not(rediss_server: RedisServer) -> None:
    tls = rediss_server.tls
    assert tls is not None
    port = rediss_server.port
    # a plain client on the TLS port: the server speaks TLS only
    assert _refused(f"redis://zkv:s3cret@{HOST}:{port}/0?timeout_s=0.5")
    # a CA that signed nothing here: the server's certificate is refused
    assert "certificate verify failed" in _refused(
        f"rediss://zkv:s3cret@{HOST}:{port}/0?ca={tls.other_ca}&timeout_s=0.5")
    # the host name checked: the certificate names 127.0.0.1, not localhost
    assert "certificate verify failed" in _refused(
        f"rediss://zkv:s3cret@localhost:{port}/0?ca={tls.ca}&timeout_s=0.5")
    # right CA, wrong password or none (the default user is off)
    # (a wrong password was an outage like any other, retried forever without a word)
    hint = "the server refused the URL's credentials: check its user and password"
    assert "invalid username-password pair" in _refused(
        f"rediss://zkv:nope@{HOST}:{port}/0?ca={tls.ca}", hint)
    assert "authenticated" in _refused(f"rediss://{HOST}:{port}/0?ca={tls.ca}", hint)


@pytest.mark.parametrize("query, why", [
    ("ca=/nonexistent/ca.pem", "ca='/nonexistent/ca.pem' is not a readable file"),
    ("ca={ca}&cert={ca}", "give cert and key together"),
    ("key={ca}", "give cert and key together"),
    ("ca={ca}&colour=red", "unknown parameter 'colour'"),
])
def test_bad_tls_parameters_are_one_line(rediss_server: RedisServer, query: str,
                                         why: str) -> None:
    assert rediss_server.tls is not None
    url = f"rediss://:pw@{HOST}:1/0?" + query.format(ca=rediss_server.tls.ca)
    with pytest.raises(ConfigError) as info:
        open_store(url, "ns")
    assert why in str(info.value) and "pw" not in str(info.value)
    with pytest.raises(ConfigError, match="unknown parameter 'ca'"):
        open_store(f"redis://{HOST}:1/0?ca={rediss_server.tls.ca}", "ns")  # TLS is rediss


def test_an_encrypted_or_unloadable_client_key_is_one_line(rediss_server: RedisServer,
                                                             tmp_path: Path) -> None:
    """An encrypted client key made OpenSSL ask for its passphrase on the terminal at every
    connect: an engine started from a shell hung at open (without a terminal the server
    was taken for down and retried for ever). A certificate with another's key, or a CA
    file that is no certificate, was an outage too. Each is one line at open now."""
    tls = rediss_server.tls
    assert tls is not None
    enc = str(tmp_path / "enc.key")
    subprocess.run([binary("openssl"), "ec", "-in", tls.key, "-aes256", "-passout", "pass:x",
                    "-out", enc], check=True, capture_output=True, timeout=30)
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("not a certificate\n")
    base = f"rediss://:pw@{HOST}:1/0?ca={tls.ca}"
    for url, why in [(f"{base}&cert={tls.cert}&key={enc}", f"key={enc!r} is encrypted"),
                     (f"{base}&cert={tls.other_ca}&key={tls.key}", "do not load as a "
                                                                   "certificate and its key"),
                     (f"rediss://:pw@{HOST}:1/0?ca={not_pem}", "holds no PEM certificate")]:
        with pytest.raises(ConfigError) as info:
            open_store(url, "ns")
        assert why in str(info.value) and "pw" not in str(info.value), info.value


def test_replay_through_tls_loads_what_it_stored(rediss_server: RedisServer,
                                                 tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "zkv.cli", "replay", "--no-progress", "--requests", "120",
         "--device-blocks", "512", "--host-blocks", "512", "--storage", rediss_server.url,
         "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=300)
    s = summary(proc)
    assert s.verified > 0 and (s.mismatched, s.failed_ops, s.store_dropped) == (0, 0, 0)
    assert s.stored > 0
    loaded = int(proc.stdout.split("storage      loaded ")[1].split()[0])
    assert loaded > 0, proc.stdout  # read back through TLS, verified byte for byte
    assert "s3cret" not in proc.stdout + proc.stderr and "warning" not in proc.stderr
