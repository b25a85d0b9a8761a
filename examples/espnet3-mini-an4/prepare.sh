#!/usr/bin/env bash
# Make a runnable copy of ESPnet3's mini_an4 recipe (egs3/mini_an4/esp2_asr from the installed espnet package)
# with runner's settings appended to its conf/training_asr_transformer.yaml. Usage:
#   examples/espnet3-mini-an4/prepare.sh DEST [--podman WHEELHOUSE]
# --podman: the podman image variant (podman.yaml in place of runner.yaml's `container:` line), built offline from
# WHEELHOUSE (containers/wheelhouse-espnet3.sh WHEELHOUSE makes it).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
py=${RUNNER_ESPNET3_PYTHON:-$repo/.venv-espnet3/bin/python}
[ -x "$py" ] || { echo "prepare: $py not found; run scripts/install-espnet3.sh first" >&2; exit 1; }
dest=${1:?usage: prepare.sh DEST [--podman WHEELHOUSE]}
wheelhouse=
if [ "${2:-}" = --podman ]; then
  wheelhouse=$(realpath -m "${3:?usage: prepare.sh DEST --podman WHEELHOUSE}")
fi
[ -e "$dest" ] && { echo "prepare: $dest exists; expected a new directory" >&2; exit 2; }
src=$("$py" -c 'import egs3, os; print(os.path.join(os.path.dirname(egs3.__file__), "mini_an4", "esp2_asr"))')
cp -r "$src" "$dest"
find "$dest" -name __pycache__ -prune -exec rm -rf {} +
tar -xzf "$dest/downloads.tar.gz" -C "$dest"
if [ -z "$wheelhouse" ]; then
  cat "$here/runner.yaml" >> "$dest/conf/training_asr_transformer.yaml"
else
  { grep -v '^  container:' "$here/runner.yaml"; cat "$here/podman.yaml"; echo "    wheelhouse: $wheelhouse"
  } >> "$dest/conf/training_asr_transformer.yaml"
fi
echo "prepared $dest: cd there and follow examples/espnet3-mini-an4/README.md"
