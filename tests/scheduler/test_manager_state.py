"""Random operation sequences against CacheManager, invariants checked after every step.

A simulated worker executes each step's ops on "block contents" (each block holds the hash
of the KV it carries), so every match also proves that the tree never points at a block
whose bytes are not the block it claims: the bookkeeping twin of a bit-for-bit check.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from zkv.protocol import BACKUP, D2H, H2D, H2S, S2H, OpResult
from zkv.scheduler.eviction import POLICIES
from zkv.scheduler.hashing import hash_ids_chain
from zkv.scheduler.manager import WRITE_POLICIES, CacheConfig, CacheManager
from zkv.scheduler.radix import DEVICE, HOST

BS = 4
GARBAGE = b"garbage"


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(WRITE_POLICIES),
        ndev=st.integers(3, 8),
        nhost=st.integers(0, 12),
        threshold=st.integers(1, 3),
        storage=st.booleans(),
        eviction=st.sampled_from(POLICIES),
        retry_s=st.sampled_from((1.0, 1e-9)),  # 1e-9: failed storage writes retried each step
        seeded=st.booleans(),  # L3 holds every path already (another engine wrote it)
    )
    def setup(self, policy: str, ndev: int, nhost: int, threshold: int, storage: bool,
              eviction: str, retry_s: float, seeded: bool) -> None:
        self.store: set[bytes] = set()
        if seeded:
            for n in range(1, 7):
                for i in range(1 << n):
                    self.store.update(hash_ids_chain([(i >> b) & 1 for b in range(n)]))
        self.cm = CacheManager(
            CacheConfig(ndev, nhost, BS, policy, threshold, storage_write=storage,
                        eviction_policy=eviction, store_retry_s=retry_s,
                        store_retry_max_s=retry_s),
            storage_exists=self._exists if storage else None,
        )
        self.dev: dict[int, bytes] = {}
        self.host: dict[int, bytes] = {}
        self.reqs: dict[str, list[bytes]] = {}   # matched, not yet stepped
        self.stepped: dict[str, list[bytes]] = {}  # allocated and their step ran
        self.inflight: dict[int, OpResult] = {}   # op id -> the result the "ranks" will report
        self.writes: set[int] = set()  # the ids of the h2s ops in flight
        self.n = 0

    def _exists(self, hashes):  # the L3 existence callback
        k = 0
        while k < len(hashes) and hashes[k] in self.store:
            k += 1
        return k

    # ------------------------------------------------------------ requests

    def _match(self, path, prefetch, rid=None):
        if rid is None:
            rid = f"r{self.n}"
            self.n += 1
        hashes = hash_ids_chain(path)
        m = self.cm.match_prefix(rid, hashes)
        self.cm.check_invariants()
        held = self.cm.held_blocks(rid)
        for i, node in enumerate(held):  # what the tree claims must be what blocks hold
            assert node.hash == hashes[i]
            if node.status is DEVICE:
                assert self.dev.get(node.dev) == node.hash, "device block content mismatch"
            else:
                assert node.status is HOST
                assert self.host.get(node.host) == node.hash, "host block content mismatch"
        assert m.num_device + m.num_host == len(held)
        if prefetch:
            self.cm.prefetch(rid)
            self.cm.check_invariants()
        self.reqs[rid] = hashes
        return rid

    @precondition(lambda self: len(self.reqs) + len(self.stepped) < 5)
    @rule(
        paths=st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=6), min_size=1, max_size=3),
        prefetch=st.booleans(),
        data=st.data(),
    )
    def schedule(self, paths, prefetch, data):
        """New requests arrive: match (maybe prefetch from storage, maybe wait for it), then
        one scheduling step allocates them."""
        rids = [self._match(p, prefetch) for p in paths]
        if data.draw(st.booleans()):  # the engine asks again (from scratch) before the step
            again = st.lists(st.integers(0, 1), min_size=1, max_size=6)
            for rid in rids:
                self._match(data.draw(again), prefetch, rid)
        if prefetch:
            self._run_ops(data)
            if data.draw(st.booleans()):  # wait_complete: the loads are acked before allocate
                self._ack_all()
        self._step(data, rids)

    @precondition(lambda self: self.reqs)
    @rule(
        paths=st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=6), min_size=1, max_size=2),
        prefetch=st.booleans(),
        data=st.data(),
    )
    def rematch(self, paths, prefetch, data):
        """A waiting request is matched again under its id, from scratch (the API allows
        it before ``allocate``), once or twice in a step, prefetching each time, before the
        step's ops are taken: each incarnation's load must settle on its own."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        for p in paths:
            self._match(p, prefetch, rid)
        if prefetch:
            self._run_ops(data)

    @precondition(lambda self: self.reqs or self.stepped)
    @rule(data=st.data())
    def step(self, data):
        """A later step: retry requests that did not fit, grow running ones (decode)."""
        rids = data.draw(st.lists(st.sampled_from(sorted(self.reqs) + sorted(self.stepped)),
                                  min_size=1, unique=True))
        self._step(data, rids)

    def _step(self, data, rids):
        """Allocate the requests, run the step's ops on the simulated worker (choosing each
        op's outcome), then the forward pass writes the blocks it computed."""
        allocated = []
        for rid in rids:
            hashes = self.reqs.get(rid) or self.stepped[rid]
            extra = data.draw(st.integers(0, 2))
            tokens = (len(hashes) + extra) * BS - data.draw(st.integers(0, BS - 1))
            table = self.cm.allocate(rid, tokens)
            self.cm.check_invariants()
            if table is not None:
                allocated.append(rid)
        self._run_ops(data)
        for rid in allocated:
            hashes = self.reqs.pop(rid, None) or self.stepped[rid]
            st_ = self.cm.request(rid)
            for i, b in st_.fresh.items():  # forward pass writes the blocks it computed
                self.dev[b] = hashes[i] if i < len(hashes) else GARBAGE
            self.stepped[rid] = hashes

    def _run_ops(self, data):
        ops = self.cm.take_ops()
        self.cm.check_invariants()
        for op in ops:
            n = op.num_blocks
            outcome = data.draw(st.sampled_from(["ok", "ok", "partial"]))
            done = n if outcome == "ok" else data.draw(st.integers(0, n))
            for j in range(n):
                ok = j < done
                if op.kind in (D2H, BACKUP):
                    self.host[int(op.dst[j])] = self.dev.get(int(op.src[j])) if ok else GARBAGE
                elif op.kind == H2D:
                    self.dev[int(op.dst[j])] = self.host.get(int(op.src[j])) if ok else GARBAGE
                elif op.kind == S2H:
                    if ok and op.keys[j] not in self.store:
                        done = j
                        ok = False
                    self.host[int(op.dst[j])] = op.keys[j] if ok else GARBAGE
                elif op.kind == H2S and ok:
                    assert self.host.get(int(op.src[j])) == op.keys[j], "h2s of wrong bytes"
                    self.store.add(op.keys[j])
            self.inflight[op.id] = OpResult(op.id, done == n, done,
                                            None if done == n else "injected")
            if op.kind == H2S:
                self.writes.add(op.id)

    def _ack(self, results):
        self.cm.on_ops_done(results)
        self.cm.check_invariants()
        for rid, valid in self.cm.take_recompute().items():  # engine recomputes failed swap-ins
            st_ = self.cm.request(rid)
            hashes = self.stepped.get(rid) or self.reqs.get(rid)
            for i, b in st_.fresh.items():
                if valid <= i < len(hashes):
                    self.dev[b] = hashes[i]

    def _ack_all(self):
        results = [self.inflight[k] for k in sorted(self.inflight)]
        self.inflight.clear()
        self._ack(results)

    @precondition(lambda self: self.inflight)
    @rule(data=st.data(), mode=st.sampled_from(["one"] * 6 + ["all"] * 3 + ["lose_rank"]
                                               + ["all_but_l3_writes"] * 3))
    def ack(self, data, mode):
        if mode == "one":  # any order: acks of different ops may interleave
            op_id = data.draw(st.sampled_from(sorted(self.inflight)))
            self._ack([self.inflight.pop(op_id)])
        elif mode == "all":
            self._ack_all()
        elif mode == "all_but_l3_writes":  # a slow store: the copies come back, h2s stays
            done = sorted(set(self.inflight) - self.writes)
            self._ack([self.inflight.pop(k) for k in done])
        else:  # a rank died: every op in flight fails at once
            self.inflight.clear()
            self.cm.fail_pending()
            self.cm.check_invariants()
            for rid, valid in self.cm.take_recompute().items():
                st_ = self.cm.request(rid)
                hashes = self.stepped.get(rid) or self.reqs.get(rid)
                for i, b in st_.fresh.items():
                    if valid <= i < len(hashes):
                        self.dev[b] = hashes[i]

    @precondition(lambda self: self.stepped)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.stepped)))
        hashes = self.stepped.pop(rid)
        computed = data.draw(st.one_of(st.none(), st.integers(0, len(hashes) * BS)))
        for i, n in enumerate(self.cm.held_blocks(rid)):  # kept device blocks hold their hash
            if n.status is DEVICE and (computed is None or i < computed // BS):
                assert self.dev.get(n.dev) == n.hash
        self.cm.finish(rid, computed)
        self.cm.check_invariants()
        self._run_ops(data)  # backups emitted by the write policy
        self.cm.check_invariants()

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        del self.reqs[rid]
        self.cm.abort(rid)

    @precondition(lambda self: not self.reqs and not self.stepped)
    @rule()
    def reset(self):
        self.cm.reset()
        self.cm.check_invariants()

    @invariant()
    def consistent(self):
        if hasattr(self, "cm"):
            self.cm.check_invariants()
            # O(1) eviction: the policies looked at one entry per victim (a run of blocks
            # cut to what is needed), none skipped or rotated, whatever the ack order.
            stats, tree = self.cm.stats, self.cm.tree
            assert tree.dpol.probes <= stats.evicted_device
            assert tree.hpol.probes <= stats.evicted_host


CacheMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheManagerStateMachine = CacheMachine.TestCase
