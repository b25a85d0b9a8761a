"""Talking to Slurm: job state from sacct (accounting) or squeue/scontrol (fallbacks), and scancel."""

from __future__ import annotations

import subprocess

from runner import proc

_STATE_MAP = {"PENDING": "pending", "CONFIGURING": "running", "RUNNING": "running", "COMPLETING": "running",
              "COMPLETED": "completed", "FAILED": "failed", "NODE_FAIL": "failed", "OUT_OF_MEMORY": "failed",
              "BOOT_FAIL": "failed", "CANCELLED": "cancelled", "TIMEOUT": "timeout", "PREEMPTED": "preempted",
              "REQUEUED": "pending", "REQUEUE_HOLD": "pending", "REQUEUE_FED": "pending", "DEADLINE": "timeout",
              "SUSPENDED": "running"}


def normalize(raw: str) -> str | None:
    """Map a Slurm state ('CANCELLED by 0', 'RUNNING') to runner's states."""
    word = raw.strip().split(" ")[0].rstrip("+") if raw.strip() else ""
    return _STATE_MAP.get(word)


def job_state(job_id: str) -> str | None:
    """The job's state, or None when Slurm does not know it (any more)."""
    for argv in (["sacct", "-X", "-n", "-P", "-j", job_id, "--format=JobID,State,ExitCode"],
                 ["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"]):
        try:
            out = proc.run(argv, timeout=15)
        except Exception:
            continue
        for line in out.splitlines():
            fields = line.split("|")
            state = normalize(fields[1] if len(fields) > 1 else fields[0])
            if state:
                return state
    return None


def cancel(job_id: str) -> None:
    subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
