"""One look at a run (runner.host.observe): its records read once, Slurm asked only when the question needs it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runner.host import cron, observe, scheduler
from runner.rundir import RunDir
from tests.test_slurm_parsers import MANY_SACCT, MANY_SQUEUE, fake_slurm, make_run

pytestmark = pytest.mark.unit


def count_ledger_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    reads: list[str] = []
    events = RunDir.events

    def counted(self: RunDir) -> list[dict[str, Any]]:
        reads.append(self.name)
        return events(self)

    monkeypatch.setattr(RunDir, "events", counted)
    return reads


def test_cron_decides_and_acts_on_one_read_of_the_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The look, and the straggler queue's own read under its lock (the exit hook may queue at the same time)."""
    run = make_run(tmp_path, "c-failed", "4", "start", "exit")
    resubmitted: list[str] = []
    monkeypatch.setattr(scheduler.SLURM, "resubmit", lambda run, cfg, reason: resubmitted.append(reason))
    fake_slurm(monkeypatch, {"sacct": MANY_SACCT, "squeue": MANY_SQUEUE})
    jobs = observe.ask([observe.look(run, observe.unsettled)])
    reads = count_ledger_reads(monkeypatch)
    assert cron.handle(run, jobs, fresh=True).action == "resubmit"
    assert resubmitted == ["job 4 ended FAILED (exit 1)"]
    assert reads == ["c-failed", "c-failed"]


@pytest.mark.parametrize(("events", "finished", "need", "asks"), [
    (("start", "exit"), False, observe.unsettled, ["sacct"]),  # a failed job: cron asks
    (("start", "finished", "exit"), True, observe.unsettled, []),  # settled by its records
    (("start", "finished", "exit"), True, observe.shown, []),  # finished and exited: nothing Slurm can change
    (("start",), False, observe.shown, ["sacct", "squeue"]),  # sacct lags: the controller is asked
    (("start", "exit"), False, observe.resumable, ["sacct"]),
    (("start", "finished", "exit"), True, observe.resumable, []),
    (("start",), False, observe.never, []),
])
def test_slurm_is_asked_only_when_the_question_needs_it(events: tuple[str, ...], finished: bool, need: observe.Need,
                                                        asks: list[str], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    job = "4" if "exit" in events and not finished else "5"  # FAILED, RUNNING (sacct lags)
    run = make_run(tmp_path, "r", job, *events, finished=finished)
    calls = fake_slurm(monkeypatch, {"sacct": MANY_SACCT, "squeue": MANY_SQUEUE})
    seen = observe.observe(run, need)
    assert calls == asks
    assert seen.needed is bool(asks) and seen.asked
    assert (seen.job is not None) is bool(asks)
    assert seen.records.job_id == job and seen.scheduler == "slurm" and seen.attempt == 1


def test_a_run_on_another_scheduler_never_asks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = make_run(tmp_path, "l", "4", "start", scheduler="local")
    calls = fake_slurm(monkeypatch, {"sacct": MANY_SACCT, "squeue": MANY_SQUEUE})
    assert not observe.observe(run, observe.shown).needed and not observe.observe(run, observe.resumable).needed
    assert calls == []


def test_slurm_that_cannot_be_asked_is_told_from_a_job_it_does_not_know(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    run = make_run(tmp_path, "r", "4", "start")
    fake_slurm(monkeypatch, {"sacct": RuntimeError("sacct: error: Unable to contact slurm controller"),
                             "squeue": RuntimeError("squeue: error: Unable to contact slurm controller"),
                             "scontrol": RuntimeError("scontrol: error: Unable to contact slurm controller")})
    seen = observe.observe(run, observe.unsettled)
    assert seen.needed and not seen.asked and seen.job is None
    assert cron.decide(run, seen.config).action == "wait"  # the ledger shows the job alive: never a second one
