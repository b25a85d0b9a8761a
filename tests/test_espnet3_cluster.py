"""ESPnet3's mini_an4 recipe on the dev cluster (the slurm tier): training on 2 nodes x 2 ranks through a preemption, a
killed rank, a hang, collect_stats on Slurm worker jobs (the recipe and the local runs: tests/test_espnet3.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from runner.dev import devcluster
from tests import test_espnet3
from tests.test_espnet3 import EPOCHS, NO_PAUSE, TRAIN, assert_same_stats, cancel_a_worker_mid_way, one_run, submit
from tests.test_failures import checkpoint_done, events, job_id, runner, status, wait_for
from tests.test_program_cluster import cluster_env, exits
from tests.test_program_cluster import ranks as rank_info

pytestmark = pytest.mark.slurm
recipe = test_espnet3.recipe  # the fixture: the recipe prepared once a session


def test_a_preemption_notice_requeues_and_espnet3s_global_step_continues(slurm_cluster: devcluster.Cluster,
                                                                         recipe: Path, tmp_path: Path) -> None:
    """The train stage on 2 nodes x 2 ranks (runtime none), stopped by a preemption notice at checkpoint 10: the job
    requeues, ESPnet3's global step continues from the stop's checkpoint, and ESPnet3's experiment ends complete."""
    env = cluster_env(slurm_cluster)
    out = submit(recipe, env, tmp_path / "runs", *TRAIN, "exp_tag=cluster_usr2")
    assert out.returncode == 0, out.stdout + out.stderr
    run = one_run(tmp_path / "runs")
    wait_for("checkpoint 10", lambda: checkpoint_done(run, 10), 600, run)
    first = job_id(run)
    subprocess.run(["scancel", "--batch", "--signal=USR2", first], env=env, check=True, timeout=30)
    wait_for("the requeued job to finish", lambda: len(exits(run)) == 2, 600, run)
    first_exit, second_exit = exits(run)
    assert (first_exit["outcome"], first_exit["exit_code"]) == ("preempted", 75), first_exit
    assert second_exit["outcome"] == "completed", second_exit
    starts = [e for e in events(run) if e["event"] == "train_start"]
    assert [s["attempt"] for s in starts] == [1, 2]
    stop = starts[1]["step"]
    assert 10 <= stop < EPOCHS * 4 and starts[0]["step"] == 0  # not from 0 again: from the stop's checkpoint
    assert starts[1]["resumed_from"].endswith(f"step-{stop:07d}")
    assert next(e for e in events(run) if e["event"] == "finished")["step"] == EPOCHS * 4
    log = (run / "logs" / "attempt-1" / "rank-00000.log").read_text()
    assert re.search(rf"stopped on signal at step {stop}\b", log), log[-2000:]
    info = rank_info(run)
    assert sorted(r["hostname"] for r in info) == ["n1", "n1", "n2", "n2"]
    assert {r["runtime"] for r in info} == {"none"}
    exp = recipe / "exp" / "cluster_usr2"  # ESPnet3's experiment, named as ESPnet3 names it
    assert (exp / "last.ckpt").exists() and "valid/loss" in (exp / "train.log").read_text()
    assert status(env, run)["state"] == "completed"


def test_a_killed_rank_is_resubmitted_by_cron_and_finishes(slurm_cluster: devcluster.Cluster, recipe: Path,
                                                           tmp_path: Path) -> None:
    env = cluster_env(slurm_cluster)
    out = submit(recipe, env, tmp_path / "runs", *TRAIN, "exp_tag=cluster_kill")
    assert out.returncode == 0, out.stdout + out.stderr
    run = one_run(tmp_path / "runs")
    wait_for("checkpoint 10", lambda: checkpoint_done(run, 10), 600, run)
    os.kill(rank_info(run)[3]["pid"], signal.SIGKILL)
    wait_for("the job to fail", lambda: bool(exits(run)) and status(env, run)["state"] == "failed", 120, run)
    cron = runner(env, "cron", "--root", str(tmp_path / "runs")).stdout
    assert "resubmit:" in cron, cron
    wait_for("the resubmitted job to finish", lambda: len(exits(run)) == 2, 600, run)
    assert exits(run)[1]["outcome"] == "completed" and (run / "finished").exists()
    starts = [e["step"] for e in events(run) if e["event"] == "train_start"]
    assert starts[0] == 0 and starts[1] >= 10, starts


def test_a_stopped_rank_is_named_as_the_hang(slurm_cluster: devcluster.Cluster, recipe: Path, tmp_path: Path) -> None:
    env = cluster_env(slurm_cluster)
    out = submit(recipe, env, tmp_path / "runs", *TRAIN, "exp_tag=cluster_hang", "runner.watchdog.floor_s=5",
                 "runner.resume.enabled=false")
    assert out.returncode == 0, out.stdout + out.stderr
    run = one_run(tmp_path / "runs")
    wait_for("checkpoint 10", lambda: checkpoint_done(run, 10), 600, run)
    victim = rank_info(run)[1]
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        wait_for("the hang to be recorded", lambda: bool(exits(run)), 180, run)
        [end] = exits(run)
        assert (end["outcome"], end["exit_code"]) == ("hang", 79), end
        hang = json.loads((run / "hang.json").read_text())
        assert [(s["rank"], s["node"]) for s in hang["suspects"]] == [(1, victim["hostname"])], hang
    finally:
        os.kill(victim["pid"], signal.SIGCONT) if Path(f"/proc/{victim['pid']}").exists() else None
        runner(env, "cancel", str(run), check=False)


def test_collect_stats_on_slurm_worker_jobs_one_cancelled_equals_local(slurm_cluster: devcluster.Cluster,
                                                                       recipe: Path, tmp_path: Path) -> None:
    """ESPnet3's own parallel: block with env: slurm: its dask-jobqueue workers are Slurm jobs on the dev cluster
    (started from the stage's own job, with runner's environment); one is cancelled as it starts its shard, and the
    statistics still equal those of env: local (the recipe fixture's, one worker): the shape files and frame counts
    byte for byte, the float32 sums up to their summation order (2 shards here, 1 there)."""
    env = cluster_env(slurm_cluster)
    stats = recipe / "exp" / "stats_slurm"
    out = submit(recipe, env, tmp_path / "runs", "stages=collect_stats", "runner.scheduler=slurm",
                 "parallel.env=slurm", "parallel.n_workers=2", f"stats_dir={stats}", "exp_tag=stats_slurm",
                 "parallel.options={cores: 1, memory: 1000MB, processes: 1, walltime: '00:20:00', "
                 f"worker_extra_args: [{NO_PAUSE}]}}")
    assert out.returncode == 0, out.stdout + out.stderr
    run = one_run(tmp_path / "runs")
    victim = cancel_a_worker_mid_way(env, run, stats)
    state = subprocess.run(["sacct", "-n", "-X", "-j", victim, "-o", "State"], capture_output=True, text=True,
                           env=env, timeout=30).stdout
    assert "CANCELLED" in state, state
    assert_same_stats(stats, recipe / "exp" / "stats")
