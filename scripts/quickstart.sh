#!/usr/bin/env bash
# Set up and run the quickstart: 2-process Lightning DDP on CPU, checkpointing every 10 steps.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export OMP_NUM_THREADS=1
root=${RUN_ROOT:-runs}  # where the run directory goes (the tests put it in a temporary folder)
rc=0
# Ctrl-C stops the ranks at a checkpoint (exit 75, recorded as interrupted); the status table follows all the same.
.venv/bin/runner submit conf/quickstart.yaml run_root="$root" "$@" || rc=$?
.venv/bin/runner status --root "$root"
page=$(.venv/bin/runner report quickstart --root "$root")
cat <<EOF

What to look at next:
  $page
      the run on one page: its attempts, steps over time, where the time went (goodput); open it in a browser
  .venv/bin/runner status quickstart --json    the same numbers as data
  .venv/bin/runner logs quickstart --rank 1    what rank 1 printed
  .venv/bin/runner resume quickstart           after a Ctrl-C: continues from the newest complete checkpoint
EOF
exit "$rc"
