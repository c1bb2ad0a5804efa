"""Prefill/decode disaggregation over the store: the kv_transfer_params a producer answers
and a consumer waits on, in the protocol vLLM's P/D proxies already run::

    proxy ── prefill request, kv_transfer_params {"do_remote_decode": true} ──► producer
    producer: request_finished ──► {"zkv_blocks": n, "zkv_namespace": ns}    (answer)
        (its first n prompt blocks are in, or on their way to, the store of namespace ns)
    proxy ── decode request with those kv_transfer_params ──► consumer

    consumer, each get_num_new_matched_tokens (ProducerWait.step):
        no promise for ns ─────────────────────────────► go on (match as usual)
        found (host + store) >= n ─────────────────────► go on: load them
        found < n, within budget ──────────────────────► ask again next step
        found < n, budget spent ──► EXPIRED (warning) ─► go on: compute the rest
        malformed (a forged or garbled count) ─► refused (warning) ─► go on

Free of vLLM and of the scheduler half's state: the half keeps one ``ProducerWait`` per
request and counts what it reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PARAM_BLOCKS = "zkv_blocks"
PARAM_NAMESPACE = "zkv_namespace"


def asked(params: Any) -> bool:
    """Whether a request's own kv_transfer_params ask for a producer's answer
    (``do_remote_decode``)."""
    return isinstance(params, dict) and bool(params.get("do_remote_decode"))


def answer(params: Any, num_blocks: int, namespace: str) -> dict[str, Any] | None:
    """The producer's kv_transfer_params for a finished request whose own ``params``
    :func:`asked` for them, ``num_blocks`` leading prompt blocks saved; None when not
    asked or nothing to promise."""
    if not asked(params) or num_blocks <= 0:
        return None
    return {PARAM_BLOCKS: num_blocks, PARAM_NAMESPACE: namespace}


def promised(params: Any, namespace: str) -> int | None:
    """Leading blocks a consumer request's kv_transfer_params promise in ``namespace``
    (None: no promise here: none at all, another connector's). Raises ValueError for a
    malformed count, and for a promise of another namespace, which no block here can keep
    (the caller says so: a producer and consumer that differ in tensor-parallel size,
    model identity or ``namespace_salt`` recomputed every prompt without a word)."""
    if not isinstance(params, dict) or PARAM_BLOCKS not in params:
        return None
    theirs = params.get(PARAM_NAMESPACE)
    if theirs != namespace:
        raise ValueError(f"promised in namespace {repr(theirs)[:80]}, this engine's is "
                         f"{namespace!r} (the producer's tensor-parallel size, model or "
                         "namespace_salt differ): computed here")
    n = params[PARAM_BLOCKS]
    if type(n) is not int or n < 0:
        raise ValueError(f"{PARAM_BLOCKS} must be an int >= 0, got {repr(n)[:64]}")
    return n


GO, WAIT, EXPIRED = "go", "wait", "expired"


@dataclass(slots=True)
class ProducerWait:
    """One consumer request's wait for its producer's blocks (see the module docstring).
    ``blocks``: promised (capped to the prompt's); ``until``: the deadline, set at the
    first ask that found fewer; ``over``: expired or refused, never waits again."""

    blocks: int = 0
    until: float | None = None
    over: bool = False

    def step(self, found: int, now: float, budget_s: float) -> str:
        """GO (match as usual), WAIT (ask again) or EXPIRED (once: the budget is spent,
        compute the rest), with ``found`` leading blocks in host + store now."""
        if self.over or found >= self.blocks:
            return GO
        if self.until is None:
            self.until = now + budget_s
        if now < self.until:
            return WAIT
        self.over = True
        return EXPIRED
