#!/usr/bin/env bash
# The wheelhouse of the ESPnet3 podman image (examples/espnet3-mini-an4/podman.yaml): every wheel the image installs,
# for CPython 3.12, made here where the package index is reachable, so that the image build needs no network. The
# versions are containers/espnet3-requirements.txt's (as scripts/install-espnet3.sh installs them) plus runner's own
# wheel, built from this checkout, with its [train] extra. `pip download` (not `pip wheel`: most of the ~3.5 GB are
# torch's nvidia-* wheels, which need no building); an sdist among them is turned into a wheel here, since the image
# has no compiler. Run it with a Python 3.12 (default: the ESPnet3 venv's).
#
# Usage: containers/wheelhouse-espnet3.sh DIR    (writes DIR.tmp, then renames it to DIR; does nothing if DIR exists)
set -euo pipefail
dir=${1:?usage: containers/wheelhouse-espnet3.sh DIR}
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-${RUNNER_ESPNET3_VENV:-$repo/.venv-espnet3}/bin/python}
[ -d "$dir" ] && exit 0
ver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$ver" = 3.12 ] || { echo "wheelhouse-espnet3: $py is Python $ver; the image's Python is 3.12" >&2; exit 1; }
rm -rf "$dir.tmp"
"$py" -m pip wheel -q --no-deps --wheel-dir "$dir.tmp" "$repo"
runner_wheel=$(ls "$dir.tmp"/runner-*.whl)
"$py" -m pip download -q --dest "$dir.tmp" -r "$repo/containers/espnet3-requirements.txt" "${runner_wheel}[train]"
for sdist in "$dir.tmp"/*.tar.gz "$dir.tmp"/*.zip; do
  [ -e "$sdist" ] || continue
  "$py" -m pip wheel -q --no-deps --wheel-dir "$dir.tmp" "$sdist"
  rm "$sdist"
done
mv "$dir.tmp" "$dir"
