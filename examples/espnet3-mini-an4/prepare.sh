#!/usr/bin/env bash
# Make a runnable copy of ESPnet3's mini_an4 recipe (egs3/mini_an4/esp2_asr from the installed espnet package)
# with runner's settings appended to its conf/training_asr_transformer.yaml. Usage:
#   examples/espnet3-mini-an4/prepare.sh DEST [REPEAT]
# REPEAT (default 1): after create_dataset, list every utterance REPEAT times in the manifests
# (`repeat` below): mini_an4 has 4 training utterances and 1 for validation, too few for 4 ranks to each get a batch.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
py=${RUNNER_ESPNET3_PYTHON:-$repo/.venv-espnet3/bin/python}
[ -x "$py" ] || { echo "prepare: $py not found; run scripts/install-espnet3.sh first" >&2; exit 1; }
dest=${1:?usage: prepare.sh DEST [REPEAT]}
[ -e "$dest" ] && { echo "prepare: $dest exists; expected a new directory" >&2; exit 2; }
src=$("$py" -c 'import egs3, os; print(os.path.join(os.path.dirname(egs3.__file__), "mini_an4", "esp2_asr"))')
cp -r "$src" "$dest"
find "$dest" -name __pycache__ -prune -exec rm -rf {} +
tar -xzf "$dest/downloads.tar.gz" -C "$dest"
cat "$here/runner.yaml" >> "$dest/conf/training_asr_transformer.yaml"
echo "prepared $dest: cd there and follow examples/espnet3-mini-an4/README.md"
