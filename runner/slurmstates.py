"""Slurm's vocabulary: its job states, as squeue, sacct and scontrol spell them, and what runner calls them.

The decisions (``runner.policy``) and the host's parsers of Slurm's commands (``runner.host.slurm``) share these
words; nothing here decides anything. Standard library only.
"""

from __future__ import annotations

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
