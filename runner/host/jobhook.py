"""Host-side hooks the batch script calls: ``start`` when the job starts, ``exit`` when the step has ended.

They run with the login node's runner on the first node of the allocation, never in the container
(``scontrol`` is usually missing there). ``exit`` decides what the launcher's exit code means: record it,
alert, and requeue the job while restarts remain. The requeue is the last thing it does, because Slurm ends
the batch script (and this hook) as soon as the requeue is accepted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from runner.rundir import EXIT_PREFLIGHT, EXIT_REQUEUE, RunDir, atomic_write, read_json

ALERT_BUDGET_S = 15.0  # the job may be seconds from its time limit: queue what cannot be sent quickly


def restarts_used(run: RunDir) -> int:
    """Requeues and resubmissions so far, from the run's own ledger (survives Slurm forgetting the job)."""
    events = run.events()
    ours = sum(1 for e in events if e["event"] in ("requeued", "resubmitted"))
    # Slurm may requeue a job on its own (after a node failure): every attempt's batch script records a start.
    return max(ours, sum(1 for e in events if e["event"] == "start") - 1)


def _seconds_left(job: str) -> float | None:
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = out.stdout.strip()
    if out.returncode != 0 or not text or text in ("UNLIMITED", "NOT_SET", "INVALID"):
        return None
    days, _, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return (int(days or 0) * 24 + parts[0]) * 3600 + parts[1] * 60 + parts[2]


def classify(run: RunDir, rc: int, cfg: dict[str, Any], job: str | None) -> str:
    """What the step's end means: completed, cancelled, timeout, preempted, preflight_failed or failed."""
    if run.finished.exists():
        return "completed"
    if run.cancelled_now():
        return "cancelled"
    if rc == EXIT_PREFLIGHT:
        return "preflight_failed"
    if rc == EXIT_REQUEUE:
        left = _seconds_left(job) if job else None
        near_limit = left is not None and left <= cfg["slurm"]["signal_lead_s"] + 60
        return "timeout" if near_limit else "preempted"
    return "failed"


def _cause(run: RunDir, rc: int, event: str) -> str | None:
    if event in ("completed", "cancelled"):
        return None
    if event == "preflight_failed":
        return str((read_json(run.preflight, {}) or {}).get("summary") or "preflight failed; see preflight.txt")
    from runner import alerts

    return alerts.alert_from_run(run.root, event, exit_code=rc).cause


def _alert(run: RunDir, cfg: dict[str, Any], event: str, **fields: Any) -> None:
    from runner import alerts

    alerts.notify(run.root, cfg["alerts"], event, budget_s=ALERT_BUDGET_S, **fields)


def launcher_code(run: RunDir, rc: int, job: str | None) -> int:
    """The exit code the ranks agreed on, if rank 0 recorded one for this attempt; else srun's."""
    last = read_json(run.last_exit, {}) or {}
    same = last.get("job_id") == job and str(last.get("restart_count")) == os.environ.get("SLURM_RESTART_COUNT", "0")
    return int(last["code"]) if same and "code" in last else rc


def on_exit(run: RunDir, rc: int, signal_name: str) -> int:
    cfg = yaml.safe_load(run.config.read_text())
    job = os.environ.get("SLURM_JOB_ID")
    rc = launcher_code(run, rc, job)
    attempt = restarts_used(run) + 1
    event = classify(run, rc, cfg, job)
    status = {"exit_code": rc, "job_id": job, "attempt": attempt, "signal": signal_name, "event": event,
              "time": time.time()}
    atomic_write(run.exit_status, json.dumps(status) + "\n")
    run.record("exit", job_id=job, exit_code=rc, signal=signal_name, outcome=event, attempt=attempt,
               cause=_cause(run, rc, event))
    nodes = os.environ.get("SLURM_JOB_NODELIST", "")
    common = {"job_id": job or "", "attempt": attempt, "nodes": nodes, "exit_code": rc}
    if event in ("completed", "cancelled"):
        if event == "completed":
            _alert(run, cfg, "completed", **common)
        return 0
    if event in ("timeout", "preempted"):
        _alert(run, cfg, event, **common)
        if cfg["slurm"]["requeue"] and job and attempt <= cfg["resume"]["max_restarts"]:
            run.record("requeued", job_id=job, reason=event, attempt=attempt + 1)
            _alert(run, cfg, "requeued", **common, next_step=f"requeued as attempt {attempt + 1}; it resumes from "
                   "the newest complete checkpoint")
            subprocess.run(["scontrol", "requeue", job], capture_output=True, timeout=30)
        elif attempt > cfg["resume"]["max_restarts"]:
            run.record("gave_up", job_id=job, reason=f"{event} after {attempt - 1} restarts")
            _alert(run, cfg, "gave_up", **common)
        return 0
    # failed: `runner cron` decides about resubmission (with backoff), the alert says so. preflight_failed: a
    # person must look (a bad node or interface would fail again), so cron leaves it alone.
    _alert(run, cfg, event, **common, cause=_cause(run, rc, event))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.host.jobhook")
    parser.add_argument("what", choices=("start", "exit"))
    parser.add_argument("--rc", type=int, default=0)
    parser.add_argument("--signal", default="none")
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    run = RunDir(args.run_dir)
    if args.what == "start":
        run.record("start", job_id=os.environ.get("SLURM_JOB_ID"), nodes=os.environ.get("SLURM_JOB_NODELIST"),
                   restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0")))
        return 0
    return on_exit(run, args.rc, args.signal)


if __name__ == "__main__":
    raise SystemExit(main())
