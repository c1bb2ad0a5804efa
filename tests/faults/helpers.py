"""The whole pipeline for fault tests: a CacheManager, a Dispatcher and real worker
processes, one step per batch with a simulated forward pass (``fill`` new blocks, ``check``
reused ones byte for byte), plus a wire tamperer and the leak count."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.worker.helpers import WorkerGroup, poll_until_done
from zkv import protocol as P
from zkv.config import CacheLayout
from zkv.scheduler.dispatcher import BatchDone
from zkv.scheduler.manager import CacheConfig, CacheManager
from zkv.soak import Tamper, leaked_blocks

BS = 4
LAYOUT = CacheLayout(num_layers=2, kv_heads=2, block_size=BS, head_dim=8, dtype="float16",
                     num_device_blocks=6, num_host_blocks=6, world_size=2)
SIM = 1 << 40


@dataclass
class Pipeline:
    group: WorkerGroup
    cm: CacheManager
    sim_id: int = SIM
    checked: int = 0
    done: list[BatchDone] = field(default_factory=list)
    pending: tuple[str, list[P.Op], list[P.Op]] | None = None  # a step published, not committed

    @classmethod
    def start(cls, folder: str, layout: CacheLayout = LAYOUT, policy: str = "write_back",
              **group_kw: Any) -> Pipeline:
        """``group_kw`` go to :class:`WorkerGroup`; with ``store_dir`` the manager writes
        every block that reaches host to storage."""
        cm = CacheManager(CacheConfig(layout.num_device_blocks, layout.num_host_blocks,
                                      layout.block_size, policy,
                                      storage_write=bool(group_kw.get("store_dir"))))
        return cls(WorkerGroup(folder, layout.world_size, layout, **group_kw), cm)

    @property
    def d(self) -> Any:
        return self.group.d

    def tamper(self, mutate: Callable[[list[bytes]], list[list[bytes]]] | None) -> None:
        """Route the next publishes through ``mutate`` (None: back to the real socket)."""
        Tamper.install(self.d, mutate)

    def step(self, rid: str, hashes: list[bytes], *, publish_only: bool = False) -> BatchDone | int:
        """match + allocate + the manager's ops + fill/check, one batch; commit its acks.
        A request whose forward failed is aborted (never cached), else finished."""
        cm = self.cm
        m = cm.match_prefix(rid, hashes)
        table = cm.allocate(rid, len(hashes) * BS)
        assert table is not None, f"{rid} does not fit"
        ops = cm.take_ops()
        cached = m.num_device + m.num_host
        sim = []
        if cached:
            sim.append(self._sim(P.Op(0, P.CHECK, src=P.as_ids(table[:cached]),
                                      keys=tuple(hashes[:cached]))))
        if len(hashes) > cached:
            sim.append(self._sim(P.Op(0, P.FILL, dst=P.as_ids(table[cached:]),
                                      keys=tuple(hashes[cached:]))))
        seq = self.d.publish(ops + sim, step=len(self.done))
        if publish_only:
            self.pending = (rid, ops, sim)
            return seq
        return self.commit(rid, ops, sim, poll_until_done(self.d, seq, 30)[seq])

    def commit(self, rid: str, ops: list[P.Op], sim: list[P.Op], done: BatchDone) -> BatchDone:
        self.done.append(done)
        self.cm.on_ops_done([done.results[o.id] for o in ops])
        ok = all(done.results[o.id].ok for o in sim)
        self.checked += sum(len(o.keys) for o in sim if o.kind == P.CHECK and ok)
        if ok:
            self.cm.finish(rid)
        else:
            self.cm.abort(rid)
        self.cm.check_invariants()
        return done

    def flush(self) -> BatchDone | None:
        """Publish what ``finish`` left (backups, storage writes) and commit it."""
        ops = self.cm.take_ops()
        if not ops:
            return None
        seq = self.d.publish(ops, step=len(self.done))
        done = poll_until_done(self.d, seq, 30)[seq]
        self.cm.on_ops_done([done.results[o.id] for o in ops])
        self.cm.check_invariants()
        return done

    def _sim(self, op: P.Op) -> P.Op:
        self.sim_id += 1
        return P.Op(self.sim_id, op.kind, op.src, op.dst, op.keys)

    def leaked(self) -> int:
        return leaked_blocks(self.cm)

    def close(self) -> list[int | None]:
        self.tamper(None)
        return self.group.close()
