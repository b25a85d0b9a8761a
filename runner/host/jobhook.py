"""Host-side hooks the batch script calls: ``start`` when the job starts, ``exit`` when the step has ended.

They run with the login node's runner on the first node of the allocation, never in the container
(``scontrol`` is usually missing there). ``exit`` gathers the facts (the launcher's exit code, the run's
records, the job's time left), asks ``runner.policy`` what they mean and what to do, then records, alerts and
requeues the job. The requeue is the last thing it does, because Slurm ends the batch script (and this hook)
as soon as the requeue is accepted. Its output lands in Slurm's batch log, so log records carry timestamps.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from runner import log as runner_log
from runner import policy, proc
from runner.host.status import records
from runner.rundir import EXIT_REQUEUE, RunDir, atomic_write, read_json
from runner.spec.typed import RunConfig, read_resolved

ALERT_BUDGET_S = 15.0  # the job may be seconds from its time limit: queue what cannot be sent quickly
log = logging.getLogger(__name__)


def parse_time_left(text: str) -> float | None:
    """squeue's ``%L`` (``[D-]HH:MM:SS``, ``MM:SS``) in seconds; None for UNLIMITED and the like."""
    text = text.strip()
    if not text or text in ("UNLIMITED", "NOT_SET", "INVALID"):
        return None
    days, _, clock = text.rpartition("-")
    try:
        parts = [int(p) for p in clock.split(":")]
        whole_days = int(days or 0)
    except ValueError:
        return None
    while len(parts) < 3:
        parts.insert(0, 0)
    return (whole_days * 24 + parts[0]) * 3600 + parts[1] * 60 + parts[2]


def _seconds_left(job: str) -> float | None:
    out = proc.run(["squeue", "-h", "-j", job, "-o", "%L"], timeout=10, check=False)
    return parse_time_left(out.stdout) if out.returncode == 0 else None


def _cause(run: RunDir, rc: int, event: str) -> str | None:
    if event in ("completed", "cancelled"):
        return None
    if event == "preflight_failed":
        return str((read_json(run.preflight, {}) or {}).get("summary") or "preflight failed; see preflight.txt")
    from runner import alerts

    return alerts.alert_from_run(run.root, event, exit_code=rc).cause


def _alert(run: RunDir, cfg: RunConfig, event: str, **fields: Any) -> None:
    from runner import alerts

    alerts.notify(run.root, cfg["alerts"], event, budget_s=ALERT_BUDGET_S, **fields)


def launcher_code(run: RunDir, rc: int, job: str | None) -> int:
    """The exit code the ranks agreed on, if rank 0 recorded one for this attempt; else srun's."""
    last = read_json(run.last_exit, {}) or {}
    same = last.get("job_id") == job and str(last.get("restart_count")) == os.environ.get("SLURM_RESTART_COUNT", "0")
    return int(last["code"]) if same and "code" in last else rc


def on_exit(run: RunDir, rc: int, signal_name: str) -> int:
    cfg = read_resolved(run.config)
    limits = policy.Limits.of(cfg)
    job = os.environ.get("SLURM_JOB_ID")
    rc = launcher_code(run, rc, job)
    rec = records(run)
    attempt = policy.attempt(rec.events)
    left = _seconds_left(job) if job and rc == EXIT_REQUEUE else None  # tells a time limit from a preemption
    event = policy.classify(rec, rc, left, limits)
    status = {"exit_code": rc, "job_id": job, "attempt": attempt, "signal": signal_name, "event": event,
              "time": time.time()}
    atomic_write(run.exit_status, json.dumps(status) + "\n")
    run.record("exit", job_id=job, exit_code=rc, signal=signal_name, outcome=event, attempt=attempt,
               cause=_cause(run, rc, event))
    nodes = os.environ.get("SLURM_JOB_NODELIST", "")
    common = {"job_id": job or "", "attempt": attempt, "nodes": nodes, "exit_code": rc}
    decision = policy.after_exit(event, attempt, job, limits)
    log.info("exit %s: %s: %s", rc, decision.action, decision.reason)
    if event == "completed":
        _alert(run, cfg, "completed", **common)
    elif event in ("timeout", "preempted"):
        _alert(run, cfg, event, **common)
    elif event != "cancelled":
        # failed: `runner cron` decides about resubmission (with backoff), the alert says so. preflight_failed:
        # a person must look (a bad node or interface would fail again), so cron leaves it alone.
        _alert(run, cfg, event, **common, cause=_cause(run, rc, event))
    if decision.action == "requeue" and job:
        run.record("requeued", job_id=job, reason=event, attempt=attempt + 1)
        _alert(run, cfg, "requeued", **common, next_step=f"requeued as attempt {attempt + 1}; it resumes from "
               "the newest complete checkpoint")
        out = proc.run(["scontrol", "requeue", job], timeout=30, check=False)
        if out.returncode != 0:  # Slurm refused; an accepted requeue ends the job, and this hook with it
            log.warning("scontrol requeue %s: %s; runner cron will resubmit the run", job, proc.last_line(out))
    elif decision.action == "give_up":
        run.record("gave_up", job_id=job, reason=decision.reason)
        _alert(run, cfg, "gave_up", **common)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.host.jobhook")
    parser.add_argument("what", choices=("start", "exit"))
    parser.add_argument("--rc", type=int, default=0)
    parser.add_argument("--signal", default="none")
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    runner_log.setup(stamped=True)
    run = RunDir(args.run_dir)
    if args.what == "start":
        run.record("start", job_id=os.environ.get("SLURM_JOB_ID"), nodes=os.environ.get("SLURM_JOB_NODELIST"),
                   restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0")))
        return 0
    return on_exit(run, args.rc, args.signal)


if __name__ == "__main__":
    raise SystemExit(main())
