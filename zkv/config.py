"""Cache geometry shared by the scheduler, the workers and the launcher.

The layout travels to child processes as JSON in ``$ZKV_CONFIG`` and each worker's
``Hello`` carries its :meth:`CacheLayout.fingerprint`, so a rank whose cache differs
from the scheduler's is refused before any batch is published. The same fingerprint is
the L3 namespace, so incompatible caches never mix in a shared store.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass

import orjson
import xxhash

from zkv.errors import ConfigError

KV_LAYOUTS = ("HND", "NHD", "HNC", "NHC")
_STR_FIELDS = frozenset({"dtype", "model", "kv_layout"})  # CacheLayout's; the others: int
_DTYPE_SIZES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "uint8": 1,
                "int8": 1}


#: The most of anything a layout counts: block ids go on the wire as int32, and nothing
#: else comes near (before, a pool count past 64 bits was an orjson TypeError traceback).
MAX_COUNT = 2**31 - 1


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """Geometry of one rank's KV cache.

    Device cache: per layer ``(K, V)``, each ``[num_device_blocks, kv_heads, block_size, head_dim]``
    (any strides; :mod:`zkv.kernels.layout` describes the layouts engines use: NHD, fused,
    vLLM CPU), or with ``num_kv_parts=1`` one latent tensor per layer (MLA).
    Host pool, page-first (one host block = every layer's K and V, contiguous)::

        host_pool[num_host_blocks, num_layers, num_kv_parts, kv_heads, block_size, head_dim]
        └ block b ┘ = | L0 K | L0 V | L1 K | L1 V | ... |
                      each chunk = kv_heads * block_size * head_dim * itemsize
    """

    num_layers: int
    kv_heads: int
    block_size: int
    head_dim: int
    dtype: str = "float16"
    num_device_blocks: int = 0
    num_host_blocks: int = 0
    world_size: int = 1
    model: str = "zkv-synthetic"
    #: Byte order of one K (or V) chunk of a host block: "HND" = [heads, block, dim],
    #: "NHD" = [block, heads, dim] (what the engine's device layout gives without a transpose);
    #: "HNC" / "NHC": vLLM 0.32's GPU blocks, [heads][block][K|V] or [block][heads][K|V],
    #: kept as they are, their first half as the "K" chunk and the second as "V" (the
    #: copies see an HND-shaped chunk; the name keeps them apart in a store).
    kv_layout: str = "HND"
    #: Parts per layer: 2 (K and V) or 1 (an MLA latent cache).
    num_kv_parts: int = 2

    def __post_init__(self) -> None:
        for name, value in ((f, getattr(self, f)) for f in self.__dataclass_fields__):
            want = str if name in _STR_FIELDS else int  # bool is an int: refused (JSON true)
            if not isinstance(value, want) or isinstance(value, bool):
                raise ConfigError(f"{name} must be {'a str' if want is str else 'an int'}, "
                                  f"got {value!r}")
        for name in ("num_layers", "kv_heads", "block_size", "head_dim", "world_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_kv_parts not in (1, 2):
            raise ConfigError(f"num_kv_parts must be 2 (K and V) or 1 (MLA latent), got "
                              f"{self.num_kv_parts}")
        if self.num_device_blocks < 0 or self.num_host_blocks < 0:
            raise ConfigError("block counts must be >= 0")
        for name in ("num_device_blocks", "num_host_blocks", "num_layers", "kv_heads",
                     "block_size", "head_dim", "world_size"):  # (ids: int32 on the wire)
            if getattr(self, name) > MAX_COUNT:
                raise ConfigError(f"{name} must be <= 2**31 - 1, got {getattr(self, name)}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ConfigError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got "
                              f"{self.kv_layout!r}")
        if self.dtype not in _DTYPE_SIZES:
            raise ConfigError(f"unsupported dtype {self.dtype!r}; one of {sorted(_DTYPE_SIZES)}")

    @property
    def host_order(self) -> str:
        """The chunk order the copies write to host blocks: NHD, else HND (see kv_layout)."""
        return "NHD" if self.kv_layout == "NHD" else "HND"

    @property
    def itemsize(self) -> int:
        return _DTYPE_SIZES[self.dtype]

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one layer's K (or V) of one block."""
        return self.kv_heads * self.block_size * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, all layers, K and V (= one host block, one L3 value)."""
        return self.num_kv_parts * self.num_layers * self.chunk_bytes

    def fingerprint(self) -> str:
        """Model, dtype, block geometry and world size; not the pool sizes (those may differ
        between instances that share a store)."""
        ident = (
            f"{self.model}|{self.dtype}|L{self.num_layers}|H{self.kv_heads}|B{self.block_size}"
            f"|D{self.head_dim}|W{self.world_size}|page-first"
            + ("" if self.kv_layout == "HND" else f"|{self.kv_layout}")
        )
        if self.num_kv_parts != 2:  # K+V keeps the fingerprints caches already carry
            ident += f"|P{self.num_kv_parts}"
        return xxhash.xxh3_64_hexdigest(ident.encode())

    def to_json(self) -> str:
        return orjson.dumps(asdict(self)).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> CacheLayout:
        try:
            raw = orjson.loads(text)
        except orjson.JSONDecodeError as e:
            raise ConfigError(f"bad cache layout JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"bad cache layout JSON: expected an object of fields, got "
                              f"{type(raw).__name__}")
        fields = cls.__dataclass_fields__
        unknown = sorted(set(raw) - set(fields))
        missing = [n for n, f in fields.items() if n not in raw and f.default is MISSING
                   and f.default_factory is MISSING]
        if unknown or missing:
            raise ConfigError("bad cache layout JSON: " + "; ".join(
                ([f"unknown field(s) {', '.join(unknown)}"] if unknown else [])
                + ([f"missing field(s) {', '.join(missing)}"] if missing else [])))
        try:
            return cls(**raw)
        except (TypeError, ConfigError) as e:  # a field's type or value
            raise ConfigError(f"bad cache layout JSON: {e}") from None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CacheLayout:
        env = os.environ if env is None else env
        text = env.get("ZKV_CONFIG")
        if not text:
            raise ConfigError("ZKV_CONFIG is not set: run the ranks with zkvrun --config FILE "
                              "(the cache layout as JSON), which sets it for every rank")
        return cls.from_json(text)


#: The copy backends a rank takes (``ZKV_BACKEND``): ``auto`` is cupy when CUDA works.
CPU_BACKENDS = ("cpu", "torch", "torch-cpu")
BACKEND_NAMES = ("auto", "cupy", *CPU_BACKENDS)


def check_backend_name(name: str) -> None:
    """ConfigError unless ``name`` is a copy backend's (checked without torch: a launcher
    refuses a typo before it starts any rank)."""
    if name not in BACKEND_NAMES:
        raise ConfigError(f"unknown copy backend {name!r}; one of "
                          f"{', '.join(map(repr, BACKEND_NAMES))}")


#: ``ZKV_HEARTBEAT_S`` (a rank's heartbeat interval): its default, and the least taken (1e-9
#: was a heartbeat every turn of the actor loop: a flood of the scheduler's PULL socket).
DEFAULT_HEARTBEAT_S = 0.25
MIN_HEARTBEAT_S = 0.01
#: A scheduler declares a rank lost after its heartbeat timeout, which may be as short as
#: 1 s (vLLM's ``heartbeat_timeout_s`` at its least; the soak's is 2 s): a rank must beat
#: at least twice within it, or an idle one is lost. (Before, any value passed: 1e10
#: killed the heartbeat thread with an OverflowError, and the rank beat no more.)
MAX_HEARTBEAT_S = 0.5
#: ``ZKV_SCHEDULER_TIMEOUT_S``'s default: a scheduler restarted by zkvrun is back in seconds.
DEFAULT_SCHEDULER_TIMEOUT_S = 300.0
_FOREVER = ("inf", "none", "off")


def heartbeat_from_env(env: Mapping[str, str] | None = None) -> float:
    """``ZKV_HEARTBEAT_S``: seconds in [MIN_HEARTBEAT_S, MAX_HEARTBEAT_S] (default 0.25);
    else ConfigError naming the value."""
    env = os.environ if env is None else env
    raw = env.get("ZKV_HEARTBEAT_S", str(DEFAULT_HEARTBEAT_S))
    value = _finite_positive(raw)
    if value is None or not MIN_HEARTBEAT_S <= value <= MAX_HEARTBEAT_S:
        raise ConfigError(f"ZKV_HEARTBEAT_S must be a finite number of seconds in "
                          f"[{MIN_HEARTBEAT_S}, {MAX_HEARTBEAT_S}], got {raw!r}")
    return value


def scheduler_timeout_from_env(env: Mapping[str, str] | None = None) -> float | None:
    """``ZKV_SCHEDULER_TIMEOUT_S``: seconds (default 300), or None for ``inf`` / ``none`` /
    ``off`` (wait forever). ConfigError naming the value otherwise (as zkv.worker's)."""
    env = os.environ if env is None else env
    raw = env.get("ZKV_SCHEDULER_TIMEOUT_S", "").strip()
    if not raw:
        return DEFAULT_SCHEDULER_TIMEOUT_S
    if raw.lower() in _FOREVER:
        return None
    value = _finite_positive(raw)
    if value is None:
        raise ConfigError(f"ZKV_SCHEDULER_TIMEOUT_S must be a finite number of seconds > 0, "
                          f"or inf to wait forever, got {raw!r}")
    return value


def check_rank_env(env: Mapping[str, str] | None = None) -> None:
    """ConfigError naming the first variable every zkv.worker rank reads that a rank would
    refuse (checked without torch: a launcher refuses it before it starts any rank)."""
    env = os.environ if env is None else env
    try:
        check_backend_name(env.get("ZKV_BACKEND", "cpu"))
    except ConfigError as e:
        raise ConfigError(f"ZKV_BACKEND: {e}") from None
    heartbeat_from_env(env)
    scheduler_timeout_from_env(env)


def _finite_positive(raw: str) -> float | None:
    """``raw`` as a finite number > 0; None for junk, NaN, inf or <= 0 (and for "1_0",
    which Python's ``float`` reads as 10)."""
    try:
        value = float(raw) if "_" not in raw else math.nan
    except ValueError:
        return None
    return value if 0 < value < math.inf else None


def endpoints_from_env(env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The scheduler's endpoints as zkvrun sets them (``ZKV_PUB_ENDPOINT``,
    ``ZKV_PULL_ENDPOINT``): the scheduler binds them, every rank connects to them."""
    env = os.environ if env is None else env
    try:
        return env["ZKV_PUB_ENDPOINT"], env["ZKV_PULL_ENDPOINT"]
    except KeyError as e:
        raise ConfigError(f"{e.args[0]} is not set (zkvrun sets it for the scheduler and "
                          "every rank)") from None


#: Pools may take at most this share of the memory available when they are sized.
POOL_MEMORY_SHARE = 0.8


def available_memory() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def pools_fit(need_bytes: int) -> tuple[bool, int | None]:
    """Whether pools of ``need_bytes`` in all fit in ``POOL_MEMORY_SHARE`` of the memory
    available now (True where that is unknown), and the bytes available."""
    free = available_memory()
    return free is None or need_bytes <= POOL_MEMORY_SHARE * free, free


#: What one pool block costs the scheduler's process: a free-list slot and its int, a flag.
SCHEDULER_BYTES_PER_BLOCK = 48


def scheduler_shortfall(layout: CacheLayout) -> str | None:
    """None when the scheduler's bookkeeping of one rank's pools fits (:func:`pools_fit`);
    else the start of the caller's error line. Checked even where ``--force`` passes the
    pools' own check: past it the scheduler dies of a MemoryError, or the OOM killer."""
    blocks = layout.num_device_blocks + layout.num_host_blocks
    need = blocks * SCHEDULER_BYTES_PER_BLOCK
    fits, free = pools_fit(need)
    if fits:
        return None
    assert free is not None
    return (f"the scheduler's pools of {blocks} blocks need about {need / 2**30:.1f} GiB of "
            f"its memory (a free list and a flag per block), and {free / 2**30:.1f} GiB is "
            "available")


def pools_shortfall(layout: CacheLayout, *, device: bool = True) -> str | None:
    """None when every rank's host pool (and device pool, with ``device``) of ``layout``
    fits (:func:`pools_fit`); else what they need against what there is, the start of the
    caller's one error line (the caller says what to lower)."""
    blocks = layout.num_host_blocks + (layout.num_device_blocks if device else 0)
    need = layout.world_size * blocks * layout.block_bytes
    fits, free = pools_fit(need)
    if fits:
        return None
    assert free is not None
    counts = (f"{layout.num_device_blocks}+{layout.num_host_blocks}" if device
              else f"{layout.num_host_blocks}")
    return (f"the {'pools' if device else 'host pools'} need {need / 2**30:.1f} GiB "
            f"({layout.world_size} ranks x {counts} blocks x {layout.block_bytes >> 10} KiB) "
            f"and {free / 2**30:.1f} GiB is available (pools may take "
            f"{POOL_MEMORY_SHARE:.0%} of it)")
