#!/usr/bin/env bash
# The GPU checks in one command, for a CUDA machine with torch and cupy already installed
# (a lent machine: nothing fetched there). Run from the repository root:
#
#     bash bench/gpu_checks.sh            # logs under $OUT (default: ./gpu-checks)
#
# 1. the CUDA test suite (tests/kernels/test_cupy_backend.py, marked gpu) and the tests
#    that pick the backend or run the actor on a device, against the real driver;
# 2. bench/transfer.py's CuPy part: scattered blocks vs one contiguous pinned
#    cudaMemcpyAsync of the same bytes, the pinned pool's time to ready, layer-wise load;
# 3. the main job on the GPU: `zkv replay` with ZKV_BACKEND=cupy, one rank, every block
#    verified after each round trip.
#
# Exit status: 0 when every check passed; 1 after naming each one that failed (a test run,
# the bench, the replay, a mutant not caught, memcheck); 2 when torch sees no CUDA device
# (or torch, cupy or pyzmq is missing).
#
# Extra wheels (pyzmq, orjson, structlog for the machine's Python) may sit in .whl/: they
# are installed into /tmp/site first. PY picks the interpreter (default python3).
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-$PWD/gpu-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1  # a segfault prints the Python stack of every thread
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
step() { printf '\n===== %s (%s)\n' "$1" "$(date +%T)"; }
# Every check that fails is named at the end and the script exits 1: an H100 run once
# printed a segfault and an uncaught mutant and still exited 0.
failed=()
check() {  # check NAME RC [EXPECTED]: record NAME unless RC is EXPECTED (default 0)
    [ "$2" = "${3:-0}" ] || failed+=("$1 (rc $2)")
}

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv 2>&1 | head -3
"$PY" -c "import sys, torch, cupy, zmq; print(sys.version.split()[0], 'torch', torch.__version__, \
'cupy', cupy.__version__, 'zmq', zmq.__version__, torch.cuda.get_device_name(0))" \
    || { echo "no CUDA device seen by torch, or torch / cupy / pyzmq missing (above): these checks need them"; exit 2; }

step "C extensions (optional: the fallbacks run without them)"
timeout 120 "$PY" setup.py -q build_ext --inplace > "$OUT/build_ext.log" 2>&1 \
    && echo built || echo "not built (see build_ext.log); pure-Python fallbacks"

step "GPU tests"
timeout 200 "$PY" -m pytest -q -p no:cacheprovider -o addopts="-ra --strict-markers" \
    -W default tests/kernels/test_cupy_backend.py tests/kernels/test_backend_select.py \
    tests/worker/test_actor_device.py tests/worker/test_actor_gpu.py 2>&1 | tee "$OUT/pytest.log" | tail -60
rc=${PIPESTATUS[0]}; echo "pytest rc=$rc"; check "GPU tests" "$rc"

step "bench/transfer.py --gpu-only, thread-block cap sweep"
timeout 120 "$PY" bench/transfer.py --gpu-only --ctas 8 33 0 2>&1 | tee "$OUT/transfer.log"
check "bench/transfer.py" "${PIPESTATUS[0]}"

step "zkv replay on the GPU (ZKV_BACKEND=cupy, 1 rank)"
ZKV_BACKEND=cupy timeout 120 "$PY" -m zkv.cli replay --ranks 1 --requests 300 --no-progress \
    --log-dir "$OUT/replay-logs" --metrics-file "$OUT/replay-metrics.json" 2>&1 \
    | tee "$OUT/replay.log" | tail -25
rc=${PIPESTATUS[0]}; echo "replay rc=$rc"; check "zkv replay" "$rc"
(cd "$OUT" && tar czf replay-logs.tgz replay-logs 2>/dev/null && rm -rf replay-logs)
step "mutants: the GPU ordering tests must fail on a backend with a stream wait removed"
for mutant in no_compute_wait no_start_wait no_follow no_abandon_wait; do
    ZKV_MUTANT=$mutant timeout 90 "$PY" -m pytest -q -p no:cacheprovider -p bench.gpu_mutants \
        -o addopts="-ra" -W default tests/worker/test_actor_gpu.py 2>&1 \
        | tee -a "$OUT/mutants.log" | grep -E "^(FAILED|ERROR)|passed|failed"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 1 ] && echo "mutant $mutant: caught" || echo "mutant $mutant: NOT CAUGHT (pytest rc=$rc)"
    check "mutant $mutant caught" "$rc" 1
done

if command -v compute-sanitizer > /dev/null; then
    step "compute-sanitizer memcheck: the gather/scatter kernels"
    timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 "$PY" -m pytest -q \
        -p no:cacheprovider -o addopts="-ra" -W default tests/kernels/test_cupy_backend.py \
        -k "matches_oracle or engine_layouts or round_trip or odd_geometry or own_strides or block_cap" 2>&1 | tee "$OUT/memcheck.log" | tail -15
    rc=${PIPESTATUS[0]}; echo "memcheck rc=$rc"; check "memcheck" "$rc"
fi
step "done"
if [ ${#failed[@]} -gt 0 ]; then
    printf 'FAILED: %s\n' "${failed[@]}"
    exit 1
fi
echo "all checks passed"
