"""Records that hold secret keys leave them out of ``repr`` (a logged or printed record,
a traceback's locals, never shows one)."""

from __future__ import annotations

import dataclasses

from zkv.security import ClientKeys, Keyring


def test_a_keyring_repr_shows_no_secret_key() -> None:
    keyring = Keyring.generate(2)
    shown = repr(keyring)
    secrets = [keyring.server_secret, *keyring.rank_secrets.values()]
    assert all(s and s.decode() not in shown and repr(s) not in shown for s in secrets)
    assert shown == (f"Keyring(server_public={keyring.server_public!r}, "
                     f"rank_publics={keyring.rank_publics!r})")
    # (the secrets are still fields: equality, replace() and for_rank() use them)
    assert dataclasses.replace(keyring) == keyring
    assert keyring.for_rank(1).secret == keyring.rank_secrets[1]


def test_client_keys_repr_shows_no_secret_key() -> None:
    keys = Keyring.generate(1).for_rank(0)
    shown = repr(keys)
    assert keys.secret.decode() not in shown and repr(keys.secret) not in shown
    assert shown == (f"ClientKeys(rank=0, server_public={keys.server_public!r}, "
                     f"public={keys.public!r})")
    assert ClientKeys(0, keys.server_public, keys.public, b"x" * 40) != keys
