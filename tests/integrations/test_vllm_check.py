"""``zkv-check-vllm-config`` (the console script; here ``python -m`` its module): vLLM's
``--kv-transfer-config`` checked with the connector's own rules and vLLM's own
``KVTransferConfig`` (seconds), before an engine start that fails only after the model
loaded (~100 s here, in ~380 lines of tracebacks)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

ROOT = Path(__file__).resolve().parents[2]
PROG = "zkv-check-vllm-config"


def _check(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zkv.integrations.vllm.check", *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, **env})


def _readme_config() -> str:
    """The --kv-transfer-config JSON of the README's ``vllm serve`` example."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"vllm serve MODEL --kv-transfer-config '(\{.*?\})'", text, re.DOTALL)
    assert m, "the README's vllm serve example"
    return m.group(1)


def test_the_readmes_config_is_ok_and_says_what_the_engine_will_use() -> None:
    r = _check(_readme_config())
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout == (f"{PROG}: ok: 8 GiB host pool per rank, storage file:///var/cache/zkv "
                        "(writes on), policy write_through, prefetch timeout, log_level "
                        "warning\n")


def test_the_class_s_own_module_path_is_taken_too() -> None:
    r = _check('{"kv_connector": "ZkvConnector", "kv_connector_module_path": '
               '"zkv.integrations.vllm.connector", "kv_role": "kv_both", '
               '"kv_connector_extra_config": {"storage": "none"}}')
    assert r.returncode == 0 and r.stdout.startswith(f"{PROG}: ok: "), r.stderr


def test_the_extra_config_alone_and_the_environment_default() -> None:
    r = _check('{"host_blocks": 64, "policy": "write_back"}', ZKV_STORE_URL="none",
               ZKV_LOG_LEVEL="info")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (f"{PROG}: ok: 64 host blocks per rank, storage none (writes off), "
                        "policy write_back, prefetch timeout, log_level info\n")


@pytest.mark.parametrize("config, message", [
    ({"host_byte": "8GiB"}, "zkv: unknown kv_connector_extra_config key(s) ['host_byte']"),
    ({"storage": "/var/cache/zkv"}, "zkv: storage: bad store URL '/var/cache/zkv': expected "
                                    "SCHEME://..."),
    ({"policy": "write-through"}, "zkv: policy must be one of"),
    ({"host_bytes": "64TiB"}, "zkv: 1 host pool(s) of 65536 GiB are more than 80% of the "),
    ({"storage": "redis://:hunter2@127.0.0.1:1/0?ttl_s=0"}, "redis://***@127.0.0.1:1/0"),
    ({"kv_connector": "LMCacheConnectorV1"}, "kv_connector is 'LMCacheConnectorV1', not "
                                             "'ZkvConnector'"),
    ({"kv_connector": "ZkvConnector"}, "kv_connector_module_path must be "
                                       "'zkv.integrations.vllm_connector'"),
    ({"kv_connector": "ZkvConnector", "kv_connector_module_path":
      "zkv.integrations.vllm_connector", "kv_role": "kv_both",
      "kv_connector_extra_config": [1]},
     "kv_connector_extra_config: Input should be a valid dictionary"),
    # vLLM's own KVTransferConfig: a misspelled key made the defaults "what the engine
    # will use", and a config without kv_role was ok
    ({"kv_connector": "ZkvConnector", "kv_connector_module_path":
      "zkv.integrations.vllm_connector", "kv_role": "kv_both",
      "kv_connector_extra_cofig": {"host_bytes": "8GiB"}},
     "vLLM refuses the --kv-transfer-config: kv_connector_extra_cofig: Unexpected keyword"),
    ({"kv_connector": "ZkvConnector", "kv_connector_module_path":
      "zkv.integrations.vllm_connector"},
     "vLLM refuses the --kv-transfer-config: Value error, Please specify kv_role"),
    ({"storage": "mooncake://127.0.0.1:50051?header=junk"}, "header must be one of auto, "
                                                           "inline, split, got 'junk'"),
    ([1, 2], "expected a JSON object, got list"),
    ("{'host_bytes': 1}", "not JSON: "),
])
def test_a_bad_config_is_one_line_and_status_2(config: object, message: str,
                                              capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process (the script's ``main``; the runs above and below are the script's
    own): each run of the script imports vLLM's config anew, ~6 s a case."""
    from zkv.integrations.vllm.check import main

    for var in ("ZKV_STORE_URL", "ZKV_LOG_LEVEL"):
        monkeypatch.delenv(var, raising=False)
    code = main([config if isinstance(config, str) else orjson.dumps(config).decode()])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", out
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{PROG}: error: "), err
    assert message in lines[0] and "hunter2" not in lines[0], lines[0]


def test_the_console_script_is_installed() -> None:
    """``pip install -e .`` (install.sh) puts it beside the interpreter, as ``zkv``."""
    script = Path(sys.executable).parent / "zkv-check-vllm-config"
    r = subprocess.run([str(script), '{"storage": "none"}'], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.startswith(f"{PROG}: ok: "), r.stderr


def test_usage_and_the_pools_of_every_rank() -> None:
    r = _check()
    assert r.returncode == 2 and r.stderr.startswith(f"usage: {PROG} [-h] [--ranks N] JSON")
    assert r.stderr.splitlines()[-1] == (f"{PROG}: error: the following arguments are "
                                         "required: JSON")
    # a pool that fits once, not 1,000 times (tensor parallelism: a pool a model worker)
    one = _check('{"host_bytes": "1GiB", "storage": "none"}')
    assert one.returncode == 0, one.stderr
    many = _check("--ranks", "1000", '{"host_bytes": "1GiB", "storage": "none"}')
    assert many.returncode == 2 and many.stderr.startswith(
        f"{PROG}: error: zkv: 1000 host pool(s) of 1 GiB are more than 80% of the "), many.stderr
