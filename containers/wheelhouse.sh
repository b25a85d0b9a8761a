#!/usr/bin/env bash
# Make the wheelhouse for offline image builds (container.wheelhouse): every wheel the training image
# installs, made here where the package index is reachable, so the build itself needs no network.
# torch is pinned to the CPU build (an unpinned torch pulls GBs of CUDA wheels); runner's own wheel is
# built from this checkout; torchdata is the resumable loader of tests/programs/lightning_train.py (the program-mode
# tests' image installs it). The image's Python is Debian 12's 3.11: run this with a Python 3.11.
#
# Usage: containers/wheelhouse.sh DIR    (writes DIR.tmp, then renames it to DIR; does nothing if DIR exists)
set -euo pipefail
dir=${1:?usage: containers/wheelhouse.sh DIR}
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$repo/.venv/bin/python}
[ -d "$dir" ] && exit 0
ver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$ver" = 3.11 ] || { echo "wheelhouse: $py is Python $ver; the image's Python is 3.11" >&2; exit 1; }
rm -rf "$dir.tmp"
"$py" -m pip wheel -q --wheel-dir "$dir.tmp" "torch==2.13.0" "lightning==2.6.*" "torchdata==0.11.0" "${repo}[train]"
mv "$dir.tmp" "$dir"
