#!/usr/bin/env bash
# zkv's one install command (README "Commands"; .ci/run calls it): Debian packages the
# L3 tests need, then a venv with zkv, its tests, the vLLM integration (vLLM's CPU build)
# and the Redis / Mooncake clients. Re-running it is harmless.
set -euo pipefail
cd "$(dirname "$0")"
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v openssl >/dev/null 2>&1 || need+=(openssl)  # the rediss:// tests' certificates
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || need+=(libibverbs1)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "install.sh: needs Debian packages ${need[*]}: run as root or: sudo apt-get install -y ${need[*]}" >&2
    exit 2
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q -e '.[test,vllm,redis,mooncake]'
# vLLM pulls in torchvision/torchaudio/torchcodec; its CPU build needs none of them and they
# break or slow its import (../shared/ENVIRONMENT.md).
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "zkv installed in .venv (main job: .venv/bin/zkv replay; tests: .venv/bin/python -m pytest -q)"
