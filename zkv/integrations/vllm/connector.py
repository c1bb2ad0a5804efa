"""``ZkvConnector``: zkv as vLLM's v1 KV connector (L2 host pool + L3 store behind vLLM).

Select it the standard way::

    --kv-transfer-config '{"kv_connector": "ZkvConnector",
                           "kv_connector_module_path": "zkv.integrations.vllm_connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"host_bytes": "4GiB"}}'

The scheduler half (:mod:`.scheduler`) lives in the EngineCore process and binds the
Dispatcher on ``ipc://`` sockets in a per-engine 0700 directory named after vLLM's
``engine_id``; each worker half (:mod:`.worker`) starts a Sidecar that connects to them.
Both halves derive the same :class:`~zkv.config.CacheLayout` (and so the same L3
namespace: the model's identity (:mod:`.identity`: path or hub commit, config digest,
``hf_overrides``, quantization, vLLM's KV cache dtype), block geometry and dtype, per-rank
heads, world size, byte layout) from vLLM's config and KV cache spec.
"""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from zkv import log as zlog
from zkv.errors import ConfigError
from zkv.integrations.vllm import events as E
from zkv.integrations.vllm.config import (
    ZkvVllmConfig,
    check_host_memory,
    dp_index,
    engine_metrics_port,
    failure_policy_advice,
    l3_source,
    parse_extra_config,
    storage_secret_advice,
)
from zkv.integrations.vllm.identity import model_identity
from zkv.integrations.vllm.ipc import claim_engine_dir, ipc_endpoints
from zkv.integrations.vllm.layout import (
    Geometry,
    cache_layout,
    dtype_name,
    expected_kv_layout,
    kv_views,
)
from zkv.integrations.vllm.records import ZkvMetadata
from zkv.integrations.vllm.request_hashes import mm_ids_name_content, mm_scope
from zkv.integrations.vllm.scheduler import SchedulerHalf
from zkv.integrations.vllm.worker import WorkerHalf

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from zkv.config import CacheLayout


class ZkvConnectorMetadata(KVConnectorMetadata, ZkvMetadata):
    """:class:`ZkvMetadata` as vLLM's metadata type."""


class ZkvWorkerMetadata(KVConnectorWorkerMetadata):
    """What every worker half sends back with a step's output: the step's number, so the
    scheduler half pairs the output with its step. It also makes the connector output of a
    step without tokens non-empty, so that vLLM reports that step too."""

    def __init__(self, step: int) -> None:
        self.step = step

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, ZkvWorkerMetadata)
        return self if self.step <= other.step else other  # ranks run steps in lockstep


#: Counters reported to vLLM's own stats logging ("KV Transfer metrics: ..."), as deltas.
STAT_KEYS = ("requests", "vllm_local_tokens", "zkv_host_tokens", "zkv_store_tokens",
             "computed_tokens", "failed_load_blocks", "saved_blocks", "loaded_blocks")


class ZkvConnectorStats(KVConnectorStats):
    """zkv's counters as vLLM's ``KVConnectorStats`` (sums over an interval)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {f"zkv_{k}": v for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


def geometry(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> Geometry:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(f"zkv: models with {len(groups)} KV cache groups (hybrid or "
                          "sliding-window attention) are not supported; one full-attention "
                          "group is")
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec:
        # SlidingWindowSpec, ChunkedLocalAttentionSpec, RSWASpec, ...: vLLM frees a
        # request's blocks outside the window as it runs, so they hold no KV to save;
        # MLAAttentionSpec: one latent tensor, not K and V
        raise ConfigError(f"zkv: {type(spec).__name__} KV caches are not supported (sliding-"
                          "window, chunked-local or MLA attention); full attention is")
    if getattr(spec, "non_causal", False):
        raise ConfigError("zkv: non-causal attention is not supported: a block's KV depends "
                          "on the tokens after it, not on its prefix alone")
    if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        raise ConfigError("zkv: K and V of different head sizes are not supported")
    return Geometry(len(groups[0].layer_names), spec.num_kv_heads, spec.block_size,
                    spec.head_size, dtype_name(spec.dtype), kv_cache_config.num_blocks)


def local_engines(vllm_config: VllmConfig) -> int:
    """vLLM's data-parallel engines on this machine (1 without data parallelism): their
    ranks' host pools share its memory."""
    n = getattr(vllm_config.parallel_config, "data_parallel_size_local", 1)
    return n if isinstance(n, int) and n > 0 else 1


def world_size(vllm_config: VllmConfig) -> int:
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size != 1:
        raise ConfigError("zkv: pipeline parallelism is not supported (tensor parallel is)")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        # a vLLM block then spans N x block_size tokens over N ranks: zkv's hash i would
        # name vLLM's block i, which holds other tokens
        if getattr(pc, name, 1) != 1:
            raise ConfigError(f"zkv: context parallelism is not supported ({name} "
                              f"{getattr(pc, name)}; tensor parallel is)")
    return int(pc.tensor_parallel_size)


def open_l3(url: str | None, layout: CacheLayout, rank: int | None = None) -> Any:
    """The L3 store (None without one); ``rank``: a worker's, whose blocks it writes (None:
    the scheduler's, which only asks). A server that is down is no error here: the store
    fails fast (misses) and reconnects when it is back. A ``file://`` budget that holds no
    block on each rank is refused."""
    if url is None:
        return None
    from zkv.storage import HEADER_SIZE, open_store

    return open_store(url, layout.fingerprint(), writers=layout.world_size, rank=rank,
                      block_bytes=HEADER_SIZE + layout.block_bytes)


class ZkvConnector(KVConnectorBase_V1):
    """See the module docstring; the halves hold the logic."""

    _cache_hit_source = CacheHitSource.HOST

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True: a forward's attention layers wait for their loads (``wait_for_layer_load``),
        Python that a full CUDA graph does not run when replayed: the layer would read its
        blocks before zkv wrote them. vLLM then runs PIECEWISE graphs, which leave the
        attention (and the wait) outside the graph. True for every configuration, since
        loads can come with any step (a ``kv_producer`` loads nothing, but the role is not
        in ``extra_config``)."""
        return True

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        tc = vllm_config.kv_transfer_config
        assert tc is not None  # vLLM makes a connector only from a kv_transfer_config
        self.cfg: ZkvVllmConfig = parse_extra_config(tc.kv_connector_extra_config)
        if kv_cache_config is None:
            raise ConfigError("zkv: this vLLM does not pass kv_cache_config to connectors")
        self.geo = geometry(vllm_config, kv_cache_config)
        self._kv_cache_config = kv_cache_config
        self.world_size = world_size(vllm_config)
        self.engine_id = str(tc.engine_id)
        salt = f"|{self.cfg.namespace_salt}" if self.cfg.namespace_salt else ""
        from vllm.platforms import current_platform

        fp8 = str(current_platform.fp8_dtype()).removeprefix("torch.")
        self.model = model_identity(vllm_config.model_config, vllm_config.cache_config,
                                    fp8_e4m3=fp8) + salt
        self.sched: SchedulerHalf | None = None
        self.worker: WorkerHalf | None = None
        self._ipc_dir: str | None = None
        self._store: Any = None  # this half's L3 store: closed at shutdown, after the half
        self._metrics_server: Any = None  # metrics_port's: stopped at shutdown
        self._stats_seen: dict[str, int] = {}
        if role == KVConnectorRole.SCHEDULER:
            self._start_scheduler(vllm_config)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.rank = int(get_tensor_model_parallel_rank())
            dp = dp_index(vllm_config)
            zlog.configure("connector", self.rank, self.cfg.log_dir, self.cfg.log_level,
                           dp_rank=dp or None)
            self.worker = WorkerHalf(self.cfg, self.rank, self.engine_id)

    def _resolved_layout(self) -> str | None:
        """The KV cache layout the engine resolved (vLLM 0.32 on; None before)."""
        return (getattr(self._kv_cache_config, "kv_cache_layout", None)
                or getattr(self._vllm_config.cache_config, "kv_cache_layout", None))

    def _layout(self, kv_layout: str) -> Any:
        itemsize = torch.empty(0, dtype=getattr(torch, self.geo.dtype)).element_size()
        block_bytes = 2 * self.geo.num_layers * self.geo.kv_heads * self.geo.block_size \
            * self.geo.head_dim * itemsize
        return cache_layout(self.geo, kv_layout=kv_layout,
                            num_host_blocks=self.cfg.num_host_blocks(block_bytes),
                            world_size=self.world_size, model=self.model)

    def _start_scheduler(self, vllm_config: VllmConfig) -> None:
        """Start the scheduler role; a start that fails releases what it made (the half
        that joined the ranks, its pump thread and metrics, the store, the engine's ipc
        directory) before it raises: vLLM never gets the connector, so no ``shutdown``
        would (a retried in-process engine kept one live phantom half per failed try)."""
        try:
            self._start_scheduler_parts(vllm_config)
        except BaseException:
            self.shutdown()
            raise

    def _start_scheduler_parts(self, vllm_config: VllmConfig) -> None:
        from vllm.platforms import current_platform

        dp = dp_index(vllm_config)  # (each data-parallel engine: its own file and port)
        zlog.configure("scheduler", None, self.cfg.log_dir, self.cfg.log_level,
                       dp_rank=dp or None)
        tc = vllm_config.kv_transfer_config
        assert tc is not None
        secret = storage_secret_advice(tc.kv_connector_extra_config)
        if secret is not None:  # said by the scheduler half only: once per engine
            zlog.get_logger("connector", role="scheduler", engine_id=self.engine_id).warning(
                E.SECRET_IN_CONFIG, hint=secret)
        # (no check_host_memory here: vLLM registers the caches, and the worker halves
        # check and allocate their pools, before it starts a scheduler; checked again now,
        # those pools counted twice, against memory they already took)
        layout = self._layout(expected_kv_layout(current_platform.is_cpu(),
                                                 self._resolved_layout()))
        pub, pull, ipc_dir = ipc_endpoints(self.engine_id, create=True)
        claim_engine_dir(ipc_dir, self.engine_id)  # (another live engine's: refused)
        self._ipc_dir = ipc_dir
        store = self._store = open_l3(self.cfg.storage, layout)
        exists = None
        if store is not None:
            from zkv.storage import StorageQuery

            exists = StorageQuery(store, self.world_size)
        self.sched = SchedulerHalf(self.cfg, layout, pub_endpoint=pub, pull_endpoint=pull,
                                   store=store, storage_exists=exists,
                                   loads=tc.is_kv_consumer, saves=tc.is_kv_producer,
                                   mm_scope=mm_scope(vllm_config), engine_id=self.engine_id)
        if not mm_ids_name_content(vllm_config):
            self.sched.log.warning(
                E.MM_IDS_LOCAL, hint="with prefix caching off and "
                "mm_processor_cache_gb=0 vLLM names an image, audio or video by a counter, "
                "not its content: the blocks from a prompt's first such input on are reused "
                "only within this engine and only when the client names the input "
                "(multi_modal_uuids), never through the store; turn on either cache to "
                "reuse them")
        asynchronous = bool(vllm_config.scheduler_config.async_scheduling)
        hint = failure_policy_advice(tc.kv_load_failure_policy, asynchronous)
        if hint is not None:
            self.sched.log.warning(E.FAILURE_POLICY, policy=tc.kv_load_failure_policy,
                                   async_scheduling=asynchronous, hint=hint)
        if self.cfg.metrics_port is not None:
            from zkv.integrations.vllm import metrics

            port = engine_metrics_port(self.cfg.metrics_port, dp)
            try:
                self._metrics_server = metrics.serve(port)
            except ConfigError as e:  # the engine stops at start, with one line
                raise ConfigError(f"zkv: {e}") from None
            # (metrics_port 0 picks a free port: this line says which)
            self.sched.log.info(E.METRICS_SERVING, url=self._metrics_server.url)

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.platforms import current_platform

        assert self.worker is not None
        cpu = current_platform.is_cpu()
        names, views, kind = kv_views(kv_caches, self.geo, cpu=cpu)
        resolved = self._resolved_layout()
        if resolved is not None and kind != expected_kv_layout(cpu, resolved):
            # (the scheduler half would refuse the rank: its layout differs, less clearly)
            raise ConfigError(f"zkv: vLLM's KV tensors are {kind}, but vLLM resolved the "
                              f"layout {resolved}")
        layout = self._layout(kind)
        check_host_memory(layout, local_engines(self._vllm_config))  # before the pool
        pub, pull, _ = ipc_endpoints(self.engine_id, create=True)
        store = self._store = open_l3(self.cfg.storage, layout, self.rank)
        gate = self.cfg.gate
        if gate == "auto":
            gate = bool(getattr(self._vllm_config.scheduler_config, "async_scheduling", True))
        self.worker.start(names, views, layout, pub_endpoint=pub, pull_endpoint=pull,
                          store=store, gated=bool(gate))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None:
            assert isinstance(connector_metadata, ZkvMetadata)
            self.worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None  # the batch was released in bind_connector_metadata

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # saves are planned by the scheduler half once a step is confirmed

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # (sending: requests whose blocks vLLM kept for their saves, once saved; held.py)
        return (self.worker.finished_saves() if self.worker is not None else None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self.worker.load_errors()) if self.worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        meta = None if self.worker is None else self.worker.meta
        return None if meta is None or meta.step < 0 else ZkvWorkerMetadata(meta.step)

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self.sched is not None
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self.sched is not None
        self.sched.update_state_after_alloc(request, blocks.get_block_ids()[0],
                                            num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int
                                       ) -> dict[CacheHitSource, int]:
        """zkv's hits by tier, for vLLM's ``vllm:prompt_tokens_cached_by_source``: its host
        tier's as ``host``, L3's as ``disk`` (a ``file://`` store) or
        ``external_unspecified`` (Redis, Mooncake: remote stores, as vLLM names them).
        Before, every hit was ``host``, L3's too."""
        if not num_external_tokens or self.sched is None:
            return {}
        host, l3 = self.sched.hit_tiers(request.request_id, num_external_tokens)
        far = CacheHitSource(l3_source(None if self._store is None else self._store.url))
        return {src: n for src, n in ((CacheHitSource.HOST, host), (far, l3)) if n}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.sched is not None
        meta = self.sched.build_connector_meta(scheduler_output)
        out = ZkvConnectorMetadata()
        out.__dict__.update(meta.__dict__)
        return out

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.sched is not None:
            meta = connector_output.kv_connector_worker_meta
            self.sched.update_connector_output(
                connector_output.invalid_block_ids or (),
                step=meta.step if isinstance(meta, ZkvWorkerMetadata) else None)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        assert self.sched is not None
        return self.sched.request_finished(request)

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: see ``SchedulerHalf.reset``."""
        return True if self.sched is None else self.sched.reset()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.sched is None:
            return None
        snap = self.sched.counters()  # every step: no tree walk (snapshot() walks it)
        now = {k: snap[k] for k in STAT_KEYS}
        delta = {k: v - self._stats_seen.get(k, 0) for k, v in now.items()}
        self._stats_seen = now
        return ZkvConnectorStats(data=delta)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return ZkvConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        """Close what this connector runs; the store last, even when closing another part
        raised. The scheduler half stays, closed: a call of vLLM's after this one misses
        (was: an AssertionError). Idempotent."""
        try:
            if self._metrics_server is not None:  # its port, for the next engine
                server, self._metrics_server = self._metrics_server, None
                server.shutdown()
            if self.worker is not None:
                self.worker.close()
            if self.sched is not None:
                self.sched.close()
            if self._ipc_dir:  # (ours, claimed; also after a failed start; once)
                ipc_dir, self._ipc_dir = self._ipc_dir, None
                shutil.rmtree(ipc_dir, ignore_errors=True)
        finally:
            if self._store is not None:  # its connections and reconnect thread
                store, self._store = self._store, None
                store.close()
                role = "worker" if self.worker is not None else "scheduler"
                zlog.get_logger("connector", role=role, engine_id=self.engine_id).info(
                    E.STORE_CLOSED, store=store.url, **store.stats.snapshot())
