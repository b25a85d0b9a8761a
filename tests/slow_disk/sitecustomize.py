"""TEST STAND-IN FOR A SLOW DISK, not part of runner: loaded only by processes whose PYTHONPATH holds this folder,
which a test puts there with ``tests.slow_disk.env`` (Python imports ``sitecustomize`` at startup from sys.path).

What it does: with ``RUNNER_SLOW_DISK="STEP:SECONDS"`` set, once ``runner.checkpoint`` is imported it wraps
``runner.checkpoint.wait_for_files`` so that rank 0, called right after its own files of a checkpoint of step >= STEP
are on disk and before it waits for the other ranks' files and publishes (renames) the staging directory, first sleeps
SECONDS. A test thus finds every file of that step in ``.staging-step-N`` while the checkpoint is not yet complete,
and can kill the run at that moment.

What it does not reproduce: the writes themselves are not slowed (every file lands at full speed, fsyncs included),
only rank 0 is held (the other ranks go on training), nothing but the publication of a checkpoint waits, and the
sleep does not depend on how much is written. It relies on runner's checkpoint writer (runner/job/) calling
``checkpoint.wait_for_files`` through the module (an attribute looked up at call time) with paths inside the staging
directory; if that changes, the tests that use it stop finding their moment and fail (they do not pass silently).

It shadows any other ``sitecustomize`` on the path (there is none in runner's venv).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import re
import sys
import time
from types import ModuleType
from typing import Any

ENV = "RUNNER_SLOW_DISK"
TARGET = "runner.checkpoint"


def _slow(real: Any, at: int, seconds: float) -> Any:
    def wait_for_files(paths: list[Any], timeout_s: float) -> Any:
        m = re.search(r"\.staging-step-(\d+)$", str(paths[0].parent)) if paths else None
        if m and int(m.group(1)) >= at:
            time.sleep(seconds)
        return real(paths, timeout_s)
    return wait_for_files


class _Patch(importlib.abc.MetaPathFinder):
    """Finds runner.checkpoint with the other finders and wraps its wait_for_files once the module has run."""

    def __init__(self, at: int, seconds: float) -> None:
        self.at, self.seconds = at, seconds

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        loader, at, seconds = spec.loader, self.at, self.seconds
        real_exec = loader.exec_module  # type: ignore[attr-defined]

        def exec_module(module: ModuleType) -> None:
            real_exec(module)
            module.wait_for_files = _slow(module.wait_for_files, at, seconds)  # type: ignore[attr-defined]
        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_at, _, _seconds = os.environ.get(ENV, "").partition(":")
if _at.isdigit():
    sys.meta_path.insert(0, _Patch(int(_at), float(_seconds or 0)))
