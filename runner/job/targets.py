"""The real import check of each ``_target_``, inside the job (in the image), before training.

``runner validate`` only resolves targets statically on the login node (``runner.spec.targets``); a package
that exists only in the image is a note there. Here every target is imported for real, so a missing module or
a misspelled class stops the job with one line naming the target and the preflight exit code, not with a
traceback from every rank after the process group is up.
"""

from __future__ import annotations

import importlib
import logging

from runner.rundir import EXIT_PREFLIGHT
from runner.spec.typed import RunConfig

log = logging.getLogger(__name__)


def problem(target: str) -> str | None:
    """Why ``module.Name`` cannot be built here (one line), or None."""
    mod_name, _, attr = target.rpartition(".")
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 -- any failure of the user's import is reported the same way
        return f"cannot import {mod_name} for {target}: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
    if not callable(getattr(module, attr, None)):
        return f"{target}: {mod_name} has no class or function {attr!r}"
    return None


def check(cfg: RunConfig) -> int | None:
    """Import every ``_target_``; the preflight exit code after logging one line each, or None when all import."""
    bad = [p for section in ("model", "data") if (p := problem(cfg[section]["_target_"]))]
    for line in bad:
        log.error("preflight: %s. hint: install it in the image (container.pip / container.code)", line)
    return EXIT_PREFLIGHT if bad else None
