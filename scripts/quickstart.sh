#!/usr/bin/env bash
# Set up and run the quickstart: 2-process Lightning DDP on CPU, checkpointing every 10 steps.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export OMP_NUM_THREADS=1
rc=0
.venv/bin/runner submit conf/quickstart.yaml "$@" || rc=$?  # 75: stopped with Ctrl-C, checkpointed
.venv/bin/runner status
page=$(.venv/bin/runner report quickstart)
cat <<EOF

What to look at next:
  $page
      the run on one page: its attempts, steps over time, where the time went (goodput); open it in a browser
  .venv/bin/runner status quickstart --json    the same numbers as data
  .venv/bin/runner logs quickstart --rank 1    what rank 1 printed
  .venv/bin/runner resume quickstart           after a Ctrl-C: continues from the newest complete checkpoint
EOF
exit "$rc"
