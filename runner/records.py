"""The run's one-file records as data: their fields, and how a file on disk is read back into them.

The ledger (``runner.ledger``) is the run's history; these are its current facts, one JSON file each, written by one
process and read by others across machines and runner versions. Each has a type here and is written and read only
through ``RunDir`` (``write_exit_status``/``exit_status_record``), never by key strings on a raw dict: a renamed field
fails mypy, not silently as ``.get() -> None``. A reader normalizes what it finds: older shapes, hand edits and torn
files come back as the type, or as None, never as an exception.

Standard library only: the login node, the batch host and the ranks import it.
"""

from __future__ import annotations

import math
from typing import Any, NotRequired, TypedDict, TypeGuard


class ExitStatus(TypedDict):
    """``exit_status.json``: how the run's last attempt ended, written once it did.

    Writers: the batch script's exit hook (``runner.host.jobhook``), the local driver (``runner.host.local``), a local
    ``runner cancel`` (``cancelled``) and the ``runner parallel`` driver."""

    exit_code: int | None  # None: a run cancelled while none of its processes lived (no attempt ended with a code)
    time: float
    event: NotRequired[str]  # the attempt's outcome (ledger.Outcome): exit hook and local driver
    attempt: NotRequired[int]
    job_id: NotRequired[str | None]  # the Slurm job (exit hook)
    signal: NotRequired[str | None]  # the signal the batch shell got, by name (exit hook)
    codes: NotRequired[list[int]]  # each rank's exit code (local driver)
    cancelled: NotRequired[bool]  # the user's `runner cancel` (local), or a parallel run's end


def is_number(value: object) -> TypeGuard[int | float]:
    """A finite JSON number (not a bool, NaN or infinity): what a numeric field of a record may hold."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def exit_status(raw: Any) -> ExitStatus | None:
    """``exit_status.json`` as read (any JSON value), as an ``ExitStatus``; None when it says neither an exit code nor a
    cancel. A field of the wrong type is dropped, never passed on."""
    if not isinstance(raw, dict):
        return None
    code = _int(raw.get("exit_code"))
    if code is None and raw.get("cancelled") is not True:
        return None
    when = raw.get("time")
    status: ExitStatus = {"exit_code": code, "time": float(when) if is_number(when) else 0.0}
    if isinstance(event := raw.get("event"), str):
        status["event"] = event
    if (attempt := _int(raw.get("attempt"))) is not None:
        status["attempt"] = attempt
    if "job_id" in raw and (raw["job_id"] is None or isinstance(raw["job_id"], str)):
        status["job_id"] = raw["job_id"]
    if "signal" in raw and (raw["signal"] is None or isinstance(raw["signal"], str)):
        status["signal"] = raw["signal"]
    if isinstance(codes := raw.get("codes"), list) and all(_int(c) is not None for c in codes):
        status["codes"] = codes
    if isinstance(cancelled := raw.get("cancelled"), bool):
        status["cancelled"] = cancelled
    return status
