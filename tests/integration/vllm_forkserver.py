"""A process that has imported vLLM once and forks one child per engine run.

Importing vLLM, torch and transformers takes ~9-12 s here, about two thirds of a small
engine run; the end-to-end tests start ~35 engines. Each run still gets a process of its
own (forked, as vLLM's own tests do with ``fork_new_process_for_each_test``): the child
sets the spec's environment, runs ``vllm_runner.run_file`` and exits; nothing it does
reaches the server or the next run::

    python -m tests.integration.vllm_forkserver      (stdin / stdout: one JSON line each)
      ◄── {"spec": path, "out": path, "log": path}
      ──► {"pid": child}              the child runs the spec, stdout + stderr to ``log``
      ──► {"rc": exit status}         0: ``out`` holds the result

The server stays single-threaded (a fork copies only the calling thread) and never
starts an engine itself. Specs whose settings vLLM or huggingface_hub read at import
(``hf_hub_cache``) need a fresh interpreter: ``ForkServer.run`` refuses them
(``forkable``); the caller runs those as ``python -m tests.integration.vllm_runner``.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import IO, Any

#: Imported before the first fork: vLLM's entry points and what an engine start pulls in
#: (model, worker, executor, attention, the zkv connector), so no child imports them again.
WARM = (
    "torch", "transformers", "vllm", "vllm.config", "vllm.entrypoints.llm",
    "vllm.v1.engine.core", "vllm.v1.engine.llm_engine", "vllm.v1.executor.uniproc_executor",
    "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.models.llama",
    "vllm.model_executor.model_loader", "vllm.v1.core.sched.scheduler",
    "vllm.v1.attention.backends.cpu_attn", "vllm.lora.request",
    "zkv.integrations.vllm_connector", "tests.integration.vllm_runner",
)


def forkable(spec: dict[str, Any]) -> bool:
    """False for specs that must start in a fresh interpreter (see the module)."""
    return not spec.get("hf_hub_cache")


def _warm() -> None:
    import importlib

    for name in WARM:
        try:
            importlib.import_module(name)
        except ImportError:  # a module another vLLM version moved: the child imports it
            pass


def _child(req: dict[str, str]) -> None:
    """In the forked child: run the spec, output to ``log``; never returns."""
    rc = 1
    try:
        os.setpgid(0, 0)  # its own group: a timeout kills the engine's children with it
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)  # not the server's request pipe
        os.dup2(null, 0)
        os.close(null)
        from tests.integration import vllm_runner

        vllm_runner.run_file(req["spec"], req["out"])
        rc = 0
    except BaseException:  # noqa: BLE001 - the log is the caller's only view of it
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what a normal interpreter exit runs
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)


def serve() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _warm()
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        assert threading.active_count() == 1, "the fork server started a thread"
        pid = os.fork()
        if pid == 0:
            _child(req)
        try:
            os.setpgid(pid, pid)  # as the child does: a kill right after the fork finds it
        except OSError:  # the child got there first (or already ended)
            pass
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()
        _, status = os.waitpid(pid, 0)
        out.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        out.flush()
    return 0


class ForkServer:
    """The test side: start the server, run specs on it, stop it."""

    def __init__(self, root: Path, env: dict[str, str], start_timeout_s: float = 120.0) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.vllm_forkserver"], cwd=root, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.last_pid: int | None = None  # the child of the last run
        self._running: int | None = None  # a child whose exit status has not come back
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
        try:
            self._read(start_timeout_s)  # {"ready": true}
        except BaseException:
            self.close()
            raise

    def _read(self, timeout_s: float) -> dict[str, Any]:
        """The server's next line (it writes whole lines and flushes each)."""
        if not self._sel.select(timeout_s):
            raise TimeoutError(f"the vLLM fork server said nothing in {timeout_s:.0f} s")
        line = self._proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"the vLLM fork server exited ({self._proc.wait(10)})")
        return json.loads(line)

    def run(self, spec_path: Path, out_path: Path, log_path: Path, timeout_s: float
            ) -> tuple[int, str]:
        """Run one spec in a forked child; (exit status, its output)."""
        assert forkable(json.loads(spec_path.read_text())), "spec needs a fresh interpreter"
        stdin: IO[str] = self._proc.stdin  # type: ignore[assignment]
        stdin.write(json.dumps({"spec": str(spec_path), "out": str(out_path),
                                "log": str(log_path)}) + "\n")
        stdin.flush()
        self.last_pid = self._running = self._read(30.0)["pid"]
        try:
            rc = self._read(timeout_s)["rc"]
        except TimeoutError:
            self._kill_running()  # the server reaps it and reports
            self._read(30.0)
            raise TimeoutError(f"engine run {spec_path.name} took over {timeout_s:.0f} s"
                               ) from None
        self._running = None
        return rc, log_path.read_text(errors="replace") if log_path.exists() else ""

    def _kill_running(self) -> None:
        pid, self._running = self._running, None
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)  # its own group: the engine's children too
            except ProcessLookupError:  # it ended just now
                pass

    def close(self) -> None:
        """Stop the server; a run still going (the caller was interrupted) is killed."""
        self._kill_running()
        if self._proc.stdin is not None:
            self._proc.stdin.close()  # the server's loop ends
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        self._sel.close()
        if self._proc.stdout is not None:
            self._proc.stdout.close()


if __name__ == "__main__":
    sys.exit(serve())
