"""Random external-L1 sequences (engine-owned device blocks, zkv as L2/L3), invariants
checked after every step.

A simulated engine owns device blocks (a new id per request block) and writes each block's
hash into it when it computes it; a simulated worker runs zkv's ops on those "contents".
Every match proves that each matched host block holds the block it claims, every load that
zkv reports as done put the right bytes into the engine block, and a load that failed on
some rank is reported for recompute.

A P/D producer about to finish asks the store which of its held blocks it still has and
writes the rest again (``store_again``): the simulated store forgets those blocks first,
and every block it promises is checked to reach the store, unless the write (or the save
that brings it) failed.
"""

from __future__ import annotations

import os

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from zkv.protocol import BACKUP, H2D, H2S, S2H, OpResult
from zkv.scheduler.hashing import hash_ids_chain
from zkv.scheduler.manager import CacheConfig, CacheManager
from zkv.scheduler.radix import HOST, LOADING_FROM_STORAGE, SWAP_TO_HOST

BS = 4
GARBAGE = b"garbage"


class ExternalMachine(RuleBasedStateMachine):
    @initialize(nhost=st.integers(1, 10), storage=st.booleans(),
                retry_s=st.sampled_from((1.0, 1e-9)))  # 1e-9: failed writes retried each step
    def setup(self, nhost: int, storage: bool, retry_s: float) -> None:
        self.store: set[bytes] = set()
        self.cm = CacheManager(CacheConfig(0, nhost, BS, "write_through", storage_write=storage,
                                           store_retry_s=retry_s, store_retry_max_s=retry_s),
                               storage_exists=self._exists if storage else None)
        self.engine: dict[int, bytes] = {}   # engine block id -> contents
        self.host: dict[int, bytes] = {}
        self.reqs: dict[str, tuple[list[bytes], list[int]]] = {}  # hashes, engine ids
        self.inflight: dict[int, OpResult] = {}
        # ops in flight: (key, host block) an h2s wrote (the store has it before the ack),
        # the keys it did not write, the blocks a save did not copy
        self.writes: dict[int, tuple[list[tuple[bytes, int]], list[bytes], list[bytes]]] = {}
        # store_again's promises not yet seen in the store: hash -> (its chain, position)
        self.promised: dict[bytes, tuple[list[bytes], int]] = {}
        self.storage = storage
        self.n = 0
        self.next_dev = 0

    def _exists(self, hashes):  # noqa: ANN001, ANN202
        k = 0
        while k < len(hashes) and hashes[k] in self.store:
            k += 1
        return k

    @precondition(lambda self: len(self.reqs) < 4)
    @rule(path=st.lists(st.integers(0, 1), min_size=1, max_size=6), prefetch=st.booleans(),
          data=st.data())
    def arrive(self, path, prefetch, data):
        """Match; maybe prefetch from L3 (and maybe wait for it); load what zkv holds into
        fresh engine blocks past the engine's own (random) local hit."""
        rid = f"r{self.n}"
        self.n += 1
        hashes = hash_ids_chain(path)
        self.cm.match_prefix(rid, hashes)
        for n in self.cm.held_blocks(rid):
            assert n.status is HOST and self.host.get(n.host) == n.hash, "host content"
        if prefetch:
            self.cm.prefetch(rid)
            self.cm.check_invariants()
            self._run_ops(data)
            if data.draw(st.booleans()):
                self._ack_all()
        devs = list(range(self.next_dev, self.next_dev + len(hashes)))
        self.next_dev += len(hashes)
        self.reqs[rid] = (hashes, devs)
        held = self.cm.num_held_blocks(rid) if self.cm.request(rid).loading is None else 0
        local = data.draw(st.integers(0, len(hashes)))
        for i in range(local):  # the engine's own prefix cache had these
            self.engine[devs[i]] = hashes[i]
        if held > local and self.cm.request(rid).loading is None:
            self.cm.load_external(rid, local, devs[local:held])
        for i in range(max(local, held), len(hashes)):  # the forward computes the rest
            self.engine[devs[i]] = hashes[i]
        self.cm.check_invariants()
        self._run_ops(data)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def save(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        hashes, devs = self.reqs[rid]
        # a save reads only blocks the engine trusts
        if self.cm.request(rid).loading is not None or any(
                self.engine.get(d) != h for h, d in zip(hashes, devs)):
            return
        k = data.draw(st.integers(0, len(hashes)))
        self.cm.cache_computed(rid, k * BS, device_ids=devs)
        self.cm.check_invariants()
        self._run_ops(data)

    def _run_ops(self, data):
        ops = self.cm.take_ops()
        self.cm.check_invariants()
        for op in ops:
            n = op.num_blocks
            done = n if data.draw(st.booleans()) else data.draw(st.integers(0, n))
            for j in range(n):
                ok = j < done
                if op.kind == BACKUP:
                    self.host[int(op.dst[j])] = self.engine.get(int(op.src[j])) if ok else GARBAGE
                elif op.kind == H2D:
                    self.engine[int(op.dst[j])] = self.host.get(int(op.src[j])) if ok else GARBAGE
                elif op.kind == S2H:
                    if ok and op.keys[j] not in self.store:
                        done, ok = j, False
                    self.host[int(op.dst[j])] = op.keys[j] if ok else GARBAGE
                elif op.kind == H2S and ok:
                    assert self.host.get(int(op.src[j])) == op.keys[j], "h2s of wrong bytes"
                    self.store.add(op.keys[j])
            if op.kind == H2S:
                self.writes[op.id] = ([(op.keys[j], int(op.src[j])) for j in range(done)],
                                      list(op.keys[done:]), [])
            elif op.kind == BACKUP:  # (external L1: a save)
                self.writes[op.id] = ([], [], [self.engine.get(int(op.src[j]), GARBAGE)
                                               for j in range(done, n)])
            self.inflight[op.id] = OpResult(op.id, done == n, done, None if done == n else "x")

    def _excuse(self, unwritten, unsaved):  # noqa: ANN001, ANN202
        """A promise is not kept when its write failed (tried again, maybe), or the save
        that brings it, or one of a block before it (a save chained under it is dropped
        with it)."""
        for h in unwritten:
            self.promised.pop(h, None)
        for h in unsaved:
            for k, (chain, i) in list(self.promised.items()):
                if h in chain[: i + 1]:
                    del self.promised[k]

    def _ack(self, results):
        self.cm.on_ops_done(results)
        self.cm.check_invariants()
        tree = self.cm.tree
        for r in results:  # a block an h2s wrote (still that copy) is in_store once acked
            written, unwritten, unsaved = self.writes.pop(r.id, ((), (), ()))
            for h, hb in written:
                if h in tree.index and tree.block(h).host == hb:
                    assert tree.block(h).in_store, "acked h2s, not in_store"
            self._excuse(unwritten, unsaved)
        for rid, failed in self.cm.take_load_failures().items():  # the engine recomputes
            hashes, devs = self.reqs[rid]
            for d in failed:
                assert self.engine.get(d) == GARBAGE or d in devs
                self.engine[d] = hashes[devs.index(d)]

    def _ack_all(self):
        results = [self.inflight[k] for k in sorted(self.inflight)]
        self.inflight.clear()
        self._ack(results)

    @precondition(lambda self: self.inflight)
    @rule(data=st.data(), mode=st.sampled_from(["one"] * 5 + ["all"] * 3 + ["lose_rank"]))
    def ack(self, data, mode):
        if mode == "one":
            self._ack([self.inflight.pop(data.draw(st.sampled_from(sorted(self.inflight))))])
        elif mode == "all":
            self._ack_all()
        else:
            self.inflight.clear()
            self.writes.clear()
            self.promised.clear()  # writes in flight fail and are not tried again
            self.cm.fail_pending()
            self.cm.check_invariants()
            self._ack([])

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data):
        """Maybe a final save first, chained past the request's own save in flight (as
        vLLM's scheduler half does), its ops taken or left for a later step."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        hashes, devs = self.reqs[rid]
        if data.draw(st.booleans()) and self.cm.request(rid).loading is None and all(
                self.engine.get(d) == h for h, d in zip(hashes, devs)):
            k = data.draw(st.integers(0, len(hashes)))
            self.cm.cache_computed(rid, k * BS, device_ids=devs, chain=True)
            self.cm.check_invariants()
            if data.draw(st.booleans()):
                self._run_ops(data)
        if data.draw(st.booleans()):  # a P/D producer: its promise, before it lets go
            self._store_again(rid, data)
        del self.reqs[rid]
        self.cm.finish(rid)
        self.cm.check_invariants()

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def store_again(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self._store_again(rid, data)
        if data.draw(st.booleans()):
            self._run_ops(data)

    def _store_again(self, rid, data):  # noqa: ANN001, ANN202
        """The store lost the held blocks past ``present`` (those no write in flight put
        there: L3 evicted them, or restarted empty): written again, or on their way."""
        hashes, _ = self.reqs[rid]
        cm = self.cm
        held = cm.num_held_blocks(rid)
        writing = {h for w in self.writes.values() for h, _hb in w[0]}
        if data.draw(st.booleans()):  # as vLLM asks: the store forgets some, then a query
            lost = data.draw(st.lists(st.integers(0, max(held - 1, 0)), max_size=held))
            self.store.difference_update(hashes[i] for i in lost if hashes[i] not in writing)
            present = self._exists(hashes[:held])
        else:
            present = data.draw(st.integers(0, held))
            self.store.difference_update(h for h in hashes[present:held] if h not in writing)
        loading = any(n.status is LOADING_FROM_STORAGE and n.depth + len(n.hashes) > present
                      for n in cm.tree.path(cm.request(rid).tail))
        queued = self._queued()
        promise = cm.store_again(rid, present)
        cm.check_invariants()
        assert cm.num_held_blocks(rid) == held
        assert promise <= held, (promise, held)
        assert promise >= min(present, held) or loading, (promise, present, held)
        if not self.storage:
            assert promise == min(present, held) and self._queued() == queued
            return
        event(f"store_again: {'short' if promise < held else 'all'}, "
              f"{'rewrites' if self._queued() != queued else 'none'}")
        if promise < held:  # stopped at a block it cannot write now: a load from L3 into it
            assert cm.tree.block(hashes[promise]).status is LOADING_FROM_STORAGE, promise
        unstored = cm.core.unstored
        for i in range(present, promise):  # each on its way: a save, a write in flight or
            n = cm.tree.block(hashes[i]).node  # queued, or a failed one waiting to retry
            assert n.status is SWAP_TO_HOST or n.wbusy or n in unstored, (i, n)
            assert not n.in_store or n.wbusy, (i, n)
            if n not in unstored:  # (a retry may come after the test: not followed)
                self.promised[hashes[i]] = (hashes, i)

    def _queued(self):  # noqa: ANN202
        return {k: len(p.nodes) for k, p in self.cm.ledger.open.items()}

    @invariant()
    def promises_reach_the_store(self):
        """Once nothing is in flight or queued, every promised block is in the store."""
        if not hasattr(self, "cm") or self.inflight or self.cm.ledger.open:
            return
        for h in self.promised:
            assert h in self.store, "promised by store_again, never written"
        self.promised.clear()

    @invariant()
    def loads_done_hold_the_right_bytes(self):
        if not hasattr(self, "cm"):
            return
        self.cm.check_invariants()
        if self.inflight or self.cm.num_pending_ops:
            return
        for hashes, devs in self.reqs.values():  # every failed load was reported
            for h, d in zip(hashes, devs):
                assert self.engine.get(d, h) == h, "engine block holds wrong bytes"


ExternalMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("ZKV_STATE_EXAMPLES", 150)), stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestExternalStateMachine = ExternalMachine.TestCase
