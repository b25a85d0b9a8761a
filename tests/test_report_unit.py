"""`runner report`, the unit tier: goodput and its losses, outcomes and bad input, in process (the pages:
tests/test_report.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runner import goodput
from tests.test_report import run_cli

pytestmark = pytest.mark.unit


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "runs").mkdir()
    code, out, err = run_cli(capsys, "report", "nosuchrun", "--root", str(tmp_path / "runs"))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "nosuchrun" in err
    code, _, err = run_cli(capsys, "report", "--root", str(tmp_path / "nowhere"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "nowhere" in err


def _ev(t: float, event: str, **fields: Any) -> dict[str, Any]:
    return {"time": t, "event": event, **fields}


def test_goodput_losses_partition_wall_time() -> None:
    """Submitted at 0, queued 10 s, preflight 5 s, startup 5 s more, trained 100 s (preempted, 0 lost), requeued at
    121 and waited 19 s; second attempt lost 10 steps of 1 s, hung (20 s stall + 10 s to exit), resubmitted by a
    person at 300; third finished at 400 with 200 s kept."""
    events = [_ev(0, "submitted", job_id="1"), _ev(10, "start", job_id="1"),
              _ev(15, "preflight", status="pass", duration_s=5.0), _ev(20, "train_start", step=0, lost_steps=0,
                                                                       attempt=1),
              _ev(120, "exit", outcome="preempted", exit_code=75), _ev(121, "requeued", job_id="1"),
              _ev(140, "start", job_id="1"), _ev(150, "train_start", step=100, lost_steps=0, attempt=2),
              _ev(200, "hang", step=140, summary="hang", nodes=[]), _ev(210, "exit", outcome="hang"),
              _ev(210.5, "stopped", reason="hang"),
              _ev(300, "resubmitted", job_id="2", by="user"), _ev(310, "start", job_id="2"),
              _ev(320, "train_start", step=130, lost_steps=10, attempt=3), _ev(400, "finished", step=200),
              _ev(400, "exit", outcome="completed")]
    runs = goodput.attempts(events)
    assert [(a.number, a.opener, a.outcome, a.then) for a in runs] == [
        (1, "submitted", "preempted", "requeued"), (2, "requeued", "hang", "stopped"),
        (3, "resubmitted", "completed", None)]
    g = goodput.account(runs, created=0.0, end=400.0, productive_s=200.0, kept_step=200, hang_stall_s={2: 20.0})
    assert g.goodput == 0.5 and g.wall_s == 400
    assert g.losses["waiting for Slurm"] == 10 + 1 + 19 + 10  # queue, requeue gap, queue, queue
    assert g.losses["preflight"] == 5 and g.losses["startup"] == 5 + 10 + 10
    assert g.losses["recomputed steps"] == 10  # 10 lost steps x 1 s per kept step
    assert g.losses["hang detection"] == 30  # 20 s stall + 10 s from the summary to the exit
    assert g.losses["stopped for a person"] == 90  # 210 to 300
    assert g.losses["checkpoint stalls"] == (100 + 60 + 80) - 200 - 10 - 30
    assert sum(g.losses.values()) + 200 == pytest.approx(400)


def test_a_running_run_counts_its_unsaved_training_apart() -> None:
    """Still training at 100 s with its newest checkpoint keeping 60 s: the 20 s since are no checkpoint stall."""
    runs = goodput.attempts([_ev(0, "submitted"), _ev(5, "preflight", status="pass", duration_s=5.0),
                             _ev(20, "train_start", step=0, lost_steps=0, attempt=1)])
    g = goodput.account(runs, created=0.0, end=100.0, productive_s=60.0, kept_step=600)
    assert g.goodput == 0.6 and g.losses["since the last checkpoint"] == 20 and g.losses["checkpoint stalls"] == 0
    assert g.losses["preflight"] == 5 and g.losses["startup"] == 15


def test_local_exit_codes_read_as_outcomes() -> None:
    runs = goodput.attempts([_ev(0, "submitted"), _ev(1, "train_start", step=0, lost_steps=0, attempt=1),
                             _ev(5, "exit", exit_code=75), _ev(6, "resubmitted", scheduler="local"),
                             _ev(7, "train_start", step=10, lost_steps=0, attempt=2), _ev(9, "exit", exit_code=0),
                             _ev(10, "resubmitted", scheduler="local"), _ev(11, "train_start", step=10,
                                                                             lost_steps=0, attempt=3),
                             _ev(12, "nonfinite", step=11, what="loss"), _ev(12.5, "exit", exit_code=80)])
    assert [a.outcome for a in runs] == ["preempted", "stopped", "nan"]
    assert runs[2].nonfinite[0]["step"] == 11


def test_an_in_job_restart_is_an_attempt_of_the_same_job() -> None:
    """resume.in_job: a crash at 50 restarted in job 1 at 51 (its step on the spare from 52) is attempt 2, opened by
    ``restarted``, with its own outcome and cause, and the same job; the gap counts as a wait, never as training."""
    events = [_ev(0, "submitted", job_id="1"), _ev(1, "start", job_id="1", nodes="n1,n2"),
              _ev(5, "train_start", step=0, lost_steps=0, attempt=1),
              _ev(50, "exit", outcome="hang", cause="hang: rank 3 on n2", job_id="1", nodes=["n2"]),
              _ev(51, "restarted", job_id="1", reason="hang", attempt=2, nodes=["n1", "n3"], bad=["n2"]),
              _ev(52, "start", job_id="1", nodes="n1,n3"), _ev(60, "train_start", step=40, lost_steps=0, attempt=2),
              _ev(100, "finished", step=80), _ev(100, "exit", outcome="completed", job_id="1")]
    runs = goodput.attempts(events)
    assert [(a.number, a.opener, a.job_id, a.nodes, a.outcome, a.then) for a in runs] == [
        (1, "submitted", "1", "n1,n2", "hang", "restarted"), (2, "restarted", "1", "n1,n3", "completed", None)]
    assert runs[0].cause == "hang: rank 3 on n2" and runs[0].bad_nodes == ["n2"]
    g = goodput.account(runs, created=0.0, end=100.0, productive_s=85.0, kept_step=80)
    assert g.losses["waiting for Slurm"] == 1 + 1 + 1 and g.losses["startup"] == 4 + 8  # queue, exit hook, begin
