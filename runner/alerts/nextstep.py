"""What happens next, in words: the "Next:" line of every alert, console summary and status, and what to do about
each kind of cause.

The decisions are ``runner.policy``'s; this module only tells them. An alert's event without a decision reads
``NEXT_STEPS``; a cause's kind reads ``CAUSE_STEPS``; the exit hook, cron, a person's resume, a local run and
``runner parallel`` get their own sentence from ``next_step``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from runner.policy import Decision, Limits, failures, program_error
from runner.rundir import EXIT_PROGRAM, EXIT_USAGE

# After a command that cannot run (exit 81) or a usage error (exit 2): a resume runs the same command and config.
SUBMIT_AGAIN = "fix the command or the config it names, then submit the config again (`runner submit CONF`); a " \
               "resume would run the same command and fail the same way"

# What happens next after an alert's event, when nothing more is known (no decision was made for it).
NEXT_STEPS: dict[str, str] = {  # keyed by every AlertEvent (tests/test_alerts.py)
    "failed": "runner cron resubmits it from the last checkpoint while resume.max_restarts allows.",
    "preempted": "The job is requeued and resumes from the last checkpoint.",
    "requeued": "Waiting in the queue; it resumes from the last checkpoint when it starts.",
    "timeout": "Resumes from the last checkpoint if attempts remain.",
    "resubmitted": "A new job was submitted; it resumes from the last checkpoint.",
    "gave_up": "No attempts left: needs a person.",
    "completed": "Nothing: training finished.",
    "cancelled": "Nothing: the job was cancelled.",
    "preflight_failed": "Not retried (the same node would fail again): fix the failed check, then `runner resume`.",
    "hang": "Resubmitted without the node it names, or by runner cron while resume.max_restarts allows.",
    "nan": "Stopped, not retried: fix the model or data (learning rate?), then `runner resume`.",
    "straggler": "Nothing automatic: training goes on at this rank's pace. `runner status RUN --ranks` compares "
                 "every rank; check the node it names.",
}

# What to do about a cause (``runner.alerts.causes.Cause``), shown under it in an alert.
CAUSE_STEPS: dict[str, str] = {  # keyed by every CauseKind (tests/test_alerts.py)
    "oom": "Lower the memory a rank needs (batch size, precision, activation checkpointing), then `runner resume`.",
    "node_failure": "Nothing by hand: the job is requeued or resubmitted, without the nodes Slurm reports unhealthy.",
    "time_limit": "Nothing by hand: it resumes from the newest complete checkpoint; raise slurm.time if each attempt "
                  "ends here.",
    "preemption": "Nothing by hand: it resumes from the newest complete checkpoint when it runs again.",
    "nccl_timeout": "Check the network between the nodes (`runner preflight`; network.debug: true) and the rank "
                    "whose log ends first.",
    "program": "Fix the command, the config or the program it names, then submit the config again (`runner "
               "submit CONF`): a resume would run the same command.",
    "exception": "Read the traceback in the rank log named here; fix the code, then `runner resume`.",
    "crash_loop": "Not retried: the same exception ended two attempts in a row. Fix it, then `runner resume`.",
    "bad_nodes": "Fix or drain the node it names; the run is resubmitted without it where attempts remain.",
    "nan": "Fix the model or data (learning rate?), then `runner resume`.",
    "hang": "hang.json names the ranks and where they stopped; the node it names is left out of the next attempt.",
    "rank": "Read this rank's log: its end is the cause, the other ranks' errors are echoes of it.",
    "hook": "See `runner logs RUN --batch`: the batch script's host-side hook failed there.",
    "unknown": "Read the rank logs (`runner logs RUN`): no known sign of a cause was found.",
}


def cause_step(kind: str) -> str:
    """What to do about a cause of ``kind``."""
    return CAUSE_STEPS.get(kind, "")


# Who acted and asks what comes next: the exit hook (``after_exit``), ``runner cron``, a person (``runner resume``),
# a local run's driver, or ``runner parallel``'s.
By = Literal["hook", "cron", "user", "local", "parallel"]


def next_step(outcome: str, decision: Decision | None = None, attempt: int = 1, limits: Limits | None = None,
              requeued: bool | None = None, events: Sequence[Mapping[str, Any]] | None = None, *, by: By = "hook",
              run: str = "", job_id: str | None = None, exit_code: int | None = None, saved: bool = True) -> str:
    """The "Next:" line of every alert and console summary: the one author of what happens to a run next.

    For the exit hook: what it did (``decision``; ``requeued`` whether ``scontrol requeue`` went through) and what
    ``runner cron`` will do with the run (``next_action``). ``by="cron"`` or ``"user"`` with a ``resubmit`` decision
    and the new ``job_id``: the resubmission; ``by="cron"`` with ``give_up``: cron's last word. ``by="local"`` and
    ``"parallel"``: a run nothing resubmits by itself (``run`` names it). ``hook_failed``: a host-side hook of the
    batch script that could not run. Without a ``decision``: what an alert of ``outcome`` means (``NEXT_STEPS``).
    ``exit_code``: a local attempt's (exit 81 or 2: ``SUBMIT_AGAIN``); ``saved``: whether the local run has a complete
    checkpoint of runner's (a program's stage that trains nothing has none)."""
    if by == "local":
        return local_next_step(outcome, run, exit_code, saved)
    if by == "parallel":
        return parallel_next_step(outcome, run)
    if outcome == "hook_failed":
        return f"see `runner logs {run} --batch`; runner cron decides from Slurm's record"
    if decision is None:
        return NEXT_STEPS.get(outcome, "")
    if decision.action == "resubmit" and job_id:
        return f"resubmitted as job {job_id}; it resumes from the newest complete checkpoint ({decision.reason})"
    if decision.action == "give_up" and by == "cron":
        return f"no further submissions: {decision.reason}"
    if limits is None:  # the exit hook's decisions are told against the run's own limits, never a default
        raise TypeError("next_step: the exit hook's decision needs the run's limits")
    if decision.action == "restart":
        return f"{decision.reason}, on {', '.join(decision.nodes)}; it resumes from the newest complete checkpoint " \
               f"(restart {failures(events or ())} of resume.max_restarts={limits.max_restarts})"
    if decision.action == "hand_over":
        return f"{decision.reason}, as soon as this job ends; it resumes from the newest complete checkpoint"
    if decision.action == "requeue":
        if requeued:
            return f"requeued as attempt {attempt + 1}; it resumes from the newest complete checkpoint"
        return "scontrol requeue failed: runner cron resubmits it from the newest complete checkpoint"
    if decision.action == "give_up":
        return f"not retried: {decision.reason} (resume.max_restarts={limits.max_restarts}); `runner resume` it " \
               "once the cause is fixed"
    if decision.action == "stop" and outcome == "failed" and program_error(events or ()) is not None:
        return f"stopped, not retried: {decision.reason}. {SUBMIT_AGAIN[0].upper()}{SUBMIT_AGAIN[1:]}"
    if decision.action == "stop":
        return f"stopped, not retried: {decision.reason}. `runner resume` it once the cause is fixed"
    if decision.action == "resubmit":
        return f"resubmitted at once: {decision.reason}; it resumes from the newest complete checkpoint"
    if outcome in ("timeout", "preempted"):  # left to cron; never limited by resume.max_restarts
        return "runner cron resubmits it from the newest complete checkpoint (time limits and preemptions do not " \
               "count against resume.max_restarts)"
    if outcome in ("failed", "hang"):  # left to cron, which counts the same failures
        failed = attempt if events is None else failures(events)  # without a ledger: every attempt failed
        if failed <= limits.max_restarts:
            return f"runner cron resubmits it from the newest complete checkpoint (restart {failed} of " \
                   f"resume.max_restarts={limits.max_restarts})"
        return f"not retried: {failed - 1} restarts used of resume.max_restarts={limits.max_restarts}; " \
               "`runner resume` it once the cause is fixed"
    if outcome == "preflight_failed":
        return "not retried (the same node would fail again): fix the node or interface it names, then `runner resume`"
    return f"nothing: {decision.reason}"



def parallel_next_step(outcome: str, run: str) -> str:
    """What happens next to a ``runner parallel`` run after ``outcome`` (its driver runs where it was typed: nothing
    resubmits it)."""
    if outcome == "completed":
        return "nothing: every item is done (parallel/result.json)"
    return f"nothing by itself (runner cron resubmits Slurm training runs only): `runner resume {run}` runs the " \
           "items not done yet, the failed ones again, and skips the rest"


def local_next_step(outcome: str, run: str, exit_code: int | None = None, saved: bool = True) -> str:
    """What happens next to a local run after ``outcome``: nothing by itself (``runner cron`` resubmits Slurm runs
    only); the person who runs it resumes it, or submits it again after a command that cannot run (``exit_code``
    81 or 2). Without a checkpoint of runner's (``saved``), a resume runs the command again from its start."""
    if outcome == "completed":
        return "nothing: training finished" if saved else "nothing: the run finished"
    again = "continues from its newest complete checkpoint" if saved else \
        "runs its command again (runner holds no checkpoint of it; a program that saves its own starts from that)"
    if outcome == "failed" and exit_code in (EXIT_PROGRAM, EXIT_USAGE):
        return f"nothing by itself: {SUBMIT_AGAIN}"
    if outcome == "nan":
        return f"nothing by itself (a local run is not resubmitted): fix the model or data, then `runner resume {run}`"
    if outcome == "preflight_failed":
        return f"nothing by itself: fix the check it names, then `runner resume {run}`"
    if outcome == "cancelled":
        return f"nothing: cancelled; `runner resume {run}` {again}"
    return f"nothing by itself (runner cron resubmits Slurm runs only): `runner resume {run}` {again}"
