"""``zkv``: command-line entry point.

::

    zkv logs [-f] DIR [--rank R ...] [--seq N] [--level L] [--event SUBSTR] [--json]
    zkv replay ARGS ...      # everything after "replay" goes to zkv.replay.main unparsed
"""

from __future__ import annotations

import argparse
import sys

from zkv import logview


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zkv", description="zkv: hierarchical KV-cache manager.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    logs = sub.add_parser("logs", help="merge, filter and follow the logs of a run",
                          description="Merge the *.jsonl logs of DIR by time and print them.")
    logview.add_arguments(logs)
    sub.add_parser("replay", add_help=False, help="replay a trace through zkvrun (zkv replay -h)")
    return p


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
    ns = build_parser().parse_args(argv)
    if ns.command == "logs":
        return logview.run_args(ns)
    raise AssertionError(f"unhandled command {ns.command!r}")


if __name__ == "__main__":
    sys.exit(main())
