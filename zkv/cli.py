"""``zkv``: command-line entry point.

::

    zkv logs [-f] DIR [--rank R ...] [--seq N] [--level L] [--event SUBSTR] [--json]
    zkv replay ARGS ...      # everything after "replay" goes to zkv.replay.main unparsed
    zkv keys DIR --world-size N   # CURVE keys: the scheduler's and one pair per rank
    zkv soak ARGS ...        # replay with faults injected at random (zkv soak -h)

Ctrl-C before a command has its own handler is one line (``zkv replay: interrupted``) and
status 130, not a traceback. This module imports nothing heavy at its top; the command's
module (``zkv.replay``: numpy, zmq, ... about 0.5 s) is imported with SIGINT held back until
it is loaded (a KeyboardInterrupt raised inside a C extension's init came out as numpy's
ImportError, or a crash); ``zkv replay``'s scheduler node starts through here too
(``-m zkv.cli replay --node``). What remains is the interpreter's own start, before any of
zkv runs (``site`` and the entry script: some 40 ms).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from zkv import __version__
from zkv.argtypes import integer

if TYPE_CHECKING:
    import argparse

EXIT_INTERRUPTED = 128 + 2  # SIGINT, as a shell reports it


def build_parser() -> argparse.ArgumentParser:
    import argparse

    from zkv import logview

    p = argparse.ArgumentParser(prog="zkv", description="zkv: hierarchical KV-cache manager.")
    p.add_argument("--version", action="version", version=f"zkv {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    logs = sub.add_parser("logs", help="merge, filter and follow the logs of a run",
                          description="Merge the *.jsonl logs of DIR by time and print them.")
    logview.add_arguments(logs)
    sub.add_parser("replay", add_help=False, help="replay a trace through zkvrun (zkv replay -h)")
    sub.add_parser("soak", add_help=False, help="replay with faults injected (zkv soak -h)")
    keys = sub.add_parser("keys", help="create CURVE keys for a group (zkvrun --keys DIR)",
                          description="Write the scheduler's key pair and one key pair per "
                                      "rank into a new 0700 directory DIR. The scheduler node "
                                      "needs all of it; rank r's node needs the public keys "
                                      "(server.key, every rank-N.key) and its own "
                                      "rank-r.key_secret.")
    keys.add_argument("dir")
    keys.add_argument("--world-size", type=integer, required=True)  # (range: generate)
    return p


def _keys(ns: argparse.Namespace) -> int:
    import os

    from zkv.errors import ConfigError
    from zkv.security import Keyring

    if os.path.lexists(ns.dir):
        print(f"zkv keys: error: {ns.dir} already exists (keys are never overwritten)",
              file=sys.stderr)
        return 2
    try:
        Keyring.generate(ns.world_size).save(ns.dir)
    except ConfigError as e:
        print(f"zkv keys: error: {e}", file=sys.stderr)
        return 2
    print(f"zkv keys: wrote the server key and {ns.world_size} rank keys to {ns.dir}")
    return 0


@contextmanager
def _sigint_held() -> Iterator[None]:
    """SIGINT recorded, not raised, inside; a KeyboardInterrupt at the end if one came."""
    got: list[int] = []
    previous: Callable[..., Any] | int | None = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, lambda signum, _frame: got.append(signum))
        held = True
    except ValueError:  # not the main thread: signals are its caller's
        held = False
    try:
        yield
    finally:
        if held:
            signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
    if got:
        raise KeyboardInterrupt


def _replay(argv: list[str]) -> int:
    try:
        with _sigint_held():
            from zkv.replay import main as replay_main  # lazily: `zkv logs` works without it
    except ModuleNotFoundError as e:
        if e.name != "zkv.replay":
            raise
        print("zkv replay: not available in this installation (no zkv.replay)", file=sys.stderr)
        return 2
    return int(replay_main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before the command's own handler (see the docstring)
        name = f"zkv {argv[0]}" if argv[:1] in (["replay"], ["soak"]) else "zkv"
        print(f"{name}: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def _main(argv: list[str]) -> int:
    if argv[:1] == ["replay"]:
        # Not through argparse: it would eat or reject replay's own options (-h, --x=...).
        return _replay(argv[1:])
    if argv[:1] == ["soak"]:
        with _sigint_held():
            from zkv.soak import main as soak_main

        return int(soak_main(argv[1:]) or 0)
    ns = build_parser().parse_args(argv)
    if ns.command == "logs":
        from zkv import logview

        return logview.run_args(ns)
    if ns.command == "keys":
        return _keys(ns)
    raise AssertionError(f"unhandled command {ns.command!r}")


if __name__ == "__main__":
    sys.exit(main())
