"""Programs as their communities write them (tests/programs/, none imports runner) on the dev cluster, 2 nodes x 1
rank, ``runtime: none``: PyTorch's torchrun tutorial script (its own snapshot and SIGTERM handler), Lightning's
Fabric image classifier under ``fabric run`` and an Accelerate script each train one world across both nodes (ranks 0
and 1 of 2 on n1 and n2; each rank's own shard and loss, the same weights after every step), and so does
Lightning's LightningCLI example with runner's checkpoints; `runner cancel` stops a program within seconds as
``cancelled``; a preemption notice (USR2 to the batch shell) reaches the torchrun
script's own SIGTERM handler, which saves, and the requeued attempt resumes from its snapshot."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner.dev import devcluster
from tests.test_failures import events, job_id, runner, wait_for
from tests.test_program_cluster import SETTINGS, cluster_env, exits, rank_log, submit

pytestmark = pytest.mark.slurm
PROGRAMS = Path(__file__).resolve().parent / "programs"
COMMANDS = {
    "torchrun": "python ddp_multinode.py {epochs} 1 --batch_size 8 --sleep {sleep}",
    "fabric": "fabric run --devices ${{num_device}} --num-nodes ${{num_nodes}} fabric_image_classifier.py "
              "--epochs {epochs} --sleep {sleep}",
    "accelerate": "python accelerate_regression.py --cpu --num_epochs {epochs} --sleep {sleep}",
    "lightning_cli": "python lightning_cli_main.py fit --config ${{program_config}}",
}
# The rest of a LightningCLI user's config (trainer:, model:, data:; `epochs` is its max_steps).
CLI = {"seed_everything": 7, "model": {"out_dim": 10, "learning_rate": 0.02}, "data": {},
       "trainer": {"accelerator": "cpu", "devices": "${num_device}", "num_nodes": "${num_nodes}",
                   "enable_progress_bar": False}}
SAYS = {"torchrun": "rank {r} of 2 (local 0, group {r}, run None)", "fabric": "fabric rank {r} of 2",
        "accelerate": "accelerate process {r} of 2 (DistributedType.MULTI_CPU)"}
# One line per optimizer step and rank, in each program's own words: (rank, step key, loss, weights).
LINES = {
    "torchrun": re.compile(r"^\[RANK(?P<rank>\d)\] epoch (?P<e>\d+) batch (?P<b>\d+) loss (?P<loss>\S+) "
                           r"weights (?P<w>\S+)$", re.M),
    "fabric": re.compile(r"^Train Epoch: (?P<e>\d+) \[(?P<b>\d+)\] rank (?P<rank>\d) Loss: (?P<loss>\S+) "
                         r"weights (?P<w>\S+)$", re.M),
    "accelerate": re.compile(r"^epoch (?P<e>\d+) step (?P<b>\d+) process (?P<rank>\d) loss (?P<loss>\S+) "
                             r"weights (?P<w>\S+)$", re.M),
}


def start(cluster: devcluster.Cluster, tmp: Path, kind: str, epochs: int, sleep: float,
          *overrides: str) -> tuple[Path, dict[str, str]]:
    """The programs copied into ``tmp/work`` and ``program.yaml`` running ``kind`` on 2 nodes x 1 rank, submitted
    from there (with ``overrides``: ``runner.resume.in_job=true``, say): its run directory and the environment."""
    work = tmp / "work"
    work.mkdir(parents=True)
    for program in PROGRAMS.glob("*.py"):
        shutil.copy(program, work / program.name)
    doc: dict[str, Any] = {"num_nodes": 2, "num_device": 1,
                           "command": COMMANDS[kind].format(epochs=epochs, sleep=sleep),
                           "runner": {"name": f"user-{kind}", **SETTINGS}}
    if kind == "lightning_cli":
        doc.update(CLI, trainer={**CLI["trainer"], "max_steps": epochs})
    (work / "program.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    env = cluster_env(cluster)
    return submit(env, work, tmp / "runs", *overrides), env


def steps(kind: str, run: Path, attempt: int = 1) -> dict[tuple[str, str], dict[int, tuple[str, str]]]:
    """Each step's (loss, weights) by rank, from both rank logs."""
    seen: dict[tuple[str, str], dict[int, tuple[str, str]]] = defaultdict(dict)
    for rank in (0, 1):
        for m in LINES[kind].finditer(rank_log(run, rank, attempt)):
            assert int(m["rank"]) == rank, m.group(0)
            seen[(m["e"], m["b"])][rank] = (m["loss"], m["w"])
    return seen


def training(run: Path, kind: str, count: int = 6) -> bool:
    log = run / "logs" / "attempt-1" / "rank-00000.log"
    return log.exists() and len(LINES[kind].findall(log.read_text())) >= count


@pytest.mark.parametrize("kind", ["torchrun", "fabric", "accelerate"])
def test_each_program_trains_one_world_across_two_nodes(slurm_cluster: devcluster.Cluster, tmp_path: Path,
                                                        kind: str) -> None:
    run, _ = start(slurm_cluster, tmp_path, kind, epochs=2, sleep=0)
    wait_for("the run to end", lambda: bool(exits(run)), 180, run)
    assert [(e["outcome"], e["exit_code"]) for e in exits(run)] == [("completed", 0)], exits(run)
    assert (run / "finished").exists()
    hosts = {json.loads(f.read_text())["rank"]: json.loads(f.read_text())["hostname"]
             for f in (run / "ranks").glob("rank-*.json")}
    assert hosts == {0: "n1", 1: "n2"}, hosts
    for rank in (0, 1):
        assert SAYS[kind].format(r=rank) in rank_log(run, rank, 1), rank_log(run, rank, 1)[-3000:]
    seen = steps(kind, run)
    assert len(seen) >= 16 and all(len(ranks) == 2 for ranks in seen.values()), seen  # every step on both ranks
    for ranks in seen.values():  # each rank its own shard (its own loss), one all-reduced gradient (the same weights)
        assert ranks[0][0] != ranks[1][0] and ranks[0][1] == ranks[1][1], ranks


def test_a_lightning_cli_program_trains_one_world_across_two_nodes_with_runners_checkpoints(
        slurm_cluster: devcluster.Cluster, tmp_path: Path) -> None:
    """Lightning's LightningCLI example with `fit --config ${program_config}`: runner's copy of the config, resolved
    for jsonargparse, gives its Trainer 1 device on each of 2 nodes; runner's callback checkpoints it."""
    run, _ = start(slurm_cluster, tmp_path, "lightning_cli", epochs=40, sleep=0)
    wait_for("the run to end", lambda: bool(exits(run)), 180, run)
    assert [(e["outcome"], e["exit_code"]) for e in exits(run)] == [("completed", 0)], exits(run)
    hosts = {json.loads(f.read_text())["rank"]: json.loads(f.read_text())["hostname"]
             for f in (run / "ranks").glob("rank-*.json")}
    assert hosts == {0: "n1", 1: "n2"}, hosts
    for rank in (0, 1):  # Lightning's own words: one process group of both ranks
        assert f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/2" in rank_log(run, rank, 1)
    assert [e["step"] for e in events(run) if e["event"] == "finished"] == [40]
    assert (run / "checkpoints" / "step-0000040" / "COMPLETE").exists()


@pytest.mark.parametrize("kind", ["torchrun", "fabric", "accelerate"])
def test_runner_cancel_stops_a_program_within_seconds_as_cancelled(slurm_cluster: devcluster.Cluster,
                                                                   tmp_path: Path, kind: str) -> None:
    run, env = start(slurm_cluster, tmp_path, kind, epochs=50, sleep=0.05)
    wait_for("rank 0's sixth step", lambda: training(run, kind), 120, run)
    sent = time.monotonic()
    runner(env, "cancel", str(run))
    wait_for("the job to end", lambda: bool(exits(run)), 30, run)
    took = time.monotonic() - sent
    assert took < 10, took
    assert [e["outcome"] for e in exits(run)] == ["cancelled"], exits(run)
    assert not (run / "finished").exists()
    for rank in (0, 1):
        assert "SIGKILL" not in rank_log(run, rank, 1)


def test_a_preemption_notice_reaches_the_scripts_own_handler_and_it_resumes_from_its_snapshot(
        slurm_cluster: devcluster.Cluster, tmp_path: Path) -> None:
    run, env = start(slurm_cluster, tmp_path, "torchrun", epochs=4, sleep=0.05)
    wait_for("rank 0's sixth step", lambda: training(run, "torchrun"), 120, run)
    first = job_id(run)
    # The notice goes to the batch shell only (as `--signal=B:USR2@N`); it must reach every rank's program.
    subprocess.run(["scancel", "--batch", "--signal=USR2", first], env=env, check=True, timeout=30)
    wait_for("the requeued job to finish", lambda: (run / "finished").exists() and len(exits(run)) == 2, 180, run)
    attempt1 = rank_log(run, 0, 1)
    [epoch] = re.findall(r"^\[RANK0\] SIGTERM at epoch (\d+)$", attempt1, re.M)  # the script's own handler ran
    assert f"Epoch {epoch} | Training snapshot saved at snapshot.pt" in attempt1
    assert "SIGTERM at epoch" in rank_log(run, 1, 1)
    second = rank_log(run, 0, 2)
    assert f"Resuming training from snapshot at Epoch {epoch}" in second and "[RANK0] done" in second
    assert [(e["outcome"], e["exit_code"]) for e in exits(run)] == [("preempted", 75), ("completed", 0)]
    assert "requeued" in [e["event"] for e in events(run)] and job_id(run) == first  # the same job, requeued
    assert min(int(e) for e, _ in steps("torchrun", run, 2)) == int(epoch)
