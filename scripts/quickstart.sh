#!/usr/bin/env bash
# Set up and run the quickstart: 2-process Lightning DDP on CPU, checkpointing every 10 steps.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export OMP_NUM_THREADS=1
.venv/bin/runner submit conf/quickstart.yaml "$@"
.venv/bin/runner status
