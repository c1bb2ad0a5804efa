"""The bench scripts as a user runs them: a bad flag is one ``error:`` line and status 2
before anything starts; the quick scheduler bench passes its own checks (LRU equal to the
independent reference, the baseline's hashes equal to zkv's, the invariants after every
replay); the pipeline bench runs without its copy row; small runs of the storage, store
query, transfer and connector benches pass theirs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BAD_FLAGS = [
    ("pipeline.py", ["--ranks", "0"], "argument --ranks: must be > 0, got 0"),
    ("pipeline.py", ["--ranks", "1,x"], "argument --ranks: not an int: 'x'"),
    ("pipeline.py", ["--ranks", "1,,2"], "argument --ranks: expected a comma-separated"),
    ("pipeline.py", ["--empty", "0"], "argument --empty: must be > 0, got 0"),
    ("pipeline.py", ["--copies", "-1"], "argument --copies: must be >= 0, got -1"),
    ("scheduler_ops.py", ["--repeat", "0"], "argument --repeat: must be > 0, got 0"),
    ("scheduler_ops.py", ["--trace", "/nonexistent/t.jsonl"],
     "argument --trace: no such file: /nonexistent/t.jsonl"),
    ("storage.py", ["--batch", "0"], "argument --batch: must be > 0, got 0"),
    ("storage.py", ["--dtype", "float13"], "argument --dtype: unsupported dtype 'float13'"),
    ("storage.py", ["--redis", "localhost:6379"], "argument --redis: bad store URL"),
    # was: its own servers started, then a ConfigError traceback for the other scheme
    ("storage.py", ["--mooncake", "redis://127.0.0.1:6390/0"],
     "argument --mooncake: expected a mooncake:// URL, got a redis:// one"),
    ("storage.py", ["--redis", "mooncake://127.0.0.1:50051"],
     "argument --redis: expected a redis:// or rediss:// URL, got a mooncake:// one"),
    ("storage.py", ["--dir", "/nonexistent"], "argument --dir: no such directory"),
    ("store_query.py", ["--reps", "0"], "argument --reps: must be > 0, got 0"),
    # a folder it cannot write in (/proc as root passed os.access), a seed numpy refuses,
    # a maxmemory redis refuses or that evicts nothing: tracebacks after servers started
    ("store_query.py", ["--dir", "/proc"], "argument --dir: cannot write in /proc"),
    ("transfer.py", ["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    ("store_eviction.py", ["--maxmemory", "foo"],
     "argument --maxmemory: must be bytes or a size like 48mb, got 'foo'"),
    ("store_eviction.py", ["--maxmemory", "0mb"], "argument --maxmemory: must be > 0"),
    ("store_eviction.py", ["--requests", "0"], "argument --requests: must be > 0, got 0"),
    ("store_eviction.py", ["--pace-ms", "nan"],
     "argument --pace-ms: must be a finite number >= 0, got nan"),
    ("store_eviction.py", ["--segment-mb", "8"],
     "argument --segment-mb: must be >= 16 (Mooncake's least), got 8"),
    ("transfer.py", ["--blocks", "0"], "argument --blocks: must be > 0, got 0"),
    ("transfer.py", ["--blocks", "1000"], "--blocks 1000 is more than the smaller pool holds"),
    ("transfer.py", ["--cpu-only", "--gpu-only"], "leave nothing to run"),
    ("connector_sched.py", ["--doc-tokens", "-1"], "argument --doc-tokens: must be > 0"),
    ("decode_steps.py", ["--contexts", "64,5"], "--contexts must be > 10 blocks"),
    ("decode_steps.py", ["--requests", "0"], "argument --requests: must be > 0, got 0"),
    ("vllm_e2e.py", ["--models", "tiny,llama"], "argument --models: unknown 'llama'"),
    ("vllm_e2e.py", ["--doc-tokens", "9000"], "--doc-tokens must be <= 7936"),
    ("vllm_pd.py", ["--docs", "0"], "argument --docs: must be > 0, got 0"),
    ("vllm_pd.py", ["--doc-tokens", "2048"], "--doc-tokens must be < 2048"),
    ("vllm_store_hang.py", ["--seconds", "nan"], "argument --seconds: must be a finite number"),
]


def _bench(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("script,args,message", BAD_FLAGS,
                         ids=[f"{s}:{' '.join(a)}" for s, a, _ in BAD_FLAGS])
def test_a_bad_flag_is_one_line_and_status_2(script: str, args: list[str],
                                             message: str) -> None:
    r = _bench(script, *args)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]  # argparse's usage lines, then the one error
    assert last.startswith(f"{script}: error: ") and message in last, r.stderr


def test_transfer_gpu_only_without_cuda_says_so() -> None:
    from zkv.kernels import cuda_available

    if cuda_available():
        pytest.skip("this machine has CUDA: --gpu-only runs")
    r = _bench("transfer.py", "--gpu-only")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines()[-1] == (
        "transfer.py: error: --gpu-only needs CUDA, and this machine has none")


def test_scheduler_bench_quick_passes_its_checks() -> None:
    # the trace in the repository: a clean clone has no ../shared
    r = _bench("scheduler_ops.py", "--quick", "--trace",
               str(ROOT / "tests" / "data" / "mooncake_trace_head800.jsonl"), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    policy_rows = [ln for ln in r.stdout.splitlines() if "lru == reference" in ln]
    assert len(policy_rows) == 7, r.stdout  # chat and trace at every capacity
    assert "chat, 20,000 device blocks, hashing included:" in r.stdout


def test_pipeline_bench_without_copies() -> None:
    r = _bench("pipeline.py", "--ranks", "1", "--empty", "40", "--copies", "0", timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    workloads = [ln[7:33].strip() for ln in r.stdout.splitlines() if ln.startswith("    1  ")]
    assert workloads == [
        "bare pyzmq echo (floor)", "echo + orjson parse only", "echo + zkv codec", "empty"]
    assert "copy" not in r.stdout and "target empty p50 <= 1.2x floor: 1 ranks" in r.stdout


# Small runs of the other CPU benches: each checks its own results (bytes read back equal
# to bytes written, the existence query's count equal to the baseline's, the oracle's bytes)
# and exits non-zero when one differs; these keep them from rotting. The vLLM benches start
# engines (minutes) and are left to their own commands.
SMOKE = [
    ("storage.py", ["--blocks", "32", "--reps", "1"],
     [r"^file://\s+[\d.]+", r"^redis://\s+[\d.]+", r"^mooncake://\s+[\d.]+"]),
    ("store_query.py", ["--blocks", "16", "--reps", "1"],
     [r"^file://\s+1 miss ", r"^redis://\s+8 hit all ", r"^mooncake://\s+8 hit 3/4 "]),
    ("store_eviction.py", ["--requests", "60", "--pace-ms", "0", "--configs", "lru5",
                           "mooncake", "--no-put-cost", "--segment-mb", "16"],
     [r"^  redis allkeys-lru, maxmemory-samples 5\s+\d+\s+0\.\d+\s+0\.\d+\s+[\d.]+x\s+0$",
      r"^  mooncake master, 16 MB segment\s+\d+\s+0\.\d+"]),
    ("transfer.py", ["--cpu-only", "--blocks", "16", "--layers", "2", "--reps", "1",
                     "--device-blocks", "32", "--host-blocks", "32"],
     [r"cpu d2h ext \(16 scattered blocks\)\s+[\d.]+", r"oracle d2h"]),
    ("connector_sched.py", ["--docs", "4", "--doc-tokens", "256"],
     [r"saved blocks 32, loaded blocks 32, tokens served from zkv 1024 of 2048"]),
    ("decode_steps.py", ["--requests", "4", "--contexts", "16,64"],
     [r"^  context +16 blocks .* us/request/step .*1\.00x the shortest context$",
      r"^  context +64 blocks "]),
]


@pytest.mark.parametrize("script,args,lines", SMOKE, ids=[s for s, _, _ in SMOKE])
def test_small_bench_runs_pass_their_checks(script: str, args: list[str],
                                            lines: list[str]) -> None:
    r = _bench(script, *args, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for pattern in lines:
        assert re.search(pattern, r.stdout, re.MULTILINE), (pattern, r.stdout)


def test_the_storage_bench_against_a_server_that_is_not_there_is_one_line() -> None:
    """A given redis:// that nothing listens on: one ``error:`` line naming it, status 1
    (was: an AssertionError traceback from the first put)."""
    import socket

    with socket.socket() as s:  # a port nothing listens on (bound, never listening)
        s.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
        r = _bench("storage.py", "--redis", url, "--blocks", "8", "--reps", "1", timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"bench/storage.py: error: {url} unreachable (see the storage.store_unreachable line "
        "above)"), r.stderr[-3000:]


def test_the_storage_bench_sets_the_split_header_over_a_given_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--mooncake URL?header=inline``: its split-header row replaces the parameter (it
    appended a second one: ``header is given twice``, a traceback after the servers)."""
    import importlib.util

    from zkv.storage.url import parse_url

    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # (its helpers, as when run)
    spec = importlib.util.spec_from_file_location("bench_storage", ROOT / "bench" / "storage.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    url = bench.with_param("mooncake://127.0.0.1:50051?header=inline&timeout_s=3", "header",
                           "split")
    assert parse_url(url)[1] == {"host": "127.0.0.1", "port": 50051, "timeout_s": 3.0,
                                 "header": "split"}
    assert bench.with_param("mooncake://127.0.0.1:50051", "header", "split") == (
        "mooncake://127.0.0.1:50051?header=split")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_killed_pipeline_bench_leaves_no_process(tmp_path: Path, sig: str) -> None:
    """A bench stopped by a timeout's SIGTERM exits through its cleanup (echo groups and
    ranks stopped, its socket folder removed: ``exit_on_sigterm``); SIGKILLed, it runs
    none, and its echo processes (bare loops, unlike zkv.worker, which watches its parent)
    die with it all the same (``PR_SET_PDEATHSIG``): none spins on."""
    import os
    import signal

    from tests.waiting import wait_exited, wait_until
    from tests.worker.helpers import children_of, cmdline

    p = subprocess.Popen([sys.executable, str(ROOT / "bench" / "pipeline.py"), "--ranks", "2",
                          "--empty", "1000000", "--copies", "0"], cwd=ROOT,
                         env=dict(os.environ, TMPDIR=str(tmp_path)),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kids: list[int] = []

    def started() -> bool:  # 3 echo groups x 2 ranks, and zkv's 2 ranks
        assert p.poll() is None, kids
        kids[:] = [c for c in children_of(p.pid)
                   if "mode = sys.argv[3]" in cmdline(c) or "zkv.worker" in cmdline(c)]
        return len(kids) >= 8

    try:
        wait_until(started, 60, "the bench's 8 processes")
        p.send_signal(getattr(signal, sig))
        assert p.wait(30) == (143 if sig == "SIGTERM" else -signal.SIGKILL)
        wait_exited(kids, 10, "the bench's processes")
        if sig == "SIGTERM":
            assert list(tmp_path.glob("zkv-bench-*")) == []
    finally:
        p.kill()
        p.wait()
        for c in kids:
            try:
                os.kill(c, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _load_bench(monkeypatch: pytest.MonkeyPatch, script: str):  # type: ignore[no-untyped-def]
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # (its helpers, as when run)
    spec = importlib.util.spec_from_file_location(f"bench_{script[:-3]}", ROOT / "bench" / script)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # (its dataclasses look it up)
    spec.loader.exec_module(bench)
    return bench


def test_the_reference_hashing_time_is_per_block_of_its_own_sample(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference path hashes the first 200 requests only: its us/block is its time over
    those requests' blocks (was: scaled by requests to the whole workload and divided by
    every block, 21% low on the full chat workload, whose first turns are short). A clock
    that ticks 100 ns per block hashed, on both paths: both read 0.100 us/block."""
    from types import SimpleNamespace

    bench = _load_bench(monkeypatch, "scheduler_ops.py")
    clock = [0]

    def fake_hash(ids: list[int]) -> list[bytes]:
        clock[0] += 100 * len(ids)
        return [b"h"] * len(ids)

    monkeypatch.setattr(bench, "time", SimpleNamespace(thread_time_ns=lambda: clock[0]))
    monkeypatch.setattr(bench.hashing, "hash_ids_chain_py", fake_hash)
    requests = [[1]] * 200 + [[1] * 9] * 200  # the sample: 1 block each, the rest 9
    w = bench.Workload("trace", 512, requests, fake_hash, fake_hash, (1_000,))
    w.hashes = [fake_hash(r) for r in requests]
    line = bench.hashing_line(w)
    assert "native 0.100 us/block (reference Python path 0.100)" in line, line


def test_the_echo_clock_starts_after_the_encode_as_zkvs_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``Dispatcher.publish`` stamps ``t_pub`` after encoding the batch, so zkv's ``empty``
    latency holds no encode; the ``echo + zkv codec`` row held its own (the clock started
    before it). Here an encode costs 1000 us of a fake clock and nothing else does: every
    latency of that echo reads 0."""
    from types import SimpleNamespace

    bench = _load_bench(monkeypatch, "pipeline.py")
    clock = [0.0]
    real_encode = bench.P.encode

    def slow_encode(m):  # type: ignore[no-untyped-def]
        clock[0] += 1e-3
        return real_encode(m)

    ack = real_encode(bench.P.BlocksCopied(0, 0, True, (), 0.0, 0.0))
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(bench.P, "encode", slow_encode)
    echo = object.__new__(bench.EchoGroup)  # its sockets and children faked
    echo.world_size, echo.mode = 2, "codec"
    echo.pub = SimpleNamespace(send_multipart=lambda frames: None)
    echo.pull = SimpleNamespace(poll=lambda timeout: 1, recv_multipart=lambda flags: ack)
    assert list(echo.measure(5, warmup=2)) == [0.0] * 5
