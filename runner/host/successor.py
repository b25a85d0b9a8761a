"""``resume.successor``: the next attempt waits in the queue behind the run's job and starts when that job ends.

Host side: ``runner submit``, ``resume`` and ``cron`` on the login node, the batch script's hooks on the first node
of a job. A successor is the run's job script again, submitted with ``--dependency=afternotok:JOB`` (``queue``):
Slurm starts it as soon as JOB ends in a failed state (exit 75 after a preemption notice, a crash, a hang, a time
limit, a lost node), without ``scontrol requeue`` and its requeue delay. Each job's successor is queued by one
party only: a job runner submits gets its successor right after sbatch, and a successor queues the next one when
it takes the run over (``runner.host.jobhook``'s ``claim``), so two are never queued behind one job.
``successor.json`` names the queued one and the job it follows. ``cancel`` removes it: the exit hook for every
end that is not a hand-over (``runner.policy.after_exit``), ``runner cancel``, and a resubmission (the new job
brings its own).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from runner import ledger
from runner.errors import SubmitError
from runner.host import nodes, slurm
from runner.rundir import RunDir, atomic_write, read_json
from runner.spec.typed import RunConfig

log = logging.getLogger(__name__)


def queued(run: RunDir) -> dict[str, Any] | None:
    """``successor.json``: {"job_id", "after"}, or None."""
    found = read_json(run.successor)
    return found if isinstance(found, dict) and isinstance(found.get("job_id"), str) else None


def following(run: RunDir, job: str | None) -> str | None:
    """The successor queued behind ``job``, if any (one queued behind an earlier job is not ``job``'s)."""
    found = queued(run)
    return found["job_id"] if found is not None and job and found.get("after") == job else None


def queue(run: RunDir, cfg: RunConfig, after: str) -> str | None:
    """With ``resume.successor``, queue the successor of job ``after``; its id, or None (off, or sbatch refused:
    then the run recovers as without one, by requeue or ``runner cron``)."""
    if not cfg["resume"]["successor"]:
        return None
    try:
        job, _ = nodes.submit(str(run.script), run.root.parent, cfg["resume"]["exclude_nodes_s"], after=after,
                              needed=cfg["num_nodes"], partition=cfg["slurm"]["partition"])
    except SubmitError as e:
        log.warning("no successor queued behind job %s: %s; it is requeued or resubmitted instead", after, e)
        run.record("successor_failed", after=after, error=str(e))
        return None
    atomic_write(run.successor, json.dumps({"job_id": job, "after": after, "time": time.time()}) + "\n")
    run.record("successor_queued", job_id=job, after=after)
    return job


def cancel(run: RunDir, job: str, reason: str) -> None:
    """scancel a successor so that it never trains; ``successor.json`` is removed if it still names that job."""
    complaint = slurm.cancel(job)
    if (queued(run) or {}).get("job_id") == job:
        run.successor.unlink(missing_ok=True)
    fields: ledger.SuccessorCancelled = {"job_id": job, "reason": reason}
    if complaint:
        fields["error"] = complaint
    run.record("successor_cancelled", **fields)
    log.info("successor job %s cancelled (%s)%s", job, reason, f": {complaint}" if complaint else "")
