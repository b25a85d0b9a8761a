"""Failure classes with budgets: preemptions and time limits are free, bad nodes are left out, a NaN and a crash
loop stop for a person. Table tests of ``runner.policy``, no root, no Slurm."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runner import policy, slurmstates
from runner.alerts import nextstep
from runner.rundir import RunDir
from tests.test_policy import Limits

pytestmark = pytest.mark.unit

BOOM = {"type": "RuntimeError", "frame": "model.py:40 in training_step", "step": 120, "message": "boom"}


def _exit(crash: dict[str, Any] | None, outcome: str = "failed") -> dict[str, Any]:
    return {"event": "exit", "outcome": outcome, "crash": crash}


SUB = {"event": "submitted"}
CRON = {"event": "resubmitted", "by": "cron", "time": 0.0}
USER = {"event": "resubmitted", "by": "user"}
LOOPS = [
    # (ledger, a crash loop?)
    ([SUB, _exit(BOOM), CRON, _exit(BOOM)], True),
    ([SUB, _exit(BOOM), CRON, _exit({**BOOM, "message": "boom at 0x7f3a"})], True),  # the message may differ
    ([SUB, _exit(BOOM), CRON, _exit({**BOOM, "step": 121})], False),  # got further: not a loop
    ([SUB, _exit(BOOM), CRON, _exit({**BOOM, "frame": "data.py:9 in __getitem__"})], False),
    ([SUB, _exit(BOOM), CRON, _exit({**BOOM, "type": "ValueError"})], False),
    ([SUB, _exit(BOOM)], False),  # once is bad luck
    ([SUB, _exit(BOOM), USER, _exit(BOOM)], False),  # the user resumed after the first: give it its chance
    ([SUB, _exit(BOOM), CRON, _exit(BOOM), USER], False),  # a resume lifts the stop
    ([SUB, _exit(BOOM), CRON, _exit(BOOM, "preempted"), CRON, _exit(BOOM)], True),  # a preemption between
    ([SUB, _exit(None), CRON, _exit(None)], False),  # no crash record (killed, OOM): not a loop by this rule
    ([SUB, _exit({"type": "RuntimeError", "frame": None, "step": None}), CRON,
      _exit({"type": "RuntimeError", "frame": None, "step": None})], False),  # no step known: cannot tell
]


@pytest.mark.parametrize(("events", "loop"), LOOPS)
def test_crash_loop_table(events: list[dict[str, Any]], loop: bool) -> None:
    assert (policy.crash_loop(events) is not None) == loop


def test_the_launcher_records_the_raising_line_and_the_earliest_crash_wins(tmp_path: Path) -> None:
    from runner.job.outcome import record_crash

    rd = RunDir(tmp_path)

    def training_step() -> None:
        raise RuntimeError("injected fault at step 7")

    try:
        training_step()
    except RuntimeError as e:
        first = record_crash(rd, 1, 2, 7, e)
    try:
        raise ConnectionError("peer closed")
    except ConnectionError as e:
        record_crash(rd, 1, 0, 7, e)
    assert first["frame"].endswith(f"{Path(__file__).name}:{training_step.__code__.co_firstlineno + 1} in "
                                   "training_step")
    assert rd.first_crash(1)["type"] == "RuntimeError"  # the other rank's error is its echo
    assert rd.first_crash(2) is None


def _x(outcome: str) -> dict[str, Any]:
    return {"event": "exit", "outcome": outcome, "time": 0.0}


START = {"event": "start"}
FAILURES = [
    # (ledger, ended, failed attempts that count against resume.max_restarts)
    ([SUB, START, _x("preempted"), START, _x("timeout"), START, _x("preempted")], False, 0),
    ([SUB, START, _x("failed"), CRON, START, _x("preempted"), START, _x("failed")], False, 2),
    ([SUB, START, _x("hang"), CRON, START, _x("preflight_failed")], False, 2),
    ([SUB, START, START, _x("failed")], False, 2),  # the first attempt died without its exit hook (node lost)
    ([SUB, START], True, 1),  # Slurm says it ended; the hook never ran
    ([SUB, START], False, 0),  # still running
    ([SUB, START, _x("failed"), CRON, START, _x("failed"), USER, START, _x("failed")], False, 1),  # fresh budget
    ([SUB, START, _x("superseded"), START, _x("completed")], False, 0),
]


@pytest.mark.parametrize(("events", "ended", "count"), FAILURES)
def test_what_counts_against_max_restarts(events: list[dict[str, Any]], ended: bool, count: int) -> None:
    assert policy.failures(events, ended=ended) == count


L3 = Limits(max_restarts=3)
LOOPED = [SUB, START, _exit(BOOM), CRON, START, _exit(BOOM)]
AFTER = [
    # (outcome, ledger with this exit, bad nodes, action, reason contains)
    ("failed", LOOPED, (), "stop", "crash loop: RuntimeError at model.py:40 in training_step, step 120"),
    ("failed", [SUB, START, _exit(BOOM)], (), "skip", "runner cron decides"),
    ("nan", [SUB, START, _x("nan")], (), "stop", "non-finite"),
    ("hang", [SUB, START, _x("hang")], ("n2",), "resubmit", "resubmitted without n2"),
    ("hang", [SUB, START, _x("hang")], (), "skip", "runner cron decides"),
    ("preflight_failed", [SUB, START, _x("preflight_failed")], ("n1", "n3"), "resubmit", "without n1, n3"),
    ("preflight_failed", [SUB, START, _x("preflight_failed")], (), "skip", "preflight failed"),
    ("hang", [SUB] + [START, _x("hang"), CRON] * 3 + [START, _x("hang")], ("n2",), "give_up", "hang after 3"),
    ("preempted", [SUB] + [START, _x("preempted")] * 9, (), "requeue", "requeued as attempt"),
]


@pytest.mark.parametrize(("outcome", "events", "nodes", "action", "reason"), AFTER)
def test_the_exit_hooks_move(outcome: str, events: list[dict[str, Any]], nodes: tuple[str, ...], action: str,
                             reason: str) -> None:
    d = policy.after_exit(outcome, policy.attempt(events), "7", L3, events, nodes)
    assert d.action == action and reason in d.reason, d
    step = nextstep.next_step(outcome, d, policy.attempt(events), L3, True, events)
    if action in ("stop", "give_up"):
        assert "runner resume" in step, step
    if action == "resubmit":
        assert step.startswith("resubmitted at once"), step


@pytest.mark.parametrize(("events", "skips"), [
    ([SUB, START, _x("nan"), {"event": "stopped", "reason": "non-finite loss"}], True),
    ([SUB, START, _x("nan"), {"event": "stopped", "reason": "non-finite loss"}, USER], False),
    ([SUB, START, _x("failed")], False),
])
def test_cron_leaves_a_stopped_run_alone_until_resume(events: list[dict[str, Any]], skips: bool) -> None:
    rec = policy.Records(events=events, job_id="7")
    d = policy.settled(rec)
    assert (d is not None and "stopped" in d.reason) == skips


def test_cron_gives_up_on_failures_not_on_preemptions() -> None:
    job = slurmstates.JobInfo("9", "FAILED", "sacct", "1:0")
    preempted = [SUB] + [START, _x("preempted"), CRON] * 5 + [START, _x("failed")]
    assert policy.next_action(policy.Records(events=preempted, job_id="9"), job, L3, now=1e9).action == "resubmit"
    failing = [SUB] + [START, _x("failed"), CRON] * 3 + [START, _x("failed")]
    d = policy.next_action(policy.Records(events=failing, job_id="9"), job, L3, now=1e9)
    assert d.action == "give_up" and "3 restarts used" in d.reason
