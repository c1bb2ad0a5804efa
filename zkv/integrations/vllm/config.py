"""``kv_connector_extra_config`` of the zkv connector: parsed once, refused whole if wrong.

Keys (all optional)::

    host_blocks              int > 0      zkv host (L2) blocks per rank
    host_bytes               int | "4GiB" host pool bytes per rank (instead of host_blocks;
                                          default 2GiB)
    storage                  URL | "none" L3: file:///path, redis://127.0.0.1:PORT/DB
                                          (rediss:// over TLS), mooncake://127.0.0.1:PORT;
                                          default $ZKV_STORE_URL, else
                                          file://~/.cache/zkv/l3. A password belongs in
                                          $ZKV_STORE_URL: vLLM logs this config at start
    storage_write            bool         write blocks that reach host to L3 (default: true
                                          when there is an L3)
    policy                   str          write_through (default): save each full block as
                                          soon as it is computed; write_through_selective:
                                          so once `write_through_threshold` requests used
                                          it, else when its request finishes; write_back:
                                          when its request finishes
    write_through_threshold  int >= 1     default 2
    prefetch                 str          L3 -> host prefetch: timeout (default) |
                                          wait_complete | best_effort
    prefetch_base_ms         float >= 0   timeout policy: budget = base + per_ki_token x
    prefetch_per_ki_token_ms float >= 0   prompt tokens / 1024, at most max (defaults 50,
    prefetch_max_ms          float >= 0   50 and 2000 ms; zkv.scheduler.prefetch); max
                                          also bounds a P/D consumer's wait for the
                                          blocks its producer promised
    gate                     "auto"|bool  run a batch only once the worker half released it
                                          (auto: when vLLM schedules asynchronously)
    layer_timeout_s          float > 0    a forward waits this long for a layer's load
                                          before it counts as failed (default 30,
                                          at most a day, as heartbeat_timeout_s)
    heartbeat_timeout_s      float >= 1   a rank not heard from for this long is lost and
                                          zkv is off for the engine (default 30; an idle
                                          engine loses none: what the ranks sent while
                                          nothing polled is read first)
    log_dir                  str          zkv's JSON logs (default: stderr, level warning); a
                                          directory this process can write or make
    log_level                str          debug | info | warning | error | critical (any
                                          case, warn, fatal; default $ZKV_LOG_LEVEL, else
                                          warning)
    metrics_port             int >= 0     serve zkv's Prometheus metrics on 127.0.0.1:PORT
                                          from the scheduler process (0: any port); data-
                                          parallel engine d serves on PORT + d, as vLLM's
                                          own per-replica ports do
    namespace_salt           str          mixed into the L3 namespace
    inject_load_failures     list[int]    test hook: the n-th load batch (0-based, per rank)
                                          fails after scribbling over its destination blocks
    inject_rank              int          the rank those failures happen on (default 0)

A value of the wrong type or out of range, or an unknown key, raises :class:`ConfigError`
with one line naming the key (vLLM refuses to start).

Both halves parse the same config in their own process (the scheduler half in the
EngineCore, a worker half in each of vLLM's worker processes) and so resolve the same
``storage``: those processes inherit the environment (``$ZKV_STORE_URL`` included) of the
process that started them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zkv.config import CacheLayout, pools_shortfall
from zkv.errors import ConfigError
from zkv.log import LEVELS, check_log_dir, level_name
from zkv.scheduler.prefetch import PREFETCH_POLICIES, PrefetchPolicy
from zkv.scheduler.records import WRITE_POLICIES, WRITE_THROUGH
from zkv.security import redact_url
from zkv.storage.url import file_url, parse_url

LOG_LEVELS = tuple(LEVELS)  # (zkv.log's: debug, info, warning, error, critical)
# ASCII digits only: \d took other scripts' ("٤GiB" was 4 GiB)
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
DEFAULT_HOST_BYTES = 2 * 2**30
MIN_HEARTBEAT_TIMEOUT_S = 1.0  # four of the ranks' heartbeats (Sidecar: every 0.25 s)
MAX_TIMEOUT_S = 86400.0  # a day: "never" for these timeouts (1e10 s overflowed a wait)
#: host_bytes and host_blocks at most (an int64, as torch sizes a pool): a larger one was an
#: OverflowError traceback at start, where the pool's size is put in GiB for the message.
MAX_POOL_SIZE = 2**63 - 1
#: ``storage`` when the extra config gives none (the variable ``python -m zkv.worker``
#: reads): vLLM logs its whole extra config at INFO at every start, and ``vllm serve`` has
#: it on its command line (``ps``), so a store password belongs here.
STORE_URL_ENV = "ZKV_STORE_URL"


def default_storage_url() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return file_url(os.path.join(base, "zkv", "l3"))


def l3_source(url: str | None) -> str:
    """vLLM's name (a ``CacheHitSource``) for the tier of L3 hits from the store at
    ``url``: a local directory is ``disk``; Redis and Mooncake are remote stores,
    ``external_unspecified``."""
    return "disk" if url is not None and url.startswith("file:") else "external_unspecified"


def env_storage_url(env: Mapping[str, str] | None = None) -> str | None:
    """``storage`` when the extra config has no such key: ``$ZKV_STORE_URL`` (``none``: no
    L3; empty: unset), else :func:`default_storage_url`."""
    raw = (os.environ if env is None else env).get(STORE_URL_ENV, "")
    return _storage(raw, STORE_URL_ENV) if raw.strip() else default_storage_url()


@dataclass(frozen=True, slots=True)
class ZkvVllmConfig:
    """The parsed extra config. ``repr`` shows ``storage`` without its user or password."""

    host_blocks: int | None = None
    host_bytes: int | None = None
    storage: str | None = None             # None: no L3
    storage_write: bool = True
    policy: str = WRITE_THROUGH
    write_through_threshold: int = 2
    prefetch: str = "timeout"
    prefetch_base_ms: float = 50.0
    prefetch_per_ki_token_ms: float = 50.0
    prefetch_max_ms: float = 2000.0
    layer_timeout_s: float = 30.0
    heartbeat_timeout_s: float = 30.0
    gate: str | bool = "auto"
    log_dir: str | None = None
    log_level: str = "warning"
    metrics_port: int | None = None
    namespace_salt: str = ""
    inject_load_failures: tuple[int, ...] = field(default_factory=tuple)
    inject_rank: int = 0

    def __repr__(self) -> str:
        shown = {f: getattr(self, f) for f in self.__dataclass_fields__}
        if self.storage is not None:
            shown["storage"] = redact_url(self.storage)
        return f"ZkvVllmConfig({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def prefetch_policy(self) -> PrefetchPolicy:
        return PrefetchPolicy(self.prefetch, self.prefetch_base_ms / 1e3,
                              self.prefetch_per_ki_token_ms / 1e3, self.prefetch_max_ms / 1e3)

    def num_host_blocks(self, block_bytes: int) -> int:
        """Host blocks per rank for blocks of ``block_bytes`` (at least 1)."""
        if self.host_blocks is not None:
            return self.host_blocks
        n = (self.host_bytes or DEFAULT_HOST_BYTES) // max(1, block_bytes)
        if n < 1:
            raise ConfigError(f"zkv: host_bytes={self.host_bytes} holds no block of "
                              f"{block_bytes} bytes")
        return int(n)


def parse_size(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"zkv: {key} must be a byte size, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        size = float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()]  # (inf: 400 digits)
        n = int(size) if math.isfinite(size) else MAX_POOL_SIZE + 1
    else:
        raise ConfigError(f"zkv: {key} must be a byte size like 4GiB or 1048576, got {value!r}")
    if n <= 0:
        raise ConfigError(f"zkv: {key} must be > 0, got {value!r}")
    if n > MAX_POOL_SIZE:
        raise ConfigError(f"zkv: {key} must be at most {MAX_POOL_SIZE} bytes, got {value!r:.40}")
    return n


def _typed(key: str, value: Any, typ: type | tuple[type, ...], what: str) -> Any:
    if isinstance(value, bool) and typ is not bool:
        raise ConfigError(f"zkv: {key} must be {what}, got {value!r}")
    if not isinstance(value, typ):
        raise ConfigError(f"zkv: {key} must be {what}, got {value!r}")
    return value


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"zkv: {key} must be one of {', '.join(choices)}; got {value!r}")
    return str(value)


def _log_level(key: str, value: Any) -> str:
    """A level name, any case, ``warn`` for ``warning`` (as ``$ZKV_LOG_LEVEL`` takes it)."""
    name = _typed(key, value, str, "a level name")
    return _choice(key, level_name(name) or name, LOG_LEVELS)


def _at_most(key: str, v: float, high: float) -> float:
    if v > high:  # (a wait past the platform's limit raised OverflowError in the forward)
        raise ConfigError(f"zkv: {key} must be <= {high:g} s, got {v:g}")
    return v


def _number(key: str, value: Any, low: float, strict: bool = False) -> float:
    try:
        v = float(_typed(key, value, (int, float), "a number"))
    except OverflowError:  # an int of 309 digits or more (Python's json.loads keeps it)
        raise ConfigError(f"zkv: {key} must be a finite number, got {value!r:.40}") from None
    if not math.isfinite(v):  # JSON configs may carry NaN / Infinity
        raise ConfigError(f"zkv: {key} must be a finite number, got {value!r}")
    if v < low or (strict and v == low):
        raise ConfigError(f"zkv: {key} must be {'>' if strict else '>='} {low}, got {value!r}")
    return v


def _storage(value: Any, key: str = "storage") -> str | None:
    url = _typed(key, value, str, "an L3 URL or 'none'")
    if url.lower() in ("none", "off"):
        return None
    if not url.strip():
        raise ConfigError(f"zkv: {key} is empty: give an L3 URL, or 'none' for no L3")
    try:
        parse_url(url)  # the storage package's own check, without connecting
    except ConfigError as e:  # (its message shows no password)
        raise ConfigError(f"zkv: {key}: {e}") from None
    return url


def storage_secret_advice(extra: Mapping[str, Any] | None) -> str | None:
    """What to say at start when the extra config's ``storage`` holds a user or password
    (None: nothing). The URL still works; the advice shows it without the credentials."""
    url = (extra or {}).get("storage")
    if not isinstance(url, str) or redact_url(url) == url:
        return None
    return (f"storage {redact_url(url)!r} holds credentials, and vLLM logs its "
            "kv_connector_extra_config at every start (vllm serve also shows it in ps): "
            f"leave storage out and give the URL in ${STORE_URL_ENV}, in the environment "
            "vLLM starts in")


def parse_extra_config(extra: Mapping[str, Any] | None,
                       env: Mapping[str, str] | None = None) -> ZkvVllmConfig:
    """Validate ``kv_connector_extra_config``; see the module docstring for the keys.
    ``env``: where ``$ZKV_STORE_URL`` is read (default ``os.environ``)."""
    if extra is not None and not isinstance(extra, Mapping):
        raise ConfigError("zkv: kv_connector_extra_config must be a JSON object of zkv keys, "
                          f"got {type(extra).__name__} {extra!r:.60}")
    extra = dict(extra or {})
    known = set(ZkvVllmConfig.__dataclass_fields__)
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ConfigError(f"zkv: unknown kv_connector_extra_config key(s) {unknown}; "
                          f"known: {sorted(known)}")
    if "host_blocks" in extra and "host_bytes" in extra:
        raise ConfigError("zkv: give host_blocks or host_bytes, not both")
    kw: dict[str, Any] = {}
    env = os.environ if env is None else env
    if "storage" not in extra:  # (an explicit key wins; the variable is not read then)
        kw["storage"] = env_storage_url(env)
    if "log_level" not in extra and env.get("ZKV_LOG_LEVEL"):  # (as every zkv process)
        kw["log_level"] = _log_level("ZKV_LOG_LEVEL", env["ZKV_LOG_LEVEL"])
    for key, value in extra.items():
        if key == "host_blocks":
            kw[key] = int(_typed(key, value, int, "an integer"))
            if not 0 < kw[key] <= MAX_POOL_SIZE:
                raise ConfigError(f"zkv: host_blocks must be > 0 and <= {MAX_POOL_SIZE}, "
                                  f"got {value!r:.40}")
        elif key == "host_bytes":
            kw[key] = parse_size(key, value)
        elif key == "storage":
            kw[key] = _storage(value)
        elif key == "storage_write":
            kw[key] = _typed(key, value, bool, "true or false")
        elif key == "policy":
            kw[key] = _choice(key, value, WRITE_POLICIES)
        elif key == "write_through_threshold":
            kw[key] = int(_number(key, _typed(key, value, int, "an integer"), 1))
        elif key == "prefetch":
            kw[key] = _choice(key, value, PREFETCH_POLICIES)
        elif key in ("prefetch_base_ms", "prefetch_per_ki_token_ms", "prefetch_max_ms"):
            kw[key] = _number(key, value, 0)
        elif key == "gate":
            if value != "auto" and not isinstance(value, bool):
                raise ConfigError(f"zkv: gate must be \"auto\", true or false; got {value!r}")
            kw[key] = value
        elif key == "layer_timeout_s":
            kw[key] = _at_most(key, _number(key, value, 0, strict=True), MAX_TIMEOUT_S)
        elif key == "heartbeat_timeout_s":  # a few of the ranks' heartbeats (every 0.25 s)
            kw[key] = _at_most(key, _number(key, value, MIN_HEARTBEAT_TIMEOUT_S), MAX_TIMEOUT_S)
        elif key == "log_dir":
            kw[key] = _typed(key, value, str, "a string")
            if not kw[key].strip():  # (configure() took "" for no key: stderr, silently)
                raise ConfigError("zkv: log_dir is empty: give a directory, or leave the key "
                                  "out for stderr")
            _no_control(key, kw[key])  # (a NUL: every process's start a ValueError traceback)
            try:
                check_log_dir(kw[key])
            except ConfigError as e:
                raise ConfigError(f"zkv: log_dir: {e}") from None
        elif key == "namespace_salt":
            kw[key] = _no_control(key, _typed(key, value, str, "a string"))
        elif key == "log_level":
            kw[key] = _log_level(key, value)
        elif key == "metrics_port":
            kw[key] = None if value is None else int(_number(key, _typed(
                key, value, int, "an integer port"), 0))
            if kw[key] is not None and kw[key] > 65535:
                raise ConfigError(f"zkv: metrics_port must be <= 65535, got {value!r}")
        elif key == "inject_load_failures":
            seq = _typed(key, value, (list, tuple), "a list of integers")
            if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in seq):
                raise ConfigError(f"zkv: {key} must be a list of integers >= 0, got {value!r}")
            kw[key] = tuple(seq)
        elif key == "inject_rank":
            kw[key] = int(_number(key, _typed(key, value, int, "an integer"), 0))
    _read_only_with(extra, kw)
    if kw["storage"] is None:
        if kw.get("storage_write"):
            raise ConfigError("zkv: storage_write is true but storage is none: nothing to "
                              "write to")
        kw.setdefault("storage_write", False)
    return ZkvVllmConfig(**kw)


def _no_control(key: str, value: str) -> str:
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ConfigError(f"zkv: {key} holds a control character (a NUL, a newline, a tab): "
                          f"{value!r:.60}")
    return value


def _read_only_with(extra: Mapping[str, Any], kw: Mapping[str, Any]) -> None:
    """ConfigError for a key the configuration does not read (it changed nothing and said
    nothing), as ``zkv replay`` refuses such flags."""
    policy = kw.get("policy", WRITE_THROUGH)
    if "write_through_threshold" in extra and policy != "write_through_selective":
        raise ConfigError(f"zkv: write_through_threshold is read by policy "
                          f"write_through_selective only (the policy is {policy})")
    for key in ("prefetch_base_ms", "prefetch_per_ki_token_ms", "prefetch_max_ms"):
        if key in extra and kw.get("prefetch", "timeout") != "timeout":
            raise ConfigError(f"zkv: {key} is read by prefetch timeout only (the prefetch "
                              f"policy is {kw['prefetch']})")
    if "inject_rank" in extra and not kw.get("inject_load_failures"):
        raise ConfigError("zkv: inject_rank is read with inject_load_failures only")


def dp_index(vllm_config: Any) -> int:
    """This engine's data-parallel index (0 without data parallelism): vLLM runs each
    DP engine in its own process with the one ``kv_connector_extra_config``, so what a
    process binds (a metrics port) or names (a log file) takes it in. vLLM sets
    ``data_parallel_rank`` back to 0 for an independent (dense) DP engine;
    ``data_parallel_index`` keeps the engine's number."""
    parallel = getattr(vllm_config, "parallel_config", None)
    index = getattr(parallel, "data_parallel_index", None)
    if index is None:
        index = getattr(parallel, "data_parallel_rank", 0)
    return int(index or 0)


def engine_metrics_port(port: int, dp: int) -> int:
    """The metrics port of data-parallel engine ``dp`` (0 stays 0: a free port each);
    ConfigError when it runs past 65535."""
    if port == 0:
        return 0
    if port + dp > 65535:
        raise ConfigError(f"zkv: metrics_port {port} + data-parallel index {dp} is past "
                          "65535; give a lower port")
    return port + dp


def failure_policy_advice(policy: str, async_scheduling: bool) -> str | None:
    """What to say at start about vLLM's ``kv_load_failure_policy`` (None: nothing).

    Synchronous scheduling: ``recompute`` (a failed load costs a recompute, not the
    request). Async scheduling (vLLM's default on a GPU): vLLM 0.32 does not recover from a
    failed load by recompute (it leaves the request's output placeholders in place: the
    request is stranded or recomputed wrong, vLLM issues #45138, #49250; vLLM's CPU runner
    with async scheduling kept on died with an IndexError in the embedding at the first
    injected failure), so ``fail`` (the request fails, the engine goes on) or scheduling
    synchronously."""
    if async_scheduling and policy == "recompute":
        return ("vLLM under async scheduling does not recover from a failed load by "
                "recompute (vLLM #45138, #49250: the engine can die at the first one): set "
                "kv_load_failure_policy=fail (only that request fails) or --no-async-scheduling")
    if not async_scheduling and policy != "recompute":
        return ("set kv_load_failure_policy=recompute: a failed load then costs a recompute, "
                "not the request")
    return None


def check_host_memory(layout: CacheLayout, engines: int = 1) -> None:
    """Refuse host pools that do not fit this machine: every rank's pool (the ranks share
    the machine: zkv's sockets are ipc://), of each of the ``engines`` data-parallel
    engines on it, within ``POOL_MEMORY_SHARE`` of the memory available. A pool past that
    would be allocated lazily and run the machine out of memory while serving, not at
    start. (vLLM starts local DP engines at once: each one checked only its own ranks,
    before the others allocated theirs.)"""
    short = pools_shortfall(dataclasses.replace(layout, world_size=layout.world_size * engines),
                            device=False)
    if short:
        raise ConfigError(f"zkv: {short}; lower host_bytes or host_blocks")
