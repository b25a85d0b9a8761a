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
mkdir -p "$(dirname "$dest")"
cp -r "$src" "$dest"
find "$dest" -name __pycache__ -prune -exec rm -rf {} +
tar -xzf "$dest/downloads.tar.gz" -C "$dest"
if [ -z "$wheelhouse" ]; then
  cat "$here/runner.yaml" >> "$dest/conf/training_asr_transformer.yaml"
else
  { grep -v '^  container:' "$here/runner.yaml"; cat "$here/podman.yaml"; echo "    wheelhouse: $wheelhouse"
  } >> "$dest/conf/training_asr_transformer.yaml"
fi
# Inference reads the model ESPnet3's training leaves for it: the average of the 10 best checkpoints by validation
# loss (the recipe's best_model_criterion), which exists once the train stage ran 11 epochs or more. The recipe's own
# inference.yaml names epoch0_step1_valid.loss.ckpt, a file only a 1-step training run leaves.
# shellcheck disable=SC2016  # ${exp_dir} is ESPnet3's interpolation, written as is
model='${exp_dir}/valid.loss.ave_10best.pth'
sed -i "s|^\(  asr_model_file: \).*|\1$model|" "$dest/conf/inference.yaml"
grep -qF "asr_model_file: $model" "$dest/conf/inference.yaml" ||
  { echo "prepare: $dest/conf/inference.yaml has no asr_model_file line to point at the averaged model" >&2; exit 1; }
echo "prepared $dest: cd there and follow examples/espnet3-mini-an4/README.md"
