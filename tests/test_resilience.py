"""Beyond preemption: a hang, a NaN, a crash loop and a straggler, injected on the real local Slurm cluster.

Each test injects one fault into a real run (SIGSTOP of one rank; a loss that turns NaN at a chosen step; an
exception at a fixed step; one rank made slower) and asserts what a user at 3 a.m. relies on: ``runner status
--json`` names the cause (and, for a hang, the rank and the node), the run finishes or stays stopped as it must,
and a node that hung is left out of the next job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from runner.dev import devcluster
from runner.host import nodes
from tests.test_failures import checkpoint_done, env_for, events, hook, runner, submit, wait_for

pytestmark = pytest.mark.slurm
__all__ = ["hook"]  # the webhook fixture, shared with test_failures


def _status(env: dict[str, str], run: Path) -> dict[str, Any]:
    return json.loads(runner(env, "status", str(run), "--json").stdout)[0]


def _exits(run: Path) -> list[dict[str, Any]]:
    return [e for e in events(run) if e["event"] == "exit"]


def test_a_stopped_rank_is_named_its_node_left_out_and_the_run_finishes(slurm_cluster: devcluster.Cluster,
                                                                      hook: Any, tmp_path: Path) -> None:
    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path, "num_nodes=1", "watchdog.floor_s=5")
    wait_for("checkpoint 20", lambda: checkpoint_done(run, 20), 120, run)
    rank1 = json.loads((run / "ranks" / "rank-00001.json").read_text())
    os.kill(rank1["pid"], signal.SIGSTOP)
    t0 = time.monotonic()
    wait_for("the hang to be named", lambda: any(e["outcome"] == "hang" for e in _exits(run)), 60, run)
    named_after = time.monotonic() - t0
    row = _status(env, run)
    assert row["last_outcome"] == "hang"
    assert row["last_cause"].startswith("hang: ") and f"rank 1 on {rank1['hostname']}" in row["last_cause"]
    assert list(nodes.remembered(tmp_path, 3600)) == [rank1["hostname"]]
    resubmitted = [e for e in events(run) if e["event"] == "resubmitted"]
    assert len(resubmitted) == 1 and rank1["hostname"] in resubmitted[0]["reason"]
    show = subprocess.run(["scontrol", "show", "job", resubmitted[0]["job_id"]], env=env, capture_output=True,
                          text=True, timeout=30).stdout
    assert f"ExcNodeList={rank1['hostname']}" in show
    wait_for("the resubmitted job to finish", lambda: (run / "finished").exists(), 180, run)
    ranks = [json.loads(p.read_text())["hostname"] for p in sorted((run / "ranks").glob("rank-*.json"))]
    assert rank1["hostname"] not in ranks  # the next attempt ran elsewhere
    print(f"hang named {named_after:.1f} s after the SIGSTOP")


def test_a_nan_stops_the_run_for_a_person_and_cron_leaves_it(slurm_cluster: devcluster.Cluster, hook: Any,
                                                            tmp_path: Path) -> None:
    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path, "model.faults.nan_at_step=25")
    wait_for("the job to end", lambda: bool(_exits(run)), 120, run)
    row = _status(env, run)
    assert row["last_outcome"] == "nan" and row["last_cause"].startswith("nan: non-finite loss")
    assert "step 25" in row["last_cause"]
    assert [e["event"] for e in events(run)].count("stopped") == 1
    complete = sorted(int(p.parent.name[5:]) for p in (run / "checkpoints").glob("step-*/COMPLETE"))
    assert complete and max(complete) <= 20  # nothing of step 25 on was saved
    runner(env, "cron", "--root", str(tmp_path))
    assert "resubmitted" not in [e["event"] for e in events(run)]
    got = [a["event"] for a in hook.wait_for(1, timeout=30)]
    assert got == ["nan"] or got == ["failed"], got


def test_a_crash_loop_stops_after_its_second_attempt(slurm_cluster: devcluster.Cluster, hook: Any,
                                                    tmp_path: Path) -> None:
    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path, "model.faults.raise_at_step=25", "resume.max_restarts=5")
    wait_for("the first job to fail", lambda: _status(env, run)["state"] == "failed", 120, run)
    runner(env, "cron", "--root", str(tmp_path))  # resubmits: once may be bad luck
    wait_for("the second failure", lambda: len(_exits(run)) == 2, 120, run)
    wait_for("the second job to end", lambda: _status(env, run)["state"] == "failed", 120, run)
    for _ in range(2):
        runner(env, "cron", "--root", str(tmp_path))
    assert [e["event"] for e in events(run)].count("resubmitted") == 1
    assert [e["event"] for e in events(run)].count("stopped") == 1
    row = _status(env, run)
    assert row["last_cause"].startswith("crash_loop: RuntimeError: injected fault at step 25")
    assert "example.py" in row["last_cause"] and "step 25" in row["last_cause"]


def test_a_slow_rank_is_named_with_its_node(slurm_cluster: devcluster.Cluster, hook: Any, tmp_path: Path) -> None:
    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path, "model.faults.slow_s=0.1", "model.faults.rank=2", "model.step_time_s=0.02",
                 "watchdog.straggler_report_s=2", "trainer.max_steps=150")
    wait_for("the straggler record", lambda: any(e["event"] == "straggler" for e in events(run)), 120, run)
    runner(env, "cron", "--root", str(tmp_path))  # while the job runs: cron alerts it (else the exit hook does)
    wait_for("the run to finish", lambda: (run / "finished").exists(), 180, run)
    [ev] = [e for e in events(run) if e["event"] == "straggler"]
    host = json.loads((run / "ranks" / "rank-00002.json").read_text())["hostname"]
    assert (ev["rank"], ev["node"], ev["slow"]) == (2, host, "forward")
    out = runner(env, "status", str(run), "--ranks").stdout.splitlines()
    assert out[1].split()[:2] == ["2", host] and out[1].rstrip().endswith("forward")
    # One alert at the real webhook server, once: rank, node, and how much slower than the median.
    got = hook.wait_for(2, timeout=30)
    runner(env, "cron", "--root", str(tmp_path))
    assert [a["event"] for a in got] == ["straggler", "completed"], got
    alert = got[0]
    assert (alert["extra"]["rank"], alert["extra"]["node"], alert["nodes"]) == ("2", host, host)
    assert alert["cause"].startswith(f"straggler: rank 2 on {host} is ") and "x the median in forward" in alert["cause"]
    assert float(alert["extra"]["slower than the median"].split("x")[0]) == ev["compute_x"] > 1.5
    assert [e["event"] for e in events(run)].count("straggler_alert") == 1 and len(hook.received) == 2
