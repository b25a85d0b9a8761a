#!/usr/bin/env bash
# The ESPnet3 environment for examples/espnet3-mini-an4 (not part of the quickstart): a Python 3.12 venv at
# .venv-espnet3 with ESPnet3 from PyPI, torch/torchaudio 2.11 (PyPI's builds; they run on the CPU), the packages
# its recipes use that its requirements do not pull, and runner itself (runtime `none` runs each rank with the
# Python that ran `runner submit`). The versions: containers/espnet3-requirements.txt (the podman image's wheelhouse,
# containers/wheelhouse-espnet3.sh, reads it too). Idempotent: a stamp of these files skips a finished install.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${RUNNER_ESPNET3_VENV:-.venv-espnet3}
REQUIREMENTS=containers/espnet3-requirements.txt
find_python() {
  for c in "${PYTHON312:-}" python3.12 "$HOME/.pyenv/versions/3.12.1/bin/python3.12" /root/.pyenv/versions/3.12.1/bin/python3.12; do
    # pyenv's shims exist for versions that are not selected: ask the interpreter itself.
    [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { command -v "$c"; return; }
  done
  echo "install-espnet3: ESPnet3 needs Python >= 3.12 and none was found; set PYTHON312=/path/to/python3.12" >&2
  exit 1
}
stamp=$VENV/.runner-espnet3-$(cat pyproject.toml scripts/install-espnet3.sh "$REQUIREMENTS" examples/espnet3-mini-an4/sph2pipe | sha256sum | cut -c1-16)
[ -e "$stamp" ] && exit 0
[ -x "$VENV/bin/python" ] || "$(find_python)" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -r "$REQUIREMENTS"
"$VENV/bin/python" -m pip install -q -e ".[train]"
# sph2pipe (ESPnet's recipes call it by name) is on no registry here: a stand-in over libsndfile, in the venv's bin
# (runner puts a venv's bin first on PATH for the program, as `activate` does).
{ echo "#!$(cd "$VENV" && pwd)/bin/python"; tail -n +2 examples/espnet3-mini-an4/sph2pipe; } > "$VENV/bin/sph2pipe"
chmod +x "$VENV/bin/sph2pipe"
touch "$stamp"
