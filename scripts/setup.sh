#!/usr/bin/env bash
# Create .venv with runner and its training and test dependencies. Idempotent; torch is pinned to a CPU
# build here (an unpinned torch pulls several GB of CUDA wheels on a machine without GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_PIN=${TORCH_PIN:-torch==2.13.0}
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if ! "$PY" -m venv .venv 2>/dev/null; then
    # Debian/Ubuntu ship venv separately; install it when we may, else say what is missing.
    rm -rf .venv
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get install -y -qq python3-venv >/dev/null || { apt-get update -qq && apt-get install -y -qq python3-venv; }
      "$PY" -m venv .venv
    else
      echo "setup: '$PY -m venv' failed; install python3-venv (Debian/Ubuntu) and run again" >&2
      exit 1
    fi
  fi
fi
stamp=.venv/.runner-setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ ! -e "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "$TORCH_PIN" -e ".[train,dev]"
  touch "$stamp"
fi
