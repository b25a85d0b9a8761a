"""``runner cron``: run every minute from crontab; resumes every run that died, from its last checkpoint.

Safe to run often: one instance at a time per run root (a non-blocking lock; a second one exits at once),
every Slurm command has a timeout, and one run's problem never stops the others. For each unfinished Slurm
run with no pending or running job it decides, from the Slurm state and the run's ledger, to resubmit (with
exponential backoff), to leave it alone (finished, cancelled by the user, already given up) or to give up
after ``resume.max_restarts``.
"""

from __future__ import annotations

import fcntl
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from runner.rundir import RunDir, read_json

RESUBMIT_STATES = ("FAILED", "NODE_FAIL", "TIMEOUT", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
SLURM_REQUEUES = ("NODE_FAIL", "BOOT_FAIL")  # with --requeue, Slurm puts these back in the queue by itself
REQUEUE_GRACE_S = 180.0


@dataclass
class Decision:
    """What cron will do with one run, and why (printed as one line per run)."""

    action: str  # skip | wait | resubmit | give_up
    reason: str


def decide(run: RunDir, cfg: dict[str, Any], now: float | None = None) -> Decision:
    from runner.host import slurm
    from runner.host.jobhook import restarts_used

    now = time.time() if now is None else now
    events = run.events()
    names = [e["event"] for e in events]
    if run.finished.exists():
        return Decision("skip", "finished")
    if run.cancelled_now():
        return Decision("skip", "cancelled by the user")
    if "gave_up" in names:
        return Decision("skip", "already gave up")
    job = run.job_id()
    if not job:
        return Decision("skip", "never submitted")
    outcomes = [e.get("outcome") for e in events if e["event"] == "exit"]
    if outcomes and outcomes[-1] == "preflight_failed":
        return Decision("skip", "preflight failed: fix the node or interface it names, then `runner resume`")
    info = slurm.query(job)
    if info is not None and not info.terminal:
        return Decision("skip", f"job {job} is {info.state}")
    status = read_json(run.exit_status, {}) or {}
    state = info.state if info is not None else "UNKNOWN"
    if state == "CANCELLED" and status.get("event") not in ("timeout", "preempted"):
        return Decision("skip", f"job {job} was cancelled (scancel)")
    if state not in RESUBMIT_STATES and state not in ("COMPLETED", "CANCELLED", "UNKNOWN"):
        return Decision("skip", f"job {job} is {state}")
    reason = f"job {job} ended {state}" + (f" (exit {status['exit_code']})" if "exit_code" in status else "")
    ended = max((e["time"] for e in events if e["event"] == "exit"), default=0.0)
    if state in SLURM_REQUEUES and cfg["slurm"]["requeue"] and now < ended + REQUEUE_GRACE_S:
        # Slurm requeues a --requeue job itself after a node failure; resubmitting too would run it twice.
        return Decision("wait", f"{reason}; Slurm requeues it itself ({ended + REQUEUE_GRACE_S - now:.0f} s grace)")
    used = restarts_used(run)
    if used >= cfg["resume"]["max_restarts"]:
        return Decision("give_up", f"{reason}; {used} restarts used of resume.max_restarts="
                                   f"{cfg['resume']['max_restarts']}")
    last = max((e["time"] for e in events if e["event"] in ("resubmitted", "requeued", "exit")), default=0.0)
    delay = float(cfg["resume"]["backoff_s"]) * (2 ** max(used - 1, 0)) if used else 0.0
    if now < last + delay:
        return Decision("wait", f"{reason}; backoff {delay:.0f} s, {last + delay - now:.0f} s left")
    return Decision("resubmit", reason)


def handle(run: RunDir) -> Decision:
    from runner import alerts
    from runner.host import submit
    from runner.host.jobhook import restarts_used

    cfg = yaml.safe_load(run.config.read_text())
    alerts.flush_queue(run.root, cfg["alerts"])
    d = decide(run, cfg)
    if d.action == "resubmit":
        submit.resubmit(run, cfg, d.reason)
    elif d.action == "give_up":
        run.record("gave_up", reason=d.reason)
        alerts.notify(run.root, cfg["alerts"], "gave_up", attempt=restarts_used(run) + 1,
                      next_step=f"no further submissions: {d.reason}")
    return d


def runs_under(root: Path) -> list[RunDir]:
    if not root.is_dir():
        return []
    return [RunDir(p.resolve()) for p in sorted(root.iterdir())
            if (p / "manifest.json").is_file() and (read_json(p / "manifest.json", {}) or {}).get("scheduler")
            == "slurm"]


def run_once(roots: list[Path]) -> int:
    for root in roots:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / ".runner-cron.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"runner cron: another instance is working on {root}; leaving it to that one")
                continue
            for run in runs_under(root):
                try:
                    d = handle(run)
                except Exception as e:  # one broken run must never stop the others
                    print(f"{run.name}: error: {type(e).__name__}: {e}", file=sys.stderr)
                    continue
                if d.action != "skip":
                    print(f"{run.name}: {d.action}: {d.reason}", flush=True)
    return 0


def crontab_line(roots: list[Path]) -> str:
    exe = shlex.quote(str(Path(sys.executable).parent / "runner"))
    args = " ".join(f"--root {shlex.quote(str(r.resolve()))}" for r in roots)
    log = shlex.quote(str(roots[0].resolve() / ".runner-cron.log"))
    return f"* * * * * {exe} cron {args} >> {log} 2>&1"


def install(roots: list[Path], yes: bool) -> int:
    line = crontab_line(roots)
    print(line)
    if not yes:
        print("# add it with `crontab -e`, or run again with --yes to install it")
        return 0
    current = subprocess.run(["crontab", "-l"], capture_output=True, text=True, timeout=30)
    existing = current.stdout if current.returncode == 0 else ""
    if line in existing.splitlines():
        print("# already installed")
        return 0
    subprocess.run(["crontab", "-"], input=existing + line + "\n", text=True, check=True, timeout=30)
    print("# installed")
    return 0
