"""Which image a rank runs in, read from inside: the rank record's ``runtime``/``image``/``in_container`` fields
and the check that the image is the one the run was submitted with.

``runner build`` copies the image's spec into ``/etc/runner-spec.json`` and the image's ``sys.prefix`` into
``/etc/runner-python-prefix``; ``runner submit`` records the runtime, the image and its spec hash in the run's
``manifest.json``. A rank is inside the image only when both files are there and its own Python is the image's.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from runner.image import PYTHON_PREFIX as PYTHON_PREFIX
from runner.image import SPEC as SPEC
from runner.records import RunManifest
from runner.rundir import RunDir, atomic_write, read_json

log = logging.getLogger(__name__)
APPTAINER_DIR = Path("/.singularity.d")


def inside(runtime: str = "none") -> bool:
    """In runner's image, with the image's Python; under Apptainer also inside a real Apptainer container: the
    ``/.singularity.d`` it builds into every SIF and the ``APPTAINER_CONTAINER`` (image path) its starter sets."""
    try:
        ours = SPEC.is_file() and PYTHON_PREFIX.read_text().strip() == sys.prefix
    except OSError:
        return False
    if runtime in ("apptainer", "singularity"):
        return ours and APPTAINER_DIR.is_dir() and bool(apptainer_image())
    return ours


def apptainer_image() -> str | None:
    return os.environ.get("APPTAINER_CONTAINER") or os.environ.get("SINGULARITY_CONTAINER")


def describe(manifest: RunManifest) -> dict[str, Any]:
    """The fields a rank records about its container (``ranks/rank-XXXXX.json``)."""
    runtime = manifest.get("runtime", "none")
    here = inside(runtime)
    return {"runtime": runtime, "image": manifest.get("image"), "in_container": here,
            "image_spec_hash": (read_json(SPEC, {}) or {}).get("spec_hash") if here else None,
            "apptainer_container": apptainer_image()}


def stale_image(manifest: RunManifest, force: bool, report: RunDir | None = None) -> bool:
    """True when this rank must not train in this image: another spec than the run's (logged, naming both).

    A run submitted for an image (``spec_hash`` in its manifest) that starts in another one (rebuilt, or a tag
    or path that now holds other code) stops at once; ``resume.force`` turns it into a warning. ``report`` (rank 0):
    the run whose preflight.json/.txt say why, for the exit hook's alert and ``runner status``.
    """
    want = manifest.get("spec_hash")
    if manifest.get("runtime", "none") == "none" or not want:
        return False
    have = (read_json(SPEC, {}) or {}).get("spec_hash") if SPEC.is_file() else None
    if have == want:
        return False
    found = f"image spec {have}" if have else f"no {SPEC} (not inside a runner image)"
    what = f"image {manifest.get('image')}: found {found}; expected spec {want} (the run's manifest)"
    if force:
        log.warning("%s; resume.force is set: training anyway", what)
        return False
    why = (f"{what}. hint: `runner build --from-run RUN_DIR` rebuilds the run's image (resume.force: true in the "
           "run's config.yaml trains anyway)")
    log.error("%s", why)
    if report is not None:
        atomic_write(report.preflight, json.dumps({"status": "fail", "summary": f"stale image: {what}"}) + "\n")
        atomic_write(report.preflight_table, why + "\n")
    return True
