"""Alerts sent in the background: the exit hook queues them and returns; a detached process sends them.

The exit hook runs seconds before Slurm ends the job, and a requeue must not wait behind a slow webhook, so it
never sends itself: it writes the alerts to the run's queue (``delivery.enqueue``) and starts this module
(``send_later``) with a time budget. Whatever is not delivered stays queued for ``runner cron``.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

from runner import log as runner_log
from runner.alerts.delivery import MAX_TOTAL_S, flush_queue
from runner.spec.typed import read_resolved

log = logging.getLogger(__name__)


def send_later(run_dir: str | os.PathLike[str], budget_s: float) -> None:
    """Send the run's queued alerts from a detached process that gives up after ``budget_s`` seconds.

    The caller returns at once. What the process cannot send in time (or, on a cluster that kills a job's
    processes when it ends, before it is killed) stays queued for ``runner cron``. Never raises.
    """
    argv = [sys.executable, "-m", "runner.alerts.background", os.fspath(run_dir), "--budget", f"{budget_s:g}"]
    try:  # Popen, not proc.run: it outlives its caller by design
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        log.warning("cannot start the alert sender: %s; the alerts stay queued for runner cron", exc.strerror)


def _main(argv: list[str] | None = None) -> int:
    """``python -m runner.alerts.background RUN_DIR --budget S``: the detached sender of ``send_later``."""
    parser = argparse.ArgumentParser(prog="python -m runner.alerts.background")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--budget", type=float, default=MAX_TOTAL_S)
    args = parser.parse_args(argv)
    runner_log.setup(stamped=True)
    flush_queue(args.run_dir, read_resolved(args.run_dir / "config.yaml")["alerts"], budget_s=args.budget)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
