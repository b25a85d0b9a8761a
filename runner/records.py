"""The run's one-file records as data: their fields, and how a file on disk is read back into them.

The ledger (``runner.ledger``) is the run's history; these are its current facts, one JSON file each, written by one
process and read by others across machines and runner versions. Each has a type here and is written and read only
through ``RunDir`` (``write_exit_status``/``exit_status_record`` and the like; the run's manifest also through
``runner.host.observe.manifest_of``, which refuses a damaged one) or ``runner.checkpoint`` (a checkpoint's manifest),
never by key strings on a raw dict: a renamed field fails mypy, not silently as ``.get() -> None``. A reader
normalizes what it finds: older shapes, hand edits and torn files come back as the type, or as None, never as an
exception.

Standard library only: the login node, the batch host and the ranks import it.
"""

from __future__ import annotations

import math
from types import NoneType
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


class RankExit(TypedDict):
    """``exits/rank-XXXXX.json``: a rank's process is ending, written on its way out (the launcher's exit, or the
    watchdog's after a hang). The step reaper (``runner.host.jobhook.reap``) tells a node whose ranks all ended
    without one, and stopped beating, from nodes whose ranks ended: the first is lost."""

    rank: int
    host: str
    attempt: int | None
    code: int
    time: float


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


class StandbyHandoff(TypedDict):
    """``standby/JOB-N/handoff.json``: the begin hook's word to resume.in_job's warm standby step
    (``runner.job.standby``), whose tasks imported torch and Lightning while the last attempt trained. Writer: the batch
    script's begin hook (or its exit hook, to stand the step down); readers: the standby's tasks, each of which becomes
    a rank or exits."""

    env: dict[str, str]  # the attempt's variables (runner.world.attempt_env and its step's nodes)
    nodes: list[str]  # the attempt's step, in node-rank order; [] stands the standby down (every task exits 0)
    per_node: int  # ranks on each node


def standby_handoff(raw: Any) -> StandbyHandoff | None:
    """``handoff.json`` as read, as a ``StandbyHandoff``; None when any field is missing or of the wrong type."""
    if not isinstance(raw, dict):
        return None
    env, nodes, per_node = raw.get("env"), raw.get("nodes"), _int(raw.get("per_node"))
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        return None
    if not isinstance(nodes, list) or not _strings(nodes) or per_node is None or per_node < 1:
        return None
    return {"env": {str(k): str(v) for k, v in env.items()}, "nodes": [str(n) for n in nodes], "per_node": per_node}


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
    tried: int  # checkpoints of this attempt that failed to load before this choice (runner.job.fallback); 0


def resume_verdict(raw: Any) -> ResumeVerdict | None:
    """A verdict file as read, as a ``ResumeVerdict``; None when it says no attempt, or a path without a step."""
    if not isinstance(raw, dict) or (attempt := _int(raw.get("attempt"))) is None:
        return None
    step, path = _int(raw.get("step")), _str(raw.get("path"))
    if path and step is None:
        return None
    return {"attempt": attempt, "job": _str(raw.get("job")), "restart": _str(raw.get("restart")),
            "step": step if path else None, "path": path or None, "tried": _int(raw.get("tried")) or 0}


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
    position: str  # how a resume continues its train loader mid-epoch (honesty.positioning: restored, replayed,
    # or "epoch start": passed over for the newest at an epoch's end, checkpoint.passed_over)
    format: str  # "dcp" (checkpoint.SHARDED): one shard per rank; missing: one model file
    shards: dict[str, str]  # a sharded checkpoint's rank -> the file of its shard
    files: dict[str, Any]  # every file's size and sha256, as written (checkpoint.verify checks each entry)


_MANIFEST_TYPES: dict[str, type | tuple[type, ...]] = {
    "step": int, "epoch": int, "config_hash": str, "world_size": int, "runner_version": str, "mid_epoch": bool,
    "epoch_batches": int, "accumulate": int, "format": str, "files": dict, "position": str}


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


class GitState(TypedDict, total=False):
    """The run manifest's ``git``: the checkout the config was submitted from (``runner.host.provenance``). Every
    field is None outside git. The diff itself is never here (it may hold a token): a private file beside it."""

    commit: str | None
    dirty: bool | None  # uncommitted changes to tracked files
    diff_files: list[str] | None  # the files those changes touch
    diff_sha256: str | None  # of the diff (``git diff HEAD``); None when clean


class DataModule(TypedDict, total=False):
    """The run manifest's ``data_module`` (``runner.host.submit.data_module``): whether runner's ``dataloader``
    settings reach the data module."""

    target: str | None  # its ``_target_``; None in program mode (the program builds its own)
    takes_dataloader: bool | None  # it takes runner's ``dataloader`` argument; None: not known (or program mode)
    global_batch: int | str | None  # the global batch, or in words who decides it ("the data module's own")


class SweepMark(TypedDict):
    """The run manifest's ``sweep``: the sweep a run is one point of (``runner sweep``, ``runner.host.sweep``)."""

    id: str  # the sweep's id, its folder under RUN_ROOT/sweeps/
    index: int  # the point's place in the sweep, from 0 (a Slurm array's task id)
    size: int  # the sweep's number of points
    point: dict[str, str]  # the point's values: key.path -> value as written on the command line


class RunManifest(TypedDict, total=False):
    """The run's ``manifest.json``: what the run is, fixed when it was submitted. Writers: ``runner submit``
    (``runner.host.submit.make``, redacted; a resize rewrites ``world_size`` and ``accumulate_grad_batches``) and
    the ``runner parallel`` driver (``kind: parallel``, rewritten at each start). Readers: every rank's launcher (the
    config hash, the image it must run in, the program's working directory), ``runner status``, ``report``, ``cron``,
    ``resume``, ``build --from-run`` and the exit hook. Any field may be missing from an older or hand-made one."""

    runner_version: str  # the runner that wrote it (submit, parallel)
    kind: str  # "parallel": a `runner parallel` run (parallel); missing: a training run (submit)
    config_hash: str  # of what determines the trajectory (spec.Config.hash): checkpoints of another are not resumed
    config_file: str  # the config as given, resolved (submit, parallel): a _target_ module beside it is importable
    overrides: list[str]  # the command line's key=value overrides (submit)
    scheduler: str  # "slurm" or "local" (submit; parallel: "local"), read through runner.host.scheduler.of_manifest
    image: str  # the image the ranks run in, "none" without one (submit)
    runtime: str  # container.runtime: "none", "podman", "apptainer" ... (submit)
    spec_hash: str | None  # the image's spec (runner.image.SPEC); None without a container image (submit)
    world_size: int  # ranks (submit; a resize rewrites it)
    global_batch: int | None  # samples per optimizer step; None when the program or the data module decides (submit)
    accumulate_grad_batches: int | None  # None in program mode (submit; a resize rewrites it)
    git: GitState  # the submitting checkout (submit)
    created: float  # when it was submitted (submit; parallel: the run's first start)
    host: str  # where it was submitted from (submit, parallel)
    data_module: DataModule  # submit
    cwd: str  # where `runner submit` ran: a program (command:) runs there (submit)
    env: str  # parallel.env: "local", "local_gpu" or "slurm" (parallel)
    items: int  # the work items of a parallel run (parallel)
    sweep: SweepMark  # the sweep this run is a point of (submit, for `runner sweep`); missing: a run of its own
    stage: str  # the recipe stage(s) a program's command runs (``--stages train``: "train"); missing: none named


_RUN_TYPES: dict[str, tuple[type, ...]] = {
    "runner_version": (str,), "kind": (str,), "config_hash": (str,), "config_file": (str,), "scheduler": (str,),
    "image": (str,), "runtime": (str,), "spec_hash": (str, NoneType), "world_size": (int,),
    "global_batch": (int, NoneType), "accumulate_grad_batches": (int, NoneType), "host": (str,), "cwd": (str,),
    "env": (str,), "items": (int,), "stage": (str,)}
_GIT_TYPES: dict[str, tuple[type, ...]] = {
    "commit": (str, NoneType), "dirty": (bool, NoneType), "diff_sha256": (str, NoneType)}
_DATA_MODULE_TYPES: dict[str, tuple[type, ...]] = {
    "target": (str, NoneType), "takes_dataloader": (bool, NoneType), "global_batch": (int, str, NoneType)}


def _fields(raw: dict[Any, Any], types: dict[str, tuple[type, ...]]) -> dict[str, Any]:
    """The fields of ``raw`` that ``types`` names and whose value is of one of its types (a bool is no int)."""
    return {k: v for k, v in raw.items() if k in types and isinstance(v, types[k])
            and (bool in types[k] or not isinstance(v, bool))}


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def run_manifest(raw: Any) -> RunManifest:
    """A run's manifest as read, as a ``RunManifest``: a field of the wrong type is dropped, and so is a field it does
    not name; ``git`` and ``data_module`` keep their fields of the right type; {} for anything but an object."""
    if not isinstance(raw, dict):
        return {}
    got = _fields(raw, _RUN_TYPES)
    if is_number(raw.get("created")):
        got["created"] = float(raw["created"])
    if _strings(raw.get("overrides")):
        got["overrides"] = list(raw["overrides"])
    if isinstance(git := raw.get("git"), dict):
        got["git"] = _fields(git, _GIT_TYPES)
        if "diff_files" in git and (git["diff_files"] is None or _strings(git["diff_files"])):
            got["git"]["diff_files"] = git["diff_files"]
    if isinstance(data := raw.get("data_module"), dict):
        got["data_module"] = _fields(data, _DATA_MODULE_TYPES)
    if (mark := sweep_mark(raw.get("sweep"))) is not None:
        got["sweep"] = mark
    return cast(RunManifest, got)


def sweep_mark(raw: Any) -> SweepMark | None:
    """A manifest's ``sweep`` as read: the whole mark when every field has its type, else None (a run of its own)."""
    if not isinstance(raw, dict):
        return None
    point = raw.get("point")
    if not (isinstance(raw.get("id"), str) and _whole(raw.get("index")) and _whole(raw.get("size"))
            and isinstance(point, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in point.items())):
        return None
    return {"id": raw["id"], "index": raw["index"], "size": raw["size"], "point": dict(point)}


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _time(value: Any) -> float:
    return float(value) if is_number(value) else 0.0
