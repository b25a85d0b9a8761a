"""Alerts about a job that goes on running: a straggler its watchdog recorded in the ledger.

The job only writes its ledger (rank 0's watchdog records a rank once per attempt, after two slow reports in a
row); the alert is made and queued on the host, as every other alert, by whichever of the two host-side callers
comes first: ``runner cron`` (every minute, while the job runs) or the batch script's exit hook (when the attempt
ends). Both then send the queue. Which records still need their alert is ``runner.policy.straggler_alerts``; a
lock keeps the two from queueing one twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runner import alerts, policy, stragglers
from runner.alerts import nextstep
from runner.rundir import RunDir, locked
from runner.spec.typed import RunConfig


def straggler_alert(run: RunDir, event: Mapping[str, Any], job_id: str | None) -> alerts.Alert:
    """The alert of one ``straggler`` record: rank, node and how much slower than the median, in the cause."""
    forward = event.get("slow") != "data"
    x = event.get("compute_x") if forward else event.get("data_x")
    return alerts.Alert(event="straggler", run=run.name, run_dir=str(run.root), job_id=job_id or "",
                        attempt=int(event.get("attempt") or 1), nodes=str(event.get("node", "")),
                        cause=stragglers.describe(event), next_step=nextstep.next_step("straggler"),
                        extra={"rank": str(event.get("rank")), "node": str(event.get("node")),
                               "slower than the median": f"{x}x in {'forward' if forward else 'data wait'}"})


def queue_stragglers(run: RunDir, cfg: RunConfig, job_id: str | None) -> int:
    """Queue the alert of every straggler record that has none yet, and record ``straggler_alert`` for each (also
    when alerts are off: it was decided). Returns how many alerts were queued; never raises."""
    try:
        with locked(run.alerts / ".stragglers.lock"):  # a ledger read, a few small writes
            due = policy.straggler_alerts(run.events())
            if not due:
                return 0
            queued = alerts.enqueue(run.root, cfg["alerts"], [straggler_alert(run, e, job_id) for e in due])
            for e in due:
                run.record("straggler_alert", rank=e.get("rank"), attempt=e.get("attempt"), queued=queued > 0)
            return queued
    except OSError:  # a flaky shared filesystem: cron tries again next minute
        return 0
