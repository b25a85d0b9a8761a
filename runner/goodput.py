"""A run's life as attempts, and where its wall time went: goodput and its losses.

Goodput is productive training time over wall time since submission, as the field defines it (Google's ML
goodput, NVIDIA's resiliency tooling): productive time is the training time that a checkpoint or the finished run
keeps (``productive_s`` in the checkpoint manifest and the ``finished`` marker); everything else is a loss, and
each loss has a name. Pure functions of the ledger and a few numbers, used by ``runner status --json`` and
``runner report`` (login node) alike, so both show the same goodput.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from runner.rundir import (
    EXIT_HANG,
    EXIT_NONFINITE,
    EXIT_PREFLIGHT,
    EXIT_PROGRAM,
    EXIT_REQUEUE,
    EXIT_SUPERSEDED,
    EXIT_TERMINATED,
)

# Events that queue a new attempt: the first submission, Slurm's requeue, a resubmission (cron, `runner resume`),
# a successor job taking over, an in-job restart (resume.in_job: a new step in the same job).
OPENERS = ("submitted", "requeued", "resubmitted", "handed_over", "restarted")
# A local run's exit records only its code; what the code means (README: launcher exit codes).
_LOCAL_OUTCOME = {0: "completed", EXIT_REQUEUE: "preempted", EXIT_TERMINATED: "stopped", EXIT_PREFLIGHT:
                  "preflight_failed", EXIT_SUPERSEDED: "superseded", EXIT_HANG: "hang", EXIT_NONFINITE: "nan",
                  EXIT_PROGRAM: "program_error", 130: "stopped"}
# The losses, in the order the report shows them, with what each counts.
LOSSES: dict[str, str] = {
    "waiting for Slurm": "from each submission, requeue or resubmission until the job started (queue, backoff)",
    "preflight": "the preflight checks of each attempt (preflight.duration_s)",
    "startup": "from the job's start to the first training step, preflight left out (imports, rendezvous, "
               "loading the checkpoint)",
    "recomputed steps": "steps trained again after a fault: the steps lost (train_start.lost_steps) x the mean "
                        "productive step time",
    "hang detection": "from the last step of a hung attempt to its exit (the watchdog's limit, the reports)",
    "checkpoint stalls": "training time no checkpoint kept and no other loss explains: the checkpoint written at a "
                         "stop, the last write, shutdown",
    "stopped for a person": "from an exit that stopped the run (a NaN, a failed preflight, a crash loop, a "
                            "cancel) until someone resumed it, or until now",
    "since the last checkpoint": "a running attempt's training after its newest complete checkpoint",
    "other": "wall time none of the above explains (before the first submission's record, clock rounding)",
    "the program ran": "a program that shows runner no steps (it calls no runner.progress and trains no Lightning "
                       "Trainer with runner's callback): from its start (the preflight's end) to its exit, its own "
                       "start and its training alike, since runner cannot tell them apart",
}


@dataclass
class Attempt:
    """One submission, requeue or resubmission of a run, from the ledger."""

    number: int  # 1, 2, ... in ledger order
    queued: float  # when it was submitted, requeued or resubmitted
    opener: str  # the event that queued it
    job_id: str | None = None
    by: str | None = None  # resubmitted by cron or a user (`runner resume`)
    log_attempt: int | None = None  # logs/attempt-N of its ranks (train_start.attempt)
    started: float | None = None  # the batch script's start (Slurm runs)
    nodes: str | None = None  # Slurm's node list of the job
    preflight_end: float | None = None
    preflight_s: float = 0.0
    preflight_status: str | None = None
    preflight_summary: str | None = None
    train_start: float | None = None
    from_step: int | None = None
    lost_steps: int = 0
    ended: float | None = None  # its exit
    outcome: str | None = None  # completed, preempted, timeout, failed, hang, nan, preflight_failed, ...
    cause: str | None = None
    exit_code: int | None = None
    bad_nodes: list[str] = field(default_factory=list)  # nodes its exit named (kept out of the next jobs)
    then: str | None = None  # what followed its exit: requeued, resubmitted, handed_over, gave_up, stopped, ...
    then_reason: str | None = None
    finished: float | None = None  # training reached its end in this attempt
    last_step: int | None = None  # the furthest step it recorded (finished, hang, NaN, ...)
    hang: Mapping[str, Any] | None = None
    nonfinite: list[Mapping[str, Any]] = field(default_factory=list)  # skipped and stopping NaN/inf steps
    stragglers: list[Mapping[str, Any]] = field(default_factory=list)
    events: list[Mapping[str, Any]] = field(default_factory=list)  # its own ledger lines

    def stop(self, end: float) -> float:
        """When its training stopped: at the end of training where it finished (the exit and teardown after that
        are no part of the run's wall time), else at its exit, else (still running) at ``end``."""
        return self.finished if self.finished is not None else self.ended if self.ended is not None else end

    @property
    def began(self) -> float:
        """When its job began to run (its start, or its submission for a local run)."""
        return self.started if self.started is not None else self.queued


def _outcome(e: Mapping[str, Any]) -> str | None:
    if isinstance(e.get("outcome"), str):
        return str(e["outcome"])
    code = e.get("exit_code")
    return _LOCAL_OUTCOME.get(code, "failed") if isinstance(code, int) else None


def attempts(events: Sequence[Mapping[str, Any]]) -> list[Attempt]:
    """The run's attempts from its ledger, oldest first. A ``start`` or ``train_start`` after an attempt's exit
    with no opener between is one more attempt (Slurm requeued the job on its own, after a node failure)."""
    out: list[Attempt] = []
    for e in events:
        name, t = e["event"], float(e["time"])
        cur = out[-1] if out else None
        if name in OPENERS or cur is None or (name in ("start", "train_start") and cur.ended is not None):
            if cur is not None and cur.ended is not None and cur.then is None and name in OPENERS:
                cur.then = name
            cur = Attempt(len(out) + 1, t, name if name in OPENERS else "requeued by Slurm")
            out.append(cur)
            if name in OPENERS:
                cur.job_id = _str(e.get("successor") if name == "handed_over" else e.get("job_id"))
                cur.by = _str(e.get("by"))
                cur.events.append(e)
                continue
        cur.events.append(e)
        if name == "start":
            cur.started, cur.nodes = t, _str(e.get("nodes"))
            cur.job_id = _str(e.get("job_id")) or cur.job_id
        elif name == "took_over":
            cur.job_id = _str(e.get("job_id")) or cur.job_id
        elif name == "preflight":
            cur.preflight_end, cur.preflight_s = t, _num(e.get("duration_s"))
            cur.preflight_status, cur.preflight_summary = _str(e.get("status")), _str(e.get("summary"))
        elif name == "train_start":
            cur.train_start, cur.from_step = t, _int(e.get("step"))
            cur.lost_steps, cur.log_attempt = _int(e.get("lost_steps")) or 0, _int(e.get("attempt"))
        elif name == "exit" and cur.ended is None:
            cur.ended, cur.outcome, cur.cause = t, _outcome(e), _str(e.get("cause"))
            if cur.outcome == "completed" and "outcome" not in e and cur.finished is None:
                cur.outcome = "stopped"  # a local run's exit 0 is a finish only where training reached its end
            cur.exit_code = _int(e.get("exit_code"))
            cur.bad_nodes = [str(n) for n in e.get("nodes") or [] if isinstance(n, str)]
        elif name in ("gave_up", "stopped", "requeue_failed", "cancelled"):
            cur.then, cur.then_reason = cur.then or name, _str(e.get("reason")) or cur.then_reason
        elif name == "finished":
            cur.finished, cur.last_step = t, _int(e.get("step"))
        elif name == "hang":
            cur.hang, cur.last_step = e, _int(e.get("step"))
        elif name in ("nonfinite", "nonfinite_skipped"):
            cur.nonfinite.append(e)
        elif name == "straggler":
            cur.stragglers.append(e)
    return out


def _str(v: Any) -> str | None:
    return None if v is None else str(v)


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


# Exits after which nothing restarts the run by itself: the gap until the next attempt waited for a person.
_PERSON = ("nan", "preflight_failed", "program_error", "cancelled", "stopped")


def _waited_for_person(a: Attempt, nxt: Attempt | None) -> bool:
    if a.then in ("gave_up", "stopped", "cancelled") or a.outcome in _PERSON:
        return True
    return nxt is not None and nxt.opener == "resubmitted" and nxt.by == "user"


def unseen(a: Attempt, program: bool) -> bool:
    """Whether ``a`` ran a program (``program``: the run's ``command:``) that showed runner no step (no
    ``train_start``); a failed preflight never started it."""
    return program and a.train_start is None and a.outcome != "preflight_failed"


def program_start(a: Attempt) -> float:
    """When a program's attempt handed over to the program: its preflight's end, else (no preflight) its start."""
    return a.preflight_end if a.preflight_end is not None else a.began


@dataclass
class Goodput:
    """Where a run's wall time went. ``goodput`` is ``productive_s / wall_s`` (None before a checkpoint)."""

    wall_s: float
    productive_s: float | None
    losses: dict[str, float]

    @property
    def goodput(self) -> float | None:
        if self.productive_s is None or self.wall_s <= 0:
            return None
        return round(self.productive_s / self.wall_s, 3)

    def as_json(self) -> dict[str, Any]:
        return {"goodput": self.goodput, "wall_s": round(self.wall_s, 1),
                "productive_s": None if self.productive_s is None else round(self.productive_s, 1),
                "losses_s": {k: round(v, 1) for k, v in self.losses.items()}}


@dataclass
class Accounting:
    """What a run's goodput is worked out from (``account``), apart from where its wall time ends: a run that has not
    finished runs on to now, so its goodput is worked out again at each look (``at``)."""

    attempts: list[Attempt]
    created: float | None  # the submission (the manifest's); None: unknown, no wall time
    kept: float | None  # productive_s of the finished run or of its newest checkpoint
    kept_step: int | None
    stalls: dict[int, float] = field(default_factory=dict)  # account's hang_stall_s
    program: bool = False

    def at(self, end: float) -> Goodput:
        created = self.created if self.created is not None else end
        return account(self.attempts, created, end, self.kept, self.kept_step, self.stalls, self.program)


def account(runs: Sequence[Attempt], created: float, end: float, productive_s: float | None,
            kept_step: int | None, hang_stall_s: Mapping[int, float] | None = None, program: bool = False) -> Goodput:
    """Split ``end - created`` into productive time and the named losses (see ``LOSSES``).

    ``kept_step`` is the step that ``productive_s`` reaches (the newest checkpoint's, or the last); its mean step
    time prices the recomputed steps. ``hang_stall_s`` is, per attempt (by its logs/attempt-N number), how long
    its steps had stopped when the watchdog fired (the ranks' hang reports), where known. ``program``: the run is a
    program (``command:``), whose attempts without a step runner saw are "the program ran", not startup.
    """
    kept = productive_s or 0.0
    per_step = kept / kept_step if kept_step else 0.0
    loss = dict.fromkeys(LOSSES, 0.0)
    trained = 0.0
    for i, a in enumerate(runs):
        nxt = runs[i + 1] if i + 1 < len(runs) else None
        # Wall time ends at ``end`` (a finished run's end of training): its exit and teardown come after.
        stop = min(a.stop(end), end)
        if a.started is not None:
            loss["waiting for Slurm"] += max(min(a.started, stop) - a.queued, 0.0)
        loss["preflight"] += a.preflight_s
        if a.train_start is not None:
            loss["startup"] += max(a.train_start - a.began - a.preflight_s, 0.0)
            trained += max(stop - a.train_start, 0.0)
        elif unseen(a, program):  # a program that showed runner no step: runner's startup until its preflight ended
            ran = program_start(a)
            loss["startup"] += max(ran - a.began - a.preflight_s, 0.0)
            loss["the program ran"] += max(stop - ran, 0.0)
        else:  # never trained: its whole run was startup (and preflight)
            loss["startup"] += max(stop - a.began - a.preflight_s, 0.0)
        loss["recomputed steps"] += a.lost_steps * per_step
        if a.hang is not None and a.ended is not None:
            stall = (hang_stall_s or {}).get(a.log_attempt or 0, 0.0)
            loss["hang detection"] += stall + max(a.ended - float(a.hang["time"]), 0.0)
        if a.ended is not None:  # the gap until the next attempt was queued, or until now
            gap = max(min(nxt.queued if nxt else end, end) - a.ended, 0.0)
            loss["stopped for a person" if _waited_for_person(a, nxt) else "waiting for Slurm"] += gap
    unkept = max(trained - kept, 0.0)
    loss["recomputed steps"] = min(loss["recomputed steps"], unkept)
    loss["hang detection"] = min(loss["hang detection"], unkept - loss["recomputed steps"])
    rest = unkept - loss["recomputed steps"] - loss["hang detection"]
    running = bool(runs) and runs[-1].ended is None and runs[-1].finished is None
    loss["since the last checkpoint" if running else "checkpoint stalls"] += rest
    wall = max(end - created, 0.0)
    loss["other"] = max(wall - kept - sum(loss.values()), 0.0)
    return Goodput(wall, productive_s, loss)
