"""Program mode on the real dev cluster (2 nodes x 2 ranks, CPU/gloo): a plain Lightning script, written as users write
them (tests/programs/lightning_train.py: its own argparse, Trainer and DataLoaders, no import of runner), copied as
``train.py`` into a working directory and submitted from there with ``command: python train.py ...``.

Each test asserts what the user sees (the script's own prints, the run's state, its weights) and what the ledger
says. One undisturbed run (``runtime: none``, torchdata's resumable loader) is shared: it is the "trains to the end"
case and the weights every disturbed run must end with, bit for bit. The same script trains inside the podman image
(built offline from the wheelhouse, torchdata included) to the same weights: tests/test_program_podman.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner.dev import devcluster
from runner.host import nodes
from tests.test_failures import checkpoint_done, events, final_weights, job_id, runner, status, wait_for

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
PROGRAM = REPO / "tests" / "programs" / "lightning_train.py"
STEPS = 60
EVERY = 10
# ~0.08 s a step on 2 cores (0.05 s of it the script's own sleep): long enough to be hit mid-training.
FLAGS = f"--max_steps {STEPS} --stateful --sleep 0.05"
# runner's settings, as conf/slurm-2node.yaml has them; in a `runner:` block, or top level (the podman variant).
SETTINGS: dict[str, Any] = {
    "scheduler": "slurm", "seed": 1234,
    "checkpoint": {"every_n_steps": EVERY, "keep_last": 20},
    "slurm": {"time": "00:10:00", "cpus_per_task": 1, "signal_lead_s": 60},
    "network": {"ifname": None, "pg_timeout_s": 60},
    "resume": {"backoff_s": 0},
    "alerts": {"enabled": False},
    "container": {"runtime": "none"},
}


def program(work: Path, flags: str, name: str = "program-cluster", block: bool = True,
            container: dict[str, Any] | None = None, **extra: Any) -> Path:
    """``work/train.py`` (the script, unchanged) and ``work/program.yaml`` that runs it on 2 nodes x 2 ranks."""
    work.mkdir(parents=True, exist_ok=True)
    shutil.copy(PROGRAM, work / "train.py")
    settings = {"name": name, **SETTINGS, "container": container or SETTINGS["container"]}
    doc: dict[str, Any] = {"num_nodes": 2, "num_device": 2,
                           "command": f"python train.py --devices ${{num_device}} --num_nodes ${{num_nodes}} {flags}",
                           **extra}
    doc.update({"runner": settings} if block else settings)
    (work / "program.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return work / "program.yaml"


def submit(env: dict[str, str], work: Path, root: Path, *overrides: str, block: bool = True) -> Path:
    """``runner submit program.yaml`` run in ``work`` (where the program then runs, as sbatch would)."""
    key = "runner.run_root" if block else "run_root"
    out = subprocess.run([sys.executable, "-m", "runner", "submit", "program.yaml", f"{key}={root}", *overrides],
                         capture_output=True, text=True, env=env, timeout=180, cwd=work)
    assert out.returncode == 0, out.stdout + out.stderr
    [run] = root.iterdir()
    return run


def cluster_env(cluster: devcluster.Cluster) -> dict[str, str]:
    return {**os.environ, **cluster.env(), "OMP_NUM_THREADS": "1"}


def rank_log(run: Path, rank: int, attempt: int) -> str:
    return (run / "logs" / f"attempt-{attempt}" / f"rank-{rank:05d}.log").read_text()


def ranks(run: Path) -> list[dict[str, Any]]:
    files = sorted((run / "ranks").glob("rank-*.json"))
    assert len(files) == 4, files
    return [json.loads(f.read_text()) for f in files]


def exits(run: Path) -> list[dict[str, Any]]:
    return [e for e in events(run) if e["event"] == "exit"]


def ended(run: Path) -> bool:
    """The exit hook recorded the job's end (it writes the ledger after the ranks are gone)."""
    return bool(exits(run))


def complete_steps(run: Path) -> list[int]:
    return sorted(int(p.parent.name[5:]) for p in (run / "checkpoints").glob("step-*/COMPLETE"))


def assert_same_weights(run: Path, reference: list[Any]) -> None:
    import torch

    for mine, ref in zip(final_weights(run), reference, strict=True):
        assert sorted(mine) == sorted(ref) and all(torch.equal(mine[k], ref[k]) for k in ref)


@pytest.fixture(scope="session")  # one run for this file and tests/test_program_podman.py
def undisturbed(slurm_cluster: devcluster.Cluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The program trained to its end on the cluster, undisturbed (runtime none): its run directory."""
    tmp = tmp_path_factory.mktemp("undisturbed")
    program(tmp / "work", FLAGS)
    run = submit(cluster_env(slurm_cluster), tmp / "work", tmp / "runs")
    wait_for("the undisturbed run to end", lambda: ended(run), 180, run)
    return run


def test_the_script_trains_to_the_end_on_two_nodes(undisturbed: Path) -> None:
    run = undisturbed
    assert (run / "finished").exists()
    names = [e["event"] for e in events(run)]
    assert names.count("train_start") == 1 and "finished" in names, names
    [start] = [e for e in events(run) if e["event"] == "train_start"]
    assert (start["step"], start["resumed_from"]) == (0, None)
    [data] = [e for e in events(run) if e["event"] == "data"]
    assert data["exactness"] == "exact" and data["global_batch"] == 64  # 16 x 4 ranks, measured
    [end] = exits(run)
    assert (end["outcome"], end["exit_code"]) == ("completed", 0), end
    assert next(e for e in events(run) if e["event"] == "finished")["step"] == STEPS
    for rank in range(4):
        log = rank_log(run, rank, 1)
        assert "train starts at step 0" in log and f"trained to step {STEPS}" in log  # the script's own prints
    info = ranks(run)
    assert [r["in_container"] for r in info] == [False] * 4 and {r["runtime"] for r in info} == {"none"}
    assert sorted(r["hostname"] for r in info) == ["n1", "n1", "n2", "n2"]
    assert complete_steps(run) == list(range(EVERY, STEPS + 1, EVERY))
    assert len(final_weights(run)) == 4
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["cwd"] == str(run.parent.parent / "work")  # where `runner submit` ran, and the program too


def test_a_preemption_notice_checkpoints_requeues_and_resumes_bitwise(slurm_cluster: devcluster.Cluster,
                                                                      undisturbed: Path, tmp_path: Path) -> None:
    env = cluster_env(slurm_cluster)
    program(tmp_path / "work", FLAGS)
    run = submit(env, tmp_path / "work", tmp_path / "runs")
    wait_for("checkpoint 20", lambda: checkpoint_done(run, 20), 120, run)
    first = job_id(run)
    # The notice goes to the batch shell only (as `--signal=B:USR2@N`); it must reach every rank's program.
    subprocess.run(["scancel", "--batch", "--signal=USR2", first], env=env, check=True, timeout=30)
    wait_for("the requeued job to finish", lambda: (run / "finished").exists() and len(exits(run)) == 2, 180, run)

    attempt1 = rank_log(run, 0, 1)
    stop = re.search(r"stopped on signal at step (\d+); exit 75", attempt1)
    assert stop, attempt1[-3000:]
    step = int(stop.group(1))
    assert 20 <= step < STEPS
    assert all("received SIGUSR2" in rank_log(run, r, 1) for r in range(4))
    # The checkpoint of the stop step, written at that step boundary: the last one the first attempt made.
    assert re.findall(r"checkpoint step-(\d+) complete", attempt1)[-1] == f"{step:07d}"
    assert json.loads((run / "checkpoints" / f"step-{step:07d}" / "manifest.json").read_text())["step"] == step
    # The script's own trainer.global_step at on_train_start, in the next attempt: the checkpoint's step.
    assert f"train starts at step {step}\n" in rank_log(run, 0, 2)
    assert f"trained to step {STEPS}" in rank_log(run, 0, 2)
    first_exit, second_exit = exits(run)
    assert (first_exit["outcome"], first_exit["exit_code"], first_exit["job_id"]) == ("preempted", 75, first)
    assert second_exit["outcome"] == "completed"
    names = [e["event"] for e in events(run)]
    assert "requeued" in names and names.index("requeued") < names.index("finished")
    starts = [e for e in events(run) if e["event"] == "train_start"]
    assert [(s["attempt"], s["step"]) for s in starts] == [(1, 0), (2, step)]
    assert starts[1]["resumed_from"].endswith(f"step-{step:07d}") and starts[1]["lost_steps"] == 0
    assert job_id(run) == first  # requeued: the same Slurm job, its second run
    assert_same_weights(run, final_weights(undisturbed))


def test_a_killed_rank_fails_the_job_cron_resubmits_it_and_it_finishes(slurm_cluster: devcluster.Cluster,
                                                                      undisturbed: Path, tmp_path: Path) -> None:
    env = cluster_env(slurm_cluster)
    program(tmp_path / "work", FLAGS)
    run = submit(env, tmp_path / "work", tmp_path / "runs")
    wait_for("checkpoint 20", lambda: checkpoint_done(run, 20), 120, run)
    victim = ranks(run)[3]
    os.kill(victim["pid"], signal.SIGKILL)  # runtime none: the rank's pid is the node's (network namespaces only)
    wait_for("the job to fail", lambda: ended(run) and status(env, run)["state"] == "failed", 90, run)
    [end] = exits(run)
    assert end["outcome"] == "failed", end
    saved = complete_steps(run)[-1]
    out = runner(env, "cron", "--root", str(tmp_path / "runs")).stdout  # run from the repository, not the work dir
    assert "resubmit:" in out, out
    wait_for("the resubmitted job to finish", lambda: (run / "finished").exists() and len(exits(run)) == 2, 180, run)
    names = [e["event"] for e in events(run)]
    assert names.count("resubmitted") == 1 and exits(run)[1]["outcome"] == "completed", names
    assert job_id(run) != end["job_id"]
    starts = [e for e in events(run) if e["event"] == "train_start"]
    assert [s["step"] for s in starts] == [0, saved]
    assert f"train starts at step {saved}\n" in rank_log(run, 0, 2)
    assert_same_weights(run, final_weights(undisturbed))


def test_a_stopped_rank_is_named_with_its_node(slurm_cluster: devcluster.Cluster, tmp_path: Path) -> None:
    env = cluster_env(slurm_cluster)
    program(tmp_path / "work", "--max_steps 1000 --sleep 0.05")
    run = submit(env, tmp_path / "work", tmp_path / "runs", "runner.watchdog.floor_s=5")
    wait_for("checkpoint 20", lambda: checkpoint_done(run, 20), 120, run)
    victim = ranks(run)[1]
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        # The exit hook records the hang, then resubmits without the node it names (here the partition cannot
        # do without it: 2 of 2 nodes, so it comes back in before sbatch).
        wait_for("the hang to be named and the run resubmitted",
                 lambda: "resubmitted" in [e["event"] for e in events(run)], 90, run)
        [end] = exits(run)
        assert (end["outcome"], end["exit_code"], end["nodes"]) == ("hang", 79, [victim["hostname"]]), end
        hang = json.loads((run / "hang.json").read_text())
        assert [(s["rank"], s["node"]) for s in hang["suspects"]] == [(1, victim["hostname"])], hang
        assert hang["nodes"] == [victim["hostname"]]
        assert f"rank 1 on {victim['hostname']}" in hang["summary"]
        [recorded] = [e for e in events(run) if e["event"] == "hang"]
        assert recorded["nodes"] == [victim["hostname"]] and recorded["step"] >= 20
        row = status(env, run)
        assert row["last_outcome"] == "hang" and f"rank 1 on {victim['hostname']}" in row["last_cause"], row
        assert list(nodes.remembered(tmp_path / "runs", 3600)) == [victim["hostname"]]
        [resubmitted] = [e for e in events(run) if e["event"] == "resubmitted"]
        assert victim["hostname"] in resubmitted["reason"], resubmitted
    finally:
        runner(env, "cancel", str(run), check=False)


def test_a_nan_from_the_script_stops_the_run_without_saving_it(slurm_cluster: devcluster.Cluster,
                                                              tmp_path: Path) -> None:
    env = cluster_env(slurm_cluster)
    nan_at = 25
    program(tmp_path / "work", f"--max_steps {STEPS} --sleep 0.05 --nan-at {nan_at}")
    run = submit(env, tmp_path / "work", tmp_path / "runs")
    wait_for("the job to end", lambda: ended(run) and "stopped" in [e["event"] for e in events(run)], 120, run)
    assert json.loads((run / "last_exit.json").read_text())["code"] == 80
    [end] = exits(run)
    assert (end["outcome"], end["exit_code"]) == ("nan", 80), end
    [nonfinite] = [e for e in events(run) if e["event"] == "nonfinite"]
    assert nonfinite["step"] == nan_at, nonfinite
    assert [e["event"] for e in events(run)].count("stopped") == 1
    assert not (run / "finished").exists()
    assert complete_steps(run) == [10, 20]
    on_disk = [int(m.group(1)) for p in (run / "checkpoints").iterdir() if (m := re.search(r"(\d+)", p.name))]
    assert max(on_disk) < nan_at, on_disk  # nothing of step 25 on, not even staged
    log = rank_log(run, 0, 1)
    assert "trained to step" not in log  # the script's code after fit never ran
    row = status(env, run)
    assert row["last_outcome"] == "nan" and f"step {nan_at}" in row["last_cause"], row
