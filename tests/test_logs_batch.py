"""`runner logs RUN --batch [--attempt N]`: the part of Slurm's batch output one attempt wrote. A requeued job appends
to its slurm-JOB.out, a resubmitted run writes another file, and the run's job_id may already name a job that has
not started: each attempt's part is found from its ``start`` record (job and offset), never from the newest job."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.errors import InputError
from runner.host import status
from runner.rundir import RunDir

pytestmark = pytest.mark.unit

FIRST, SECOND, THIRD = "attempt one: srun: error: node n2 died\n", "attempt two: requeued, ran on\n", "third\n"


def run_with_three_attempts(tmp_path: Path, numbered: bool = True) -> RunDir:
    """Job 11 ran attempts 1 and 2 (requeued: one file, appended), job 12 (runner cron's resubmission) attempt 3,
    and job 13 is queued behind it (the run's job_id now), with no output yet."""
    run = RunDir(tmp_path / "run")
    run.logs.mkdir(parents=True)
    run.batch_log("11").write_text(FIRST + SECOND)
    run.batch_log("12").write_text(THIRD)
    for job, attempt, offset in (("11", 1, 0), ("11", 2, len(FIRST)), ("12", 3, 0)):
        run.record("start", job_id=job, out_offset=offset, **({"attempt": attempt} if numbered else {}))
    (run.root / "job_id").write_text("13\n")
    return run


@pytest.mark.parametrize("attempt, shown", [(1, FIRST), (2, SECOND), (3, THIRD), (None, THIRD)])
def test_each_attempt_shows_its_own_part_of_the_batch_output(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             attempt: int | None, shown: str) -> None:
    run = run_with_three_attempts(tmp_path)
    assert status.logs(run, None, follow=False, attempt=attempt) == 0
    assert capsys.readouterr().out == shown


def test_an_attempt_no_job_ran_is_one_line_naming_those_that_did(tmp_path: Path) -> None:
    run = run_with_three_attempts(tmp_path)
    with pytest.raises(InputError, match=r"found no Slurm job that ran attempt 7; expected one of \[1, 2, 3\]"):
        status.logs(run, None, follow=False, attempt=7)


def test_an_empty_part_is_said_not_printed_as_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = run_with_three_attempts(tmp_path)
    run.batch_log("12").write_text("")
    assert status.logs(run, None, follow=False) == 0
    out = capsys.readouterr()
    assert out.out == "" and f"attempt 3's part of {run.batch_log('12')} is empty" in out.err


def test_a_ledger_from_before_starts_named_their_attempt_shows_the_last_started_job(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = run_with_three_attempts(tmp_path, numbered=False)
    assert status.logs(run, None, follow=False) == 0
    assert capsys.readouterr().out == THIRD  # job 12's file, not the queued job 13's (which has none)
