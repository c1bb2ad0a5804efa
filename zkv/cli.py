"""``zkv``: command-line entry point.

::

    zkv logs [-f] DIR [--rank R ...] [--seq N] [--level L] [--event SUBSTR] [--json]
    zkv replay ARGS ...      # everything after "replay" goes to zkv.replay.main unparsed
    zkv keys DIR --world-size N   # CURVE keys: the scheduler's and one pair per rank
    zkv soak ARGS ...        # replay with faults injected at random (zkv soak -h)
"""

from __future__ import annotations

import argparse
import os
import sys

from zkv import __version__, logview


def build_parser() -> argparse.ArgumentParser:
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
    keys.add_argument("--world-size", type=int, required=True)
    return p


def _keys(ns: argparse.Namespace) -> int:
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


def _replay(argv: list[str]) -> int:
    try:
        from zkv.replay import main as replay_main  # lazily: `zkv logs` works without it
    except ModuleNotFoundError as e:
        if e.name != "zkv.replay":
            raise
        print("zkv replay: not available in this installation (no zkv.replay)", file=sys.stderr)
        return 2
    return int(replay_main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["replay"]:
        # Not through argparse: it would eat or reject replay's own options (-h, --x=...).
        return _replay(argv[1:])
    if argv[:1] == ["soak"]:
        from zkv.soak import main as soak_main

        return int(soak_main(argv[1:]) or 0)
    ns = build_parser().parse_args(argv)
    if ns.command == "logs":
        return logview.run_args(ns)
    if ns.command == "keys":
        return _keys(ns)
    raise AssertionError(f"unhandled command {ns.command!r}")


if __name__ == "__main__":
    sys.exit(main())
