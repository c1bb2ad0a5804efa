"""``zkv replay``'s flags: the parser (a usage error is one line, status 2), and the
flags a run's configuration would not read, refused (``--threshold 5`` under write_back,
``--prefetch-base-ms`` under wait_complete, ``--host-blocks 0`` with an L3 store: each
changed nothing and said nothing)."""

from __future__ import annotations

import argparse
import os
from typing import NoReturn

from zkv.argtypes import nonempty, nonneg_float, nonneg_int, port, positive_int
from zkv.errors import ConfigError
from zkv.protocol import MAX_OPS
from zkv.scheduler.eviction import POLICIES as EVICTION_POLICIES
from zkv.scheduler.manager import WRITE_POLICIES
from zkv.scheduler.prefetch import PREFETCH_POLICIES

#: ``--workload trace``'s default file: the bundled trace.
DEFAULT_TRACE = os.path.normpath(os.path.join(
    os.path.dirname(__file__), "..", "..", "shared", "traces", "mooncake_synthetic_trace.jsonl"))
#: The flags read by one configuration only (None in the parsed args: not given).
DEFAULTS = {"threshold": 2, "prefetch_base_ms": 50.0, "prefetch_per_ki_token_ms": 50.0}


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (``zkv replay: error: ...``), exit status 2; a URL's
    password in it written ``***@`` (an abbreviated ``--stor URL`` is echoed back)."""

    def error(self, message: str) -> NoReturn:
        from zkv.security import redact_credentials

        self.exit(2, f"{self.prog}: error: {redact_credentials(message)}\n")


#: Requests a step: its batch carries a check and a fill per request beside the cache's own
#: ops (a few: one per kind, this step's and the last's), at most MAX_OPS (4096 made 8193).
MAX_BATCH = (MAX_OPS - 16) // 2


def _batch(s: str) -> int:
    n = positive_int(s)
    if n > MAX_BATCH:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_BATCH} (a step's batch carries two "
                                         f"ops per request), got {n}")
    return n


def build_parser(description: str = "") -> argparse.ArgumentParser:
    # No abbreviations: ``--stora URL`` would get past _without_storage onto the node's
    # command line, a store password with it (ps).
    p = _Parser(prog="zkv replay", description=description, allow_abbrev=False)
    _workload_args(p)
    _cache_args(p)
    _storage_args(p)
    _run_args(p)
    return p


def _workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload", "what is replayed")
    g.add_argument("--workload", choices=("chat", "trace"), default="chat",
                   help="chat: multi-turn conversations sharing a system prompt; trace: the "
                        "Mooncake trace's block ids (default: %(default)s)")
    g.add_argument("--trace", type=nonempty, default=None,
                   help="Mooncake trace JSONL, with --workload trace (default: "
                        f"{DEFAULT_TRACE})")
    g.add_argument("--requests", type=positive_int, default=300,
                   help="requests to replay (default: %(default)s)")
    g.add_argument("--batch", type=_batch, default=2,
                   help="requests per scheduling step (default: %(default)s)")
    g.add_argument("--seed", type=nonneg_int, default=0,
                   help="the chat workload's random seed (default: %(default)s)")


def _cache_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cache", "the ranks, their KV geometry and pools, the policies")
    g.add_argument("--ranks", type=positive_int, default=2,
                   help="worker processes, one per rank (default: %(default)s)")
    g.add_argument("--layers", type=positive_int, default=4,
                   help="model layers (default: %(default)s)")
    g.add_argument("--kv-heads", type=positive_int, default=2,
                   help="KV heads per rank (default: %(default)s)")
    g.add_argument("--head-dim", type=positive_int, default=64,
                   help="elements per head and token (default: %(default)s)")
    g.add_argument("--block-size", type=positive_int, default=16,
                   help="tokens per block (default: %(default)s)")
    g.add_argument("--dtype", default="float16", help="KV dtype (default: %(default)s)")
    g.add_argument("--device-blocks", type=positive_int, default=768,
                   help="L1 blocks per rank (default: %(default)s)")
    g.add_argument("--host-blocks", type=nonneg_int, default=1024,
                   help="L2 blocks per rank, 0 for none (default: %(default)s)")
    g.add_argument("--policy", choices=WRITE_POLICIES, default="write_back",
                   help="when blocks are written to the host tier (default: %(default)s)")
    g.add_argument("--threshold", type=positive_int, default=None,
                   help="write_through_selective hit threshold (default: "
                        f"{DEFAULTS['threshold']})")
    g.add_argument("--eviction", choices=EVICTION_POLICIES, default="lru",
                   help="eviction order in each tier (lru, or slru: segmented, with a ghost "
                        "memory of recent evictions; default: %(default)s)")


def _storage_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("storage", "L3, and how long a request waits for it")
    g.add_argument("--storage", type=nonempty, default=None, metavar="URL",
                   help="L3 store: file:///path, redis://HOST:PORT/DB (rediss:// over TLS), "
                        "mooncake://HOST:PORT, "
                        "or 'none' (default: a fresh local directory, in /dev/shm if present)")
    g.add_argument("--store-dir", type=nonempty, default=None,
                   help="local-directory L3 (= --storage file://DIR; 'none' disables L3)")
    g.add_argument("--prefetch", choices=PREFETCH_POLICIES, default="wait_complete",
                   help="how long a request waits for its L3 loads (default: %(default)s)")
    g.add_argument("--prefetch-base-ms", type=nonneg_float, default=None,
                   help="timeout policy: budget = base + per-ki-token x prompt tokens / 1024, "
                        "at most 2,000 ms (vLLM's prefetch_max_ms; default: "
                        f"{DEFAULTS['prefetch_base_ms']})")
    g.add_argument("--prefetch-per-ki-token-ms", type=nonneg_float, default=None,
                   help="the timeout budget's part per 1,024 prompt tokens (default: "
                        f"{DEFAULTS['prefetch_per_ki_token_ms']})")


def _run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run", "logs, metrics, supervision")
    g.add_argument("--log-dir", type=nonempty, default=None,
                   help="where the JSON logs go (default: $ZKV_LOG_DIR, else "
                        "{tmp}/zkv-logs-{uid}/{run_id})")
    g.add_argument("--metrics-port", type=port, default=None,
                   help="serve Prometheus metrics on 127.0.0.1:PORT while running (0 = any)")
    g.add_argument("--metrics-file", type=nonempty, default=None,
                   help="write the final metrics here")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is one only when stderr is a terminal)")
    g.add_argument("--max-restarts", type=nonneg_int, default=0,
                   help="start the whole group again after a failure, this many times "
                        "(default: %(default)s)")
    g.add_argument("--force", action="store_true",
                   help="allow more ranks than 4 per core, or pools larger than free memory")
    g.add_argument("--node", action="store_true", help=argparse.SUPPRESS)


def check_flags_read(args: argparse.Namespace) -> None:
    """ConfigError naming a flag the run's configuration would not read; then the defaults
    of the flags not given. (Run by the launcher and by the node: both parse the argv.)"""
    if args.threshold is not None and args.policy != "write_through_selective":
        raise ConfigError(f"--threshold is read by --policy write_through_selective only (the "
                          f"policy is {args.policy})")
    for flag in ("prefetch_base_ms", "prefetch_per_ki_token_ms"):
        if getattr(args, flag) is not None and args.prefetch != "timeout":
            raise ConfigError(f"--{flag.replace('_', '-')} is read by --prefetch timeout only "
                              f"(the prefetch policy is {args.prefetch})")
    if args.host_blocks == 0 and "none" not in (args.storage, args.store_dir):
        raise ConfigError("--host-blocks 0 leaves the L3 store unused (blocks reach it and "
                          "come back through host memory): give host blocks, or --storage "
                          "none")
    for flag, value in DEFAULTS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)
