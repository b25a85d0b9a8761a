#!/usr/bin/env bash
# Set up and run every test: lint (ruff, mypy), unit tests, and the integration tests on a real local Slurm
# cluster and real podman builds (those install slurm/munge/mariadb/podman with apt when run as root).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# ESPnet3's own venv (Python 3.12) for tests/test_espnet3.py; a stamp skips it once done. Without a Python 3.12 its
# tests skip with the reason on a laptop, and fail under CI=true.
scripts/install-espnet3.sh || [ "${CI:-}" != true ]
if [ "$(id -u)" = 0 ]; then
  scripts/install-slurm.sh
  [ -x scripts/install-podman.sh ] && scripts/install-podman.sh
  scripts/install-chromium.sh  # the report page's browser test (tests/test_report.py)
  scripts/install-tmux.sh  # the quickstart as a person runs it, in a terminal (tests/test_quickstart_tmux.py)
fi
export OMP_NUM_THREADS=1
.venv/bin/ruff check runner tests bench
.venv/bin/mypy runner
.venv/bin/lint-imports
.venv/bin/pytest -m "not own_session" "$@" || [ $? -eq 5 ]  # 5: nothing selected (e.g. one file named)
.venv/bin/pytest -m own_session "$@" || [ $? -eq 5 ]  # takes the dev cluster down: never under another test's feet
