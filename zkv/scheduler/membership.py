"""Who the ranks are: hellos, ready markers, refusals and joins, for the dispatcher
(``dispatcher.py`` owns the sockets and the batches; this owns one :class:`RankState` per
rank and the decisions on them, all off the per-batch path).

Joining. A rank counts as joined when (a) its ``Hello`` carried the scheduler's layout
fingerprint and (b) the XPUB reported the rank's :func:`~zkv.protocol.ready_topic`
subscription for the same pid. The worker's SUB subscribes to everything (``b""``) before
that marker, and a SUB sends its subscriptions in order over one pipe, so (b) proves that
every later batch reaches the rank: no slow-joiner drop. No batch is published before
every rank joined. Per rank, until the group starts::

    (none) ─── hello, layout fits ───► hello_pid ── its ready marker ──► joined_pid
      │  ▲                                  │                                │
      │  └──── a Bye, or its subscriber went away: forgotten ◄───────────────┘
      │        (it may say hello again)
      └─ hello, layout differs ──► refused: told; wait_for_ranks raises ConfigError
                                   (once); a later hello that fits clears it

Once started a joined rank stays joined; its subscriber going away sets
``disconnected_at`` (the dispatcher declares it lost after a short grace, so that a Bye
sent just before gives the reason).

Refusing. A hello that is not taken is answered with ``Refused(rank, pid, reason)`` on
the XPUB, so that process stops at once with the reason (exit code 4) instead of waiting
for batches that never come::

    hello ─┬─ layout differs ─────────► Refused("... refused: <fields>"), and
           │                            wait_for_ranks raises ConfigError naming them
           ├─ rank >= world size ─────► Refused("rank R is not below world size W")
           ├─ a new pid after start ──► Refused("... cannot rejoin"); the running rank
           │                            (another pid) reads past it
           ├─ the joined pid again ───► Refused("... link ... dropped and came back ...")
           │  after start               and the dispatcher declares the rank lost: it
           │                            said hello on a new connection, started over at
           │                            seq 0, and missed what was published meanwhile
           └─ a new pid before start ─► taken; the pid it replaces (said hello or joined)
                                        is told Refused("replaced by pid P") and stops:
                                        acks carry no pid, so a stale process left
                                        running would ack the rank's batches
    its ready marker comes later ─────► Refused again (the SUB may not have been connected
                                        at the hello; ``MAX_UNTOLD`` are kept), and
                                        wait_for_ranks waits up to ``TELL_S`` for it
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from zkv import log as ev
from zkv import protocol as P
from zkv.config import CacheLayout

#: Refusals kept to tell again when that process's subscriber shows up (bounded: one
#: rank could say hello from many pids).
MAX_UNTOLD = 64
#: How long ``wait_for_ranks`` waits for a refused process's subscriber before it raises.
TELL_S = 1.0
#: Why the joined process of a started group that says hello again is refused.
RECONNECTED = ("its link to the scheduler dropped and came back while the group ran: "
               "batches published meanwhile went with the old connection, and a rank "
               "cannot resume a started group")
#: Ready markers remembered per rank (pids whose subscription came; bounded: a rank could
#: subscribe to markers of many made-up pids). The hello's and the joined pid's stay.
MAX_SUB_PIDS = 64


@dataclass(slots=True)
class RankState:
    rank: int
    hello_pid: int | None = None
    sub_pids: dict[int, None] = field(default_factory=dict)  # (insertion order: the oldest
    #                                                             is dropped past MAX_SUB_PIDS)
    joined_pid: int | None = None
    last_seen: float = 0.0
    last_seq: int = -1
    refused: str | None = None
    disconnected_at: float | None = None


class Membership:
    """The ranks of one group (``ranks[r]``, r < ``world_size``) and who may join.

    ``counts``: the dispatcher's refusal counts (``hello`` and ``forged`` are counted here,
    ``malformed`` subscriptions through ``refuse``); ``refuse(reason, **fields)`` counts
    and logs a refused message (rate-limited); ``forged(**fields)`` logs a forged one;
    ``tell(rank, pid, reason)`` publishes ``Refused``. Every call is O(1) but ``missing``
    (O(world_size)).
    """

    def __init__(self, world_size: int, layout: CacheLayout | None, fingerprint: str, *,
                 counts: dict[str, int], log: Any, refuse: Callable[..., None],
                 forged: Callable[..., None], tell: Callable[[int, int, str], None]) -> None:
        self.world_size = world_size
        self.layout = layout
        self.fingerprint = fingerprint
        self.ranks = [RankState(r) for r in range(world_size)]
        self.started = False  # set by the dispatcher once every rank joined
        self._counts = counts
        self._log = log
        self._refuse = refuse
        self._forged = forged
        self._tell = tell
        # a refused hello's line: a peer may send many (before, one error line each)
        self._refused_log = ev.RateLimited(log, ev.RANK_REFUSED, burst=10)
        # (a hello storm with a new pid each, or hello / bye pairs: a line per message)
        self._left_log = ev.RateLimited(log, ev.RANK_LEFT, burst=10, level="warning")
        # (rank, pid) -> reason: refused, its subscriber not seen yet (see tell_refused)
        self._untold: dict[tuple[int, int], str] = {}

    def flush_logs(self) -> None:
        """Write the summary of the lines the rate limits held back (at close)."""
        self._refused_log.flush()
        self._left_log.flush()

    def rank_of(self, rank: int, what: str) -> RankState | None:
        """The record of ``rank``; None (refused as ``unknown_rank``) past the world."""
        if rank >= self.world_size:
            self._refuse("unknown_rank", error=f"{what} from rank {rank} >= world size "
                         f"{self.world_size}", rank=rank)
            return None
        return self.ranks[rank]

    # ------------------------------------------------------------ joining

    def all_joined(self) -> bool:
        return all(r.joined_pid is not None for r in self.ranks)

    def on_hello(self, msg: P.Hello) -> str | None:
        """Take or refuse a hello. Returns why the rank is lost when it is the joined
        process of a started group saying hello again (the dispatcher declares it lost)."""
        r = self.rank_of(msg.rank, "hello")
        if r is None:  # counted (unknown_rank) and logged by rank_of
            self._tell_refused(msg, f"rank {msg.rank} is not below world size "
                                    f"{self.world_size}")
            return None
        problem = self._layout_problem(msg)
        if problem is not None:
            r.refused = self._refuse_hello(msg, problem)
            return None
        if self.started:
            if msg.pid != r.joined_pid:
                self._refuse_hello(msg, "hello after the group started (ranks cannot rejoin)")
                return None
            # Its process says hello again only on a new connection: the link dropped and
            # came back (a restart of ours would know no pid). The rank started over at seq
            # 0 and batches published meanwhile were dropped with the old connection.
            self._refuse_hello(msg, RECONNECTED)
            return RECONNECTED
        old = r.joined_pid if r.joined_pid is not None else r.hello_pid
        if old is not None and old != msg.pid:
            self._replaced(r, old, msg.pid)
        r.hello_pid = msg.pid
        r.refused = None
        if self._untold:  # refused before, fits now: never tell it otherwise
            self._untold.pop((msg.rank, msg.pid), None)
        r.last_seen = time.monotonic()
        self._maybe_join(r)
        return None

    def on_subscription(self, sub: bytes, sender: int | None, authenticated: bool) -> bool:
        """An XPUB message (``sub[0]`` 1: subscribe, 0: unsubscribe). True when a joined
        rank's subscriber went away after the start (``disconnected_at`` set now)."""
        if not sub:
            return False
        if sub[0] > 1:  # no subscription: a message an XSUB sent upstream (XPUB passes
            # those up as they are; before, taken for an unsubscription of the marker it
            # named). Counted by refuse alone (it was counted here too: 2 a message).
            self._refuse("malformed", error="an upstream message that is no (un)subscription",
                         sender=sender)
            return False
        marker = P.parse_ready_topic(sub[1:])
        if marker is None:
            return False
        rank, pid = marker
        if rank >= self.world_size:
            if sub[0] == 1:
                self._retell(rank, pid)
            return False
        # A subscription, or an unsubscription a connection sent, names its own rank. (An
        # unsubscription libzmq made for a closed connection has no sender.)
        if authenticated and rank != sender and (sub[0] == 1 or sender is not None):
            self._counts["forged"] += 1
            self._forged(rank=rank, sender=sender,
                         type="subscription" if sub[0] == 1 else "unsubscription",
                         num_forged=self._counts["forged"])
            return False
        r = self.ranks[rank]
        if sub[0] == 1:
            self._retell(rank, pid)
            if not self.started or pid == r.joined_pid:  # (after the start: only its own)
                self._remember_sub(r, pid)
                self._maybe_join(r)
            return False
        r.sub_pids.pop(pid, None)
        if pid != r.joined_pid:
            return False
        if self.started:
            if r.disconnected_at is None:
                r.disconnected_at = time.monotonic()
                return True
            return False
        self.forget(r, pid, "subscriber disconnected")
        return False

    def _remember_sub(self, r: RankState, pid: int) -> None:
        subs = r.sub_pids
        subs[pid] = None
        if len(subs) > MAX_SUB_PIDS:  # the oldest but the hello's and the joined pid's
            for old in subs:
                if old != r.hello_pid and old != r.joined_pid and old != pid:
                    del subs[old]
                    break

    def _replaced(self, r: RankState, old: int, new: int) -> None:
        """(Before the start.) A new process of rank ``r`` said hello: the one it replaces
        is told to stop, once its subscriber is there if it is not yet."""
        self._left_log(rank=r.rank, worker_pid=old, reason=f"replaced by pid {new}")
        if r.joined_pid == old:
            r.joined_pid = None
        self._refuse_pid(r.rank, old, f"replaced by pid {new} (a newer process of rank "
                                      f"{r.rank} said hello)")

    def forget(self, r: RankState, pid: int, reason: str) -> None:
        """Before the start: ``r`` left (a Bye, its subscriber gone); it may come back."""
        r.joined_pid = r.hello_pid = None
        self._left_log(rank=r.rank, worker_pid=pid, reason=reason)

    def _maybe_join(self, r: RankState) -> None:
        if self.started or r.hello_pid is None or r.hello_pid not in r.sub_pids:
            return
        if r.joined_pid != r.hello_pid:
            r.joined_pid = r.hello_pid
            self._log.info(ev.RANK_JOINED, rank=r.rank, worker_pid=r.joined_pid)

    def missing(self, timeout_s: float) -> str:
        """Why the group did not join within ``timeout_s``, rank by rank."""
        parts = []
        for r in self.ranks:
            if r.joined_pid is not None:
                continue
            if r.refused:
                parts.append(f"rank {r.rank}: refused ({r.refused})")
            elif r.hello_pid is not None:
                parts.append(f"rank {r.rank}: said hello (pid {r.hello_pid}) but its "
                             "subscription never arrived")
            else:
                parts.append(f"rank {r.rank}: no hello")
        missing = [r.rank for r in self.ranks if r.joined_pid is None]
        return (f"ranks {missing} of {self.world_size} did not join within {timeout_s} s: "
                + "; ".join(parts))

    # ------------------------------------------------------------ refusing

    def take_refused(self) -> list[str]:
        """The reasons of the ranks refused for their layout, each reported once (a later
        hello may fix it)."""
        refused = [r.refused for r in self.ranks if r.refused]
        for r in self.ranks:
            r.refused = None
        return refused

    def any_refused(self) -> bool:
        return any(r.refused for r in self.ranks)

    def refused_untold(self) -> bool:
        """Whether a process refused for a layout (``wait_for_ranks`` is about to raise)
        has not been told for sure yet."""
        return any(rank < self.world_size and self.ranks[rank].refused
                   for rank, _pid in self._untold)

    def _refuse_hello(self, msg: P.Hello, problem: str) -> str:
        """Count (``hello``), log and tell a refused hello; returns the reason."""
        self._counts["hello"] += 1
        reason = self._tell_refused(msg, problem)
        self._refused_log(rank=msg.rank, worker_pid=msg.pid, error=reason)
        return reason

    def _tell_refused(self, msg: P.Hello, problem: str) -> str:
        """Tell the process that sent ``msg`` that it is refused (it stops); returns the
        reason it is told. Published now; unless its ready marker came already (then its
        SUB gets this), again when it comes."""
        return self._refuse_pid(msg.rank, msg.pid, problem)

    def _refuse_pid(self, rank: int, pid: int, problem: str) -> str:
        reason = f"rank {rank} (pid {pid}) refused: {problem}"
        self._tell(rank, pid, reason)
        if rank < self.world_size and pid in self.ranks[rank].sub_pids:
            return reason
        untold = self._untold
        untold[(rank, pid)] = reason
        if len(untold) > MAX_UNTOLD:
            del untold[next(iter(untold))]
        return reason

    def _retell(self, rank: int, pid: int) -> None:
        """The ready marker of ``pid`` came: tell it now if it was refused before."""
        if self._untold:
            reason = self._untold.pop((rank, pid), None)
            if reason is not None:
                self._tell(rank, pid, reason)

    def _layout_problem(self, msg: P.Hello) -> str | None:
        """Why a rank's layout does not fit, naming the differing fields; None if it fits."""
        if self.layout is not None and msg.geometry:
            return layout_diff(self.layout, msg.geometry)
        if msg.layout != self.fingerprint:
            return (f"layout fingerprint {msg.layout} differs from the scheduler's "
                    f"{self.fingerprint} (model, dtype or geometry)")
        return None


def layout_diff(layout: CacheLayout, geometry: str) -> str | None:
    """The fields in which a rank's layout (``geometry``: its JSON) differs from ``layout``,
    as ``"num_host_blocks: rank has 16, scheduler has 8; ..."``; None when equal."""
    try:
        theirs = orjson.loads(geometry)
    except orjson.JSONDecodeError:
        return "its layout description is not JSON"
    if not isinstance(theirs, dict):
        return "its layout description is not a JSON object"
    ours = asdict(layout)
    # (the type too: JSON's true or 1.0 equals Python's 1, and a world_size of true fitted)
    diffs = [f"{k}: rank has {theirs.get(k, '(missing)')!r}, scheduler has {v!r}"
             for k, v in ours.items() if theirs.get(k, object()) != v
             or type(theirs[k]) is not type(v)]
    diffs += [f"{k}: unknown field" for k in theirs.keys() - ours.keys()]
    return "layout differs: " + "; ".join(diffs) if diffs else None
