"""Run a rank's worker actor as a daemon thread inside a model worker process.

::

    with Sidecar(kv_caches) as zkv:          # RANK, ZKV_* from zkvrun / torchrun
        for step in ...:
            for i, layer in enumerate(model.layers):
                zkv.wait_layer(seq, i)        # compute waits on the layer's h2d event
                hidden = layer(hidden, kv_caches[i])

Device of a rank (:func:`select_device`): the device the engine's KV cache lives on; for
a cache on the CPU, ``LOCAL_RANK`` (zkvrun / torchrun set it) when a CUDA backend is
asked for. The backend is built for that device before it allocates anything, and the
compute stream defaults to the current stream of the thread that builds the Sidecar.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from zkv import log as ev
from zkv import security
from zkv.config import CacheLayout, endpoints_from_env
from zkv.errors import ConfigError
from zkv.storage import Store
from zkv.worker.actor import WorkerActor

_JOIN_TIMEOUT_S = 2.0


def run_on_every_cpu() -> None:
    """Let the calling thread run on every CPU the process may use. A thread inherits its
    creator's CPU affinity, and the host process may have pinned that one to its compute
    cores (vLLM's CPU worker binds the thread that runs its OpenMP kernels, and so the
    thread that starts the Sidecar, to one core per rank): zkv's copy and I/O threads then
    queue behind the model on that core while the others idle. (Seen with two engines on
    two cores: a producer's L3 writes waited 20 s behind the other engine's worker.) The
    kernel keeps the set within the process's cpuset. Where affinity cannot be set, the
    inherited one stays."""
    try:
        every = set(range(os.cpu_count() or 1))
        if os.sched_getaffinity(0) != every:
            os.sched_setaffinity(0, every)
    except (AttributeError, OSError):  # not Linux, or a cpuset that refuses the set
        pass


def resolve_backend(backend: Any, device: int | None = None) -> Any:
    """A backend object from a name (``"auto"``, ``"cpu"``, ``"cupy"``) on ``device``
    (None: the rank's device from the environment, see :func:`device_from_env`), or the
    object as given."""
    if isinstance(backend, str):
        from zkv.kernels import cuda_available, get_backend

        if device is None and backend != "cpu" and cuda_available():
            device = device_from_env()
        return get_backend(backend, device=device)
    return backend


def device_from_env(env: Mapping[str, str] | None = None) -> int:
    """The CUDA device of this rank: ``LOCAL_RANK`` (checked against the visible devices),
    else torch's current device (one visible device per process)."""
    import torch

    env = os.environ if env is None else env
    count = torch.cuda.device_count()
    text = env.get("LOCAL_RANK")
    if text is None:
        return torch.cuda.current_device()
    if not text.isdigit():
        raise ConfigError(f"LOCAL_RANK must be a non-negative integer, got {text!r}")
    if int(text) < count:
        return int(text)
    if count == 1:
        return 0  # the launcher gave each process its own device (CUDA_VISIBLE_DEVICES)
    raise ConfigError(f"LOCAL_RANK={text} names no CUDA device ({count} visible)")


def select_device(kv_caches: Any) -> int | None:
    """The CUDA device index the engine's KV cache lives on (None: it is on the CPU).
    Every tensor must be on that one device."""
    tensors = list(_tensors(kv_caches))
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ConfigError(f"kv_caches spans devices {sorted(map(str, devices))}; one rank, "
                          "one device")
    dev = next(iter(devices)) if devices else None
    return dev.index if dev is not None and dev.type == "cuda" else None


def _tensors(kv_caches: Any) -> Any:
    import torch

    for entry in kv_caches:
        parts = entry if isinstance(entry, (tuple, list)) else (entry,)
        yield from (t for t in parts if isinstance(t, torch.Tensor))


def security_from_env(rank: int, keys: security.ClientKeys | str | None = None,
                      env: Mapping[str, str] | None = None
                      ) -> tuple[security.ClientKeys | None, bool]:
    """``(keys, insecure)`` for rank ``rank``: ``keys`` as given (a keyring directory is
    loaded), else the keyring named by ``$ZKV_KEYS``; ``$ZKV_INSECURE=1`` allows plain tcp."""
    env = os.environ if env is None else env
    if isinstance(keys, str):
        keys = security.Keyring.load(keys).for_rank(rank)
    elif keys is None:
        keys = security.client_keys_from_env(rank, env)
    return keys, env.get("ZKV_INSECURE") == "1"


def rank_from_env(env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    text = env.get("RANK")
    if text is None or not text.isdigit():
        raise ConfigError(f"RANK must be a non-negative integer, got {text!r}")
    return int(text)


class Sidecar:
    """The worker actor of one rank, on a daemon thread, over the model's own KV cache.

    Missing arguments come from the environment zkvrun / torchrun set: ``RANK``,
    ``ZKV_PUB_ENDPOINT``, ``ZKV_PULL_ENDPOINT``, ``ZKV_CONFIG`` (the layout), ``ZKV_KEYS``
    (a keyring directory; ``keys`` may also be :class:`~zkv.security.ClientKeys` or a
    keyring directory), ``ZKV_INSECURE=1`` (plain tcp allowed). The host
    pool is allocated here (page-first, pinned on GPU). ``compute_stream``: the model's
    CUDA stream as a raw handle (default: the default stream); see :class:`WorkerActor`.
    ``gated``: run a batch that writes the KV cache (a load) only after :meth:`release`
    (an engine that schedules ahead); saves and storage I/O run as they come.
    ``scheduler_timeout_s``: stop once no scheduler was reachable for that long (None:
    wait forever; see :class:`WorkerActor`). ``env``: where missing arguments come from
    (default ``os.environ``; an engine that starts its own scheduler passes ``{}``, so a
    ``$ZKV_KEYS`` it inherited does not make the rank speak CURVE to a scheduler without
    keys).
    """

    def __init__(
        self,
        kv_caches: Sequence[tuple[Any, Any]],
        *,
        layout: CacheLayout | None = None,
        rank: int | None = None,
        pub_endpoint: str | None = None,
        pull_endpoint: str | None = None,
        backend: Any = "auto",
        store: Store | None = None,
        heartbeat_interval_s: float = 0.25,
        compute_stream: int | None = None,
        host_pool: Any = None,
        gated: bool = False,
        keys: security.ClientKeys | str | None = None,
        scheduler_timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        layout = layout if layout is not None else CacheLayout.from_env(env)
        rank = rank if rank is not None else rank_from_env(env)
        client_keys, insecure = security_from_env(rank, keys, env)
        if pub_endpoint is None or pull_endpoint is None:
            env_pub, env_pull = endpoints_from_env(env)
            pub_endpoint = pub_endpoint or env_pub
            pull_endpoint = pull_endpoint or env_pull
        device = select_device(kv_caches)
        if backend == "auto" and device is None:
            backend = "cpu"  # the engine's cache is in CPU memory
        self.backend = resolve_backend(backend, device)
        self.layout = layout
        self.host_pool = (host_pool if host_pool is not None
                          else self.backend.allocate_host_pool(layout))
        self.actor = WorkerActor(
            rank, layout, kv_caches, self.host_pool, self.backend,
            pub_endpoint=pub_endpoint, pull_endpoint=pull_endpoint, store=store,
            heartbeat_interval_s=heartbeat_interval_s, compute_stream=compute_stream,
            gated=gated, keys=client_keys, insecure=insecure,
            scheduler_timeout_s=scheduler_timeout_s,
        )
        # the actor's exit waits for its store calls running (the store's own timeouts)
        self._join_s = _JOIN_TIMEOUT_S + (store.close_wait_s if store is not None else 0.0)
        self._thread = threading.Thread(target=self._run, name=f"zkv-worker-{rank}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        run_on_every_cpu()  # before the actor starts its own threads: they inherit it
        self.actor.run()

    @property
    def rank(self) -> int:
        return self.actor.rank

    @property
    def last_seq(self) -> int:
        """Seq of the last batch this rank acked (-1 before the first)."""
        return self.actor.last_seq

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def exit_reason(self) -> str | None:
        return self.actor.exit_reason

    def wait_layer(self, seq: int, layer: int, timeout: float | None = None) -> None:
        """Before layer ``layer`` of the forward of step batch ``seq``; see
        :meth:`LayerDoneCounter.wait_layer`."""
        self.actor.counter.wait_layer(seq, layer, timeout)

    def abandon_saves(self, upto: int, timeout: float | None = None) -> bool:
        """In the model thread, once its wait for batch ``upto`` (a fence) timed out and
        its forward goes on: no save of a batch up to ``upto`` copies later (a copy running
        now is waited for, at most ``timeout``; on GPU the compute stream waits for it).
        False if one still ran at the timeout. See :meth:`WorkerActor.abandon_saves`."""
        quiet, handle = self.actor.abandon_saves(upto, timeout)
        if handle is not None:
            self.backend.wait_event_on_compute(handle)
        return quiet

    def abandon_load(self, seq: int, layer: int, reason: str,
                     timeout: float | None = None) -> bool:
        """In the model thread, once its wait for ``layer`` of ``seq`` timed out and the
        engine will recompute: no copy of layers ``layer..`` of ``seq`` writes the KV cache
        later (a copy running now is waited for, at most ``timeout``; on GPU the compute
        stream waits for it), and no save of ``seq`` reads the engine's blocks later unless
        layer 0 was marked (the forward no longer waits behind it). False if a copy still ran
        at the timeout. See :meth:`LayerDoneCounter.abandon`."""
        quiet, handle = self.actor.counter.abandon(seq, layer, reason, timeout)
        if handle is not None:
            self.backend.wait_event_on_compute(handle)
        return quiet

    def follow_compute_stream(self) -> None:
        """In the model thread, before each step: later batches start after the work
        queued on the thread's current stream (see
        :meth:`WorkerActor.follow_compute_stream`)."""
        self.actor.follow_compute_stream()

    def release(self, seq: int) -> None:
        """``gated=True``: batches up to ``seq`` may now write the KV cache (call it before
        the forward that reads batch ``seq``, once earlier forwards are done)."""
        self.actor.release(seq)

    def wait_acked(self, seq: int, timeout: float | None = None) -> Any:
        """This rank's ack of batch ``seq`` (a ``BlocksCopied``), or None on timeout."""
        return self.actor.wait_acked(seq, timeout)

    def close(self) -> bool:
        """Stop the actor (it says ``Bye``) and join its thread: at most 2 s plus the store's
        ``close_wait_s`` (the actor's exit waits for its store calls running). Whether it
        stopped; if not, ``worker.stop_timeout`` (an error) says so and the daemon thread
        is left to the process's exit: the engine's own shutdown goes on (an exception
        here stopped vLLM's worker teardown, and the store was never closed)."""
        self.actor.stop("sidecar closed")
        self._thread.join(self._join_s)
        if self._thread.is_alive():
            ev.get_logger("worker", rank=self.rank).error(
                ev.STOP_TIMEOUT, waited_s=round(self._join_s, 3),
                detail="the worker thread did not stop (a store call hung?); left running")
            return False
        return True

    def __enter__(self) -> Sidecar:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
