#!/usr/bin/env bash
# Set up and run every test: lint (ruff, mypy, import contracts), unit tests, and the integration tests on a real local
# Slurm cluster and real podman builds (those install slurm/munge/mariadb/podman with apt when run as root and missing).
#
# Usage: scripts/test.sh [--unit] [pytest args]
#   --unit   lint and the unit tier only (tests that start no process; under a minute on 2 cores): no apt, no
#            ESPnet3 venv. The tiers (unit, local, browser, slurm, podman) are markers, one tier per file: see
#            tests/conftest.py.
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
# Each step's time, printed at the end (also when a step fails), so that growth is seen; pytest prints the time of
# each test tier itself ("time per tier").
times=()
step() {
  local name=$1 start=$SECONDS rc=0
  shift
  "$@" || rc=$?
  times+=("$(printf '%-26s %5d s' "$name" $((SECONDS - start)))")
  return $rc
}
summary() { echo "== time per step =="; printf '%s\n' "${times[@]}" "$(printf '%-26s %5d s' total "$SECONDS")"; }
trap summary EXIT
# Caches that outlive a clone (a clean-clone CI then starts warm), keyed by what they hold.
export RUNNER_CACHE=${RUNNER_CACHE:-/var/tmp/runner-cache}
export MYPY_CACHE_DIR=${MYPY_CACHE_DIR:-$RUNNER_CACHE/mypy} RUFF_CACHE_DIR=${RUFF_CACHE_DIR:-$RUNNER_CACHE/ruff}

step setup scripts/setup.sh
if [ "$unit" = 0 ]; then
  # ESPnet3's own venv (Python 3.12) for tests/test_espnet3*.py; its packages are cached outside the clone, a stamp
  # skips it once done. Without a Python 3.12 its tests skip with the reason on a laptop, and fail under CI=true.
  step install-espnet3 scripts/install-espnet3.sh || [ "${CI:-}" != true ]
  if [ "$(id -u)" = 0 ]; then  # each installer only when what it installs is missing
    have slurmctld slurmd slurmdbd sbatch munged mariadbd nsenter unshare ip tc iptables ||
      step install-slurm scripts/install-slurm.sh
    have podman runc mmdebstrap || step install-podman scripts/install-podman.sh
    # Real Apptainer from its Go module source (needs Go); cached outside the clone, ~0.2 s when done. Without Go its
    # tests skip with the reason on a laptop, and fail under CI=true.
    step install-apptainer scripts/install-apptainer.sh || [ "${CI:-}" != true ]
    have chromium || step install-chromium scripts/install-chromium.sh  # the report page's browser test
    have tmux || step install-tmux scripts/install-tmux.sh  # the quickstart as a person runs it, in a terminal
  fi
fi
export OMP_NUM_THREADS=1
step ruff .venv/bin/ruff check runner tests bench
step mypy .venv/bin/mypy runner
step lint-imports .venv/bin/lint-imports
# pytest keeps only the last -m: the selection asked for is and-ed into each session's own.
and="${mark:+$mark and }"
tests() { .venv/bin/pytest "$@" || [ $? -eq 5 ]; }  # 5: nothing selected
# --durations: the slowest tests are named at the end, where a CI log's tail shows them.
step "pytest" tests -m "${and}not own_session" --durations=25 ${args[@]+"${args[@]}"}
[ "$unit" = 1 ] ||  # no unit test takes the cluster down; never under another test's feet
  step "pytest (own session)" tests -m "${and}own_session" ${args[@]+"${args[@]}"}
