"""Slurm's vocabulary: its job states, as squeue, sacct and scontrol spell them, and what runner calls them.

The decisions (``runner.policy``) and the host's parsers of Slurm's commands (``runner.host.slurm``) share these
words; nothing here decides anything. Standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

# Slurm's job states (squeue/scontrol spelling) -> runner's states.
SLURM_STATES = {
    "PENDING": "pending", "CONFIGURING": "running", "RUNNING": "running", "COMPLETING": "running",
    "STAGE_OUT": "running", "SIGNALING": "running", "RESIZING": "running", "SUSPENDED": "running",
    "STOPPED": "running", "RESV_DEL_HOLD": "pending", "REQUEUED": "pending", "REQUEUE_HOLD": "pending",
    "REQUEUE_FED": "pending", "SPECIAL_EXIT": "pending", "REVOKED": "cancelled",
    "COMPLETED": "completed", "FAILED": "failed", "NODE_FAIL": "failed", "OUT_OF_MEMORY": "failed",
    "BOOT_FAIL": "failed", "CANCELLED": "cancelled", "TIMEOUT": "timeout", "DEADLINE": "timeout",
    "PREEMPTED": "preempted",
}
TERMINAL = frozenset({"COMPLETED", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "CANCELLED", "TIMEOUT",
                      "DEADLINE", "PREEMPTED", "REVOKED"})
# Ended states after which cron resubmits (CANCELLED only when the hook saw a time limit or preemption).
RESUBMIT_STATES = ("FAILED", "NODE_FAIL", "TIMEOUT", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
SLURM_REQUEUES = ("NODE_FAIL", "BOOT_FAIL")  # with --requeue, Slurm puts these back in the queue by itself


def job_id(env: Mapping[str, str]) -> str | None:
    """The id a run records for the job this process belongs to (the run's ``job_id``, the ledger's, the alerts'):
    ``SLURM_JOB_ID``, or for a task of a job array ``ARRAYJOB_TASK``, which squeue and sacct print and which scancel,
    ``scontrol requeue`` and ``--dependency`` accept. (A task's own ``SLURM_JOB_ID`` is a number Slurm gives it
    only once it leaves the queue; its array's id is known from sbatch on, so its submitter records the same id.)
    None outside a Slurm job."""
    array, task = env.get("SLURM_ARRAY_JOB_ID", ""), env.get("SLURM_ARRAY_TASK_ID", "")
    if array.isdigit() and task.isdigit():
        return f"{array}_{task}"
    return env.get("SLURM_JOB_ID") or None


def task_id(array_job: str, task: int) -> str:
    """The id of task ``task`` of the job array ``array_job`` (see ``job_id``)."""
    return f"{array_job}_{task}"


def submitted_at(job: str) -> int | None:
    """Where a job stands in submission order: its number, or its array's for an array task (``12_3``: 12; the task's
    own number comes later, when it starts). None for anything else."""
    head = job.split("_", 1)[0]
    return int(head) if head.isdigit() else None


_ARRAY = re.compile(r"(\d+)_\[([0-9,\-]+)(?:%\d+)?\]")


def job_ids(field: str) -> list[str]:
    """The jobs one row of squeue or sacct stands for: ``12`` and ``12_3`` themselves; an array's tasks still in the
    queue as one row, ``12_[3-5,7%2]``, each (``12_3``, ``12_4``, ...). A task list Slurm cut short
    (``SLURM_BITSTR_LEN``: ``12_[3,5,7,9...``) stands for none: the tasks are asked about again by their own ids."""
    field = field.strip()
    if m := _ARRAY.fullmatch(field):
        tasks: list[str] = []
        for part in m.group(2).split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                return []
            tasks += [task_id(m.group(1), t) for t in range(int(lo), int(hi or lo) + 1)]
        return tasks
    head, _, task = field.partition("_")
    return [field] if head.isdigit() and (not task or task.isdigit()) else []


def base_state(raw: str) -> str:
    """'CANCELLED by 0' -> 'CANCELLED'; 'COMPLETING+' -> 'COMPLETING' (sacct's and scontrol's decorations)."""
    words = raw.strip().split()
    return words[0].rstrip("+").upper() if words else ""


def normalize(raw: str) -> str | None:
    """Map a Slurm state ('CANCELLED by 0', 'RUNNING') to runner's states; None for an unknown word."""
    return SLURM_STATES.get(base_state(raw))


def exit_code(value: str | None) -> int | None:
    """Slurm's "75:0" (exit code : signal) -> 75."""
    head = (value or "").split(":")[0]
    return int(head) if head.isdigit() else None


@dataclass(frozen=True)
class JobInfo:
    """One job as a Slurm command reported it (``runner.host.slurm`` parses the commands into it)."""

    job_id: str
    state: str  # Slurm's own word: RUNNING, COMPLETED, CANCELLED, ...
    source: str  # sacct, squeue or scontrol
    exit_code: str | None = None  # "3:0" = exit code 3, signal 0
    reason: str | None = None
    nodes: str | None = None
    restarts: int | None = None

    @property
    def runner_state(self) -> str | None:
        return normalize(self.state)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL
