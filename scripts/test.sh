#!/usr/bin/env bash
# Set up and run every test: lint (ruff, mypy, import contracts), unit tests, and the integration tests on a real local
# Slurm cluster and real podman builds (those install slurm/munge/mariadb/podman with apt when run as root and missing).
#
# Usage: scripts/test.sh [--unit] [pytest args]
#   --unit   lint and the unit tier only (tests that start no process; under a minute on 2 cores): no apt, no
#            ESPnet3 venv. The tiers (unit, local, browser, slurm, podman) are markers: see tests/conftest.py.
#   -m EXPR  runs the tests EXPR selects; own_session tests among them still run in a pytest session of their own.
set -euo pipefail
cd "$(dirname "$0")/.."
unit=0
mark=""
args=()
while [ $# -gt 0 ]; do
  case $1 in
    --unit) unit=1 ;;
    -m) [ $# -ge 2 ] || { echo "test.sh: -m needs an expression" >&2; exit 2; }
        mark="${mark:+$mark and }($2)"; shift ;;
    -m?*) mark="${mark:+$mark and }(${1#-m})" ;;
    *) args+=("$1") ;;
  esac
  shift
done
[ "$unit" = 1 ] && mark="${mark:+$mark and }unit"
have() { for c in "$@"; do command -v "$c" >/dev/null || return 1; done; }

scripts/setup.sh
if [ "$unit" = 0 ]; then
  # ESPnet3's own venv (Python 3.12) for tests/test_espnet3.py; a stamp skips it once done. Without a Python 3.12 its
  # tests skip with the reason on a laptop, and fail under CI=true.
  scripts/install-espnet3.sh || [ "${CI:-}" != true ]
  if [ "$(id -u)" = 0 ]; then  # each installer only when what it installs is missing
    have slurmctld slurmd slurmdbd sbatch munged mariadbd nsenter unshare ip tc iptables || scripts/install-slurm.sh
    have podman runc mmdebstrap || scripts/install-podman.sh
    # Real Apptainer from its Go module source (needs Go); cached outside the clone, ~0.2 s when done. Without Go its
    # tests skip with the reason on a laptop, and fail under CI=true.
    scripts/install-apptainer.sh || [ "${CI:-}" != true ]
    have chromium || scripts/install-chromium.sh  # the report page's browser test (tests/test_report.py)
    have tmux || scripts/install-tmux.sh  # the quickstart as a person runs it, in a terminal (tests/test_quickstart_tmux.py)
  fi
fi
export OMP_NUM_THREADS=1
.venv/bin/ruff check runner tests bench
.venv/bin/mypy runner
.venv/bin/lint-imports
# pytest keeps only the last -m: the selection asked for is and-ed into each session's own.
and="${mark:+$mark and }"
.venv/bin/pytest -m "${and}not own_session" ${args[@]+"${args[@]}"} || [ $? -eq 5 ]  # 5: nothing selected
[ "$unit" = 1 ] ||  # no unit test takes the cluster down
  .venv/bin/pytest -m "${and}own_session" ${args[@]+"${args[@]}"} || [ $? -eq 5 ]  # never under another test's feet
