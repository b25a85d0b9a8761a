"""List every utterance of ESPnet3's manifests N times (ids suffixed -r1, -r2, ...): mini_an4 is 4 training
utterances and 1 validation utterance, fewer than 4 ranks need for a batch each. Usage:
    python repeat.py data/manifest N
Idempotent: the originals are kept beside as *.tsv.orig and each run starts from them."""

import shutil
import sys
from pathlib import Path

manifests, n = Path(sys.argv[1]), int(sys.argv[2])
for tsv in sorted(manifests.glob("*.tsv")):
    orig = tsv.with_suffix(".tsv.orig")
    if not orig.exists():
        shutil.copy(tsv, orig)
    rows = [line.split("\t", 1) for line in orig.read_text().splitlines() if line.strip()]
    tsv.write_text("".join(f"{uid}-r{i}\t{rest}\n" for i in range(1, n + 1) for uid, rest in rows))
