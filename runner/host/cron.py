"""``runner cron``: run every minute from crontab; resumes every run that died, from its last checkpoint.

Safe to run often: one instance at a time per run root (a non-blocking lock; a second one exits at once),
every Slurm command has a timeout, and one run's problem never stops the others. It gathers the facts of
every Slurm run under a root, asks Slurm once about all their jobs, and acts on what ``runner.policy`` decides
for each: resubmit (with exponential backoff), wait, leave it alone (finished, cancelled by the user, already
given up, a successor job takes it over) or give up after ``resume.max_restarts``. It also queues and sends the
alerts of what running jobs recorded (a straggler: ``runner.host.notices``). Its output lands in a log file (see
``crontab_line``), so log records carry timestamps; the one line per run that it acts on is printed.
"""

from __future__ import annotations

import logging
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from runner import log as runner_log
from runner import policy, proc, slurmstates
from runner.alerts import nextstep
from runner.host import observe, scheduler
from runner.host.observe import manifest_of
from runner.rundir import RunDir, locked
from runner.spec.typed import RunConfig, read_resolved

log = logging.getLogger(__name__)


def decide(run: RunDir, cfg: RunConfig, jobs: Mapping[str, slurmstates.JobInfo] | None = None,
           now: float | None = None, asked: bool = True) -> policy.Decision:
    """Cron's decision for one run; ``jobs`` is Slurm's answer for many runs at once (asked here when not given),
    ``asked`` False when Slurm could not be asked (then a job the ledger shows alive is never resubmitted)."""
    return _decision(observe.observe(run, observe.unsettled, jobs, asked), cfg, now)


def _decision(seen: observe.Observation, cfg: RunConfig, now: float | None = None) -> policy.Decision:
    return policy.next_action(seen.records, seen.job, policy.Limits.of(cfg), time.time() if now is None else now,
                              seen.asked, seen.heir)


def _alerts_queued(run: RunDir) -> bool:
    from runner import alerts

    queue = alerts.queue_dir(run.root)
    return queue.is_dir() and any(queue.iterdir())


def handle(run: RunDir, jobs: Mapping[str, slurmstates.JobInfo] | None = None, asked: bool = True,
           fresh: bool | None = None, seen: observe.Observation | None = None) -> policy.Decision:
    """Decide for one run and act; its alerts are queued (``run_once`` sends every run's after its pass, under one
    time budget and without the root's lock).

    A resubmission acts on a fresh answer from Slurm (the one asked for all runs may be minutes old by now):
    ``fresh=None`` asks again for this run; ``fresh=False`` returns the resubmit decision without acting (the caller
    asks once for all of them and calls again with ``fresh=True`` and that answer). ``seen``: the caller's look at
    the run, the one ``jobs`` answers (read here when not given)."""
    from runner import alerts
    from runner.host import notices

    seen = seen or observe.look(run, observe.unsettled)  # the ledger, read once
    settled = policy.settled(seen.records)
    if settled is not None:
        return settled  # nothing to decide: not even the config is read
    cfg = seen.config
    notices.queue_stragglers(run, cfg, seen.records.job_id)  # a straggler of the running job, recorded in its ledger
    _alert_hook_failures(run, cfg, seen.records.events, seen.attempt)
    seen = observe.answer(seen, jobs, asked)
    d = _decision(seen, cfg)
    if d.action == "resubmit" and fresh is False:
        return d
    if d.action == "resubmit" and jobs is not None and fresh is None:
        d = decide(run, cfg)  # a fresh look: the ledger and Slurm again, right before acting
    if d.action == "resubmit":
        _remember_failed_node(run, (jobs or {}).get(seen.records.job_id or ""))
        scheduler.SLURM.resubmit(run, cfg, d.reason)
    elif d.action == "give_up":
        run.record("gave_up", reason=d.reason)
        alerts.notify(run.root, cfg["alerts"], "gave_up", attempt=seen.attempt,
                      next_step=nextstep.next_step("gave_up", d, by="cron"))
    return d


def _alert_hook_failures(run: RunDir, cfg: RunConfig, events: Sequence[Mapping[str, Any]], attempt: int) -> None:
    """A host-side hook the batch script could not run (its ``hook_failed`` ledger line): alerted once, since the
    hook that would have alerted is the one that failed; what happens next is decided from Slurm's record."""
    from runner import alerts

    told = {e.get("of") for e in events if e["event"] == "hook_failure_alerted"}
    for e in events:
        if e["event"] != "hook_failed" or e["time"] in told:
            continue
        run.record("hook_failure_alerted", of=e["time"])
        alerts.notify(run.root, cfg["alerts"], "failed", job_id=str(e.get("job_id") or ""),
                      attempt=attempt,
                      cause=f"the batch script's host-side {str(e.get('hook'))[:20]} hook could not run (exit "
                            f"{e.get('exit_code')}): no exit record, requeue or alert came from the job itself",
                      cause_kind="hook",
                      next_step=nextstep.next_step("hook_failed", by="cron", run=run.name))


def _remember_failed_node(run: RunDir, job: slurmstates.JobInfo | None) -> None:
    """A job that ended NODE_FAIL: the nodes Slurm now reports unhealthy are left out of the resubmission."""
    from runner.host import nodes, slurm

    if job is not None and slurmstates.base_state(job.state) == "NODE_FAIL" and job.nodes:
        bad = nodes.record(run.root.parent, slurm.unhealthy(job.nodes), "node_fail", run.name,
                           f"job {job.job_id} ended NODE_FAIL")
        if bad:
            log.info("%s: job %s ended NODE_FAIL on %s: left out of the next jobs", run.name, job.job_id,
                     ", ".join(bad))


def _is_slurm_run(path: Path) -> bool:
    """A Slurm run directory; raises (one line, logged by the caller) when its manifest cannot be read."""
    if not RunDir(path).manifest.is_file():
        return False
    return scheduler.of_manifest(manifest_of(RunDir(path))).queue


def runs_under(root: Path) -> list[RunDir]:
    """The Slurm runs under root; an entry that cannot be read is logged and left out."""
    if not root.is_dir():
        return []
    runs = []
    for p in sorted(root.iterdir()):
        try:
            if _is_slurm_run(p):
                runs.append(RunDir(p.resolve()))
        except Exception as e:  # one broken run must never stop the others
            log.error("%s: cannot read: %s", p, runner_log.one_line(e))
    return runs


def _looks(runs: list[RunDir]) -> dict[RunDir, observe.Observation]:
    """One look at each run (``observe.look``); a run that cannot be read is left out (``handle`` reports it)."""
    looks = {}
    for run in runs:
        try:
            looks[run] = observe.look(run, observe.unsettled)
        except Exception:  # handle() reports it
            continue
    return looks


SEND_BUDGET_S = 20.0  # one cron pass spends at most this long sending alerts, however many runs have some queued


def _queues(runs: list[RunDir]) -> list[tuple[Path, Mapping[str, Any]]]:
    """(run directory, alerts section) of every run with alerts waiting, oldest queue first."""
    out: list[tuple[Path, Mapping[str, Any]]] = []
    for run in runs:
        try:
            if _alerts_queued(run):
                out.append((run.root, read_resolved(run.config)["alerts"]))
        except Exception as e:  # logged by handle() already, or a config that cannot be read: left queued
            log.debug("%s: alerts left queued: %s", run.name, runner_log.one_line(e))
    return out


def send_alerts(root: Path, runs: list[RunDir], budget_s: float = SEND_BUDGET_S) -> None:
    """The one sender of a cron pass: every run's queued alerts, one deadline for all of them, the root's decision
    lock not held (another cron decides meanwhile); a second sender leaves the sending to the first."""
    from runner import alerts

    with locked(root / ".runner-cron-send.lock", blocking=False, fail_open=True) as held:
        if not held:
            log.info("another instance is sending the alerts of %s; leaving them to it", root)
            return
        sent, left = alerts.flush_many(_queues(runs), budget_s)
        if sent or left:
            log.info("alerts: %d sent, %d left queued for the next pass", sent, left)


def _act(run: RunDir, jobs: Mapping[str, slurmstates.JobInfo], asked: bool, fresh: bool,
         seen: observe.Observation | None = None) -> str | None:
    """``handle`` one run, its line printed when it acted; one broken run never stops the others."""
    try:
        d = handle(run, jobs, asked=asked, fresh=fresh, seen=seen)
    except Exception as e:
        log.error("%s: %s", run.name, runner_log.one_line(e))
        return None
    if d.action != "skip" and (fresh or d.action != "resubmit"):
        print(f"{run.name}: {d.action}: {d.reason}", flush=True)
    return d.action


def run_once(roots: list[Path], report: bool = False) -> int:
    from runner import alerts

    for root in roots:
        root.mkdir(parents=True, exist_ok=True)
        with locked(root / ".runner-cron.lock", blocking=False) as held:
            if not held:
                log.info("another instance is working on %s; leaving it to that one", root)
                continue
            runs = runs_under(root)
            looks = _looks(runs)
            answer = observe.ask(looks.values())  # once for every run whose decision depends on Slurm
            if answer is None:
                log.warning("Slurm cannot be asked (sacct, squeue and scontrol failed or timed out): no run whose "
                            "job may be alive is resubmitted; trying again next time")
            with alerts.deferred():  # every decision first, no webhook in the way; the alerts after the lock
                due = [run for run in runs
                       if _act(run, answer or {}, answer is not None, False, looks.get(run)) == "resubmit"]
                if due:  # one fresh answer for every run about to be resubmitted (minutes may have passed)
                    fresh = observe.ask(_looks(due).values())
                    for run in due:
                        _act(run, fresh or {}, fresh is not None, True)
        send_alerts(root, runs)
        with locked(root / ".runner-cron.lock", blocking=False) as held:
            if report and held:  # after the decisions: the pages show what was just done
                from runner.host import report as pages

                try:
                    pages.refresh(root)
                except Exception as e:  # a page must never stop cron's real work
                    log.error("%s: reports not written: %s", root, runner_log.one_line(e))
    return 0


def crontab_line(roots: list[Path], report: bool = False) -> str:
    exe = shlex.quote(str(Path(sys.executable).parent / "runner"))
    args = " ".join(f"--root {shlex.quote(str(r.resolve()))}" for r in roots) + (" --report" if report else "")
    log = shlex.quote(str(roots[0].resolve() / ".runner-cron.log"))
    return f"* * * * * {exe} cron {args} >> {log} 2>&1"


def install(roots: list[Path], yes: bool, report: bool = False) -> int:
    line = crontab_line(roots, report)
    print(line)
    if not yes:
        print("# add it with `crontab -e`, or run again with --yes to install it")
        return 0
    current = proc.run(["crontab", "-l"], timeout=30, check=False)  # no crontab yet: exit 1
    existing = current.stdout if current.returncode == 0 else ""
    if line in existing.splitlines():
        print("# already installed")
        return 0
    proc.run(["crontab", "-"], input=existing + line + "\n", timeout=30)
    print("# installed")
    return 0
