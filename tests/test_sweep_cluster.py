"""A Slurm sweep on the dev cluster: one job array, each task the single job of its point's run.

Three points of a quickstart-sized config (one node, two ranks each) submitted by one sbatch: three run directories,
each recording its task (``ARRAYJOB_i``) as its job, each trained to the end. One task is preempted: its exit hook
requeues that task, which resumes. Another task's rank is SIGKILLed: that run fails alone, `runner cron` resubmits
that run alone (a job of its own, never the array again) and it resumes from its checkpoint to the end; `runner
status` shows the three under their sweep (the parsers' recordings of array output: tests/test_slurm_arrays.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

import runner as api
from runner.dev import devcluster
from runner.host import sweep
from runner.rundir import RunDir
from tests.test_failures import FINAL, checkpoint_done, events, runner, status, wait_for
from tests.test_program_cluster import cluster_env

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "conf" / "quickstart.yaml"
STEPS = 60
BASE = ["scheduler=slurm", f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=10", "model.step_time_s=0.1",
        "slurm.time=00:05:00", "slurm.cpus_per_task=1", "resume.backoff_s=0", "alerts.kind=json"]


def test_a_slurm_sweep_is_one_job_array_and_cron_resubmits_only_the_failed_task(
        slurm_cluster: devcluster.Cluster, tmp_path: Path) -> None:
    env = cluster_env(slurm_cluster)
    root = tmp_path / "runs"
    out = runner(env, "sweep", str(QUICKSTART), "model.lr=0.01,0.02,0.03", f"run_root={root}", *BASE)
    [folder] = (root / "sweeps").iterdir()
    array = json.loads((folder / "sweep.json").read_text())["job"]
    runs = sweep.SweepDir(folder).runs()
    paths = [runs[i].root for i in range(3)]
    assert [RunDir(p).job_id() for p in paths] == [f"{array}_{i}" for i in range(3)], out.stdout

    # One task is preempted (its batch shell gets the stop signal): it checkpoints and Slurm requeues that task.
    wait_for("point 0's checkpoint 10", lambda: checkpoint_done(paths[0], 10), 90, paths[0])
    subprocess.run(["scancel", "--batch", "--signal=USR2", f"{array}_0"], env=env, check=True, timeout=30)
    # Another task's rank dies mid-training: its job fails, the others train on.
    victim = paths[1]
    wait_for("point 1's checkpoint 10", lambda: checkpoint_done(victim, 10), 90, victim)
    rank = json.loads((victim / "ranks" / "rank-00001.json").read_text())
    assert (rank["slurm"]["SLURM_ARRAY_JOB_ID"], rank["slurm"]["SLURM_ARRAY_TASK_ID"]) == (array, "1")
    os.kill(rank["pid"], signal.SIGKILL)
    wait_for("point 1's task to fail and end", lambda: (lambda row: row["state"] == "failed" and row.get("slurm_state")
                                                          in FINAL)(status(env, victim)), 60, victim)
    [ended] = [e for e in events(victim) if e["event"] == "exit"]
    assert (ended["job_id"], ended["outcome"]) == (f"{array}_1", "failed")  # the exit hook knew its task

    cron = runner(env, "cron", "--root", str(root)).stdout
    assert [line.split(":")[0] for line in cron.splitlines() if ": resubmit:" in line] == [victim.name], cron
    [again] = [e for e in events(victim) if e["event"] == "resubmitted"]
    assert again["job_id"].isdigit() and RunDir(victim).job_id() == again["job_id"]  # a job of its own

    for p in paths:  # the exit hook's record of the end: the job's last word
        wait_for(f"{p.name} to finish", lambda p=p: any(e.get("outcome") == "completed" for e in events(p)), 120, p)
        assert (p / "finished").exists()
    assert "resuming from" in RunDir(victim).rank_log(0).read_text()
    preempted = [(e["event"], e.get("outcome"), e.get("job_id")) for e in events(paths[0])
                 if e["event"] in ("exit", "requeued", "resubmitted")]
    assert preempted == [("exit", "preempted", f"{array}_0"), ("requeued", None, f"{array}_0"),
                         ("exit", "completed", f"{array}_0")], preempted  # the same task, requeued by its own hook
    names = [e["event"] for e in events(paths[2])]
    assert "resubmitted" not in names and "requeued" not in names and names.count("exit") == 1, names
    for i in (0, 2):
        assert (paths[i] / "logs" / f"slurm-{array}_{i}.out").is_file()  # where `runner logs --batch` reads
    assert "resubmit:" not in runner(env, "cron", "--root", str(root)).stdout  # all finished: nothing to do
    assert api.find_sweep(folder.name, root).wait(timeout=30) == {0: "completed", 1: "completed", 2: "completed"}

    # The array itself was submitted once: Slurm knows it as three tasks, and nothing of it ran twice.
    acct = subprocess.run(["sacct", "-X", "-n", "-P", "-j", array, "--format=JobID,State"], env=env,
                          capture_output=True, text=True, timeout=30, check=True).stdout
    assert sorted({line.split("|")[0] for line in acct.splitlines()}) == [f"{array}_{i}" for i in range(3)], acct
    table = runner(env, "status", "--root", str(root)).stdout
    assert f"sweep {folder.name}: 3 of 3 runs, 3 completed" in table, table
    rows = [line for line in table.splitlines() if "model.lr=" in line]
    assert [r.split("model.lr=")[1].split()[0] for r in rows] == ["0.01", "0.02", "0.03"], table
