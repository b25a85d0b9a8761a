"""Issue 41: keep the allocation. On a 3-node dev cluster a run of 2 nodes x 2 ranks with one spare node
(``slurm.spare_nodes: 1``) and ``resume.in_job: true`` trains again in the SAME Slurm job after a SIGKILLed rank, a
SIGSTOPped rank (the hang is named, rank and node, and the spare takes the node's place) and a lost node (its slurmd
and tasks killed: runner ends the step on the node's silence before Slurm marks it down, and the spare takes its
place), each from the newest complete checkpoint and bitwise equal to an undisturbed run (the exact-resume config of
tests/test_failures.py); a crash loop inside one job stops at resume.max_restarts with one ``stopped`` and its alerts
on a real HTTP server. Programs nobody here wrote get the same: PyTorch's torchrun tutorial script (its own snapshot)
and a plain Lightning script (runner's checkpoints) train again in the same job after a SIGKILLed rank. Each test
prints the seconds from the fault to the new attempt's first training (its ``train_start`` in the ledger).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runner.dev import devcluster
from tests.conftest import fixture_tier
from tests.test_failures import (
    assert_recovered,
    checkpoint_done,
    env_for,
    events,
    final_weights,
    reference,
    runner,
    status,
    submit,
    wait_for,
)
from tests.waiting import alerts_all_sent, standby_warm

pytestmark = pytest.mark.slurm
__all__ = ["reference"]  # the fixture, shared with tests/test_failures.py

IN_JOB = ["resume.in_job=true", "slurm.spare_nodes=1", "watchdog.floor_s=5"]


@pytest.fixture(scope="module")
@fixture_tier("slurm")
def cluster3() -> Iterator[devcluster.Cluster]:
    """The machine's dev cluster with 3 nodes for this module (a spare beside the run's 2), then as it was."""
    from tests.slurm_fixture import dev_cluster

    with dev_cluster(3, restore=True) as cluster:
        yield cluster


@pytest.fixture
def hook(cluster3: devcluster.Cluster) -> Iterator[Any]:
    from tests.webhook_server import WebhookServer

    server = WebhookServer(host=devcluster.CONTROLLER_ADDR)
    try:
        yield server
    finally:
        server.stop()


def rank_of(run: Path, rank: int, attempt: int) -> dict[str, Any]:
    """The launcher's record of ``rank`` once it is the given attempt's ({} before)."""
    try:
        info = json.loads((run / "ranks" / f"rank-{rank:05d}.json").read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) and info.get("attempt") == attempt else {}


def training(run: Path, attempt: int) -> dict[str, Any] | None:
    """The ledger's ``train_start`` of ``attempt``: its ranks train (or None yet)."""
    return next((e for e in events(run) if e["event"] == "train_start" and e.get("attempt") == attempt), None)


def one_job(run: Path) -> str:
    """The run's only Slurm job: every attempt started in it, and nothing was requeued or resubmitted."""
    evs = events(run)
    jobs = {e["job_id"] for e in evs if e["event"] in ("start", "exit", "restarted")}
    assert len(jobs) == 1, jobs
    assert not [e for e in evs if e["event"] in ("requeued", "resubmitted", "handed_over")], evs
    return jobs.pop()


def hosts(run: Path, attempt: int) -> set[str]:
    return {rank_of(run, r, attempt).get("hostname", "?") for r in range(4)}


def recovery_s(run: Path, fault_at: float, attempt: int = 2) -> float:
    start = training(run, attempt)
    assert start is not None
    seconds = start["time"] - fault_at
    evs = events(run)
    began = next(e["time"] for e in evs if e["event"] == "start")
    cold = next(e["time"] for e in evs if e["event"] == "train_start") - began
    print(f"\n{run.name}: fault -> attempt {attempt} training (train_start): {seconds:.1f} s (attempt 1: its start "
          f"hook -> train_start {cold:.1f} s; load average {os.getloadavg()[0]:.1f}); after the fault:")
    for e in events(run):
        if e["time"] >= fault_at and e["event"] not in ("straggler", "straggler_alert"):
            said = {k: e[k] for k in ("outcome", "attempt", "nodes", "status", "duration_s", "step") if k in e}
            print(f"  +{e['time'] - fault_at:5.1f} s  {e['event']} {said}")
    return float(seconds)


def test_a_killed_rank_trains_again_in_the_same_job(cluster3: devcluster.Cluster, hook: Any, reference: list[Any],
                                                    tmp_path: Path) -> None:
    env = env_for(cluster3, hook)
    # Slower steps than the other tests' (the weights do not depend on them): a crash comes long after the start,
    # when the warm standby step has imported what a rank imports, at the lowest priority beside the training.
    run = submit(env, tmp_path, *IN_JOB, "model.step_time_s=0.5")
    wait_for("checkpoint 20", lambda: checkpoint_done(run, 20), 120, run)
    wait_for("the warm standby", lambda: standby_warm(run, 6), 60, run)  # 3 nodes x 2
    first = rank_of(run, 3, 1)
    assert first["hostname"] == "n2" and hosts(run, 1) == {"n1", "n2"}, first  # n3 is the spare
    killed_at = time.time()
    os.kill(first["pid"], signal.SIGKILL)
    wait_for("the run to finish", lambda: (run / "finished").exists(), 240, run)
    job = one_job(run)
    [restarted] = [e for e in events(run) if e["event"] == "restarted"]
    assert restarted["attempt"] == 2 and restarted["nodes"] == ["n1", "n2"] and restarted["bad"] == [], restarted
    assert hosts(run, 2) == {"n1", "n2"}  # nothing named a node: the same nodes
    # The warm standby step (resume.warm_standby, on by default) trains attempt 2: its ranks imported beforehand.
    assert [e.get("warm") for e in events(run) if e["event"] == "start"] == [None, True]
    recovery_s(run, killed_at)
    assert_recovered(run, reference, hook, ["failed", "completed"])
    [failed] = [a for a in hook.received if a["event"] == "failed"]
    assert failed["cause"].startswith("rank 3 on n2: killed") and f"restarted in job {job}" in failed["next_step"]
    row = status(env, run)
    assert row["state"] == "completed" and row["job_id"] == job, row


def test_a_hang_is_named_and_the_spare_takes_the_node(cluster3: devcluster.Cluster, hook: Any, reference: list[Any],
                                                       tmp_path: Path) -> None:
    env = env_for(cluster3, hook)
    run = submit(env, tmp_path, *IN_JOB)
    wait_for("checkpoint 20", lambda: checkpoint_done(run, 20), 120, run)
    stuck = rank_of(run, 3, 1)
    assert stuck["hostname"] == "n2", stuck
    stopped_at = time.time()
    os.kill(stuck["pid"], signal.SIGSTOP)
    try:
        wait_for("the hang's exit", lambda: any(e["event"] == "exit" and e.get("outcome") == "hang"
                                                for e in events(run)), 120, run)
        named = [e for e in events(run) if e["event"] == "exit"][-1]
        print(f"\n{run.name}: SIGSTOP -> hang recorded: {named['time'] - stopped_at:.1f} s")
        wait_for("the run to finish", lambda: (run / "finished").exists(), 240, run)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stuck["pid"], signal.SIGKILL)
    one_job(run)
    hang = json.loads((run / "hang.json").read_text())
    assert [(s["rank"], s["node"]) for s in hang["suspects"]] == [(3, "n2")] and hang["nodes"] == ["n2"], hang
    [restarted] = [e for e in events(run) if e["event"] == "restarted"]
    assert restarted["bad"] == ["n2"] and restarted["nodes"] == ["n1", "n3"], restarted
    assert hosts(run, 2) == {"n1", "n3"}
    recovery_s(run, stopped_at)
    assert_recovered(run, reference, hook, ["hang", "completed"])
    [alert] = [a for a in hook.received if a["event"] == "hang"]
    assert "rank 3" in alert["cause"] and "n2" in alert["cause"], alert


def test_a_lost_node_is_replaced_by_the_spare_in_the_same_job(cluster3: devcluster.Cluster, hook: Any,
                                                               reference: list[Any], tmp_path: Path) -> None:
    env = env_for(cluster3, hook)
    run = submit(env, tmp_path, *IN_JOB, "model.step_time_s=0.5")  # time for the warm standby (as a killed rank's)
    wait_for("checkpoint 20", lambda: checkpoint_done(run, 20), 120, run)
    wait_for("the warm standby", lambda: standby_warm(run, 6), 60, run)
    assert rank_of(run, 3, 1)["hostname"] == "n2"
    lost_at = time.time()
    devcluster.kill_node(cluster3, "n2")
    try:
        wait_for("the run to finish", lambda: (run / "finished").exists(), 240, run)
    finally:
        devcluster.revive_node(cluster3, "n2")
    one_job(run)
    restarted = [e for e in events(run) if e["event"] == "restarted"]
    assert restarted and restarted[-1]["nodes"] == ["n1", "n3"] and "n2" in restarted[-1]["bad"], restarted
    attempt = restarted[-1]["attempt"]
    assert hosts(run, attempt) == {"n1", "n3"}
    # The warm standby step's tasks on n1 and n3 train it: the step outlived its tasks on n2 (srun --no-kill).
    assert [e.get("warm") for e in events(run) if e["event"] == "start"][-1] is True
    recovery_s(run, lost_at, attempt)
    import torch

    for mine, ref in zip(final_weights(run), reference, strict=True):
        assert all(torch.equal(mine[k], ref[k]) for k in ref)
    got = hook.wait_for(2, timeout=30)
    assert [a["event"] for a in got] == ["failed", "completed"], got
    # runner ended the step on n2's silence after its peers failed (the step reaper), before Slurm marked n2 down;
    # the cause is the lost node's, not its peers' connection errors
    lost = [e for e in events(run) if e["event"] == "nodes_lost"]
    assert [e["nodes"] for e in lost] == [["n2"]] and lost[0]["attempt"] == attempt - 1, lost
    assert got[0]["cause"].startswith("node failure: ") and "n2 lost" in got[0]["cause"], got[0]


def test_a_crash_loop_in_one_job_stops_at_max_restarts(cluster3: devcluster.Cluster, hook: Any,
                                                       tmp_path: Path) -> None:
    env = env_for(cluster3, hook)
    run = submit(env, tmp_path, *IN_JOB, "resume.max_restarts=2")
    for attempt in (1, 2, 3):  # each at another step (the same crash twice in a row is a crash loop at once)
        wait_for(f"attempt {attempt}'s checkpoint", lambda a=attempt: training(run, a) and rank_of(run, 3, a)
                 and checkpoint_done(run, 10 * a), 120, run)
        os.kill(rank_of(run, 3, attempt)["pid"], signal.SIGKILL)
    wait_for("the stop", lambda: any(e["event"] == "stopped" for e in events(run)), 60, run)
    job = one_job(run)
    evs = events(run)
    assert [e["event"] for e in evs].count("stopped") == 1
    assert [e["attempt"] for e in evs if e["event"] == "restarted"] == [2, 3]
    assert "resume.max_restarts=2" in next(e for e in evs if e["event"] == "stopped")["reason"]
    got = hook.wait_for(3, timeout=60)
    assert [a["event"] for a in got] == ["failed"] * 3, got
    assert "stopped, not retried" in got[-1]["next_step"], got[-1]
    wait_for("every queued alert to be sent", lambda: alerts_all_sent(run), 30, run)
    runner(env, "cron", "--root", str(tmp_path))  # stopped for a person: cron leaves it
    one_job(run)
    assert status(env, run)["job_id"] == job


# Program mode: the program's own keys at the top of program.yaml, runner's in its `runner:` block.
PROGRAM_IN_JOB = ["runner.resume.in_job=true", "runner.slurm.spare_nodes=1"]


def test_a_lightning_script_trains_again_in_the_same_job_from_runners_checkpoint(cluster3: devcluster.Cluster,
                                                                                 tmp_path: Path) -> None:
    """A plain Lightning script (tests/programs/lightning_train.py: its own argparse, Trainer and loaders; runner
    checkpoints it), 2 nodes x 2 ranks and a spare: a SIGKILLed rank, and the script trains again in the same job
    from runner's newest complete checkpoint to its last step."""
    from tests.test_program_cluster import FLAGS, STEPS, cluster_env, complete_steps, exits, program, ranks
    from tests.test_program_cluster import submit as submit_program

    env = cluster_env(cluster3)
    program(tmp_path / "work", FLAGS)
    run = submit_program(env, tmp_path / "work", tmp_path / "runs", *PROGRAM_IN_JOB)
    wait_for("checkpoint 20", lambda: checkpoint_done(run, 20), 120, run)
    victim = ranks(run)[3]
    killed_at = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for("the job's end", lambda: (run / "finished").exists() and len(exits(run)) == 2, 240, run)
    one_job(run)
    [restarted] = [e for e in events(run) if e["event"] == "restarted"]
    assert restarted["nodes"] == ["n1", "n2"] and restarted["bad"] == [], restarted
    starts = [e for e in events(run) if e["event"] == "train_start"]
    assert starts[0]["step"] == 0 and starts[1]["step"] >= 20 and starts[1]["step"] in complete_steps(run), starts
    assert [e["step"] for e in events(run) if e["event"] == "finished"] == [STEPS]
    assert [e["outcome"] for e in exits(run)] == ["failed", "completed"], exits(run)
    recovery_s(run, killed_at)


def test_the_torchrun_tutorial_script_trains_again_in_the_same_job_from_its_own_snapshot(
        cluster3: devcluster.Cluster, tmp_path: Path) -> None:
    """PyTorch's multinode torchrun tutorial script (its own epoch snapshot; runner has no checkpoint of it), 2 nodes
    x 1 rank and a spare: a SIGKILLed rank, and the script trains again in the same job, from its snapshot."""
    from tests.test_program_cluster import exits, rank_log
    from tests.test_user_programs_cluster import start
    from tests.test_user_programs_cluster import training as stepping

    run, _ = start(cluster3, tmp_path, "torchrun", 6, 0.05, *PROGRAM_IN_JOB)
    snapshot = tmp_path / "work" / "snapshot.pt"
    wait_for("its first snapshot", lambda: snapshot.exists() and stepping(run, "torchrun"), 120, run)
    victim = json.loads((run / "ranks" / "rank-00001.json").read_text())
    killed_at = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for("the job's end", lambda: (run / "finished").exists() and len(exits(run)) == 2, 240, run)
    one_job(run)
    assert [e["outcome"] for e in exits(run)] == ["failed", "completed"], exits(run)
    second = rank_log(run, 0, 2)
    assert "Resuming training from snapshot at Epoch" in second and "[RANK0] done" in second, second[-2000:]
    [again] = [e for e in events(run) if e["event"] == "start" and e["time"] > killed_at]  # it reports no steps
    print(f"\n{run.name}: SIGKILL -> attempt 2's start hook: {again['time'] - killed_at:.1f} s")
