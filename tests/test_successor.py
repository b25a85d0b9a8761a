"""resume.successor on the real local Slurm cluster: the next attempt waits in the queue behind the job
(``--dependency=afternotok``) and takes the run over as soon as the job ends, without ``scontrol requeue``.

What must hold: the successor trains from the checkpoint to the same final weights as an undisturbed run, one job
trains at a time (the successor takes over only after the first job's exit), nothing is requeued, the successor
queued behind the job that finished is cancelled, and ``runner cancel`` cancels the queued successor too.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from runner.dev import devcluster
from runner.host import slurm
from tests.test_failures import (
    assert_recovered,
    checkpoint_done,
    env_for,
    events,
    hook,
    job_id,
    reference,
    runner,
    status,
    submit,
    wait_for,
)

pytestmark = pytest.mark.slurm
__all__ = ["hook", "reference"]  # fixtures shared with test_failures

SUCCESSOR = ["resume.successor=true"]


def queued_behind(run: Path, job: str) -> str:
    [e] = [e for e in events(run) if e["event"] == "successor_queued" and e["after"] == job]
    return str(e["job_id"])


def slurm_state(job: str) -> str | None:
    info = slurm.query(job)
    return info.state if info else None


def test_a_preempted_job_hands_over_to_its_successor(slurm_cluster: devcluster.Cluster, hook: Any,
                                                     reference: list[Any], tmp_path: Path) -> None:
    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path, *SUCCESSOR)
    first = job_id(run)
    heir = queued_behind(run, first)
    pending = subprocess.run(["squeue", "-h", "-j", heir, "-o", "%T %r"], env=env, capture_output=True, text=True,
                             timeout=30).stdout.split()
    assert pending == ["PENDING", "Dependency"], pending
    wait_for("checkpoint 20", lambda: checkpoint_done(run, 20), 120, run)
    subprocess.run(["scancel", "--batch", "--signal=USR2", first], env=env, check=True, timeout=30)
    wait_for("the successor to finish the run", lambda: (run / "finished").exists(), 180, run)
    ledger = events(run)
    names = [e["event"] for e in ledger]
    assert "requeued" not in names and "superseded" not in names and "resubmitted" not in names, names
    [handed] = [e for e in ledger if e["event"] == "handed_over"]
    [took] = [e for e in ledger if e["event"] == "took_over"]
    assert (handed["job_id"], handed["successor"], handed["reason"]) == (first, heir, "preempted")
    assert (took["job_id"], took["after"]) == (heir, first) and job_id(run) == heir
    first_exit = next(e for e in ledger if e["event"] == "exit" and e["job_id"] == first)
    starts = [e for e in ledger if e["event"] == "start"]
    assert [s["job_id"] for s in starts] == [first, heir]
    assert first_exit["time"] < took["time"] < starts[1]["time"]  # one trainer at a time: the first had exited
    assert first_exit["outcome"] == "preempted" and first_exit["exit_code"] == 75
    show = slurm.parse_scontrol_pairs(subprocess.run(["scontrol", "show", "job", first], env=env,
                                                     capture_output=True, text=True, timeout=30).stdout)
    assert show["Restarts"] == "0" and show["JobState"] == "FAILED"  # ended, never requeued
    ranks = [json.loads(p.read_text())["slurm"]["SLURM_JOB_ID"] for p in sorted((run / "ranks").glob("rank-*"))]
    assert set(ranks) == {heir}  # the last attempt's ranks all ran in the successor
    # The successor queued its own successor when it took over; the finished run's exit hook cancelled it.
    third = queued_behind(run, heir)
    wait_for("the successor's exit hook", lambda: any(e["event"] == "exit" and e["job_id"] == heir
                                                      for e in events(run)), 60, run)
    wait_for("the finished run's successor to be cancelled", lambda: slurm_state(third) == "CANCELLED", 30, run)
    assert [e["job_id"] for e in events(run) if e["event"] == "successor_cancelled"] == [third]
    assert not (run / "successor.json").exists()
    assert_recovered(run, reference, hook, ["preempted", "completed"])
    row = status(env, run)
    assert row["state"] == "completed" and row["restarts"] == 1 and row["job_id"] == heir


def test_cancel_cancels_the_queued_successor_too(slurm_cluster: devcluster.Cluster, hook: Any,
                                                 tmp_path: Path) -> None:
    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path, *SUCCESSOR, "trainer.max_steps=400")
    first = job_id(run)
    heir = queued_behind(run, first)
    wait_for("training", lambda: any(e["event"] == "train_start" for e in events(run)), 120, run)
    runner(env, "cancel", str(run))
    for job in (heir, first):
        wait_for(f"job {job} to be cancelled", lambda j=job: slurm_state(j) == "CANCELLED", 60, run)  # type: ignore
    runner(env, "cron", "--root", str(tmp_path))
    names = [e["event"] for e in events(run)]
    assert "took_over" not in names and "resubmitted" not in names and "requeued" not in names, names
    assert status(env, run)["state"] == "cancelled"


def test_a_successor_waits_for_its_job_and_its_backoff(slurm_cluster: devcluster.Cluster, tmp_path: Path) -> None:
    """The sbatch options and the backoff as Slurm takes them: pending on its dependency, no earlier than the
    backoff once eligible, cancelled by Slurm itself when the job it follows COMPLETED."""
    env = {**slurm_cluster.env()}
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --output=/dev/null\nsleep \"${1:-3}\"\n")
    first = slurm.submit(str(script), env={**env, "PATH": "/usr/bin:/bin"})
    heir = slurm.submit(str(script), env={**env, "PATH": "/usr/bin:/bin"}, after=first)
    assert slurm.delay_start(heir, 120) is None
    show = slurm.parse_scontrol_pairs(subprocess.run(["scontrol", "show", "job", heir], capture_output=True,
                                                     text=True, timeout=30).stdout)
    assert show["JobState"] == "PENDING" and show["Dependency"].startswith(f"afternotok:{first}")
    begin = [time.mktime(time.strptime(show[k], "%Y-%m-%dT%H:%M:%S")) for k in ("StartTime", "EligibleTime")
             if show.get(k, "Unknown")[:1].isdigit()]
    assert begin and max(begin) > time.time() + 100, show  # the begin time Slurm holds it to
    wait_for("the first job to complete", lambda: slurm_state(first) == "COMPLETED", 60)
    wait_for("Slurm to cancel the successor of a completed job", lambda: slurm_state(heir) == "CANCELLED", 30)
