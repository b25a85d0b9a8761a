"""A sweep's job array on Slurm, without a cluster: the id a task's run records (``slurmstates.job_id``, one rule for
the batch host, the ranks and the alerts), the parsers reading array tasks in squeue, sacct and scontrol output
recorded from the dev cluster's Slurm 22.05 (tests/fixtures/slurm/array_*.txt), and a task's claim on its run
(the array on the dev cluster: tests/test_sweep_cluster.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from runner import slurmstates
from runner.host import slurm
from runner.job.jobenv import JobEnv
from runner.rundir import EXIT_SUPERSEDED, RunDir

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent / "fixtures" / "slurm"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
TASK = {"SLURM_JOB_ID": "131", "SLURM_ARRAY_JOB_ID": "128", "SLURM_ARRAY_TASK_ID": "3"}


@pytest.mark.parametrize(("env", "expected"), [
    ({"SLURM_JOB_ID": "41"}, "41"),
    (TASK, "128_3"),  # an array task: its array's id and its index, not its own number
    ({"SLURM_JOB_ID": "41", "SLURM_ARRAY_JOB_ID": "", "SLURM_ARRAY_TASK_ID": ""}, "41"),
    ({"SLURM_JOB_ID": "41", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "x"}, "41"),
    ({}, None),
])
def test_the_job_a_run_records(env: dict[str, str], expected: str | None) -> None:
    assert slurmstates.job_id(env) == expected
    srun = {**env, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train"}
    assert JobEnv.read(srun).job_id == expected  # the ranks read the same rule: they check ownership with it


@pytest.mark.parametrize(("field", "expected"), [
    ("12", ["12"]), ("12_3", ["12_3"]), ("12_[3-5,7%2]", ["12_3", "12_4", "12_5", "12_7"]), ("12_[4]", ["12_4"]),
    ("12_[3,5,7,9...", []),  # cut short by SLURM_BITSTR_LEN: stands for none (asked again by their own ids)
    ("12.batch", []), ("", []), ("12_x", []),
])
def test_the_jobs_one_row_stands_for(field: str, expected: list[str]) -> None:
    assert slurmstates.job_ids(field) == expected


@pytest.mark.parametrize(("job", "expected"), [("12", 12), ("12_3", 12), ("", None), ("x_1", None)])
def test_where_a_job_stands_in_submission_order(job: str, expected: int | None) -> None:
    assert slurmstates.submitted_at(job) == expected


def recorded(name: str) -> tuple[str, str]:
    """(stdout, the array's id) of one recording: array 1, four one-node tasks, at most one at a time."""
    return (FIXTURES / name).read_text(), MANIFEST["files"][name]["job_id"].split("_")[0]


def test_a_task_still_in_the_queue_is_found_in_the_arrays_one_row() -> None:
    """Asked for the array, squeue (without -r) and sacct list its queued tasks as one row, ``1_[1-3%1]``: each task
    is found in it by its own id."""
    for parse, name in ((slurm.parse_squeue_many, "array_squeue_all.txt"), (slurm.parse_sacct_many,
                                                                           "array_sacct_all.txt")):
        text, a = recorded(name)
        found = parse(text)
        assert [found[f"{a}_{i}"].state for i in range(4)] == ["RUNNING", "PENDING", "PENDING", "PENDING"], text
        assert found[f"{a}_2"].job_id == f"{a}_2" and f"{a}_4" not in found and a not in found


def test_a_task_asked_by_its_id_is_found_where_slurm_knows_it() -> None:
    """sacct knows nothing of a task that never left the queue (Slurm gives it a record when it starts); squeue and
    scontrol do, so ``ask_many`` asks them for whatever sacct does not say has ended."""
    text, a = recorded("array_sacct_pending.txt")
    assert text == "" and slurm.parse_sacct(text, f"{a}_2") is None
    text, a = recorded("array_squeue_pending_r.txt")
    pending = slurm.parse_squeue(text, f"{a}_2")
    assert pending is not None and (pending.state, pending.reason) == ("PENDING", "JobArrayTaskLimit")
    for name, task, state, nodes in (("array_scontrol_pending.txt", 2, "PENDING", None),
                                     ("array_scontrol_running.txt", 0, "RUNNING", "n1"),
                                     ("array_scontrol_cancelled.txt", 3, "CANCELLED", None)):
        text, a = recorded(name)
        info = slurm.parse_scontrol(text, f"{a}_{task}")
        assert info is not None and (info.state, info.nodes) == (state, nodes), name
        assert slurm.parse_scontrol(text, f"{a}_{task + 1}") is None  # another task's record is not this one's


def test_a_requeued_task_counts_its_restarts_and_cancelled_tasks_end() -> None:
    text, a = recorded("array_sacct_requeued.txt")
    requeued = slurm.parse_sacct(text, f"{a}_0")
    assert requeued is not None and (requeued.state, requeued.restarts) == ("PENDING", 1)
    text, a = recorded("array_squeue_requeued.txt")
    again = slurm.parse_squeue(text, f"{a}_0")
    assert again is not None and again.state == "PENDING"  # back in the queue, under the array's limit
    text, a = recorded("array_sacct_cancelled.txt")  # the rows of two tasks interleave: each keeps its own
    cancelled = slurm.parse_sacct_many(text)
    assert {cancelled[f"{a}_{i}"].runner_state for i in (0, 1)} == {"cancelled"}
    assert cancelled[f"{a}_0"].restarts == 1 and f"{a}_3" not in cancelled  # 3 never started: scontrol knows it


def test_an_array_task_older_than_its_runs_owner_steps_aside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm requeued a task after runner cron resubmitted its run as job 130: the task (array 128, itself numbered
    131 once it started) is the older job and must not train; the task that owns the run does, its ports from its own
    number."""
    from runner.host import jobhook

    for key in [k for k in os.environ if k.startswith(("SLURM_", "RUNNER_"))]:
        monkeypatch.delenv(key)
    for key, value in {**TASK, "SLURM_JOB_NODELIST": "n1"}.items():
        monkeypatch.setenv(key, value)
    (tmp_path / "logs").mkdir()
    run = RunDir(tmp_path)
    run.job_id_file.write_text("130\n")
    assert jobhook.begin(run, "") == (EXIT_SUPERSEDED, {})
    run.job_id_file.write_text("128_3\n")
    code, env = jobhook.begin(run, "")
    assert code == 0 and env["MASTER_PORT"] == str(10000 + 2 * 131)
