"""Exit codes of ``python -m zkv.worker`` (a rank), and what each means. A module of its own
so that zkvrun can name them without importing the worker (torch and the copy kernels)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FATAL = 1  # an error the actor cannot go on after (a device fault, a bug)
EXIT_CONFIG = 2  # bad environment or layout: one line on stderr, nothing started
EXIT_SEQ_GAP = 3  # the scheduler's batches skipped some (a Bye names the gap)
EXIT_REFUSED = 4  # the scheduler refused this process's hello (the reason on stderr)
EXIT_SCHEDULER_GONE = 5  # no scheduler reached for ZKV_SCHEDULER_TIMEOUT_S (the reason on stderr)

WORKER_EXITS = {
    EXIT_FATAL: "fatal error",
    EXIT_CONFIG: "bad configuration",
    EXIT_SEQ_GAP: "missed batches",
    EXIT_REFUSED: "refused by the scheduler",
    EXIT_SCHEDULER_GONE: "scheduler unreachable",
}
