"""Every recovery decision of runner (runner.policy) as one table per question, one row per case.

The ledgers are what the hooks, the launcher, cron and submit record (events submitted, start, train_start,
preflight, exit with its outcome, requeued, resubmitted, cancelled, gave_up, finished); Slurm's answers are
parsed from the output recorded on a real Slurm 22.05 (tests/fixtures/slurm/, see test_slurm_parsers.py).
Pure functions only: no cluster, no files, no clock.
"""

from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path
from typing import Any

import pytest

from runner import policy, slurmstates
from runner.alerts import nextstep
from runner.host import slurm
from runner.policy import Records
from runner.slurmstates import JobInfo
from runner.spec import schema


def Limits(**overrides: Any) -> policy.Limits:  # noqa: N802 -- reads as the dataclass it builds
    """The limits of a config at the schema's defaults, ``overrides`` replaced (the policy itself has none)."""
    return dataclasses.replace(policy.Limits.of(schema.fill_defaults({}, schema.SCHEMA)),  # type: ignore[arg-type]
                               **overrides)


pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent / "fixtures" / "slurm"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
T0 = 1_790_000_000.0  # the submission; every ledger time below is relative to it


def slurm_says(name: str) -> JobInfo:
    """Slurm's answer about a job, parsed from a real recording (``sacct_TIMEOUT.txt``, ``squeue_RUNNING.txt``)."""
    parse = {"sacct": slurm.parse_sacct, "squeue": slurm.parse_squeue, "scontrol": slurm.parse_scontrol}
    got = parse[name.split("_", 1)[0]]((FIXTURES / name).read_text(), MANIFEST["files"][name]["job_id"])
    assert got is not None, name
    return got


def at(t: float, event: str, **fields: Any) -> dict[str, Any]:
    return {"time": T0 + t, "event": event, **fields}


def exited(t: float, outcome: str, code: int, attempt: int = 1, job: str = "4") -> dict[str, Any]:
    return at(t, "exit", job_id=job, exit_code=code, signal="USR2" if code == 75 else "none", outcome=outcome,
              attempt=attempt, cause=None if outcome in ("completed", "cancelled") else "Killed")


def status_of(e: dict[str, Any]) -> dict[str, Any]:
    """exit_status.json as the exit hook writes it next to the ledger's exit event."""
    return {"exit_code": e["exit_code"], "job_id": e["job_id"], "attempt": e["attempt"], "signal": e["signal"],
            "event": e["outcome"], "time": e["time"]}


def rec(events: list[dict[str, Any]], *, finished: bool = False, job: str | None = "4",
        status: dict[str, Any] | None = None, successor: str | None = None) -> Records:
    """A run's records; exit_status.json follows the ledger's last exit unless given."""
    exits = [e for e in events if e["event"] == "exit"]
    if status is None and exits:
        status = status_of(exits[-1])
    return Records(events=events, exit_status=status, finished=finished, job_id=job, successor=successor)


# Ledgers (job 4 unless said otherwise)
SUBMIT = [at(0, "submitted", scheduler="slurm", job_id="4", world_size=4)]
STARTED = [*SUBMIT, at(10, "start", job_id="4", nodes="n[1-2]", restart_count=0)]
TRAINING = [*STARTED, at(14, "preflight", status="ok", duration_s=3.1, summary="ok"),
            at(15, "train_start", step=0, lost_steps=0, attempt=1, resumed_from=None)]
FAILED = [*TRAINING, exited(100, "failed", 1)]
FINISHED = [*TRAINING, at(95, "finished", step=80), exited(100, "completed", 0)]
TRAINING_DONE = [*TRAINING, at(95, "finished", step=80)]  # the exit hook has not run yet
CANCELLED = [*TRAINING, at(50, "cancelled", job_id="4"), exited(52, "cancelled", 76)]
RESUMED_AFTER_CANCEL = [*CANCELLED, at(300, "resubmitted", job_id="9", reason="runner resume", attempt=2)]
GAVE_UP = [*FAILED, at(160, "gave_up", reason="job 4 ended FAILED (exit 1); 0 restarts used of ...")]
PREFLIGHT_FAILED = [*STARTED, at(14, "preflight", status="failed", duration_s=3.0, summary="n2: eth0 down"),
                    exited(15, "preflight_failed", 77)]
PREFLIGHT_THEN_FAILED = [*PREFLIGHT_FAILED, at(200, "resubmitted", job_id="4", reason="runner resume", attempt=2),
                         at(210, "start", job_id="4", restart_count=0), exited(300, "failed", 1, attempt=2)]
TIMEOUT_REQUEUED = [*TRAINING, exited(100, "timeout", 75), at(100.5, "requeued", job_id="4", reason="timeout",
                                                                attempt=2)]
REQUEUED_RUNNING = [*TIMEOUT_REQUEUED, at(130, "start", job_id="4", restart_count=1),
                    at(135, "train_start", step=60, lost_steps=3, attempt=2, resumed_from="step-0000060")]
PREEMPTED = [*TRAINING, exited(100, "preempted", 75)]
# A rank was killed; srun's --kill-on-bad-exit SIGTERM made the others exit 75 before they saw the lost peer: the exit
# hook (no signal to the batch script) records a failure, and the batch script still exits 75.
KILLED_RANK_75 = [*TRAINING, {**exited(100, "failed", 75), "signal": "none"}]
NODE_FAIL = [*TRAINING, exited(100, "failed", 1)]  # srun lost a rank on the dead node; the hook ran on n1
NODE_FAIL_NO_HOOK = TRAINING  # the batch host itself died: no exit recorded
RESUBMITTED_ONCE = [*FAILED, at(200, "resubmitted", job_id="9", reason="job 4 ended FAILED (exit 1)", attempt=2),
                    at(210, "start", job_id="9", restart_count=0), exited(300, "failed", 1, attempt=2, job="9")]
RESUBMITTED_TWICE = [*RESUBMITTED_ONCE, at(400, "resubmitted", job_id="12", reason="...", attempt=3),
                     at(410, "start", job_id="12", restart_count=0), exited(500, "failed", 1, attempt=3, job="12")]
RESUBMITTED_PENDING = [*FAILED, at(200, "resubmitted", job_id="9", reason="job 4 ended FAILED (exit 1)", attempt=2)]
# Slurm requeued a --requeue job itself after node failures: only the batch script's start events show it.
SLURM_REQUEUED_TWICE = [*TRAINING, at(200, "start", job_id="4", restart_count=1),
                        at(400, "start", job_id="4", restart_count=2), exited(500, "failed", 1, attempt=3)]
FOUR_ATTEMPTS_ONE_OURS = [*TIMEOUT_REQUEUED, at(130, "start", job_id="4", restart_count=1),
                          at(300, "start", job_id="4", restart_count=2), at(500, "start", job_id="4", restart_count=3)]
LOCAL_CANCELLED = [at(0, "submitted", scheduler="local", world_size=2), exited(40, "failed", 76, job="")]


# ---------------------------------------------------------------------------------------------------------------
# Slurm's words -> runner's states (the vocabulary table)

SLURM_WORDS = [
    ("CANCELLED by 0", "cancelled", True), ("COMPLETING", "running", False), ("RUNNING+", "running", False),
    ("OUT_OF_MEMORY", "failed", True), ("DEADLINE", "timeout", True), ("", None, False), ("NEW_STATE", None, False),
    ("PENDING", "pending", False), ("REQUEUED", "pending", False), ("REQUEUE_HOLD", "pending", False),
    ("SUSPENDED", "running", False), ("NODE_FAIL", "failed", True), ("BOOT_FAIL", "failed", True),
    ("PREEMPTED", "preempted", True), ("REVOKED", "cancelled", True), ("TIMEOUT", "timeout", True),
    ("COMPLETED", "completed", True), ("FAILED", "failed", True),
]


@pytest.mark.parametrize("raw, state, terminal", SLURM_WORDS, ids=[w[0] or "empty" for w in SLURM_WORDS])
def test_slurm_words(raw: str, state: str | None, terminal: bool) -> None:
    assert slurmstates.normalize(raw) == state
    assert (slurmstates.base_state(raw) in slurmstates.TERMINAL) == terminal
    assert JobInfo("1", slurmstates.base_state(raw), "squeue").terminal == terminal


def test_every_terminal_word_is_a_state() -> None:
    assert slurmstates.TERMINAL <= set(slurmstates.SLURM_STATES)
    assert set(slurmstates.RESUBMIT_STATES) <= slurmstates.TERMINAL
    assert set(slurmstates.SLURM_REQUEUES) <= slurmstates.TERMINAL


# ---------------------------------------------------------------------------------------------------------------
# How many restarts a run has used

RESTARTS = [
    pytest.param([], 0, id="empty ledger"),
    pytest.param(SUBMIT, 0, id="submitted"),
    pytest.param(TRAINING, 0, id="first attempt training"),
    pytest.param(FAILED, 0, id="first attempt failed"),
    pytest.param(TIMEOUT_REQUEUED, 1, id="requeued by the hook"),
    pytest.param(REQUEUED_RUNNING, 1, id="requeued and started again: one restart, not two"),
    pytest.param(RESUBMITTED_ONCE, 1, id="resubmitted by cron"),
    pytest.param(RESUBMITTED_TWICE, 2, id="resubmitted twice"),
    pytest.param(SLURM_REQUEUED_TWICE, 2, id="Slurm's own requeues, counted by start events"),
    pytest.param(FOUR_ATTEMPTS_ONE_OURS, 3, id="more starts than recorded requeues: the starts win"),
    pytest.param(CANCELLED, 0, id="cancelled"),
    pytest.param(RESUMED_AFTER_CANCEL, 1, id="resumed after a cancel"),
]


@pytest.mark.parametrize("events, used", RESTARTS)
def test_restarts_used(events: list[dict[str, Any]], used: int) -> None:
    assert policy.restarts_used(events) == used
    assert policy.attempt(events) == used + 1


# ---------------------------------------------------------------------------------------------------------------
# The exit hook: what the step's end means (classify), then requeue, give up or leave it (after_exit)

LEAD = Limits(signal_lead_s=120)
CLASSIFY = [
    pytest.param(rec(TRAINING_DONE, finished=True), 0, None, LEAD, "completed", id="finished"),
    pytest.param(rec(TRAINING_DONE, finished=True), 75, 100.0, LEAD, "completed", id="finished wins over exit 75"),
    pytest.param(rec([*TRAINING, at(50, "cancelled", job_id="4")]), 76, None, LEAD, "cancelled",
                 id="cancelled by the user (stopped by SIGTERM)"),
    pytest.param(rec([*TRAINING, at(50, "cancelled", job_id="4")]), 75, 100.0, LEAD, "cancelled",
                 id="cancelled by the user wins over exit 75"),
    pytest.param(rec([*CANCELLED, at(300, "resubmitted", job_id="9", attempt=2)]), 1, None, LEAD, "failed",
                 id="a cancel before a resume no longer holds"),
    pytest.param(rec(STARTED), 77, None, LEAD, "preflight_failed", id="preflight 77"),
    pytest.param(rec(TRAINING), 75, 150.0, LEAD, "timeout", id="75 near the time limit -> timeout"),
    pytest.param(rec(TRAINING), 75, 180.0, LEAD, "timeout", id="75 at lead + 60 s -> timeout"),
    pytest.param(rec(TRAINING), 75, 0.0, LEAD, "timeout", id="75 at the limit -> timeout"),
    pytest.param(rec(TRAINING), 75, 181.0, LEAD, "preempted", id="75 far from the limit -> preempted"),
    pytest.param(rec(TRAINING), 75, None, LEAD, "preempted", id="75, time left unknown -> preempted"),
    pytest.param(rec(TRAINING), 75, 350.0, Limits(signal_lead_s=300), "timeout", id="75 with a longer lead"),
    pytest.param(rec(TRAINING), 1, None, LEAD, "failed", id="exit 1 -> failed"),
    pytest.param(rec(TRAINING), 0, None, LEAD, "failed", id="exit 0 without `finished` -> failed"),
    pytest.param(rec(TRAINING), 76, None, LEAD, "failed", id="stopped by SIGTERM, not by the user -> failed"),
    pytest.param(rec(TRAINING), 137, 10.0, LEAD, "failed", id="killed -> failed"),
]


@pytest.mark.parametrize("records, rc, seconds_left, limits, outcome", CLASSIFY)
def test_classify(records: Records, rc: int, seconds_left: float | None, limits: Limits, outcome: str) -> None:
    assert policy.classify(records, rc, seconds_left, limits) == outcome
    assert policy.classify(records, rc, seconds_left, limits, job_id=records.job_id) == outcome  # the owner's end


# A rank killed by the stop signal itself (128 + N) before its handler was in place: a time limit or a preemption
# as if it had checkpointed (it resumes from the newest checkpoint), never a failure counted against restarts.
STOPPED_BY = [
    pytest.param(140, signal.SIGUSR2, 100.0, "timeout", id="killed by USR2 near the limit -> timeout"),
    pytest.param(140, signal.SIGUSR2, None, "preempted", id="killed by USR2, time left unknown -> preempted"),
    pytest.param(138, signal.SIGUSR1, 100.0, "timeout", id="another configured signal"),
    pytest.param(140, None, 100.0, "failed", id="140 without the batch script getting a signal -> failed"),
    pytest.param(140, signal.SIGUSR1, 100.0, "failed", id="killed by a signal other than the one received -> failed"),
    pytest.param(1, signal.SIGUSR2, 100.0, "failed", id="exit 1 after the signal -> failed"),
    pytest.param(75, None, 100.0, "timeout", id="75 after TERM (got None) is the launcher's own stop"),
]


@pytest.mark.parametrize("rc, got, seconds_left, outcome", STOPPED_BY)
def test_a_rank_killed_by_the_stop_signal_is_not_a_failure(rc: int, got: int | None, seconds_left: float | None,
                                                           outcome: str) -> None:
    assert policy.classify(rec(TRAINING), rc, seconds_left, LEAD, got=got) == outcome


# srun's --kill-on-bad-exit sends SIGTERM to the ranks a failed one left, and a program's ranks may then stop with
# exit 75 as after a notice. Only the batch script's own signal (the notice, or Slurm's TERM) makes a 75 a stop.
NOT_ASKED = [
    pytest.param(75, None, True, "preempted", id="75 after Slurm's TERM to the job -> preempted"),
    pytest.param(75, signal.SIGUSR2, True, "preempted", id="75 after the notice -> preempted"),
    pytest.param(75, None, False, "failed", id="75 with no signal to the batch script: srun's kill after a failure"),
    pytest.param(140, signal.SIGUSR2, True, "preempted", id="killed by the notice itself"),
]


@pytest.mark.parametrize("rc, got, asked, outcome", NOT_ASKED)
def test_a_stop_needs_a_signal_to_the_job(rc: int, got: int | None, asked: bool, outcome: str) -> None:
    assert policy.classify(rec(TRAINING), rc, None, LEAD, got=got, asked=asked) == outcome


# A second job on the same run: job 4 trains, then job 9 is submitted and made the owner (its id in job_id).
TWO_JOBS = [*TRAINING, at(200, "resubmitted", job_id="9", reason="...", attempt=2),
            at(210, "start", job_id="9", restart_count=0)]
SUPERSEDED = [
    pytest.param(rec(TWO_JOBS, job="9"), 78, "4", "superseded", id="the old job stopped itself (exit 78)"),
    pytest.param(rec(TWO_JOBS, job="9"), 1, "4", "superseded", id="the old job failed: not the run's failure"),
    pytest.param(rec(TWO_JOBS, job="9"), 75, "4", "superseded", id="the old job checkpointed on a signal: no requeue"),
    pytest.param(rec(TWO_JOBS, job="9", finished=True), 0, "4", "superseded",
                 id="the owner finished: not the old job's completion"),
    pytest.param(rec(TWO_JOBS, job="9"), 1, "9", "failed", id="the owner's own end is classified as usual"),
    pytest.param(rec(TRAINING, job=None), 1, "4", "failed", id="no job_id file: nobody else owns it"),
    pytest.param(rec(TWO_JOBS, job="9"), 78, None, "superseded", id="exit 78 alone"),
]


@pytest.mark.parametrize("records, rc, job, outcome", SUPERSEDED)
def test_a_superseded_job_is_classified_first(records: Records, rc: int, job: str | None, outcome: str) -> None:
    assert policy.classify(records, rc, 10_000.0, Limits(), job) == outcome
    if outcome == "superseded":  # nothing is requeued, given up or left to cron on its account
        d = policy.after_exit(outcome, 1, job, Limits())
        assert d.action == "skip" and "superseded" in d.reason


AFTER_EXIT = [
    pytest.param("completed", 1, "4", Limits(), "skip", "training finished", id="completed"),
    pytest.param("cancelled", 1, "4", Limits(), "skip", "cancelled by the user", id="cancelled"),
    pytest.param("timeout", 1, "4", Limits(), "requeue", "timeout; requeued as attempt 2", id="timeout -> requeue"),
    pytest.param("preempted", 1, "4", Limits(), "requeue", "preempted; requeued as attempt 2",
                 id="preempted -> requeue"),
    pytest.param("preempted", 3, "4", Limits(max_restarts=3), "requeue", "requeued as attempt 4",
                 id="the last restart allowed"),
    pytest.param("preempted", 4, "4", Limits(max_restarts=3), "requeue", "requeued as attempt 5",
                 id="preemptions never consume max_restarts"),
    pytest.param("timeout", 1, "4", Limits(max_restarts=0), "requeue", "requeued as attempt 2",
                 id="time limits never consume max_restarts, even with max_restarts=0"),
    pytest.param("timeout", 1, "4", Limits(requeue=False), "skip", "slurm.requeue is off",
                 id="requeue off -> left to cron"),
    pytest.param("timeout", 4, "4", Limits(requeue=False, max_restarts=3), "skip", "slurm.requeue is off",
                 id="requeue off, past max_restarts: still left to cron"),
    pytest.param("timeout", 1, None, Limits(), "skip", "runner cron resubmits", id="no job id -> left to cron"),
    pytest.param("failed", 1, "4", Limits(), "skip", "runner cron decides", id="failed -> left to cron"),
    pytest.param("failed", 9, "4", Limits(max_restarts=3), "skip", "runner cron decides",
                 id="failed past max_restarts -> cron gives up"),
    pytest.param("preflight_failed", 1, "4", Limits(), "skip", "preflight failed", id="preflight failed"),
]


@pytest.mark.parametrize("outcome, attempt, job, limits, action, reason", AFTER_EXIT)
def test_after_exit(outcome: str, attempt: int, job: str | None, limits: Limits, action: str, reason: str) -> None:
    d = policy.after_exit(outcome, attempt, job, limits)
    assert d.action == action and reason in d.reason, d


NOT_FOUND = {"event": "program_error", "reason": "not_found", "detail": "no script 'train.py' in /w"}
PROGRAM_EXITS = [
    pytest.param([NOT_FOUND, {"event": "exit", "exit_code": 81}], "stop", "the program cannot train: no script",
                 id="a command that cannot start stops for a person"),
    pytest.param([{"event": "exit", "exit_code": 81}], "stop", "see its rank logs", id="exit 81 without a record"),
    pytest.param([NOT_FOUND, {"event": "exit", "exit_code": 81}, {"event": "exit", "exit_code": 1}], "skip",
                 "runner cron decides", id="an earlier program error does not stop a later crash"),
]


@pytest.mark.parametrize("events, action, reason", PROGRAM_EXITS)
def test_after_exit_of_a_program_that_cannot_train(events: list[dict[str, Any]], action: str, reason: str) -> None:
    d = policy.after_exit("failed", 1, "4", Limits(), events)
    assert d.action == action and reason in d.reason, d


# resume.in_job: a crash or a hang trains again in the same job, on the nodes step_nodes chose

IN_JOB = Limits(in_job=True, max_restarts=2)
STEP = ("n1", "n2")  # the nodes the next step would train on (None: none left)


def failed_attempts(n: int, outcome: str = "failed", restarted: bool = True) -> list[dict[str, Any]]:
    """``n`` attempts of job 4 that ended ``outcome``, each but the last restarted in the job (the last exit is
    the one being decided, recorded already as after_exit sees it)."""
    out: list[dict[str, Any]] = [{"event": "submitted", "job_id": "4"}]
    for i in range(n):
        out += [{"event": "start", "job_id": "4"}, {"event": "exit", "outcome": outcome, "job_id": "4"}]
        if i < n - 1 and restarted:
            out.append({"event": "restarted", "job_id": "4", "attempt": i + 2})
    return out


CRASH = {"type": "RuntimeError", "frame": "m.py:3", "step": 12}
IN_JOB_EXITS = [
    pytest.param("failed", 1, IN_JOB, failed_attempts(1), (), STEP, "restart",
                 "failed; restarted in job 4 as attempt 2", id="a crash restarts in the job"),
    pytest.param("hang", 1, IN_JOB, failed_attempts(1, "hang"), ["n2"], ("n1", "n3"), "restart",
                 "hang; restarted in job 4 without n2 as attempt 2", id="a hang restarts on the spare"),
    pytest.param("preflight_failed", 1, IN_JOB, failed_attempts(1, "preflight_failed"), ["n2"], ("n1", "n3"),
                 "restart", "without n2", id="a node's failed preflight restarts on the spare"),
    pytest.param("preflight_failed", 1, IN_JOB, failed_attempts(1, "preflight_failed"), [], STEP, "skip",
                 "preflight failed", id="the whole world's failed preflight: not retried"),
    pytest.param("failed", 3, IN_JOB, failed_attempts(3), (), STEP, "stop",
                 "failed: 3 failed attempts, 2 restarts of resume.max_restarts=2 used",
                 id="a crash loop in one job stops at max_restarts"),
    pytest.param("hang", 3, IN_JOB, failed_attempts(3, "hang"), ["n2"], ("n1", "n3"), "stop", "resume.max_restarts=2",
                 id="hangs count too"),
    pytest.param("failed", 2, IN_JOB, [*failed_attempts(1, "hang"), {"event": "restarted", "job_id": "4",
                                                                      "bad": ["n1"]},
                                       {"event": "start", "job_id": "4"}, {"event": "exit", "outcome": "failed"}],
                 ["n2"], ("n1",), "restart",
                 "failed; restarted in job 4 without n2 on n1 again (no spare left; its preflight decides) as "
                 "attempt 3", id="a lost node, the spare hung before: the hang's node again, said so"),
    pytest.param("hang", 1, IN_JOB, failed_attempts(1, "hang"), ["n2"], None, "resubmit",
                 "hang; resubmitted without n2", id="no spare left: resubmitted without the node, as before"),
    pytest.param("failed", 1, IN_JOB, failed_attempts(1), (), None, "skip", "runner cron decides",
                 id="no nodes left: the job ends, cron resubmits"),
    pytest.param("failed", 1, Limits(max_restarts=2), failed_attempts(1), (), STEP, "skip", "runner cron decides",
                 id="resume.in_job off: as before"),
    pytest.param("timeout", 1, IN_JOB, failed_attempts(1, "timeout"), (), STEP, "requeue", "requeued",
                 id="a time limit is requeued"),
    pytest.param("preempted", 1, IN_JOB, failed_attempts(1, "preempted"), (), STEP, "requeue", "requeued",
                 id="a preemption is requeued"),
    pytest.param("cancelled", 1, IN_JOB, failed_attempts(1, "cancelled"), (), STEP, "skip", "cancelled",
                 id="a cancel ends the job"),
    pytest.param("completed", 1, IN_JOB, failed_attempts(1, "completed"), (), STEP, "skip", "finished",
                 id="a finished run ends the job"),
    pytest.param("nan", 1, IN_JOB, failed_attempts(1, "nan"), (), STEP, "stop", "non-finite",
                 id="a NaN stops"),
    pytest.param("failed", 2, IN_JOB, [*failed_attempts(1)[:-1], {"event": "exit", "outcome": "failed", "crash": CRASH},
                                       {"event": "restarted", "job_id": "4"}, {"event": "start", "job_id": "4"},
                                       {"event": "exit", "outcome": "failed", "crash": CRASH}], (), STEP, "stop",
                 "crash loop: RuntimeError", id="the same crash twice in a row stops"),
]


@pytest.mark.parametrize("outcome, attempt, limits, events, bad, nodes, action, reason", IN_JOB_EXITS)
def test_after_exit_in_job(outcome: str, attempt: int, limits: Limits, events: list[dict[str, Any]],
                           bad: list[str], nodes: tuple[str, ...] | None, action: str, reason: str) -> None:
    d = policy.after_exit(outcome, attempt, "4", limits, events, bad, None, nodes)
    assert d.action == action and reason in d.reason, d
    assert d.nodes == (nodes if action == "restart" else ())
    said = nextstep.next_step(outcome, d, attempt, limits, None, events)
    assert said and ("restarted in job 4" in said) == (action == "restart"), said


def test_in_job_restarts_count_as_attempts() -> None:
    """Each in-job restart is an attempt (its own number, logs and ledger lines), counted by restarts_used."""
    events = failed_attempts(3)
    assert policy.restarts_used(events) == 2 and policy.attempt(events) == 3 and policy.failures(events) == 3


STEP_NODES = [
    pytest.param(["n1", "n2", "n3"], [], [], 2, ("n1", "n2"), id="a new job: its first nodes, the spare last"),
    pytest.param(["n1", "n2", "n3"], ["n1", "n2"], [], 2, ("n1", "n2"), id="nothing named: the same nodes"),
    pytest.param(["n1", "n2", "n3"], ["n1", "n2"], ["n2"], 2, ("n1", "n3"), id="n2 named: the spare takes its place"),
    pytest.param(["n1", "n2", "n3"], ["n1", "n2"], ["n1"], 2, ("n2", "n3"),
                 id="the first node named: the rendezvous moves to the next one"),
    pytest.param(["n1", "n2", "n3"], ["n1", "n3"], ["n3", "n2"], 2, None, id="the spare named too: none left"),
    pytest.param(["n1", "n2", "n3", "n4"], ["n1", "n3"], ["n3"], 2, ("n1", "n2"),
                 id="the kept node stays, the first free spare joins"),
    pytest.param(["n1", "n2"], ["n1", "n2"], [], 2, ("n1", "n2"), id="no spares, nothing named"),
    pytest.param(["n1", "n2"], ["n1", "n2"], ["n9"], 2, ("n1", "n2"), id="a node outside the job named"),
    pytest.param(["n1"], [], [], 2, None, id="fewer nodes than needed"),
    # doubtful: a hang's node, once; it comes back only when no spare is left
    pytest.param(["n1", "n2", "n3"], ["n1", "n2"], ["n2"], 2, ("n1", "n3"), ["n2"],
                 id="a spare is left: the hang's node waits"),
    pytest.param(["n1", "n2"], ["n2"], ["n1", "n2"], 1, ("n1",), ["n1"],
                 id="the step's node lost, the spare hung before: the hang's node trains again"),
    pytest.param(["n1", "n2", "n3"], ["n1", "n3"], ["n2", "n3"], 2, ("n1", "n2"), ["n2"],
                 id="the last spare lost: the hang's node joins"),
    pytest.param(["n1", "n2"], ["n2"], ["n1", "n2"], 1, None, [], id="nothing doubtful: none left"),
]


@pytest.mark.parametrize("allocation, previous, bad, needed, chosen, doubtful",
                         [p if len(p.values) == 6 else pytest.param(*p.values, [], id=p.id) for p in STEP_NODES])
def test_step_nodes(allocation: list[str], previous: list[str], bad: list[str], needed: int,
                    chosen: tuple[str, ...] | None, doubtful: list[str]) -> None:
    assert policy.step_nodes(allocation, previous, bad, needed, doubtful) == chosen


DOUBTFUL = [  # (each in-job end of the job: its outcome and the nodes it named, Slurm's down nodes now) -> doubtful
    pytest.param([("hang", ["n2"])], [], {"n2"}, id="a hang's node, once"),
    pytest.param([("hang", ["n2"]), ("hang", ["n2"])], [], set(), id="named by two hangs: bad for good"),
    pytest.param([("hang", ["n2"]), ("preflight_failed", ["n2"])], [], set(),
                 id="its preflight failed when it came back"),
    pytest.param([("failed", ["n2"])], [], set(), id="a crash's node cause or a lost node: not doubt"),
    pytest.param([("hang", ["n2"])], ["n2"], set(), id="Slurm reports it down now"),
    pytest.param([("hang", ["n1"]), ("failed", ["n2"])], ["n2"], {"n1"},
                 id="the goodput scenario: the hang's n1 may take the lost n2's place"),
]


@pytest.mark.parametrize("ends, down, doubtful", DOUBTFUL)
def test_doubtful_nodes(ends: list[tuple[str, list[str]]], down: list[str], doubtful: set[str]) -> None:
    assert policy.doubtful_nodes(ends, down) == doubtful


SILENT = [  # (the step's ranks and nodes, each rank's silence, world) -> the nodes every rank of which is silent
    pytest.param({0: "n2", 1: "n2"}, {0: 6.5, 1: 7.0}, 2, ("n2",), id="a step on one node, gone quiet"),
    pytest.param({0: "n2", 1: "n2"}, {0: 6.5, 1: 1.0}, 2, (), id="one rank still beats (a hang of the other)"),
    pytest.param({0: "n1", 1: "n1", 2: "n2", 3: "n2"}, {0: 0.5, 1: 0.4, 2: 9.0, 3: 9.0}, 4, ("n2",),
                 id="two nodes, one silent"),
    pytest.param({0: "n2"}, {}, 1, (), id="never seen beating"),
    pytest.param({0: "n2"}, {0: 7.0, 1: 7.0}, 2, (), id="a rank of the step not yet known"),
]


@pytest.mark.parametrize(("hosts", "quiet", "world", "silent"), SILENT)
def test_silent_nodes(hosts: dict[int, str], quiet: dict[int, float], world: int, silent: tuple[str, ...]) -> None:
    assert policy.silent_nodes(hosts, quiet, world, 6.0) == silent


GONE = [  # (each in-job end of the job: its outcome and the nodes it named) -> nodes no warm standby step may span
    pytest.param([], set(), id="no restart yet"),
    pytest.param([("hang", ["n2"])], set(), id="a hang's node still runs its standby task"),
    pytest.param([("failed", ["n2"])], {"n2"}, id="a crash's node cause or a lost node"),
    pytest.param([("preflight_failed", ["n3"]), ("hang", ["n1"])], {"n3"}, id="a failed preflight's node"),
    pytest.param([("failed", [])], set(), id="a crash that named no node"),
]


@pytest.mark.parametrize(("ends", "gone"), GONE)
def test_gone_nodes(ends: list[tuple[str, list[str]]], gone: set[str]) -> None:
    assert policy.gone_nodes(ends) == gone


BOTH = {("n1", 0), ("n1", 1), ("n2", 0), ("n2", 1), ("n3", 0), ("n3", 1)}
TAKES = [  # (the standby's waiting tasks: node, local rank; the attempt's nodes; ranks per node) -> takes it
    pytest.param(BOTH, ["n1", "n2"], 2, True, id="every slot waits"),
    pytest.param(BOTH, ["n1", "n3"], 2, True, id="the spare in a hang's or a lost node's place"),
    pytest.param(BOTH - {("n2", 1)}, ["n1", "n2"], 2, False, id="a task not yet started (or never)"),
    pytest.param(BOTH - {("n2", 0), ("n2", 1)}, ["n1", "n3"], 2, True, id="no task on a node it skips"),
    pytest.param(BOTH - {("n3", 0)}, ["n1", "n3"], 2, False, id="a slot of the spare never started"),
    pytest.param(BOTH, ["n1", "n2"], 4, False, id="fewer tasks per node than ranks"),
    pytest.param(set(), ["n1", "n2"], 2, False, id="nothing waits"),
    pytest.param(BOTH, [], 2, False, id="no nodes: nothing to train"),
]


@pytest.mark.parametrize(("waiting", "chosen", "per_node", "takes"), TAKES)
def test_standby_takes(waiting: set[tuple[str, int]], chosen: list[str], per_node: int, takes: bool) -> None:
    assert policy.standby_takes(waiting, chosen, per_node) is takes


TWO_BY_TWO = {0: "n1", 1: "n1", 2: "n2", 3: "n2"}


def _ended(*ranks: int, code: int = 1) -> dict[int, dict[str, Any]]:
    return {r: {"code": code, "host": TWO_BY_TWO[r]} for r in ranks}


LOST = [  # (the step's ranks and nodes, the ranks that said they ended, each rank's silence, world) -> nodes lost
    pytest.param(TWO_BY_TWO, _ended(0, 1), {2: 7.0, 3: 6.5}, 4, ("n2",),
                 id="n1's ranks failed on the lost peer; n2's silent 6 s: n2 lost"),
    pytest.param(TWO_BY_TWO, _ended(0, 1), {2: 7.0, 3: 2.0}, 4, (), id="a rank of n2 beat 2 s ago: srun's turn"),
    pytest.param(TWO_BY_TWO, _ended(0, 1), {2: 7.0}, 4, (), id="a rank never seen beating: undecided"),
    pytest.param(TWO_BY_TWO, _ended(0, 1, code=0), {2: 9.0, 3: 9.0}, 4, (), id="its peers finished: no failure"),
    pytest.param(TWO_BY_TWO, _ended(0, 1, 2), {3: 9.0}, 4, (),
                 id="a rank of n2 said it ended: n2 is reachable (its silent rank is srun's to kill)"),
    pytest.param(TWO_BY_TWO, {}, {0: 9.0, 1: 9.0, 2: 9.0, 3: 9.0}, 4, (),
                 id="no rank ended: a hang is the watchdog's"),
    pytest.param({0: "n1", 1: "n1", 2: "n2"}, _ended(0, 1), {2: 9.0}, 4, (), id="a rank without its record: undecided"),
    pytest.param(TWO_BY_TWO, _ended(0, 1, 2, 3, code=75), {}, 4, (), id="every rank ended (a stop): none silent"),
    pytest.param({0: "n1", 1: "n2", 2: "n3"}, {0: {"code": 1, "host": "n1"}, 1: {"code": 1, "host": "n2"}}, {2: 8.0},
                 3, ("n3",), id="three nodes, one rank each: the silent one's node"),
]


@pytest.mark.parametrize("hosts, ended, quiet, world, lost", LOST)
def test_lost_nodes(hosts: dict[int, str], ended: dict[int, dict[str, Any]], quiet: dict[int, float], world: int,
                    lost: tuple[str, ...]) -> None:
    assert policy.lost_nodes(hosts, ended, quiet, world, silent_s=6.0) == lost


# ---------------------------------------------------------------------------------------------------------------
# runner cron: skip, wait, resubmit or give up

NOW = T0 + 1000  # long after every ledger above: no grace or backoff left unless a row says so
NEXT_ACTION = [
    # Settled by the run's own records (Slurm is not even asked)
    pytest.param(rec(FINISHED, finished=True), None, Limits(), NOW, "skip", "finished", id="finished"),
    pytest.param(rec(TRAINING_DONE, finished=True), slurm_says("squeue_RUNNING.txt"), Limits(), NOW, "skip",
                 "finished", id="finished, exit hook still running"),
    pytest.param(rec(CANCELLED), slurm_says("sacct_CANCELLED.txt"), Limits(), NOW, "skip", "cancelled by the user",
                 id="cancelled by the user"),
    pytest.param(rec(GAVE_UP), slurm_says("sacct_FAILED.txt"), Limits(), NOW, "skip", "already gave up",
                 id="gave up"),
    pytest.param(rec([], job=None), None, Limits(), NOW, "skip", "never submitted", id="never submitted"),
    pytest.param(rec(PREFLIGHT_FAILED), slurm_says("sacct_FAILED.txt"), Limits(), NOW, "skip", "preflight failed",
                 id="preflight failed"),
    # The job is still there
    pytest.param(rec(SUBMIT, job="6"), slurm_says("squeue_PENDING.txt"), Limits(), NOW, "skip", "job 6 is PENDING",
                 id="job pending"),
    pytest.param(rec(TRAINING, job="5"), slurm_says("squeue_RUNNING.txt"), Limits(), NOW, "skip",
                 "job 5 is RUNNING", id="job running"),
    pytest.param(rec(TRAINING, job="5"), slurm_says("sacct_RUNNING_lag.txt"), Limits(), NOW, "skip",
                 "job 5 is PENDING", id="job running, accounting lagging"),
    pytest.param(rec(TIMEOUT_REQUEUED, job="8"), slurm_says("sacct_duplicates_REQUEUED_PENDING.txt"), Limits(), NOW,
                 "skip", "job 8 is REQUEUED", id="requeued, waiting to start again"),
    pytest.param(rec(TIMEOUT_REQUEUED, job="8"), slurm_says("scontrol_REQUEUED_PENDING.txt"), Limits(), NOW, "skip",
                 "job 8 is PENDING", id="requeued, pending (controller)"),
    pytest.param(rec(RESUBMITTED_PENDING, job="9"), None, Limits(), NOW, "resubmit", "job 9 ended UNKNOWN (exit 1)",
                 id="resubmitted job unknown to Slurm (exit status of the old job)"),
    pytest.param(rec(FAILED), JobInfo("4", "WEIRD", "squeue"), Limits(), NOW, "skip", "job 4 is WEIRD",
                 id="an unknown word is not an end"),
    # scancel'ed, or ended by Slurm
    pytest.param(rec(FAILED, job="5"), slurm_says("sacct_CANCELLED.txt"), Limits(), NOW, "skip",
                 "job 5 was cancelled (scancel)", id="scancel'ed outside runner"),
    pytest.param(rec(TRAINING, job="5"), slurm_says("scontrol_CANCELLED.txt"), Limits(), NOW, "skip",
                 "was cancelled (scancel)", id="scancel'ed, no exit recorded"),
    pytest.param(rec([*TRAINING, exited(100, "timeout", 75)], job="5"), slurm_says("sacct_CANCELLED.txt"), Limits(),
                 NOW, "resubmit", "job 5 ended CANCELLED (exit 75)", id="cancelled at the time limit -> resubmit"),
    pytest.param(rec(PREEMPTED, job="5"), slurm_says("squeue_CANCELLED.txt"), Limits(), NOW, "resubmit",
                 "ended CANCELLED", id="cancelled by preemption -> resubmit"),
    pytest.param(rec(FAILED, job="4"), JobInfo("4", "REVOKED", "sacct"), Limits(), NOW, "skip", "job 4 is REVOKED",
                 id="revoked (federation) -> skip"),
    # Node failures: Slurm requeues a --requeue job itself
    pytest.param(rec(NODE_FAIL, job="2"), slurm_says("sacct_NODE_FAIL.txt"), Limits(), T0 + 100 + 60, "wait",
                 "Slurm requeues it itself (120 s grace)", id="NODE_FAIL within the 180 s grace -> wait"),
    pytest.param(rec(NODE_FAIL, job="2"), slurm_says("sacct_NODE_FAIL.txt"), Limits(), T0 + 100 + 180, "resubmit",
                 "job 2 ended NODE_FAIL (exit 1)", id="NODE_FAIL after the grace -> resubmit"),
    pytest.param(rec(NODE_FAIL, job="2"), slurm_says("scontrol_NODE_FAIL.txt"), Limits(requeue=False), T0 + 160,
                 "resubmit", "ended NODE_FAIL", id="NODE_FAIL without --requeue -> resubmit at once"),
    pytest.param(rec(NODE_FAIL_NO_HOOK, job="2"), slurm_says("squeue_NODE_FAIL.txt"), Limits(), T0 + 160, "resubmit",
                 "job 2 ended NODE_FAIL", id="NODE_FAIL, batch host lost (no exit recorded): no grace"),
    pytest.param(rec(NODE_FAIL, job="2"), JobInfo("2", "BOOT_FAIL", "sacct"), Limits(), T0 + 200, "wait",
                 "Slurm requeues it itself", id="BOOT_FAIL within the grace -> wait"),
    # Restarts and backoff
    pytest.param(rec(FAILED), slurm_says("sacct_FAILED.txt"), Limits(), NOW, "resubmit", "job 4 ended FAILED (exit 1)",
                 id="failed -> resubmit"),
    pytest.param(rec(FAILED), slurm_says("sacct_FAILED.txt"), Limits(backoff_s=600), T0 + 101, "resubmit",
                 "ended FAILED", id="first failure: no backoff"),
    pytest.param(rec(FAILED, job="3"), slurm_says("sacct_COMPLETED.txt"), Limits(), NOW, "resubmit",
                 "job 3 ended COMPLETED (exit 1)", id="COMPLETED without `finished` -> resubmit"),
    pytest.param(rec([*TRAINING, exited(100, "timeout", 75)], job="1"), slurm_says("sacct_TIMEOUT.txt"),
                 Limits(requeue=False), NOW, "resubmit", "job 1 ended TIMEOUT (exit 75)",
                 id="time limit without requeue -> resubmit"),
    pytest.param(rec(FAILED), JobInfo("4", "OUT_OF_MEMORY", "sacct", exit_code="0:125"), Limits(), NOW, "resubmit",
                 "ended OUT_OF_MEMORY", id="out of memory -> resubmit"),
    pytest.param(rec(FAILED, status={}), None, Limits(), NOW, "resubmit", "job 4 ended UNKNOWN",
                 id="Slurm forgot the job, exit status unreadable -> resubmit"),
    pytest.param(rec(FAILED), slurm_says("sacct_FAILED.txt"), Limits(max_restarts=0), NOW, "give_up",
                 "0 restarts used of resume.max_restarts=0", id="max_restarts=0 -> give_up"),
    pytest.param(rec(RESUBMITTED_TWICE, job="12"), JobInfo("12", "FAILED", "sacct", exit_code="1:0"),
                 Limits(max_restarts=2), NOW, "give_up", "2 restarts used of resume.max_restarts=2",
                 id="max_restarts reached -> give_up"),
    pytest.param(rec(SLURM_REQUEUED_TWICE), slurm_says("sacct_FAILED.txt"), Limits(max_restarts=2), NOW, "give_up",
                 "2 restarts used", id="Slurm's own requeues count toward max_restarts"),
    pytest.param(rec(RESUBMITTED_ONCE, job="9"), JobInfo("9", "FAILED", "sacct"), Limits(backoff_s=60), T0 + 330,
                 "wait", "backoff 60 s, 30 s left", id="backoff -> wait"),
    pytest.param(rec(RESUBMITTED_ONCE, job="9"), JobInfo("9", "FAILED", "sacct"), Limits(backoff_s=60), T0 + 360,
                 "resubmit", "job 9 ended FAILED (exit 1)", id="backoff over -> resubmit"),
    pytest.param(rec(RESUBMITTED_TWICE, job="12"), JobInfo("12", "FAILED", "sacct"), Limits(backoff_s=60), T0 + 610,
                 "wait", "backoff 120 s, 10 s left", id="backoff doubles with each restart"),
    pytest.param(rec(RESUBMITTED_TWICE, job="12"), JobInfo("12", "FAILED", "sacct"), Limits(backoff_s=0), T0 + 500,
                 "resubmit", "ended FAILED", id="backoff_s=0 -> resubmit at once"),
    pytest.param(rec(PREFLIGHT_THEN_FAILED), slurm_says("sacct_FAILED.txt"), Limits(backoff_s=0), NOW, "resubmit",
                 "ended FAILED", id="preflight failed once, resumed, then failed -> resubmit"),
    pytest.param(rec(RESUMED_AFTER_CANCEL, job="9"), JobInfo("9", "FAILED", "sacct"), Limits(backoff_s=0), NOW,
                 "resubmit", "job 9 ended FAILED", id="resumed after a cancel: cron looks after it again"),
]


# Slurm cannot be asked (sacct, squeue and scontrol failed or timed out): cron never resubmits a job the ledger
# shows alive, since it may be training; it waits for an answer.
UNASKED = [
    pytest.param(rec(TRAINING), "wait", "Slurm cannot be asked and the ledger shows job 4 alive",
                 id="start without exit -> wait"),
    pytest.param(rec(SUBMIT), "wait", "job 4 alive", id="submitted, not started -> wait"),
    pytest.param(rec(TIMEOUT_REQUEUED), "wait", "job 4 alive", id="requeued, waiting in the queue -> wait"),
    pytest.param(rec(RESUBMITTED_PENDING, job="9"), "wait", "job 9 alive", id="resubmitted -> wait"),
    pytest.param(rec(FAILED), "resubmit", "job 4 ended UNKNOWN (exit 1)",
                 id="exit recorded by the hook: the job ended -> resubmit"),
    pytest.param(rec(FINISHED, finished=True), "skip", "finished", id="finished: Slurm not needed"),
    pytest.param(rec(CANCELLED), "skip", "cancelled by the user", id="cancelled: Slurm not needed"),
    pytest.param(rec([*FAILED, at(101, "restarted", job_id="4", reason="failed", attempt=2, nodes=["n1"], bad=[])]),
                 "wait", "job 4 alive", id="restarted in the job, its next step not started yet -> wait"),
]


def test_a_job_between_two_in_job_steps_is_running() -> None:
    """The exit hook recorded the exit and the restart; the next step's start is a second away: still running."""
    between = rec([*FAILED, at(101, "restarted", job_id="4", reason="failed", attempt=2, nodes=["n1"], bad=[])])
    assert policy.local_state(between) == "running" and policy.job_alive(between.events)
    assert policy.run_state(between, JobInfo("4", "RUNNING", "squeue")) == "running"


@pytest.mark.parametrize("records, action, reason", UNASKED)
def test_next_action_when_slurm_cannot_be_asked(records: Records, action: str, reason: str) -> None:
    d = policy.next_action(records, None, Limits(), NOW, asked=False)
    assert d.action == action and reason in d.reason, d


@pytest.mark.parametrize("records, job, limits, now, action, reason", NEXT_ACTION)
def test_next_action(records: Records, job: JobInfo | None, limits: Limits, now: float, action: str,
                     reason: str) -> None:
    d = policy.next_action(records, job, limits, now)
    assert d.action == action and reason in d.reason, d
    settled = policy.settled(records)
    if settled is not None:  # decided without Slurm: whatever Slurm says changes nothing
        assert d == settled == policy.next_action(records, None, limits, now)


# ---------------------------------------------------------------------------------------------------------------
# runner status: the run directory's own records, then Slurm's view (combine)

RUN_STATE = [
    # From the run directory alone (a local run, or Slurm forgot the job)
    pytest.param(rec(FINISHED, finished=True), None, "completed", id="finished"),
    pytest.param(rec(TRAINING_DONE, finished=True), None, "completed", id="finished, job still exiting"),
    pytest.param(rec(CANCELLED), None, "cancelled", id="cancelled by the user"),
    pytest.param(rec([*TRAINING, at(50, "cancelled", job_id="4")]), None, "cancelled",
                 id="cancelled, exit not recorded yet"),
    pytest.param(rec(SUBMIT), None, "pending", id="submitted, not started"),
    pytest.param(rec(STARTED), None, "running", id="batch script started"),
    pytest.param(rec(TRAINING), None, "running", id="training"),
    pytest.param(rec(REQUEUED_RUNNING), None, "preempted",
                 id="requeued and training again: the last exit status, until Slurm says RUNNING"),
    pytest.param(rec(RESUBMITTED_PENDING, job="9"), None, "running",
                 id="resubmitted: the old attempt's train_start is among the last three events"),
    pytest.param(rec([*GAVE_UP, at(300, "resubmitted", job_id="9", reason="runner resume", attempt=2)], job="9"),
                 None, "pending", id="resumed after giving up: no start among the last three events"),
    pytest.param(rec(TIMEOUT_REQUEUED), None, "preempted", id="exit 75, requeue recorded"),
    pytest.param(rec(PREEMPTED), None, "preempted", id="exit 75"),
    pytest.param(rec(FAILED), None, "failed", id="exit 1"),
    pytest.param(rec(KILLED_RANK_75), None, "failed",
                 id="exit 75 the hook recorded as a failure (the ranks' answer to srun's SIGTERM)"),
    pytest.param(rec(PREFLIGHT_FAILED), None, "failed", id="preflight failed"),
    pytest.param(rec(LOCAL_CANCELLED, job=None, status={"exit_code": 76, "cancelled": True}), None, "cancelled",
                 id="local run cancelled (exit status marked)"),
    pytest.param(rec(FAILED, status={}), None, "failed", id="exit status without a code"),
    pytest.param(Records(events=[*GAVE_UP, at(170, "resized", change="2x2 -> 1x2")], exit_status=None, job_id="4"),
                 None, "pending", id="exit status unreadable, no start among the last three events"),
    pytest.param(Records(events=[*STARTED, exited(20, "failed", 1)], exit_status=None, job_id="4"), None, "running",
                 id="exit status unreadable, a start among the last three events"),
    # Slurm's view, corrected by the records
    pytest.param(rec(SUBMIT, job="5"), slurm_says("squeue_RUNNING.txt"), "running", id="Slurm: started"),
    pytest.param(rec(TRAINING, job="8"), slurm_says("squeue_REQUEUED_PENDING.txt"), "pending",
                 id="Slurm: requeued, pending"),
    pytest.param(rec(REQUEUED_RUNNING, job="5"), slurm_says("squeue_RUNNING.txt"), "running",
                 id="Slurm: requeued and running again"),
    pytest.param(rec(RESUBMITTED_PENDING, job="6"), slurm_says("squeue_PENDING.txt"), "pending",
                 id="Slurm: resubmitted job pending"),
    pytest.param(rec(FAILED, job="1"), slurm_says("sacct_TIMEOUT.txt"), "timeout", id="Slurm: TIMEOUT"),
    pytest.param(rec(FAILED, job="5"), slurm_says("sacct_CANCELLED.txt"), "cancelled", id="Slurm: CANCELLED"),
    pytest.param(rec(FAILED, job="2"), slurm_says("sacct_NODE_FAIL.txt"), "failed", id="Slurm: NODE_FAIL"),
    pytest.param(rec(FINISHED, finished=True), slurm_says("sacct_FAILED.txt"), "completed",
                 id="`finished` wins over Slurm"),
    pytest.param(rec(FAILED, job="3"), slurm_says("sacct_COMPLETED.txt"), "failed",
                 id="COMPLETED without `finished` -> failed"),
    pytest.param(rec(PREEMPTED), slurm_says("sacct_FAILED.txt"), "preempted", id="exit 75 recorded, Slurm FAILED"),
    pytest.param(rec(TRAINING), JobInfo("9", "FAILED", "sacct", exit_code="75:0"), "preempted",
                 id="Slurm's exit code 75"),
    pytest.param(rec(FAILED), JobInfo("9", "WEIRD", "squeue"), "failed", id="unknown Slurm word: records decide"),
    pytest.param(rec(KILLED_RANK_75), JobInfo("4", "FAILED", "sacct", exit_code="75:0"), "failed",
                 id="Slurm's exit code 75, but the hook recorded a failure (a killed rank; CI stop 46)"),
]


@pytest.mark.parametrize("records, job, state", RUN_STATE)
def test_run_state(records: Records, job: JobInfo | None, state: str) -> None:
    assert policy.run_state(records, job) == state


COMBINE = [  # (the run directory's state, Slurm's answer) -> the state shown
    # live states come from Slurm, whatever the run directory guessed
    ("pending", "squeue_RUNNING.txt", "running"),
    ("running", "squeue_REQUEUED_PENDING.txt", "pending"),
    # final states: Slurm's, unless the run directory knows better
    ("failed", "sacct_TIMEOUT.txt", "timeout"),
    ("failed", "sacct_CANCELLED.txt", "cancelled"),
    ("failed", "sacct_NODE_FAIL.txt", "failed"),
    ("completed", "sacct_FAILED.txt", "completed"),  # `finished` marker wins
    ("failed", "sacct_COMPLETED.txt", "failed"),  # exit 0 without `finished`
    ("preempted", "sacct_FAILED.txt", "preempted"),  # exit 75: requeue me
    ("running", JobInfo("9", "FAILED", "sacct", exit_code="75:0"), "preempted"),
    ("failed", JobInfo("9", "FAILED", "sacct", exit_code="75:0"), "failed"),  # the hook read the 75 as a failure
    # Slurm forgot the job: the run directory is all there is
    ("failed", None, "failed"),
    ("failed", JobInfo("9", "WEIRD", "squeue"), "failed"),
]


@pytest.mark.parametrize("local, job, state", COMBINE)
def test_combine(local: str, job: str | JobInfo | None, state: str) -> None:
    assert policy.combine(local, slurm_says(job) if isinstance(job, str) else job) == state


ASKS_SLURM = [
    pytest.param(rec(SUBMIT), True, id="submitted"),
    pytest.param(rec(FAILED), True, id="failed: Slurm may know better"),
    pytest.param(rec(TRAINING_DONE, finished=True), True, id="finished, job still exiting"),
    pytest.param(rec(FINISHED, finished=True), False, id="finished and exited"),
    pytest.param(rec([], job=None), False, id="no job"),
]


@pytest.mark.parametrize("records, asks", ASKS_SLURM)
def test_asks_slurm(records: Records, asks: bool) -> None:
    assert policy.asks_slurm(records) == asks


# ---------------------------------------------------------------------------------------------------------------
# runner resume

RESUME = [  # (records, Slurm's answer, Slurm asked?, --force) -> decision
    pytest.param(rec(FINISHED, finished=True), None, True, False, "skip", "already finished", id="finished"),
    pytest.param(rec(CANCELLED), slurm_says("sacct_CANCELLED.txt"), True, False, "resubmit", "runner resume",
                 id="cancelled: a resume lifts it"),
    pytest.param(rec(GAVE_UP), slurm_says("sacct_FAILED.txt"), True, False, "resubmit", "runner resume",
                 id="gave up"),
    pytest.param(rec(PREFLIGHT_FAILED), slurm_says("sacct_FAILED.txt"), True, False, "resubmit", "runner resume",
                 id="preflight failed"),
    pytest.param(rec(FAILED), slurm_says("sacct_FAILED.txt"), True, False, "resubmit", "runner resume",
                 id="failed"),
    pytest.param(rec(FAILED), None, True, False, "resubmit", "runner resume", id="failed, Slurm forgot the job"),
    pytest.param(rec(TRAINING, job="5"), None, True, False, "resubmit", "runner resume",
                 id="no exit recorded but Slurm answered it does not know the job: it is gone"),
    # One job trains a run at a time
    pytest.param(rec(TRAINING, job="5"), slurm_says("squeue_RUNNING.txt"), True, False, "refuse",
                 "job 5 is RUNNING: one job trains a run at a time", id="job running -> refuse"),
    pytest.param(rec(TRAINING, job="5"), slurm_says("squeue_RUNNING.txt"), True, True, "refuse", "runner cancel",
                 id="job running, --force -> still refused: cancel first"),
    pytest.param(rec(SUBMIT, job="6"), slurm_says("squeue_PENDING.txt"), True, False, "refuse", "job 6 is PENDING",
                 id="job pending -> refuse"),
    pytest.param(rec(TIMEOUT_REQUEUED, job="8"), slurm_says("scontrol_REQUEUED_PENDING.txt"), True, False, "refuse",
                 "job 8 is PENDING", id="requeued, pending -> refuse"),
    pytest.param(rec(CANCELLED, job="5"), slurm_says("scontrol_CANCELLED.txt"), True, False, "resubmit",
                 "runner resume", id="after `runner cancel` the job ended -> resubmit"),
    pytest.param(rec(TRAINING), None, False, False, "refuse", "Slurm cannot be asked whether job 4 ended",
                 id="Slurm cannot be asked, ledger shows the job alive -> refuse"),
    pytest.param(rec(TRAINING), None, False, True, "resubmit", "runner resume",
                 id="Slurm cannot be asked, --force (the user knows it ended) -> resubmit"),
    pytest.param(rec(FAILED), None, False, False, "resubmit", "runner resume",
                 id="Slurm cannot be asked, exit recorded -> resubmit"),
]


@pytest.mark.parametrize("records, job, asked, force, action, reason", RESUME)
def test_resume_action(records: Records, job: JobInfo | None, asked: bool, force: bool, action: str,
                       reason: str) -> None:
    d = policy.resume_action(records, job, asked, force)
    assert d.action == action and reason in d.reason, d


# What the exit hook's alert says happens next must be what happens: cron resubmits a failed run while restarts
# remain (it says so), gives up after (it says so); a requeue that failed is not announced as a requeue.
NEXT_STEP = [
    pytest.param("failed", 1, Limits(max_restarts=3), None, "runner cron resubmits it", id="failed, restarts left"),
    pytest.param("failed", 4, Limits(max_restarts=3), None, "not retried: 3 restarts used of resume.max_restarts=3",
                 id="failed, no restarts left"),
    pytest.param("timeout", 1, Limits(), True, "requeued as attempt 2", id="timeout, requeued"),
    pytest.param("timeout", 1, Limits(), False, "scontrol requeue failed: runner cron resubmits it",
                 id="timeout, the requeue failed"),
    pytest.param("timeout", 1, Limits(requeue=False), None, "runner cron resubmits it", id="timeout, requeue off"),
    pytest.param("preempted", 4, Limits(max_restarts=3), True, "requeued as attempt 5",
                 id="preempted past max_restarts: requeued all the same"),
    pytest.param("preflight_failed", 1, Limits(), None, "not retried (the same node would fail again)",
                 id="preflight failed"),
    pytest.param("completed", 1, Limits(), None, "nothing: training finished", id="completed"),
]


@pytest.mark.parametrize("outcome, attempt, limits, requeued, says", NEXT_STEP)
def test_alert_says_what_happens_next(outcome: str, attempt: int, limits: Limits, requeued: bool | None,
                                      says: str) -> None:
    step = nextstep.next_step(outcome, policy.after_exit(outcome, attempt, "4", limits), attempt, limits, requeued)
    assert says in step, step
    assert "Not retried automatically" not in step


def test_cron_does_what_the_failed_alert_says() -> None:
    """The alert of a failed run with restarts left promises a resubmission: cron's decision is a resubmission."""
    limits = Limits(max_restarts=3, backoff_s=0)
    step = nextstep.next_step("failed", policy.after_exit("failed", 1, "4", limits), 1, limits)
    assert "resubmits" in step
    assert policy.next_action(rec(FAILED), slurm_says("sacct_FAILED.txt"), limits, NOW).action == "resubmit"


def test_limits_from_a_config() -> None:
    from runner.spec.schema import SCHEMA, fill_defaults

    cfg: Any = {"slurm": {"requeue": False, "signal_lead_s": 300}, "resume": {"max_restarts": 5, "backoff_s": 30}}
    # a run submitted before resume.successor existed has it off: read_resolved fills the schema's defaults
    assert policy.Limits.of(fill_defaults(cfg, SCHEMA)) == policy.Limits(
        requeue=False, signal_lead_s=300, max_restarts=5, backoff_s=30.0, successor=False)
    cfg["resume"]["successor"] = True
    assert policy.Limits.of(cfg).successor


# ---------------------------------------------------------------------------------------------------------------
# resume.successor: job 5 waits behind job 4 (--dependency=afternotok:4); job 6 behind job 5 once 5 took over

HEIR = JobInfo("5", "PENDING", "squeue", reason="Dependency")
HEIR_RUNNING = JobInfo("5", "RUNNING", "squeue")
HEIR_GONE = JobInfo("5", "CANCELLED", "sacct", exit_code="0:0")
QUEUED = [*SUBMIT, at(0.2, "successor_queued", job_id="5", after="4")]
QUEUED_TRAINING = [*QUEUED, *TRAINING[1:]]


def handed_over(ledger: list[dict[str, Any]], t: float, outcome: str, code: int) -> list[dict[str, Any]]:
    return [*ledger, exited(t, outcome, code), at(t + 0.1, "handed_over", job_id="4", successor="5", reason=outcome,
                                                  attempt=2, delay_s=0.0)]


PREEMPTED_HANDED = handed_over(QUEUED_TRAINING, 100, "preempted", 75)
FAILED_HANDED = handed_over(QUEUED_TRAINING, 100, "failed", 1)
TOOK_OVER = [*FAILED_HANDED, at(101, "took_over", job_id="5", after="4"),
             at(101.1, "successor_queued", job_id="6", after="5"), at(101.5, "start", job_id="5", restart_count=0),
             at(106, "train_start", step=40, lost_steps=2, attempt=2, resumed_from="step-0000040")]
TOOK_OVER_FAILED = [*TOOK_OVER, exited(200, "failed", 1, attempt=2, job="5")]
STOPPED_NAN = [*QUEUED_TRAINING, exited(100, "nan", 80), at(100.1, "stopped", job_id="4", reason="non-finite ...")]
WITH = Limits(successor=True, backoff_s=60)
AFTER_EXIT_WITH_SUCCESSOR = [  # (outcome, ledger with this exit, named nodes, limits) -> action, reason, backoff
    pytest.param("preempted", PREEMPTED_HANDED[:-1], (), WITH, "hand_over", "preempted; job 5 takes over as attempt 2",
                 0.0, id="preempted -> the successor, not a requeue"),
    pytest.param("timeout", [*QUEUED_TRAINING, exited(100, "timeout", 75)], (), Limits(requeue=False), "hand_over",
                 "timeout; job 5 takes over", 0.0, id="timeout, slurm.requeue off -> the successor all the same"),
    pytest.param("failed", FAILED_HANDED[:-1], (), WITH, "hand_over", "failed; job 5 takes over as attempt 2", 0.0,
                 id="first failure -> the successor at once"),
    pytest.param("failed", TOOK_OVER_FAILED, (), WITH, "hand_over", "after a backoff of 60 s", 60.0,
                 id="second failure -> the successor after resume.backoff_s"),
    pytest.param("failed", TOOK_OVER_FAILED, (), Limits(successor=True, max_restarts=1), "give_up",
                 "failed after 1 restarts of resume.max_restarts=1", 0.0, id="failures past max_restarts -> give up"),
    pytest.param("hang", [*QUEUED_TRAINING, exited(100, "hang", 79)], (), WITH, "hand_over", "hang; job 5 takes over",
                 0.0, id="hang, nobody named -> the successor"),
    pytest.param("hang", [*QUEUED_TRAINING, exited(100, "hang", 79)], ("n2",), WITH, "resubmit", "without n2", 0.0,
                 id="hang naming a node -> resubmitted without it (the successor would land there)"),
    pytest.param("nan", [*QUEUED_TRAINING, exited(100, "nan", 80)], (), WITH, "stop", "non-finite", 0.0,
                 id="NaN -> stopped for a person"),
    pytest.param("completed", [*QUEUED_TRAINING, exited(100, "completed", 0)], (), WITH, "skip", "training finished",
                 0.0, id="finished"),
    pytest.param("cancelled", [*QUEUED_TRAINING, exited(100, "cancelled", 76)], (), WITH, "skip",
                 "cancelled by the user", 0.0, id="cancelled by the user"),
    pytest.param("preflight_failed", [*QUEUED[:2], exited(15, "preflight_failed", 77)], (), WITH, "skip",
                 "preflight failed", 0.0, id="preflight failed, nobody named -> a person looks"),
    pytest.param("superseded", [], (), WITH, "skip", "superseded", 0.0, id="superseded: not this job's successor"),
]


@pytest.mark.parametrize("outcome, events, bad, limits, action, reason, delay", AFTER_EXIT_WITH_SUCCESSOR)
def test_after_exit_with_a_successor(outcome: str, events: list[dict[str, Any]], bad: tuple[str, ...],
                                     limits: Limits, action: str, reason: str, delay: float) -> None:
    attempt = policy.attempt(events)
    d = policy.after_exit(outcome, attempt, "4", limits, events, bad, successor="5")
    assert (d.action, d.delay_s) == (action, delay) and reason in d.reason, d
    # One restart at most: a hand-over never requeues, and every other decision cancels the successor.
    assert d.action != "requeue"
    if d.action == "hand_over":
        step = nextstep.next_step(outcome, d, attempt, limits, None, events)
        assert "job 5 takes over" in step and "as soon as this job ends" in step, step
    without = policy.after_exit(outcome, attempt, "4", limits, events, bad)  # none queued (or Slurm lost it)
    assert without.action != "hand_over" and (without.action == "requeue") == (outcome in ("preempted", "timeout")
                                                                               and limits.requeue)


TAKE_OVER = [  # (the run's records, the successor, the job it follows) -> train or step aside
    pytest.param(rec(PREEMPTED_HANDED, successor="5"), "5", "4", "train", "job 4 ended; job 5 takes over as attempt 2",
                 id="the job it follows handed over"),
    pytest.param(rec(QUEUED_TRAINING, successor="5"), "5", "4", "train", "takes over",
                 id="the job it follows died with its node (no exit recorded)"),
    pytest.param(rec(TOOK_OVER, job="5", successor="6"), "5", "4", "train", "owns the run already",
                 id="Slurm requeued the successor after it took over"),
    pytest.param(rec([*QUEUED_TRAINING, at(95, "finished", step=80), exited(100, "completed", 0)], finished=True),
                 "5", "4", "skip", "finished", id="finished (its scancel failed, or Slurm kept it pending)"),
    pytest.param(rec([*QUEUED_TRAINING, at(50, "cancelled", job_id="4"), exited(52, "cancelled", 76)]), "5", "4",
                 "skip", "cancelled by the user", id="cancelled by the user"),
    pytest.param(rec(STOPPED_NAN), "5", "4", "skip", "stopped: non-finite", id="stopped for a person"),
    pytest.param(rec([*FAILED_HANDED, at(150, "gave_up", reason="...")]), "5", "4", "skip", "already gave up",
                 id="gave up"),
    pytest.param(rec([*FAILED_HANDED, at(150, "resubmitted", job_id="9", attempt=2)], job="9"), "5", "4", "skip",
                 "job 9 owns the run, not job 4 that job 5 follows", id="resubmitted as another job"),
    pytest.param(rec(TOOK_OVER_FAILED, job="5"), "8", "4", "skip", "job 5 owns the run, not job 4",
                 id="a stale successor of an earlier job"),
    pytest.param(rec(FAILED_HANDED), "5", "4", "train", "takes over", id="failed with restarts left"),
    pytest.param(rec(TOOK_OVER_FAILED, job="5"), "6", "5", "skip", "1 restarts used of resume.max_restarts=1",
                 id="out of restarts (the hook could not cancel it): cron gives up"),
]


@pytest.mark.parametrize("records, job, after, action, reason", TAKE_OVER)
def test_a_successor_takes_over_or_steps_aside(records: Records, job: str, after: str, action: str,
                                               reason: str) -> None:
    d = policy.take_over(records, job, after, Limits(max_restarts=1))
    assert d.action == action and reason in d.reason, d


SUCCESSOR_CRON = [  # (records, Slurm on the run's job, Slurm on the successor) -> cron's decision
    pytest.param(rec(PREEMPTED_HANDED, successor="5"), JobInfo("4", "FAILED", "sacct", exit_code="75:0"), HEIR,
                 "skip", "job 4 ended; its successor job 5 is PENDING and takes over", id="successor pending"),
    pytest.param(rec(FAILED_HANDED, successor="5"), JobInfo("4", "FAILED", "sacct", exit_code="1:0"), HEIR_RUNNING,
                 "skip", "successor job 5 is RUNNING", id="successor starting (not yet the owner)"),
    pytest.param(rec(PREEMPTED_HANDED, successor="5"), JobInfo("4", "FAILED", "sacct", exit_code="75:0"), HEIR_GONE,
                 "resubmit", "job 4 ended FAILED (exit 75)", id="successor cancelled outside runner -> resubmit"),
    pytest.param(rec(FAILED_HANDED, successor="5"), JobInfo("4", "FAILED", "sacct", exit_code="1:0"), None,
                 "resubmit", "job 4 ended FAILED", id="successor unknown to Slurm -> resubmit"),
    pytest.param(rec(QUEUED_TRAINING, successor="5"), HEIR_RUNNING, HEIR, "skip", "is RUNNING",
                 id="the job itself running"),
]


@pytest.mark.parametrize("records, job, heir, action, reason", SUCCESSOR_CRON)
def test_cron_leaves_the_run_to_its_successor(records: Records, job: JobInfo, heir: JobInfo | None, action: str,
                                              reason: str) -> None:
    d = policy.next_action(records, job, Limits(successor=True), NOW, heir=heir)
    assert d.action == action and reason in d.reason, d
    assert policy.next_action(records, None, Limits(), NOW, asked=False).action == "wait"  # the ledger: alive


SUCCESSOR_STATE = [  # (records, Slurm on the run's job, Slurm on the successor) -> runner status
    pytest.param(rec(PREEMPTED_HANDED, successor="5"), JobInfo("4", "FAILED", "sacct", exit_code="75:0"), HEIR,
                 "pending", id="handed over, successor pending"),
    pytest.param(rec(PREEMPTED_HANDED, successor="5"), JobInfo("4", "FAILED", "sacct", exit_code="75:0"),
                 HEIR_RUNNING, "running", id="successor running"),
    pytest.param(rec(PREEMPTED_HANDED, successor="5"), JobInfo("4", "FAILED", "sacct", exit_code="75:0"), HEIR_GONE,
                 "preempted", id="successor gone: the job's own end"),
    pytest.param(rec(QUEUED_TRAINING, successor="5"), HEIR_RUNNING, HEIR, "running", id="the job running"),
    pytest.param(rec([*QUEUED_TRAINING, at(95, "finished", step=80), exited(100, "completed", 0)], finished=True,
                     successor="5"), JobInfo("4", "COMPLETED", "sacct", exit_code="0:0"), HEIR, "completed",
                 id="finished, successor not yet cancelled"),
]


@pytest.mark.parametrize("records, job, heir, state", SUCCESSOR_STATE)
def test_run_state_with_a_successor(records: Records, job: JobInfo, heir: JobInfo, state: str) -> None:
    assert policy.run_state(records, job, heir) == state


def test_resume_refuses_while_a_successor_waits() -> None:
    d = policy.resume_action(rec(PREEMPTED_HANDED, successor="5"), JobInfo("4", "FAILED", "sacct"), heir=HEIR)
    assert d.action == "refuse" and "job 5 is PENDING: one job trains a run at a time" in d.reason
    assert policy.resume_action(rec(PREEMPTED_HANDED, successor="5"), JobInfo("4", "FAILED", "sacct"),
                                heir=HEIR_GONE).action == "resubmit"


# ---------------------------------------------------------------------------------------------------------------
# Stragglers: one alert per rank per attempt


def slow(t: float, rank: int, attempt: int = 1) -> dict[str, Any]:
    return at(t, "straggler", rank=rank, node=f"n{rank}", slow="forward", step=40, compute_x=6.1, data_x=1.0,
              compute_s=0.12, data_s=0.001, attempt=attempt)


def alerted(t: float, rank: int, attempt: int = 1) -> dict[str, Any]:
    return at(t, "straggler_alert", rank=rank, attempt=attempt)


STRAGGLER_ALERTS = [  # (ledger) -> the (attempt, rank) pairs still to alert
    pytest.param(TRAINING, [], id="no straggler"),
    pytest.param([*TRAINING, slow(50, 2)], [(1, 2)], id="a new straggler"),
    pytest.param([*TRAINING, slow(50, 2), alerted(51, 2)], [], id="alerted already"),
    pytest.param([*TRAINING, slow(50, 2), alerted(51, 2), slow(80, 2)], [], id="recorded twice: one alert"),
    pytest.param([*TRAINING, slow(50, 2), slow(60, 3)], [(1, 2), (1, 3)], id="two ranks: one each"),
    pytest.param([*TRAINING, slow(50, 2), alerted(51, 2), *TIMEOUT_REQUEUED[-2:], slow(150, 2, attempt=2)], [(2, 2)],
                 id="slow again in the next attempt: news again"),
    pytest.param([*TRAINING, slow(50, 2), alerted(51, 2), slow(60, 3)], [(1, 3)], id="only the new one"),
]


@pytest.mark.parametrize("events, due", STRAGGLER_ALERTS)
def test_straggler_alerts(events: list[dict[str, Any]], due: list[tuple[int, int]]) -> None:
    assert [(e["attempt"], e["rank"]) for e in policy.straggler_alerts(events)] == due
