"""Every recovery decision of runner, as pure functions of what a run recorded and what Slurm says.

When is a run requeued, resubmitted, left alone or given up, and what state is it in? Each answer is made
here, once, and tested as one table (tests/test_policy.py), the way Slurm's own job states are one table.
Nothing here reads a file, runs a command or reads the clock: the callers gather the facts (``Records``: the
run directory's ledger, exit status, ``finished`` marker and job id; ``JobInfo``: Slurm's answer or None;
``Limits``: the config's values; ``now``), then act on the ``Decision`` or state they get back:

- the batch script's exit hook (``runner.host.jobhook``): ``classify`` the step's end, then ``after_exit`` (its
  alert's "Next:" line tells the decision in ``runner.alerts.nextstep``); with ``resume.in_job`` a crash or a hang
  ``restart``s the training in the same allocation, on the nodes ``step_nodes`` chooses;
- a successor job's batch script (``resume.successor``): ``take_over`` the run, or step aside;
- ``runner cron``: ``next_action`` (``settled`` says which runs need no Slurm answer at all);
- ``runner status``: ``run_state`` (``asks_slurm`` says whether Slurm's view can change it);
- ``runner resume``: ``resume_action`` (never next to a live job);
- ``runner cron`` and the exit hook: ``straggler_alerts`` (which slow ranks still need their one alert).

At most one job trains a run directory. The run's ``job_id`` file names its owner; a job that is not the owner
is superseded and exits ``EXIT_SUPERSEDED`` without writing a checkpoint: the batch script checks before any
Python starts (a job older than the run's current one, requeued by Slurm after ``runner cron`` resubmitted the
run), and the ranks check every few steps while training (``runner.job.owner``). ``resume_action`` and
``next_action`` never start a second job while the first may be alive, even when Slurm cannot be asked.

With ``resume.successor`` the next attempt waits in the queue behind the run's job (``--dependency=afternotok``):
Slurm starts it as soon as that job ends in a failed state, with no requeue delay. The successor is the run's
next owner, and only one: the exit hook either hands over to it (``after_exit``'s ``hand_over``, never together
with a requeue) or cancels it (every other decision: a finished, stopped or resubmitted run must never see it
train), and the successor itself ``take_over``s the run only from the job it follows, else it steps aside.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from runner.ledger import Outcome
from runner.records import ExitStatus
from runner.rundir import (
    EXIT_HANG,
    EXIT_NONFINITE,
    EXIT_PREFLIGHT,
    EXIT_PROGRAM,
    EXIT_REQUEUE,
    EXIT_SUPERSEDED,
    EXIT_USAGE,
)
from runner.slurmstates import RESUBMIT_STATES, SLURM_REQUEUES, JobInfo, exit_code
from runner.spec.typed import RunConfig

REQUEUE_GRACE_S = 180.0  # how long cron leaves a job Slurm requeues itself (NODE_FAIL) before resubmitting it
NEAR_LIMIT_S = 60.0  # an exit-75 this close to (signal_lead_s before) the time limit is the time limit's doing

# ---------------------------------------------------------------------------------------------------------------
# The facts


@dataclass(frozen=True)
class Records:
    """What a run directory says about itself (the caller reads it; see ``runner.rundir.RunDir``)."""

    events: Sequence[Mapping[str, Any]] = ()  # the ledger, oldest first
    exit_status: ExitStatus | None = None  # exit_status.json; None when missing or unreadable
    finished: bool = False  # the `finished` marker: training reached its end
    job_id: str | None = None  # the run's current Slurm job
    successor: str | None = None  # the job queued to follow ``job_id`` (resume.successor), if any


@dataclass(frozen=True)
class Limits:
    """The config values the decisions depend on: from the run's config (``of``), never defaults of their own."""

    requeue: bool  # slurm.requeue
    signal_lead_s: float  # slurm.signal_lead_s
    max_restarts: int  # resume.max_restarts
    backoff_s: float  # resume.backoff_s
    successor: bool  # resume.successor
    in_job: bool = False  # resume.in_job: a crash or a hang restarts the training in the same allocation

    @classmethod
    def of(cls, cfg: RunConfig) -> Limits:
        return cls(requeue=bool(cfg["slurm"]["requeue"]), signal_lead_s=cfg["slurm"]["signal_lead_s"],
                   max_restarts=cfg["resume"]["max_restarts"], backoff_s=float(cfg["resume"]["backoff_s"]),
                   successor=cfg["resume"]["successor"], in_job=bool(cfg["resume"]["in_job"]))


# What a decision tells its caller to do (see ``Decision``).
Action = Literal["requeue", "hand_over", "resubmit", "restart", "stop", "wait", "give_up", "refuse", "train",
                 "skip"]


@dataclass(frozen=True)
class Decision:
    """What to do with a run next, and why (cron prints it as one line).

    ``action``: requeue (the exit hook asks Slurm), hand_over (to the successor job, after ``delay_s``), resubmit
    (sbatch again), restart (a new training step in the same allocation, on ``nodes``), stop (for a person), wait
    (ask again later), give_up, refuse (the user asked for something that cannot be done), train or skip (nothing
    to do; for a successor job: step aside).
    """

    action: Action
    reason: str
    delay_s: float = 0.0  # hand_over: the backoff before the successor may start
    nodes: tuple[str, ...] = ()  # restart: the nodes the next step trains on


def _names(events: Sequence[Mapping[str, Any]]) -> list[str]:
    return [e["event"] for e in events]


def cancelled_by_user(events: Sequence[Mapping[str, Any]]) -> bool:
    """`runner cancel` was the last word since the last (re)submission (a later resume lifts it)."""
    for e in reversed(events):
        if e["event"] == "cancelled":
            return True
        if e["event"] in ("submitted", "resubmitted"):
            return False
    return False


def restarts_used(events: Sequence[Mapping[str, Any]]) -> int:
    """Requeues, resubmissions and in-job restarts so far, from the run's own ledger (survives Slurm forgetting the
    job)."""
    ours = sum(1 for e in events if e["event"] in ("requeued", "resubmitted", "restarted"))
    # Slurm may requeue a job on its own (after a node failure): every attempt's batch script records a start.
    return max(ours, sum(1 for e in events if e["event"] == "start") - 1)


# Outcomes that never consume resume.max_restarts: the run did nothing wrong (the schedule ended it).
FREE = ("timeout", "preempted", "completed", "cancelled", "superseded", "interrupted")


def failures(events: Sequence[Mapping[str, Any]], ended: bool = False) -> int:
    """Attempts that failed (what resume.max_restarts limits): every exit whose outcome is not ``FREE``, plus
    every attempt that started and never recorded its exit (its node died with the batch script). ``ended``:
    Slurm says the last attempt is over, so a last start without an exit counts too."""
    n, open_start = 0, False
    for e in events:
        if e["event"] == "start":
            n += open_start
            open_start = True
        elif e["event"] == "exit":
            open_start = False
            n += e.get("outcome") not in FREE
        elif e["event"] == "resubmitted" and e.get("by") == "user":
            n, open_start = 0, False  # a person looked at it: a fresh budget
    return n + (open_start and ended)


def attempt(events: Sequence[Mapping[str, Any]]) -> int:
    """The number of the attempt now running (or the last one), counting from 1."""
    return restarts_used(events) + 1


# ---------------------------------------------------------------------------------------------------------------
# The exit hook: what the step's end means, and whether to requeue


def superseded(rec: Records, rc: int, job_id: str | None) -> bool:
    """This job no longer owns the run: it said so (exit 78), or the run's ``job_id`` names another job."""
    return rc == EXIT_SUPERSEDED or bool(job_id and rec.job_id and rec.job_id != job_id)


def stopped_by(rc: int, got: int | None, asked: bool = True) -> bool:
    """Whether the step ended by the stop signal the batch script got (``got``: its number; None without one, or
    for TERM, which is no stop signal here): the launcher's own exit after its checkpoint (75), or a rank killed by
    that very signal (128 + N, as a shell reports it), which happens when a program's process had no handler for
    it yet. ``asked``: whether the batch script got any signal at all (TERM included). Without one, a 75 is the
    ranks' answer to srun's own SIGTERM: ``--kill-on-bad-exit`` ends the other ranks after one failed, and that
    failure is the step's end, not a stop."""
    return (rc == EXIT_REQUEUE and asked) or (got is not None and rc == 128 + got)


def classify(rec: Records, rc: int, seconds_left: float | None, limits: Limits, job_id: str | None = None,
             got: int | None = None, asked: bool = True) -> Outcome:
    """What the step's end means: superseded, completed, cancelled, preflight_failed, timeout, preempted or failed.

    ``rc`` is the launcher's exit code; ``seconds_left`` the job's time left as Slurm reports it (None when
    unknown); ``job_id`` the job that ended; ``got`` and ``asked`` what the batch script got (``stopped_by``). The
    launcher exits 75 after checkpointing on the requeue signal, which comes both ``signal_lead_s`` before the time
    limit and on a preemption notice: the time left tells them apart.
    A superseded job's end says nothing about the run (its owner is another job), so it is decided first.
    """
    if superseded(rec, rc, job_id):
        return "superseded"
    if rec.finished:
        return "completed"
    if cancelled_by_user(rec.events):
        return "cancelled"
    if rc == EXIT_PREFLIGHT:
        return "preflight_failed"
    if rc == EXIT_HANG:
        return "hang"
    if rc == EXIT_NONFINITE:
        return "nan"
    if stopped_by(rc, got, asked):
        near_limit = seconds_left is not None and seconds_left <= limits.signal_lead_s + NEAR_LIMIT_S
        return "timeout" if near_limit else "preempted"
    return "failed"


def backoff(failed: int, limits: Limits) -> float:
    """Seconds to wait before the next attempt after ``failed`` failed attempts: none after the first, then
    ``resume.backoff_s`` doubling with each failure."""
    return float(limits.backoff_s) * (2 ** max(failed - 2, 0)) if failed > 1 else 0.0


IN_JOB = ("failed", "hang", "preflight_failed")  # the ends an in-job restart may follow (preflight: with bad nodes)


def step_nodes(allocation: Sequence[str], previous: Sequence[str], bad: Collection[str], needed: int,
               doubtful: Collection[str] = ()) -> tuple[str, ...] | None:
    """The nodes the next training step of this job runs on: ``needed`` of the ``allocation`` (the job's nodes, in
    Slurm's order) that are not ``bad`` (named in this job: a hang's suspects, a failed preflight's nodes, a crash's
    node cause, nodes Slurm reports down), the ``previous`` step's first (the same placement where nothing changed),
    then spares in the allocation's order; None when too few are left (the job ends, the run goes on elsewhere).
    When too few are left, the ``doubtful`` among the bad (``doubtful_nodes``: a hang's node, once) come back last:
    the new attempt's preflight checks them before any rank trains, and a second hang there names them for good.
    In the allocation's order: srun places rank 0 on the first, which is the rendezvous (MASTER_ADDR)."""
    keep = [n for n in allocation if n in previous and n not in bad]
    spares = [n for n in allocation if n not in previous and n not in bad]
    back = [n for n in allocation if n in bad and n in doubtful]
    chosen = set((keep + spares + back)[:needed])
    return tuple(n for n in allocation if n in chosen) if len(chosen) >= needed else None


def in_job_ends(events: Sequence[Mapping[str, Any]], job_id: str | None) -> list[tuple[str, list[str]]]:
    """Each in-job restart of job ``job_id`` so far, oldest first: the end it followed and the nodes that end named
    (the ``restarted`` records' ``reason`` and ``bad``)."""
    return [(str(e.get("reason")), list(e.get("bad") or ())) for e in events
            if e["event"] == "restarted" and e.get("job_id") == job_id]


def doubtful_nodes(ends: Sequence[tuple[str, Collection[str]]], down: Collection[str]) -> set[str]:
    """The nodes named bad in this job that may train again when no spare is left: named once, by a hang, and by
    nothing else (a hang's suspect is often healthy once its step is killed; a failed preflight, a crash's node
    cause or a second hang is not doubt), and not ``down`` (Slurm's word now). ``ends``: each in-job end of this
    job, oldest first, with the nodes it named (its outcome, its nodes)."""
    named: dict[str, int] = {}
    for _, nodes in ends:
        for n in set(nodes):
            named[n] = named.get(n, 0) + 1
    sure = {n for outcome, nodes in ends if outcome != "hang" for n in nodes}
    return {n for n, times in named.items() if times == 1 and n not in sure and n not in down}


def gone_nodes(ends: Sequence[tuple[str, Collection[str]]]) -> set[str]:
    """The nodes of this job a new warm standby step must not span (resume.in_job): those named bad by an end that was
    not a hang (a crash's node cause, a failed preflight, a node Slurm reports down or the step reaper found lost): it
    would start tasks there, or wait for that node to answer. A hang's node still runs its standby task, which steps
    aside when the next attempt trains without it. ``ends``: as ``doubtful_nodes``."""
    return {n for outcome, nodes in ends if outcome != "hang" for n in nodes}


def standby_takes(waiting: Collection[tuple[str, int]], chosen: Sequence[str], per_node: int) -> bool:
    """Whether resume.in_job's warm standby step may be the next attempt's step: one of its tasks waits (``waiting``:
    each task's node and local rank) in every slot of every ``chosen`` node. Otherwise the attempt starts a step of its
    own, cold. A node of the standby lost since it started is no reason not to: the step runs with ``--no-kill`` (it
    outlives a node Slurm marks down), and the attempt's nodes are those the exit hook chose without it."""
    return bool(chosen) and all((n, local) in waiting for n in chosen for local in range(per_node))


def lost_nodes(hosts: Mapping[int, str], ended: Mapping[int, Mapping[str, Any]], quiet: Mapping[int, float],
               world: int, silent_s: float) -> tuple[str, ...]:
    """The step's nodes runner calls lost before Slurm does (the step reaper, resume.in_job with spares): a rank
    failed and said so (``ended``: the ranks whose processes wrote their end, with its ``code`` and ``host``), and
    every rank of such a node neither said it ended nor beat for ``silent_s`` (``quiet``: how long each rank's
    heartbeat has not changed: its file's age). srun would wait for Slurm to mark the node down (SlurmdTimeout
    and its ping); a node with any rank that said it ended is reachable and never lost. () while undecided: not
    every rank of the step known (``hosts`` from their records), a rank never seen beating, or one beat lately."""
    if len(hosts) < world or not any(int(e.get("code", 0)) != 0 for e in ended.values()):
        return ()
    silent = [r for r in hosts if r not in ended]
    if not silent or any(quiet.get(r, 0.0) < silent_s for r in silent):
        return ()
    return tuple(sorted({hosts[r] for r in silent} - {hosts[r] for r in ended if r in hosts}))


def silent_nodes(hosts: Mapping[int, str], quiet: Mapping[int, float], world: int, silent_s: float) -> tuple[str, ...]:
    """The step's nodes whose every rank has not beaten for ``silent_s`` while none said it ended: lost, or every rank
    of it stopped; the step reaper asks the node's slurmd which (a step on one node has no peer to fail first, so
    ``lost_nodes`` never names its node). () until every rank of the step is known and seen beating."""
    if len(hosts) < world:
        return ()
    nodes: dict[str, list[int]] = {}
    for rank, host in hosts.items():
        nodes.setdefault(host, []).append(rank)
    return tuple(sorted(n for n, ranks in nodes.items() if all(quiet.get(r, 0.0) >= silent_s for r in ranks)))


def after_exit(outcome: str, attempt: int, job_id: str | None, limits: Limits,
               events: Sequence[Mapping[str, Any]] = (), bad_nodes: Sequence[str] = (),
               successor: str | None = None, in_job: Sequence[str] | None = None) -> Decision:
    """The exit hook's move after ``classify``: restart the training in this allocation, requeue the job, hand over
    to its successor, resubmit it without its bad nodes, stop it for a person, give up, or leave it (to cron).

    ``events`` is the ledger with this exit already recorded (its ``crash``, if the launcher wrote one);
    ``bad_nodes`` the nodes this attempt named (a hang's suspects, the preflight's failing nodes); ``successor``
    the job queued behind this one (resume.successor) that Slurm still holds, if any. Every decision but
    ``hand_over`` cancels it. ``in_job``: the nodes a new step of this job would train on (``step_nodes``), None
    where none can start (not the batch script's loop, or too few good nodes left). With ``resume.in_job`` a crash
    or a hang (a failed preflight only where it named its nodes) restarts there, within resume.max_restarts (the
    in-job restarts count), and a run out of restarts stops for a person in the job, with one ``stopped``.
    """
    used = failures(events)
    if outcome == "failed" and (error := program_error(events)) is not None:
        usage = "it refused its command line (exit 2, a usage error)" if error.get("exit_code") == EXIT_USAGE \
            else "see its rank logs"
        return Decision("stop", f"the program cannot train: {error.get('detail') or usage}")
    if outcome == "failed" and (loop := crash_loop(events)) is not None:
        at = "" if loop.get("step") is None else f", step {loop.get('step')}"
        return Decision("stop", f"crash loop: {loop.get('type')} at {loop.get('frame')}{at}, in two attempts in a row")
    if outcome == "nan":
        return Decision("stop", "non-finite loss or gradients; the newest checkpoint holds finite weights")
    if limits.in_job and job_id and outcome in IN_JOB and (outcome != "preflight_failed" or bad_nodes):
        if used > limits.max_restarts:
            return Decision("stop", f"{outcome}: {used} failed attempts, {used - 1} restarts of "
                                    f"resume.max_restarts={limits.max_restarts} used")
        if in_job is not None:
            named = {n for _, nodes in in_job_ends(events, job_id) for n in nodes} | set(bad_nodes)
            left = [n for n in bad_nodes if n not in in_job]
            back = sorted(n for n in named if n in in_job)
            without = f" without {', '.join(left)}" if left else ""
            again = f" on {', '.join(back)} again (no spare left; its preflight decides)" if back else ""
            return Decision("restart", f"{outcome}; restarted in job {job_id}{without}{again} as attempt "
                                       f"{attempt + 1}", nodes=tuple(in_job))
    if outcome in ("hang", "preflight_failed") and bad_nodes:
        if used > limits.max_restarts:
            return Decision("give_up", f"{outcome} after {used - 1} failed attempts")
        return Decision("resubmit", f"{outcome}; resubmitted without {', '.join(bad_nodes)}")
    if outcome == "superseded":
        return Decision("skip", "superseded: another job owns the run; this one wrote no checkpoint")
    if outcome == "completed":
        return Decision("skip", "training finished")
    if outcome == "cancelled":
        return Decision("skip", "cancelled by the user")
    if outcome in ("timeout", "preempted"):  # never limited by resume.max_restarts
        if successor:
            return Decision("hand_over", f"{outcome}; job {successor} takes over as attempt {attempt + 1}")
        if limits.requeue and job_id:
            return Decision("requeue", f"{outcome}; requeued as attempt {attempt + 1}")
        return Decision("skip", f"{outcome}; slurm.requeue is off, runner cron resubmits it")
    if outcome in ("hang", "failed") and successor:  # what cron would do, without waiting for cron
        if used > limits.max_restarts:
            return Decision("give_up", f"{outcome} after {used - 1} restarts of resume.max_restarts="
                                       f"{limits.max_restarts}")
        delay = backoff(used, limits)
        return Decision("hand_over", f"{outcome}; job {successor} takes over as attempt {attempt + 1}"
                                     + (f" after a backoff of {delay:.0f} s" if delay else ""), delay)
    if outcome == "hang":  # nobody named: the same nodes may do, cron resubmits (with backoff)
        return Decision("skip", "hang: runner cron decides about resubmission (with backoff)")
    if outcome == "preflight_failed":  # a bad node or interface would fail again: a person must look
        return Decision("skip", "preflight failed: fix the node or interface it names, then `runner resume`")
    return Decision("skip", "failed: runner cron decides about resubmission (with backoff)")


# ---------------------------------------------------------------------------------------------------------------
# runner cron: resubmit, wait, give up or leave alone


def settled(rec: Records) -> Decision | None:
    """Cron's decision from the run's own records alone, or None when it depends on Slurm's answer."""
    if rec.finished:
        return Decision("skip", "finished")
    if cancelled_by_user(rec.events):
        return Decision("skip", "cancelled by the user")
    if "gave_up" in _names(rec.events):
        return Decision("skip", "already gave up")
    for e in reversed(rec.events):  # stopped for a person (NaN, crash loop) since the last submission or resume
        if e["event"] == "stopped":
            return Decision("skip", f"stopped: {e.get('reason')}; waiting for `runner resume`")
        if e["event"] == "submitted" or (e["event"] == "resubmitted" and e.get("by") == "user"):
            break
    if not rec.job_id:
        return Decision("skip", "never submitted")
    outcomes = [e.get("outcome") for e in rec.events if e["event"] == "exit"]
    if outcomes and outcomes[-1] == "preflight_failed":
        return Decision("skip", "preflight failed: fix the node or interface it names, then `runner resume`")
    return None


def next_action(rec: Records, job: JobInfo | None, limits: Limits, now: float, asked: bool = True,
                heir: JobInfo | None = None) -> Decision:
    """Cron's decision for one run: skip, wait, resubmit (with exponential backoff) or give_up.

    ``job`` is Slurm's answer for ``rec.job_id`` (None when Slurm does not know it any more); ``asked`` is False
    when Slurm could not be asked at all (its commands failed or timed out). Then a job that the ledger shows
    alive may well be training: resubmitting would start a second trainer, so cron waits for an answer.
    ``heir`` is Slurm's answer for ``rec.successor``: a successor still queued or running takes the run over.
    """
    early = settled(rec)
    if early is not None:
        return early
    name = rec.job_id
    if not asked and job_alive(rec.events):
        return Decision("wait", f"Slurm cannot be asked and the ledger shows job {name} alive (no exit recorded); "
                                "trying again next time")
    if job is not None and not job.terminal:
        return Decision("skip", f"job {name} is {job.state}")
    if rec.successor and heir is not None and not heir.terminal:
        return Decision("skip", f"job {name} ended; its successor job {rec.successor} is {heir.state} and takes over")
    status = rec.exit_status
    state = job.state if job is not None else "UNKNOWN"
    if state == "CANCELLED" and (status.get("event") if status else None) not in ("timeout", "preempted"):
        return Decision("skip", f"job {name} was cancelled (scancel)")
    if state not in RESUBMIT_STATES and state not in ("COMPLETED", "CANCELLED", "UNKNOWN"):
        return Decision("skip", f"job {name} is {state}")
    code = status.get("exit_code") if status else None
    reason = f"job {name} ended {state}" + (f" (exit {code})" if code is not None else "")
    ended = max((e["time"] for e in rec.events if e["event"] == "exit"), default=0.0)
    if state in SLURM_REQUEUES and limits.requeue and now < ended + REQUEUE_GRACE_S:
        # Slurm requeues a --requeue job itself after a node failure; resubmitting too would run it twice.
        return Decision("wait", f"{reason}; Slurm requeues it itself ({ended + REQUEUE_GRACE_S - now:.0f} s grace)")
    failed = failures(rec.events, ended=True)
    if failed > limits.max_restarts:
        return Decision("give_up", f"{reason}; {failed - 1} restarts used of resume.max_restarts={limits.max_restarts}")
    last = max((e["time"] for e in rec.events if e["event"] in ("resubmitted", "requeued", "exit")), default=0.0)
    delay = backoff(failed, limits)
    if now < last + delay:
        return Decision("wait", f"{reason}; backoff {delay:.0f} s, {last + delay - now:.0f} s left")
    return Decision("resubmit", reason)


# ---------------------------------------------------------------------------------------------------------------
# runner status: the run's state


def local_state(rec: Records) -> str:
    """State from the run directory alone (the last word for local runs and when the scheduler forgot)."""
    if rec.finished:
        return "completed"
    events, status = rec.events, rec.exit_status
    if cancelled_by_user(events):
        return "cancelled"
    if status is None or (events and events[-1]["event"] in ("submitted", "resubmitted", "start", "restarted")):
        return "running" if any(e["event"] in ("start", "train_start") for e in events[-3:]) else "pending"
    if status.get("event") == "interrupted":  # a local run a person stopped (Ctrl-C)
        return "interrupted"
    if status.get("exit_code") == EXIT_REQUEUE and status.get("event") in (None, "preempted", "timeout"):
        return "preempted"  # a 75 the exit hook read as a failure (srun's SIGTERM after a rank died) is not one
    return "cancelled" if status.get("cancelled") else "failed"


def local_run_state(rec: Records, alive: bool) -> str:
    """A local run's state: its own records, and ``alive``, whether any of its processes holds its owner lock. A run
    killed outright records no exit: it is ``failed``, never ``running`` forever."""
    if rec.finished:
        return "completed"
    if cancelled_by_user(rec.events):
        return "cancelled"
    if alive:
        return "running"
    ended = False
    for e in reversed(rec.events):
        if e["event"] == "exit":
            ended = True
            break
        if e["event"] in ("submitted", "resubmitted"):
            break
    if rec.events and not ended:
        return "failed"
    return local_state(rec)


def job_alive(events: Sequence[Mapping[str, Any]]) -> bool:
    """The run's job was submitted, started or requeued and has not recorded its exit since.

    Training may be done, the job is not. A requeued job waits in the queue to start again, and so does the
    successor a job handed over to: alive too. A job that restarted its training in itself (resume.in_job) is
    between two steps.
    """
    for e in reversed(events):
        if e["event"] == "exit":
            return False
        if e["event"] in ("start", "submitted", "resubmitted", "requeued", "handed_over", "took_over", "restarted"):
            return True
    return False


def asks_slurm(rec: Records) -> bool:
    """Whether Slurm's view can change the state of a Slurm run: not once it finished and its job exited."""
    return bool(rec.job_id) and (local_state(rec) != "completed" or job_alive(rec.events))


def combine(local: str, job: JobInfo | None) -> str:
    """Slurm's view of the job, corrected by the run directory's own records.

    Slurm knows whether a job is pending or running; the run directory knows whether training finished
    (the ``finished`` marker: a job that exits 0 after SIGTERM is COMPLETED to Slurm but did not finish)
    and whether it stopped to be requeued (exit code 75). When Slurm has forgotten the job (no accounting,
    older than MinJobAge), the run directory's exit status is all there is.
    """
    if local == "completed" or job is None:
        return local
    state = job.runner_state
    if state is None:
        return local
    if not job.terminal:
        return state
    if local == "preempted" or (exit_code(job.exit_code) == EXIT_REQUEUE and local != "failed"):
        return "preempted"  # "failed": the exit hook recorded the 75 as the ranks' answer to a failed one
    if state == "completed":  # the batch script exited 0 but the launcher never wrote `finished`
        return "failed"
    return state


def run_state(rec: Records, job: JobInfo | None, heir: JobInfo | None = None) -> str:
    """pending, running, completed, failed, cancelled, timeout or preempted. ``heir`` is Slurm's answer for the
    successor: once the run's job ended, a successor still queued or running is the run's state."""
    state = combine(local_state(rec), job)
    if state != "completed" and (job is None or job.terminal) and heir is not None and not heir.terminal:
        return heir.runner_state or state
    return state


# ---------------------------------------------------------------------------------------------------------------
# runner resume


def resume_action(rec: Records, job: JobInfo | None = None, asked: bool = True, force: bool = False,
                  heir: JobInfo | None = None) -> Decision:
    """A user's resume starts a stopped run again (it lifts a cancel); never a second job next to a live one.

    ``job`` is Slurm's answer for the run's job (None: Slurm does not know it, or it was not asked: a local run),
    ``asked`` False when Slurm could not be asked. A job Slurm reports pending or running is refused, whatever
    ``force`` says: cancel it first. When Slurm cannot be asked and the ledger shows the job alive, only ``force``
    (the user knows it ended, e.g. after `scancel` went through) resubmits. ``heir`` (the successor's answer) is
    refused alike: it takes the run over by itself.
    """
    if rec.finished:
        return Decision("skip", "already finished; nothing to do")
    for live in (job, heir):
        if live is not None and not live.terminal:
            return Decision("refuse", f"job {live.job_id} is {live.state}: one job trains a run at a time. "
                                      "hint: `runner cancel` it first (or let it end), then resume")
    if not asked and rec.job_id and job_alive(rec.events) and not force:
        return Decision("refuse", f"Slurm cannot be asked whether job {rec.job_id} ended, and the ledger shows it "
                                  "alive (no exit recorded). hint: once you know it ended, `runner resume --force`")
    return Decision("resubmit", "runner resume")


# ---------------------------------------------------------------------------------------------------------------
# Failure classes: a crash loop


def same_crash(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    """Two attempts ended with the same exception type, raised at the same line, at the same step."""
    if not a or not b or a.get("type") is None or a.get("step") is None:
        return False
    return all(a.get(k) == b.get(k) for k in ("type", "frame", "step"))


def program_error(events: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """When the last exit was the launcher's "the program cannot train" (a command that does not exist, a program that
    exits 0 without a step, a Trainer of another world size) or the program's usage error (exit 2: its command line
    refused): the launcher's ledger entry saying why ({"exit_code": 2} or {} when it wrote none). Another attempt
    would end the same way: the command and the config must change, in a new submission."""
    exits = [e for e in events if e["event"] == "exit"]
    if not exits or exits[-1].get("exit_code") not in (EXIT_PROGRAM, EXIT_USAGE):
        return None
    if exits[-1].get("exit_code") == EXIT_USAGE:
        return {"exit_code": EXIT_USAGE}
    return next((e for e in reversed(events) if e["event"] == "program_error"), {})


def crash_loop(events: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The crash that ended each of the last two failed attempts since the user last submitted or resumed
    the run, when it is the same one (``same_crash``); else None. Resubmitting would only fail a third time."""
    since: list[Mapping[str, Any]] = []
    for e in events:
        if e["event"] == "submitted" or (e["event"] == "resubmitted" and e.get("by") == "user"):
            since = []
        elif e["event"] == "exit" and e.get("outcome") == "failed":
            since.append(e)
    if len(since) >= 2 and same_crash(since[-1].get("crash"), since[-2].get("crash")):
        return since[-1]["crash"]  # type: ignore[no-any-return]
    return None


# ---------------------------------------------------------------------------------------------------------------
# resume.successor: the job queued behind the run's job takes it over, or steps aside


def take_over(rec: Records, job_id: str, after: str, limits: Limits) -> Decision:
    """A successor job's first move (its batch script, before any rank starts): train or skip (step aside, exit 78).

    ``job_id`` is the successor, ``after`` the job it was queued behind. It trains only where that job still owns
    the run (or it owns the run itself already: Slurm requeued it), and only when the run needs another attempt:
    a finished, cancelled, stopped or given-up run, a run resubmitted as another job, or a run out of restarts is
    left alone (the exit hook cancels the successor then; this is the check for when that scancel did not happen).
    """
    early = settled(rec)
    if early is not None:
        return Decision("skip", early.reason)
    if rec.job_id == job_id:
        return Decision("train", f"job {job_id} owns the run already (requeued by Slurm)")
    if rec.job_id != after:
        return Decision("skip", f"job {rec.job_id} owns the run, not job {after} that job {job_id} follows")
    failed = failures(rec.events, ended=True)
    if failed > limits.max_restarts:
        return Decision("skip", f"{failed - 1} restarts used of resume.max_restarts={limits.max_restarts}; runner "
                                "cron gives up")
    return Decision("train", f"job {after} ended; job {job_id} takes over as attempt {attempt(rec.events) + 1}")


# ---------------------------------------------------------------------------------------------------------------
# Stragglers: one alert per slow rank per attempt


def straggler_alerts(events: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The ledger's ``straggler`` records that still need their alert, oldest first: one per rank per attempt.

    The job's watchdog records a rank once per attempt, after two slow reports in a row (a persistent straggler,
    not a blip); whoever queues the alert (the exit hook, ``runner cron``) records ``straggler_alert`` for it, so a
    rank slow again in a later attempt is news again, and nothing is said twice.
    """
    seen = {(e.get("attempt"), e.get("rank")) for e in events if e["event"] == "straggler_alert"}
    out = []
    for e in events:
        key = (e.get("attempt"), e.get("rank"))
        if e["event"] == "straggler" and key not in seen:
            seen.add(key)
            out.append(e)
    return out
