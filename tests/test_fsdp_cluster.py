"""trainer.strategy: fsdp on the dev cluster: 2 nodes x 2 ranks, CPU/gloo, the model sharded over 4 ranks; a USR2
preemption resumes bitwise, and a run stopped on 4 ranks resumes on 1 x 2 from the 4-rank shards (DCP resharding)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from runner import checkpoint
from runner.dev import devcluster
from runner.host import nodes
from runner.rundir import RunDir
from tests import slow_disk
from tests.conftest import fixture_tier
from tests.test_failures import (
    BASE,
    checkpoint_done,
    env_for,
    events,
    final_weights,
    hook,
    job_id,
    runner,
    status,
    submit,
    wait_for,
)
from tests.test_resume_honesty import assert_resumed_honestly

pytestmark = pytest.mark.slurm
__all__ = ["hook"]  # the fixture, used by name
FSDP = ("trainer.strategy=fsdp",)


@pytest.fixture(scope="module")
@fixture_tier("local")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """The undisturbed fsdp run, 4 processes on this machine (NODE_RANK 0 and 1): every rank's final shards."""
    import os
    import sys

    root = tmp_path_factory.mktemp("fsdp-reference")
    out = subprocess.run([sys.executable, "-m", "runner", "submit", str(Path(__file__).parents[1] / "conf" /
                          "slurm-2node.yaml"), "scheduler=local", f"run_root={root}", *BASE, *FSDP,
                          "model.step_time_s=0"], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    [run] = root.glob("slurm-2node-*")
    return final_weights(run)


def test_fsdp_2x2_sharded_preempted_and_resumed_bitwise(slurm_cluster: devcluster.Cluster, hook: Any,
                                                        reference: list[Any], tmp_path: Path) -> None:
    import torch

    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path, *FSDP)
    wait_for("checkpoint 20", lambda: checkpoint_done(run, 20), 180, run)
    subprocess.run(["scancel", "--batch", "--signal=USR2", job_id(run)], env=env, check=True, timeout=30)
    wait_for("the requeued job to finish", lambda: (run / "finished").exists(), 240, run)
    exits = [e for e in events(run) if e["event"] == "exit"]
    assert exits[0]["exit_code"] == 75 and exits[0]["outcome"] == "preempted"
    for mine, ref in zip(final_weights(run), reference, strict=True):
        assert all(torch.equal(mine[k], ref[k]) for k in ref)
    held = [json.loads((run / "ranks" / f"params-rank{r:05d}.json").read_text()) for r in range(4)]
    total = held[0]["model"]
    assert sum(h["resident"] for h in held) == total
    assert all(0.15 * total <= h["resident"] <= 0.35 * total for h in held), held  # about 1/4 each
    hosts = {json.loads((run / "ranks" / f"rank-{r:05d}.json").read_text())["hostname"] for r in range(4)}
    assert len(hosts) == 2
    for _, path in checkpoint.complete(run / "checkpoints"):
        manifest = json.loads((path / "manifest.json").read_text())
        assert manifest["world_size"] == 4 and manifest["shards"] == {str(r): f"__{r}_0.distcp" for r in range(4)}
        assert checkpoint.verify(path) is None and (path / "COMPLETE").is_file()
    assert status(env, run)["state"] == "completed"


def test_fsdp_stopped_on_2x2_resumes_on_1x2_from_the_4_rank_shards(slurm_cluster: devcluster.Cluster, hook: Any,
                                                                  tmp_path: Path) -> None:
    """Not bitwise (2 ranks sum and split the data otherwise than 4): the step and the global batch continue."""
    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path, *FSDP, "slurm.requeue=false")
    wait_for("checkpoint 20", lambda: checkpoint_done(run, 20), 180, run)
    subprocess.run(["scancel", "--batch", "--signal=USR2", job_id(run)], env=env, check=True, timeout=30)
    wait_for("the preempted job to end", lambda: status(env, run)["state"] == "preempted", 120, run)
    step, path = checkpoint.complete(run / "checkpoints")[0]
    stopped_at = json.loads((path / "manifest.json").read_text())
    assert stopped_at["world_size"] == 4
    out = runner(env, "resume", str(run), "num_nodes=1")
    assert "resized from 2x2 (accumulate 1) to 1x2 (accumulate 2); global batch 32 kept" in out.stdout
    wait_for("the resized run to finish", lambda: (run / "finished").exists(), 240, run)
    starts = [e for e in events(run) if e["event"] == "train_start"]
    assert starts[-1]["step"] == step and starts[-1]["lost_steps"] <= 10
    held = [json.loads((run / "ranks" / f"params-rank{r:05d}.json").read_text()) for r in (0, 1)]
    assert all(h["world_size"] == 2 and 0.4 * h["model"] <= h["resident"] <= 0.6 * h["model"] for h in held)
    newest = checkpoint.complete(run / "checkpoints")[0][1]
    assert json.loads((newest / "manifest.json").read_text())["world_size"] == 2
    log = (run / "logs").rglob("rank-00000.log")
    assert any(f"resuming from {path} (step {step})" in p.read_text() for p in log)
    assert_resumed_honestly(RunDir(run), stopped_at, to_world=2, to_accumulate=2, state="resharded")


def test_fsdp_a_global_data_position_goes_on_exactly_from_2x2_on_1x2(slurm_cluster: devcluster.Cluster, hook: Any,
                                                                    tmp_path: Path) -> None:
    """The example loader in one global order (``data.order=global``) stopped mid-epoch on 4 ranks over 2 nodes and
    resumed on 2 ranks of 1 node: every batch of the interrupted epoch is trained once, by the 4 ranks before the
    stop and the 2 after it (each rank's trace, written on its node into the shared run root)."""
    env = env_for(slurm_cluster, hook)
    trace = tmp_path / "trace"
    run = submit(env, tmp_path, *FSDP, "slurm.requeue=false", "data.order=global", f"data.trace_dir={trace}")
    wait_for("checkpoint 10", lambda: checkpoint_done(run, 10), 180, run)
    subprocess.run(["scancel", "--batch", "--signal=USR2", job_id(run)], env=env, check=True, timeout=30)
    wait_for("the preempted job to end", lambda: status(env, run)["state"] == "preempted", 120, run)
    step, path = checkpoint.complete(run / "checkpoints")[0]
    stopped_at = json.loads((path / "manifest.json").read_text())
    assert stopped_at["world_size"] == 4 and stopped_at["mid_epoch"] and step < 32, stopped_at  # 128 batches, 4 a step
    runner(env, "resume", str(run), "num_nodes=1")
    wait_for("the resized run to finish", lambda: (run / "finished").exists(), 240, run)
    assert_resumed_honestly(RunDir(run), stopped_at, to_world=2, to_accumulate=2, state="resharded", epoch_len=64,
                            global_position=True)
    taken = [tuple(int(x) for x in line.split()) for f in sorted(trace.glob("rank-*.txt"))
             for line in f.read_text().splitlines()]
    assert sorted(b for e, b in taken if e == 0) == list(range(128))  # each batch of the interrupted epoch once
    assert sorted(b for e, b in taken if e == 1) == list(range(128))  # the next epoch whole, on 2 ranks


def test_fsdp_a_stopped_rank_is_named_and_its_node_left_out(slurm_cluster: devcluster.Cluster, hook: Any,
                                                            tmp_path: Path) -> None:
    """The watchdog and bad-node memory on shards, as for DDP (tests/test_resilience.py): rank 1 of a 1 x 2 fsdp
    run is SIGSTOPped; the hang names it and its node, the node is kept out of the next job, which finishes."""
    import os
    import signal

    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path, *FSDP, "num_nodes=1", "watchdog.floor_s=5")
    wait_for("checkpoint 20", lambda: checkpoint_done(run, 20), 180, run)
    rank1 = json.loads((run / "ranks" / "rank-00001.json").read_text())
    os.kill(rank1["pid"], signal.SIGSTOP)
    wait_for("the hang to be named", lambda: any(e["event"] == "exit" and e["outcome"] == "hang"
                                                 for e in events(run)), 90, run)
    row = status(env, run)
    assert row["last_outcome"] == "hang" and f"rank 1 on {rank1['hostname']}" in row["last_cause"], row
    assert list(nodes.remembered(tmp_path, 3600)) == [rank1["hostname"]]
    wait_for("the resubmitted job to finish", lambda: (run / "finished").exists(), 240, run)
    ranks = [json.loads(p.read_text())["hostname"] for p in sorted((run / "ranks").glob("rank-*.json"))]
    assert rank1["hostname"] not in ranks  # the next attempt ran on the other node
    assert json.loads((run / "ranks" / "params-rank00000.json").read_text())["world_size"] == 2


def test_fsdp_2x2_a_kill_during_the_sharded_write_keeps_the_previous_checkpoint(
        slurm_cluster: devcluster.Cluster, hook: Any, reference: list[Any], tmp_path: Path) -> None:
    """Every rank's shard of step 20 is on disk, rank 0 is held before publishing it (tests/slow_disk, a slow
    disk's stand-in on the job's PYTHONPATH, passed to the ranks by sbatch's environment) and killed: step 20 never
    becomes complete, the resume starts from the checkpoint before it and ends bitwise equal to the undisturbed run."""
    import torch

    env = env_for(slurm_cluster, hook)
    run = submit(slow_disk.env(20, 120, env), tmp_path, *FSDP)
    staging = run / "checkpoints" / ".staging-step-0000020"
    for name in [*(f"__{r}_0.distcp" for r in range(4)), ".metadata", "rng-rank00003.pt"]:
        wait_for(f"{name} of step 20", lambda name=name: (staging / name).exists(), 180, run)  # type: ignore[misc]
    pid = json.loads((run / "ranks" / "rank-00000.json").read_text())["pid"]
    import os
    import signal

    os.kill(pid, signal.SIGKILL)
    wait_for("the job to fail", lambda: status(env, run)["state"] == "failed", 90, run)
    ckpts = run / "checkpoints"
    assert checkpoint.latest(ckpts, check=True) == (10, ckpts / "step-0000010")
    assert not (ckpts / "step-0000020").exists()
    runner(env, "resume", str(run))
    wait_for("the resumed job to finish", lambda: (run / "finished").exists(), 240, run)
    for mine, ref in zip(final_weights(run), reference, strict=True):
        assert all(torch.equal(mine[k], ref[k]) for k in ref)
    starts = [e for e in events(run) if e["event"] == "train_start"]
    assert starts[-1]["step"] == 10


def test_fsdp_2x2_a_nan_in_one_ranks_shard_stops_every_rank_at_the_same_step(
        slurm_cluster: devcluster.Cluster, hook: Any, tmp_path: Path) -> None:
    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path, *FSDP, "model.faults.nan_at_step=25", "model.faults.rank=3")
    wait_for("the job to end", lambda: any(e["event"] == "exit" for e in events(run)), 180, run)
    row = status(env, run)
    assert row["last_outcome"] == "nan" and "step 25" in row["last_cause"], row
    assert [(e["event"], e["step"]) for e in events(run) if e["event"].startswith("nonfinite")] == [("nonfinite", 25)]
    for rank in range(4):
        log = next((run / "logs").rglob(f"rank-{rank:05d}.log")).read_text()
        assert "at step 25: training stops" in log, rank
    complete = sorted(int(p.parent.name[5:]) for p in (run / "checkpoints").glob("step-*/COMPLETE"))
    assert complete and max(complete) == 20  # nothing of step 25 was saved
    assert not (run / "finished").exists()
