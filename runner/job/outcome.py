"""What a rank leaves behind when its training ends: its crash record, the run's ``finished`` marker. Read by the
batch script's exit hook and ``runner status``.

Standard library only: the launcher and a program's rank import it before torch.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from typing import Any

from runner.rundir import RunDir, atomic_write

log = logging.getLogger(__name__)


def record_crash(rd: RunDir, attempt: int, rank: int, step: int | None, exc: BaseException) -> dict[str, Any]:
    """Write what this rank raised (type, innermost frame, step; None where no training step is known, as in a
    program's stage that trains nothing): the exit hook compares attempts with it, and the same crash at the same
    step twice is a crash loop (``runner.policy.crash_loop``)."""
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    crash = {"type": type(exc).__name__, "message": str(exc)[:300], "step": step, "rank": rank,
             "frame": f"{last.filename}:{last.lineno} in {last.name}" if last else None, "time": time.time()}
    try:
        atomic_write(rd.crash_file(attempt, rank), json.dumps(crash) + "\n")
    except OSError as e:  # the traceback still reaches the rank log
        log.warning("crash record not written: %s", e)
    return crash


def finished(rd: RunDir, step: int | None, productive_s: float | None = None, **fields: Any) -> None:
    """Rank 0, once training ended: the ``finished`` marker and its ledger line."""
    atomic_write(rd.finished, json.dumps({"step": step, "time": time.time(), "productive_s": productive_s}) + "\n")
    rd.record("finished", step=step, **fields)
