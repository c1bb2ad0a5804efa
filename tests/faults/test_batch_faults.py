"""Batches that go wrong on the wire, with the whole pipeline in the loop (CacheManager +
Dispatcher + real worker processes): truncated, of a wrong version, with out-of-range ids,
duplicated, dropped, reordered; an ack for an unknown seq; a rank killed mid-batch.
Each ends in a defined outcome, the manager's invariants hold, and no block leaks."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator

import orjson
import pytest

from tests.faults.helpers import Pipeline
from tests.worker.helpers import FakeRank, poll_until_done, short_ipc_dir
from zkv import protocol as P
from zkv.errors import RankLost
from zkv.scheduler.hashing import hash_ids_chain

A = hash_ids_chain([1, 2, 3, 4])
B = hash_ids_chain([9, 8, 7, 6])  # with A cached: 4 more blocks, 2 of them evicted (d2h)


@pytest.fixture
def pipe() -> Iterator[Pipeline]:
    with short_ipc_dir() as folder:
        p = Pipeline.start(folder, heartbeat_timeout_s=5.0, ack_timeout_s=20.0)
        try:
            yield p
        finally:
            p.close()


def _with_header(frames: list[bytes], **changes: object) -> list[bytes]:
    hdr = orjson.loads(frames[1])
    hdr.update(changes)
    return [frames[0], orjson.dumps(hdr), *frames[2:]]


def _ids_out_of_range(frames: list[bytes]) -> list[bytes]:
    hdr = orjson.loads(frames[1])
    i = next(k for k, op in enumerate(hdr["ops"]) if op["n_dst"])  # a frame of device ids
    frames = list(frames)
    frames[2 + 3 * i + 1] = P.as_ids([1000] * hdr["ops"][i]["n_dst"]).tobytes()
    return frames


CORRUPTIONS: dict[str, Callable[[list[bytes]], list[bytes]]] = {
    "truncated": lambda f: f[:-1],
    "wrong_version": lambda f: _with_header(f, v=2),
    "out_of_range_ids": _ids_out_of_range,
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupted_batch_fails_its_ops_everywhere_and_the_ranks_go_on(pipe: Pipeline,
                                                                      kind: str) -> None:
    pipe.step("a", A)
    cache_before = pipe.cm.match_prefix("peek", A)
    pipe.cm.abort("peek")
    pipe.tamper(lambda frames: [CORRUPTIONS[kind](frames)])
    done = pipe.step("b", B)  # evicts two blocks of `a` (d2h) and fills `b`
    pipe.tamper(None)
    assert not done.ok and done.lost_ranks == frozenset()
    assert all(not r.ok and r.done == 0 and "batch refused" in str(r.error)
               for r in done.results.values()), done.results
    # the d2h never ran: its device blocks are gone from the tree, nothing half-there;
    # `b` was never computed, so it is not cached
    m = pipe.cm.match_prefix("a2", A)
    assert (m.num_device, m.num_host) == (2, 0) and cache_before.num_device == 4
    assert pipe.cm.match_prefix("b2", B).num_device == 0
    pipe.cm.abort("a2")
    pipe.cm.abort("b2")
    # both ranks still serve, and what is cached still holds the right bytes
    assert pipe.step("a3", A).ok and pipe.step("b3", B).ok
    assert pipe.checked >= 2
    assert pipe.leaked() == 0


def test_duplicated_batch_runs_once(pipe: Pipeline) -> None:
    pipe.step("a", A)
    pipe.tamper(lambda frames: [frames, frames])
    done = pipe.step("b", B)
    pipe.tamper(None)
    assert done.ok
    assert pipe.d.refusals()["duplicate"] == 0  # no rank acked the copy
    assert pipe.step("b2", B).ok  # the next seq is not confused by the copy
    for rank in range(2):
        refused = _events(pipe, rank, "worker.batch_refused")
        assert [e["error"] for e in refused] == [f"old seq (expected {done.seq + 1})"]
    assert pipe.leaked() == 0


@pytest.mark.parametrize("fault", ["dropped", "reordered"])
def test_dropped_or_reordered_batch_is_a_seq_gap_and_every_rank_is_lost(pipe: Pipeline,
                                                                        fault: str) -> None:
    pipe.step("a", A)
    held: list[list[bytes]] = []
    pipe.tamper(lambda frames: held.append(frames) or [])  # seq n never leaves (yet)
    seq = pipe.step("b", B, publish_only=True)
    rid, ops, sim = pipe.pending  # type: ignore[misc]
    pipe.tamper((lambda frames: [frames, held[0]]) if fault == "reordered" else None)
    nxt = pipe.d.publish([], step=99)  # seq n+1 arrives first (or alone): a gap everywhere
    done = poll_until_done(pipe.d, {seq, nxt})
    assert not done[seq].ok and not done[nxt].ok
    pipe.commit(rid, ops, sim, done[seq])
    deadline = time.monotonic() + 10
    while pipe.d.lost_ranks != frozenset({0, 1}):  # the first loss failed the batches
        assert time.monotonic() < deadline, pipe.d.lost_ranks
        pipe.d.poll(0.05)
    with pytest.raises(RankLost):
        pipe.d.publish([], step=100)
    for p in pipe.group.procs:
        assert p.wait(10) == 3  # EXIT_SEQ_GAP, after a Bye naming the gap
    for rank in range(2):
        (gap,) = _events(pipe, rank, "worker.seq_gap")
        assert (gap["expected"], gap["seq"]) == (seq, seq + 1)
    m = pipe.cm.match_prefix("a2", A)  # nothing of seq n ran: its eviction rolled back
    assert (m.num_device, m.num_host) == (2, 0)
    pipe.cm.abort("a2")
    assert pipe.leaked() == 0


def test_ack_for_an_unknown_seq_is_refused_and_counted(pipe: Pipeline) -> None:
    pipe.step("a", A)
    pub, pull = pipe.d.pub_endpoint, pipe.d.pull_endpoint
    import zmq

    ctx: zmq.Context[object] = zmq.Context()
    liar = FakeRank(ctx, pub, pull, 0, pipe.group.layout.fingerprint(),
                    pid=pipe.group.procs[0].pid)
    try:
        for seq in (pipe.d.next_seq + 5, 0):  # not yet published; long completed
            liar.send(P.BlocksCopied(seq, 0, False, (P.OpResult(0, False, 0, "lie"),)))
        deadline_polls = 200
        while pipe.d.refusals()["unknown_seq"] < 2 and deadline_polls:
            pipe.d.poll(0.02)
            deadline_polls -= 1
        assert pipe.d.refusals()["unknown_seq"] == 2
        assert pipe.d.in_flight == 0 and pipe.d.lost_ranks == frozenset()
        assert pipe.step("b", B).ok  # and the lies left no trace in the next batch
    finally:
        liar.close()
        ctx.term()
    assert pipe.leaked() == 0


def test_rank_killed_mid_batch_rolls_the_batch_back(pipe: Pipeline) -> None:
    pipe.step("a", A)
    victim = pipe.group.procs[1]
    os.kill(victim.pid, signal.SIGSTOP)  # mid-batch: it has the batch and never acks it
    seq = pipe.step("b", B, publish_only=True)
    assert pipe.d.poll(0.2) == [] and pipe.d.in_flight == 1
    victim.kill()
    done = poll_until_done(pipe.d, seq)[seq]
    rid, ops, sim = pipe.pending  # type: ignore[misc]
    pipe.commit(rid, ops, sim, done)
    assert not done.ok and done.lost_ranks == frozenset({1})
    assert all("rank 1 lost" in str(r.error) for r in done.results.values())
    with pytest.raises(RankLost):
        pipe.d.publish([], step=99)
    m = pipe.cm.match_prefix("a2", A)
    assert (m.num_device, m.num_host) == (2, 0)  # the evicted half is gone, not half-there
    pipe.cm.abort("a2")
    assert pipe.leaked() == 0


def _events(pipe: Pipeline, rank: int, name: str) -> list[dict]:
    path = os.path.join(pipe.group.folder, "logs", f"worker-{rank}.jsonl")
    with open(path, "rb") as f:
        return [e for e in map(orjson.loads, f) if e.get("event") == name]
