"""The end of an attempt: one path for every scheduler.

Each scheduler gathers what only it can see into rank exits: Slurm reads srun's lines in the batch log
(``srun: error: n2: task 3: Killed``), a local run has each rank process's exit. From there an end is the same
everywhere. ``why`` names the first rank that failed and the cause in words, from the run's own files (crash records,
``hang.json``, ``preflight.json``, the ledger's non-finite step). ``record`` writes the exit status and the
ledger's ``exit`` once, with the alert URL redacted.

What follows stays with the scheduler: Slurm requeues, hands over or resubmits (``runner.host.jobhook``); a local
run says so on the terminal (``runner.host.local``).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from runner import alerts, ledger, records
from runner.alerts import causes
from runner.host import nodes
from runner.rundir import RunDir, read_json


@dataclass(frozen=True)
class Why:
    """What an attempt's own records say about its end."""

    cause: causes.Cause | None = None  # None: nothing runner detected itself (the alert guesses from the logs)
    crash: dict[str, Any] | None = None  # the failing rank's crash record (the launcher's)
    rank: int | None = None  # the first rank that failed, before its peers' connection errors
    bad: list[str] = field(default_factory=list)  # the nodes a hang's or the preflight's report named
    said: str | None = None  # a report's own sentence where it names no kind of cause (a failed preflight's summary)

    @property
    def sentence(self) -> str | None:
        """The cause in words, when runner saw it itself: alerts carry it instead of a guess from the logs (a hang
        report with an empty summary says nothing)."""
        return str(self.cause) if self.cause is not None and str(self.cause) else self.said


def why(run: RunDir, event: str, attempt: int, events: Sequence[Mapping[str, Any]], exits: Iterable[causes.RankExit],
        killed: Collection[int] = (), notice: str | None = None, lost: Collection[str] = (),
        reaped: Collection[str] = ()) -> Why:
    """The cause of an attempt's end, from files the attempt wrote, never from Slurm (which may not answer).

    A failure's cause is the first rank that failed (``causes.first_failure``) and how, else the earliest crash
    record; a hang's is this attempt's report; a failed preflight's names its bad nodes; a non-finite value's is the
    step and what was non-finite; a preemption's or a time limit's is the notice (``notice``: the signal's name) the
    ranks stopped on, never a guess from the log (whose last lines are the program's own). ``lost``: the step's
    nodes Slurm reports down or the step reaper found lost (``reaped``: their ranks silent after their peers failed;
    the exit hook asks, resume.in_job): a failure with one is that node's, not its peers' connection errors."""
    crashes = run.crashes(attempt)
    first = causes.first_failure(exits, crashes, killed) if event in ("failed", "hang") else None
    report = read_json(run.hang) if event == "hang" else read_json(run.preflight) if event == "preflight_failed" \
        else None
    bad = nodes.named_by(event, report, attempt)
    crash = (crashes.get(first.rank) if first else None) or (run.first_crash(attempt) if event == "failed" else None)
    rank = first.rank if first else None
    cause: causes.Cause | None = None
    if event == "failed" and lost:
        down, silent = sorted(set(lost) - set(reaped)), sorted(set(lost) & set(reaped))
        said = ([f"Slurm reports {', '.join(down)} down"] if down else []) + \
            ([f"{', '.join(silent)} lost: no heartbeat after the other ranks failed"] if silent else [])
        cause = causes.Cause("node_failure", "; ".join(said), node=", ".join(sorted(lost)))
    elif event == "hang" and isinstance(report, dict) and report.get("attempt") in (attempt, None):
        cause = causes.Cause("hang", str(report.get("summary", "hang")))
    elif first is not None:  # the rank's own end is the cause
        cause = first.why
    elif crash:  # the launcher's own record beats a guess from the log tail
        cause = causes.crashed(crash)
    elif event == "preflight_failed":
        summary = str((report if isinstance(report, dict) else {}).get("summary") or
                      "preflight failed; see preflight.txt")
        if not bad:
            return Why(None, crash, rank, bad, said=summary)
        cause = causes.Cause("bad_nodes", summary, node=", ".join(bad))
    elif event in ("preempted", "timeout"):
        signal = f" (SIG{notice})" if notice and notice != "none" else ""
        cause = causes.Cause("preemption" if event == "preempted" else "time_limit",
                             f"the notice{signal} came and the ranks stopped to be requeued")
    elif event == "nan":
        last: Mapping[str, Any] = next((e for e in reversed(events) if e.get("event") == "nonfinite"), {})
        step = last.get("step")
        cause = causes.Cause("nan", str(last.get("what", "loss")), step=step if isinstance(step, int) else None)
    return Why(cause, crash, rank, bad)


def alert_fields(run: RunDir, w: Why, attempt: int) -> dict[str, Any]:
    """What an alert about this end says beyond the event: the cause runner saw, and the failing rank's log tail
    (not a peer's echo of its end)."""
    out: dict[str, Any] = {}
    if w.sentence:
        out.update(cause=w.sentence, **({"cause_kind": w.cause.kind} if w.cause is not None else {}))
    if w.rank is not None:
        path = run.rank_log(w.rank, attempt)
        out.update(log_tail=causes.read_tail(path)[-causes.TAIL_LINES:], extra={"log": str(path.relative_to(run.root))})
    return out


def record(run: RunDir, section: Mapping[str, Any], ended: ledger.Exit) -> None:
    """The attempt's end, written once: ``exit_status.json`` (what a reader of the run's state sees first) and the
    ledger's ``exit``, both with the alert section's secrets redacted."""
    secrets = alerts.secrets_of(section)
    status: records.ExitStatus = {"exit_code": ended["exit_code"], "event": ended["outcome"],
                                  "attempt": ended["attempt"], "time": time.time()}
    if "job_id" in ended:
        status["job_id"] = ended["job_id"]
    if "signal" in ended:
        status["signal"] = ended["signal"]
    if "codes" in ended:
        status["codes"] = ended["codes"]
    run.write_exit_status(status)
    run.record("exit", **alerts.redact_obj(ended, secrets))
