"""The vLLM connector's event names (``connector.*``), one spelling for its code, its tests
and ``zkv logs --event`` (zkv's own are in :mod:`zkv.log`)."""

from __future__ import annotations

# both halves
LOAD_FAILED = "connector.load_failed"          # worker: a load batch failed on this rank;
#                                                scheduler: a request's blocks not loaded
# scheduler half
DISABLED = "connector.disabled"                # a lost rank ended zkv for this engine
CLOSED = "connector.closed"
INVARIANTS_BROKEN = "connector.invariants_broken"
BATCH_PUBLISHED = "connector.batch_published"
PROMISE_NOT_LOADED = "connector.promise_not_loaded"
PUMP_FAILED = "connector.pump_failed"
SAVE_REFUSED = "connector.save_refused"
CACHE_RESET = "connector.cache_reset"
FAILURE_POLICY = "connector.failure_policy"    # advice on kv_load_failure_policy
SECRET_IN_CONFIG = "connector.secret_in_config"  # storage's password is in vLLM's log
MM_IDS_LOCAL = "connector.mm_ids_local"        # multimodal inputs not named by content
METRICS_SERVING = "connector.metrics_serving"
STORE_CLOSED = "connector.store_closed"
STALE_DIRS_REMOVED = "connector.stale_dirs_removed"
AWAIT_EXPIRED = "connector.producer_blocks_missing"  # P/D: a consumer gave up waiting
BAD_TRANSFER_PARAMS = "connector.bad_transfer_params"
# worker half
WORKER_STARTED = "connector.worker_started"
BATCH_LATE = "connector.batch_late"
WORKER_STATS = "connector.worker_stats"
