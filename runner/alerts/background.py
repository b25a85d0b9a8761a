"""Alerts sent in the background: the exit hook queues them and returns; a detached process sends them.

The exit hook runs seconds before Slurm ends the job, and a requeue must not wait behind a slow webhook, so it
never sends itself: after the requeue and the records, it writes the alerts to the run's queue
(``delivery.enqueue``), starts this module (``send_later``) with a time budget and waits for it at most that
long. An entry leaves the queue only once delivered: whatever is not (a dead webhook, a process killed with
the job) stays queued for the next sender or ``runner cron``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from runner import log as runner_log
from runner.alerts.delivery import MAX_TOTAL_S, flush_queue
from runner.rundir import RunDir
from runner.spec.typed import read_resolved

log = logging.getLogger(__name__)


def send_later(run_dir: str | os.PathLike[str], budget_s: float) -> subprocess.Popen[bytes] | None:
    """Start a detached process that sends the run's queued alerts and gives up after ``budget_s`` seconds.

    Returns at once with the process (None if it could not start). It ignores SIGTERM (Slurm's requeue or end of
    a job), but a cluster kills a job's leftover processes when its batch script ends, so a caller in a job
    waits for it (up to the budget) before it ends. Whatever is not delivered stays queued for ``runner cron``.
    Never raises.
    """
    argv = [sys.executable, "-m", "runner.alerts.background", os.fspath(run_dir), "--budget", f"{budget_s:g}"]
    try:  # Popen, not proc.run: it runs beside its caller, in its own session
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        log.warning("cannot start the alert sender: %s; the alerts stay queued for runner cron", exc.strerror)
        return None


def _main(argv: list[str] | None = None) -> int:
    """``python -m runner.alerts.background RUN_DIR --budget S``: the detached sender of ``send_later``."""
    parser = argparse.ArgumentParser(prog="python -m runner.alerts.background")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--budget", type=float, default=MAX_TOTAL_S)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a requeue's SIGTERM; SIGKILL (after KillWait) still ends it
    runner_log.setup(stamped=True)
    flush_queue(args.run_dir, read_resolved(RunDir(args.run_dir).config)["alerts"], budget_s=args.budget)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
