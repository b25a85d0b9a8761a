"""The run's one-file records as data: their fields, and how a file on disk is read back into them.

The ledger (``runner.ledger``) is the run's history; these are its current facts, one JSON file each, written by one
process and read by others across machines and runner versions. Each has a type here and is written and read only
through ``RunDir`` (``write_exit_status``/``exit_status_record`` and the like) or ``runner.checkpoint`` (a
checkpoint's manifest), never by key strings on a raw dict: a renamed field fails mypy, not silently as
``.get() -> None``. A reader normalizes what it finds: older shapes, hand edits and torn files come back as the type,
or as None, never as an exception.

Standard library only: the login node, the batch host and the ranks import it.
"""

from __future__ import annotations

import math
from typing import Any, NotRequired, TypedDict, TypeGuard, cast


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


class LastExit(TypedDict):
    """``last_exit.json``: the exit code every rank agreed on, for the batch script's exit hook (srun reports 143 for
    the ranks its ``--kill-on-bad-exit`` ended). Writers: rank 0's launcher, or the watchdog of the rank that
    summed up a hang (rank 0 may be the stuck one)."""

    code: int
    job_id: str | None  # the Slurm job that wrote it; None in a local run
    restart_count: str | None  # Slurm's requeues of that job: the hook takes only its own attempt's code
    time: float


def last_exit(raw: Any) -> LastExit | None:
    """``last_exit.json`` as read, as a ``LastExit``; None when it holds no exit code."""
    if not isinstance(raw, dict) or (code := _int(raw.get("code"))) is None:
        return None
    restart = raw.get("restart_count")
    return {"code": code, "job_id": _str(raw.get("job_id")),
            "restart_count": str(restart) if isinstance(restart, str) or _int(restart) is not None else None,
            "time": _time(raw.get("time"))}


class ProgramOutcome(TypedDict):
    """``program-rank-XXXXX.json`` in an attempt's logs: what a program's fit did on one rank. Written by the wrapped
    ``Trainer.fit`` (``runner.job.program_entry``), read by the rank's launcher once the program ended."""

    step: int  # the global step the fit ended at
    code: int | None  # the launcher's exit code when training stopped before its end; None: fit ended by itself
    resumed: bool  # the fit continued from runner's checkpoint
    time: float
    productive_s: float | None  # training seconds the run keeps (earlier attempts' included)


def program_outcome(raw: Any) -> ProgramOutcome | None:
    """A program outcome file as read, as a ``ProgramOutcome``; None when it is not one."""
    if not isinstance(raw, dict):
        return None
    kept = raw.get("productive_s")
    return {"step": _int(raw.get("step")) or 0, "code": _int(raw.get("code")), "resumed": raw.get("resumed") is True,
            "time": _time(raw.get("time")), "productive_s": float(kept) if is_number(kept) else None}


class ResumeVerdict(TypedDict):
    """``logs/.resume-verdict.json``: rank 0's choice of the checkpoint every rank of an attempt resumes from, which
    the other ranks wait for. It names the attempt and job that wrote it: an earlier attempt's is never taken."""

    attempt: int
    job: str | None  # the Slurm job; None in a local run
    restart: str | None  # Slurm's requeues of that job
    step: int | None  # the checkpoint's step; None (and no path): start from the beginning
    path: str | None


def resume_verdict(raw: Any) -> ResumeVerdict | None:
    """A verdict file as read, as a ``ResumeVerdict``; None when it says no attempt, or a path without a step."""
    if not isinstance(raw, dict) or (attempt := _int(raw.get("attempt"))) is None:
        return None
    step, path = _int(raw.get("step")), _str(raw.get("path"))
    if path and step is None:
        return None
    return {"attempt": attempt, "job": _str(raw.get("job")), "restart": _str(raw.get("restart")),
            "step": step if path else None, "path": path or None}


class CheckpointManifest(TypedDict, total=False):
    """``checkpoints/step-XXXXXXX/manifest.json``: what one checkpoint holds. Written by rank 0 as it publishes the
    step (``checkpoint.publish``), read by every resume, ``runner status`` and ``runner report``
    (``checkpoint.manifest_of``). Any field may be missing from an older or hand-made manifest."""

    step: int
    epoch: int
    config_hash: str
    world_size: int
    time: float
    runner_version: str
    productive_s: float  # training seconds the run keeps at this step (earlier attempts' included)
    mid_epoch: bool
    epoch_batches: int  # batches each rank had taken in the epoch
    accumulate: int  # gradient accumulation of the shape that wrote it
    format: str  # "dcp" (checkpoint.SHARDED): one shard per rank; missing: one model file
    shards: dict[str, str]  # a sharded checkpoint's rank -> the file of its shard
    files: dict[str, Any]  # every file's size and sha256, as written (checkpoint.verify checks each entry)


_MANIFEST_TYPES: dict[str, type | tuple[type, ...]] = {
    "step": int, "epoch": int, "config_hash": str, "world_size": int, "runner_version": str, "mid_epoch": bool,
    "epoch_batches": int, "accumulate": int, "format": str, "files": dict}


def checkpoint_manifest(raw: Any) -> CheckpointManifest:
    """A manifest as read, as a ``CheckpointManifest``: a field of the wrong type is dropped; {} for anything else."""
    if not isinstance(raw, dict):
        return {}
    got: dict[str, Any] = {k: v for k, v in raw.items() if k in _MANIFEST_TYPES and isinstance(v, _MANIFEST_TYPES[k])
                           and (_MANIFEST_TYPES[k] is bool or not isinstance(v, bool))}
    for key in ("time", "productive_s"):
        if is_number(raw.get(key)):
            got[key] = float(raw[key])
    if isinstance(shards := raw.get("shards"), dict) and all(isinstance(v, str) for v in shards.values()):
        got["shards"] = {str(k): v for k, v in shards.items()}
    return cast(CheckpointManifest, got)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _time(value: Any) -> float:
    return float(value) if is_number(value) else 0.0
