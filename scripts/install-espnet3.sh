#!/usr/bin/env bash
# The ESPnet3 environment for examples/espnet3-mini-an4 (not part of the quickstart): a Python 3.12 venv at
# .venv-espnet3 with ESPnet3 from PyPI, torch/torchaudio 2.11 (PyPI's builds; they run on the CPU), the packages
# its recipes use that its requirements do not pull, and runner itself (runtime `none` runs each rank with the
# Python that ran `runner submit`). The versions: containers/espnet3-requirements.txt (the podman image's wheelhouse,
# containers/wheelhouse-espnet3.sh, reads it too).
#
# Two parts, so that a fresh clone costs seconds, not 5.7 GB and two minutes:
# - the packages (everything but runner) in a venv outside the clone, under $RUNNER_CACHE (default
#   /var/tmp/runner-cache), named by a hash of what it installs: the requirements, runner's own dependencies, this
#   script. Built once per machine and kept; a changed requirement builds a new one beside it.
# - .venv-espnet3 in the clone: a small venv that reads the packages' site-packages (a .pth line) and holds runner
#   installed from this clone (editable, with its entry points) and the sph2pipe stand-in.
# Idempotent: a stamp in each part skips what is done.
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
python=$(find_python)
# runner's own dependencies (its [project] and the train extra), not the rest of pyproject.toml: a changed lint
# setting keeps the packages.
deps=$("$python" -c 'import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(p["dependencies"] + p["optional-dependencies"]["train"]))')
key=$( { cat "$REQUIREMENTS"; echo "$deps"; cat scripts/install-espnet3.sh; "$python" -V; } | sha256sum | cut -c1-16)
packages=${RUNNER_CACHE:-/var/tmp/runner-cache}/espnet3-$key
if [ ! -e "$packages/.complete" ]; then
  rm -rf "$packages"  # a half-built one (a killed install) is built again
  mkdir -p "$(dirname "$packages")"
  "$python" -m venv "$packages"
  "$packages/bin/python" -m pip install -q --upgrade pip
  printf '%s\n' "$deps" > "$packages/runner-deps.txt"
  "$packages/bin/python" -m pip install -q -r "$REQUIREMENTS" -r "$packages/runner-deps.txt"
  touch "$packages/.complete"
fi
rm -rf "$VENV"
"$python" -m venv "$VENV"
site=$("$packages/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
own=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
# addsitedir, not a bare path: the packages' own .pth files are read too, as in their venv.
echo "import site; site.addsitedir('$site')" > "$own/runner-espnet3-packages.pth"
"$VENV/bin/python" -m pip install -q --no-deps -e .
# sph2pipe (ESPnet's recipes call it by name) is on no registry here: a stand-in over libsndfile, in the venv's bin
# (runner puts a venv's bin first on PATH for the program, as `activate` does).
{ echo "#!$(cd "$VENV" && pwd)/bin/python"; tail -n +2 examples/espnet3-mini-an4/sph2pipe; } > "$VENV/bin/sph2pipe"
chmod +x "$VENV/bin/sph2pipe"
"$VENV/bin/python" -c 'import espnet2, lightning, runner, torch'  # the two parts found each other
touch "$stamp"
