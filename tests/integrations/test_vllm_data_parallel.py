"""Data-parallel engines of one ``vllm serve --data-parallel-size N``: vLLM runs each DP
engine's core in its own process with the same ``kv_connector_extra_config`` (and the
engine id ``<id>_dp<d>``). Two such scheduler halves, each with a real zkv worker, start
side by side: each serves metrics on its own port and logs to its own file. Before, the
second could not start (both bound the one ``metrics_port``) and both wrote
``scheduler.jsonl``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import orjson
import pytest

from tests.integrations.child import ROOT, STUB_CONNECTOR
from zkv.errors import ConfigError
from zkv.integrations.vllm.config import engine_metrics_port

_DP_ENGINE = STUB_CONNECTOR + '''
from tests.worker.helpers import worker_env
dp, port, logs = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
eid = f"dp-{os.getpid()}_dp{dp}"
pub, pull, folder = ipc_endpoints(eid, create=True)
worker = subprocess.Popen([sys.executable, "-m", "zkv.worker"], stdin=subprocess.DEVNULL,
                          env=worker_env(0, LAYOUT.to_json(), pub, pull))
vc = plain_vllm_config()
vc.parallel_config = SimpleNamespace(data_parallel_index=dp, data_parallel_rank=0)
conn = stub_connector(eid, {"metrics_port": port, "log_dir": logs, "log_level": "info"}, vc)
error = start(conn)
url = conn._metrics_server.url if conn._metrics_server is not None else None
print(json.dumps({"error": error, "url": url}), flush=True)
sys.stdin.readline()
conn.shutdown()
try:
    worker.wait(10)
except subprocess.TimeoutExpired:
    worker.kill()
    worker.wait()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _engine(dp: int, port: int, logs: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _DP_ENGINE, str(dp), str(port), str(logs)],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_two_data_parallel_engines_get_their_own_port_and_log_file(tmp_path: Path) -> None:
    port = _free_port()
    while port + 1 > 65535 or not _is_free(port + 1):
        port = _free_port()
    engines = [_engine(0, port, tmp_path), _engine(1, port, tmp_path)]
    try:
        started = [json.loads(e.stdout.readline() or "null")  # type: ignore[union-attr]
                   for e in engines]
        assert started == [{"error": None, "url": f"http://127.0.0.1:{port + d}/metrics"}
                           for d in (0, 1)], started
        for d in (0, 1):
            with urllib.request.urlopen(started[d]["url"], timeout=10) as r:
                assert b"zkv:" in r.read()
    finally:
        for e in engines:
            try:
                e.communicate("\n", timeout=60)
            except subprocess.TimeoutExpired:
                e.kill()
                e.communicate()
    assert [e.returncode for e in engines] == [0, 0]
    assert sorted(os.listdir(tmp_path)) == ["scheduler-dp1.jsonl", "scheduler.jsonl"]
    for name, dp in (("scheduler.jsonl", None), ("scheduler-dp1.jsonl", 1)):
        records = [orjson.loads(x) for x in (tmp_path / name).read_bytes().splitlines()]
        assert records and {r.get("dp_rank") for r in records} == {dp}, name
        assert {r["pid"] for r in records} == {records[0]["pid"]}  # one engine's lines


def test_a_metrics_port_past_65535_for_a_dp_engine_is_one_line() -> None:
    assert engine_metrics_port(9090, 3) == 9093 and engine_metrics_port(0, 3) == 0
    with pytest.raises(ConfigError, match="metrics_port 65535 [+] data-parallel index 1 is"):
        engine_metrics_port(65535, 1)


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
