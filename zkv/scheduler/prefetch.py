"""Prefetch policies: when a request whose prefix is in L3 may be scheduled.

After ``match_prefix`` finds ``num_storage`` blocks in L3, ``prefetch`` starts loading
them (one s2h op). The policy decides how long the request waits for the loads before it
is scheduled; ``allocate`` then uses the prefix that arrived on every rank and the request
recomputes the rest::

    policy          may schedule when
    best_effort     at once (uses whatever has arrived; the loads still land in L2 for later)
    wait_complete   every load of the request was acked (done or failed)
    timeout         loads acked, or ``budget_s(prompt tokens)`` passed since the prefetch began

A request scheduled with loads still in flight lets them go (``allocate``; in external-L1
mode ``drop_prefetch``, before the engine's blocks are planned): it never loads a block
still arriving, and what arrives is an unheld host block that later requests match.

The timeout budget grows with the prompt, as recomputing a longer prompt costs more:
``min(max_s, base_s + per_ki_token_s * num_tokens / 1024)``.

Pure logic: no clock of its own (callers pass ``now``), no sockets, no tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BEST_EFFORT = "best_effort"
WAIT_COMPLETE = "wait_complete"
TIMEOUT = "timeout"
PREFETCH_POLICIES = (BEST_EFFORT, WAIT_COMPLETE, TIMEOUT)


@dataclass(frozen=True, slots=True)
class PrefetchPolicy:
    """A policy and its timeout budget (see the module docstring)."""

    kind: str = WAIT_COMPLETE
    base_s: float = 0.05
    per_ki_token_s: float = 0.05
    max_s: float = 2.0

    def __post_init__(self) -> None:
        if self.kind not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch policy must be one of {PREFETCH_POLICIES}, "
                             f"got {self.kind!r}")
        if not all(math.isfinite(x) and x >= 0
                   for x in (self.base_s, self.per_ki_token_s, self.max_s)):
            raise ValueError("prefetch budget terms must be finite and >= 0, got "
                             f"base_s={self.base_s}, per_ki_token_s={self.per_ki_token_s}, "
                             f"max_s={self.max_s}")

    def budget_s(self, num_tokens: int) -> float:
        """How long a request of ``num_tokens`` prompt tokens may wait for its loads."""
        if self.kind == BEST_EFFORT:
            return 0.0
        if self.kind == WAIT_COMPLETE:
            return math.inf
        return min(self.max_s, self.base_s + self.per_ki_token_s * num_tokens / 1024)


class PrefetchTracker:
    """Requests waiting for their storage loads under one policy.

    ``start`` when a prefetch begins; ``ready`` each scheduling pass (it forgets a request
    once it says yes). Invariant: a request is tracked from ``start`` until ``ready``
    returned True or ``forget``. All calls O(1); ``next_deadline`` O(waiting).
    """

    def __init__(self, policy: PrefetchPolicy) -> None:
        self.policy = policy
        self._deadline: dict[str, float] = {}
        self.num_timed_out = 0      # requests scheduled before their loads were acked
        self.num_completed = 0      # requests whose loads were all acked first

    def start(self, req_id: str, num_tokens: int, now: float,
              budget_s: float | None = None) -> None:
        """``budget_s``: this request's own (default: the policy's for ``num_tokens``)."""
        self._deadline[req_id] = now + (self.policy.budget_s(num_tokens) if budget_s is None
                                        else budget_s)

    def waiting(self, req_id: str) -> bool:
        return req_id in self._deadline

    def ready(self, req_id: str, loads_done: bool, now: float) -> bool:
        """Whether ``req_id`` may be scheduled now; ``loads_done``: none of its loads is
        still in flight. An untracked request is always ready."""
        deadline = self._deadline.get(req_id)
        if deadline is None:
            return True
        if loads_done:
            self.num_completed += 1
        elif now >= deadline:
            self.num_timed_out += 1
        else:
            return False
        del self._deadline[req_id]
        return True

    def forget(self, req_id: str) -> None:
        self._deadline.pop(req_id, None)

    def next_deadline(self) -> float | None:
        """The earliest finite deadline of a waiting request (None if none is finite)."""
        finite = [d for d in self._deadline.values() if d != math.inf]
        return min(finite) if finite else None

    def __len__(self) -> int:
        return len(self._deadline)
