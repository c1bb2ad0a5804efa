"""``zkv-check-vllm-config JSON`` (or ``python -m zkv.integrations.vllm.check JSON``): the
connector's configuration checked in seconds, before a ``vllm serve`` that takes a minute
or more to load its model. (A console script of its own, not a ``zkv`` subcommand: nothing
in zkv outside ``integrations/`` imports an engine's integration.)

vLLM builds the connector only after it loaded the model and sized its KV cache, so a typo
in ``kv_connector_extra_config`` stopped the engine 100 s after its start, in ~380 lines of
tracebacks from every process, the ``zkv: ...`` line four times among them. This takes the
same JSON as ``--kv-transfer-config`` (or the extra config alone) and runs the connector's
own checks (:func:`~zkv.integrations.vllm.config.parse_extra_config`, the store URL's
values included) and, given the whole JSON, vLLM's own ``KVTransferConfig`` (a missing or
bad ``kv_role``, a misspelled ``kv_connector_extra_config``: importing it takes ~8 s here;
the extra config alone, 0.3 s): one line and status 2 for a bad value, else one line of
what the engine will use, status 0. It opens no store (a ``file://`` store would make its
folder). The pools are checked against memory per ``--ranks`` (vLLM's tensor-parallel
size times its data-parallel engines on the machine: one pool a model worker); what needs
the model is left to the engine's start: how
many blocks a pool or a ``file://`` budget holds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from zkv.argtypes import positive_int
from zkv.config import pools_fit
from zkv.errors import ConfigError
from zkv.integrations.vllm.config import (
    DEFAULT_HOST_BYTES,
    ZkvVllmConfig,
    parse_extra_config,
)
from zkv.security import redact_credentials, redact_url

PROG = "zkv-check-vllm-config"
CONNECTOR = "ZkvConnector"
MODULE_PATH = "zkv.integrations.vllm_connector"  # the documented one (a re-export of ...)
MODULE_PATHS = (MODULE_PATH, "zkv.integrations.vllm.connector")  # (... the class's own)


def extra_config_of(text: str) -> Mapping[str, Any]:
    """The ``kv_connector_extra_config`` in ``text``: vLLM's ``--kv-transfer-config`` JSON
    naming zkv's connector, or the extra config itself; ConfigError otherwise."""
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise ConfigError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"expected a JSON object, got {type(obj).__name__}")
    if "kv_connector" not in obj:
        return obj  # the extra config alone
    if obj["kv_connector"] != CONNECTOR:
        raise ConfigError(f"kv_connector is {obj['kv_connector']!r}, not {CONNECTOR!r}")
    if obj.get("kv_connector_module_path") not in MODULE_PATHS:
        raise ConfigError(f"kv_connector_module_path must be {MODULE_PATH!r} (vLLM finds "
                          f"{CONNECTOR} there), got {obj.get('kv_connector_module_path')!r}")
    vllm_check(obj)
    extra = obj.get("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        raise ConfigError("zkv: kv_connector_extra_config must be a JSON object of zkv keys, "
                          f"got {type(extra).__name__}")
    return extra


def vllm_check(obj: dict[str, Any]) -> None:
    """ConfigError unless vLLM's own ``KVTransferConfig`` takes ``obj`` (no vLLM here:
    nothing to check against)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from vllm.config.kv_transfer import KVTransferConfig  # (its import notices)
    except ImportError:
        return
    try:
        KVTransferConfig(**obj)
    except (ValueError, TypeError) as e:  # (pydantic's ValidationError is a ValueError)
        errors = getattr(e, "errors", None)
        why = ("; ".join(": ".join(filter(None, (".".join(map(str, err["loc"])), err["msg"])))
                         for err in errors())
               if callable(errors) else str(e).splitlines()[0])
        raise ConfigError(f"vLLM refuses the --kv-transfer-config: {why}") from None


def describe(cfg: ZkvVllmConfig) -> str:
    """What the engine will use, in one line (a store's password written ``***@``)."""
    if cfg.host_blocks is not None:
        pool = f"{cfg.host_blocks} host blocks per rank"
    else:
        pool = f"{(cfg.host_bytes or DEFAULT_HOST_BYTES) / 2**30:g} GiB host pool per rank"
    store = "none" if cfg.storage is None else redact_url(cfg.storage)
    return (f"{pool}, storage {store} (writes {'on' if cfg.storage_write else 'off'}), "
            f"policy {cfg.policy}, prefetch {cfg.prefetch}, log_level {cfg.log_level}"
            + ("" if cfg.metrics_port is None else f", metrics on port {cfg.metrics_port}"))


def check(text: str, ranks: int = 1) -> str:
    """The line :func:`main` prints for ``text``, or ConfigError naming what is wrong.
    ``ranks``: the engine's model workers on this machine (its tensor-parallel size), each
    with a pool."""
    cfg = parse_extra_config(extra_config_of(text))
    if cfg.host_blocks is None:  # (blocks need the model's geometry: checked at start)
        need = cfg.host_bytes or DEFAULT_HOST_BYTES
        fits, free = pools_fit(need * ranks)
        if not fits and free is not None:
            raise ConfigError(f"zkv: {ranks} host pool(s) of {need / 2**30:g} GiB are more "
                              f"than 80% of the {free / 2**30:.1f} GiB available; lower "
                              "host_bytes")
    return describe(cfg)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=(__doc__ or "").split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", metavar="JSON", help="vLLM's --kv-transfer-config, or its "
                                                "kv_connector_extra_config alone")
    p.add_argument("--ranks", type=positive_int, default=1, metavar="N",
                   help="model workers on this machine, each with a pool (vLLM's "
                        "--tensor-parallel-size x its local data-parallel engines; "
                        "default 1)")
    return p


def main(argv: Sequence[str]) -> int:
    ns = _parser().parse_args(argv)
    try:
        line = check(ns.json, ns.ranks)
    except ConfigError as e:
        print(f"{PROG}: error: {redact_credentials(str(e))}", file=sys.stderr)
        return 2
    print(f"{PROG}: ok: {line}")
    return 0


def cli() -> int:
    """The console script's entry point."""
    return main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(cli())
