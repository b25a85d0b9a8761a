"""`runner submit` against a real Slurm: 2 nodes x 2 tasks on the local dev cluster, DDP across namespaces.

Every node of the dev cluster is its own network namespace with its own hostname and address, so the
rendezvous (MASTER_ADDR = first node, per-node interface detection) is exercised as on a real cluster.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import until

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf" / "slurm-2node.yaml"
STEPS = 60


def runner(*args: str, env: dict[str, str], check: bool = True,
           timeout: float = 90) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, env=env,
                         timeout=timeout, cwd=REPO)
    if check:
        assert out.returncode == 0, f"runner {' '.join(args)}:\n{out.stdout}{out.stderr}"
    return out


def wait_state(run: Path, env: dict[str, str], want: set[str], timeout: float = 60) -> dict[str, Any]:
    last: list[dict[str, Any]] = []

    def reached() -> dict[str, Any] | None:
        row: dict[str, Any] = json.loads(runner("status", str(run), "--json", env=env).stdout)[0]
        last[:] = [row]
        return row if row["state"] in want else None

    def why() -> str:
        logs = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in (run / "logs").rglob("*.*"))
        return f"last status: {last[0] if last else None}{logs}"
    return until(f"a state in {want}", reached, timeout, every=0.3, detail=why)


def weights(run: Path) -> list[dict[str, Any]]:
    import torch

    files = sorted((run / "final").glob("rank-*.pt"))
    return [torch.load(f, weights_only=True) for f in files]


def assert_bitwise(a: dict[str, Any], b: dict[str, Any]) -> None:
    import torch

    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# ---------------------------------------------------------------------------------------------------------------
# The real cluster


slurm = pytest.mark.slurm


@pytest.fixture(scope="module")
def env(slurm_cluster: Any) -> dict[str, str]:
    return {**os.environ, **slurm_cluster.env(), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def two_node_run(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """One `runner submit conf/slurm-2node.yaml` to COMPLETED, with `runner logs --follow` watching it."""
    root = tmp_path_factory.mktemp("slurm-runs")
    t0 = time.monotonic()
    out = runner("submit", str(CONF), f"run_root={root}", f"trainer.max_steps={STEPS}", env=env)
    m = re.search(r"submitted job (\d+): (\S+)", out.stdout)
    assert m, out.stdout
    job, run = m.group(1), Path(m.group(2))
    assert (run / "job_id").read_text().strip() == job
    follow = subprocess.Popen([sys.executable, "-m", "runner", "logs", str(run), "--rank", "0", "--follow"],
                              env=env, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_state(run, env, {"completed", "failed", "cancelled", "timeout", "preempted"}, timeout=60)

    def row() -> dict[str, Any]:
        return dict(json.loads(runner("status", str(run), "--json", env=env).stdout)[0])

    def settled() -> bool:
        state = row().get("slurm_state")
        return not state or state == "COMPLETED"
    # training is done once `finished` exists; the job itself ends after the exit hook
    until("Slurm's state COMPLETED (or none any more)", settled, 20, every=0.2, detail=row)
    try:
        followed, _ = follow.communicate(timeout=15)
    finally:
        follow.kill()
    print(f"2-node run: submit -> completed in {time.monotonic() - t0:.1f} s")
    return run, job, followed


@slurm
def test_two_nodes_two_tasks_layout(two_node_run: tuple[Path, str, str], slurm_cluster: Any) -> None:
    run, job, _ = two_node_run
    infos = [json.loads(p.read_text()) for p in sorted((run / "ranks").glob("rank-*.json"))]
    assert [i["rank"] for i in infos] == [0, 1, 2, 3]
    first, second = slurm_cluster.nodes[:2]
    hosts = {}
    for info in infos:
        rank, s = info["rank"], info["slurm"]
        assert s["SLURM_JOB_ID"] == job and s["SLURM_NTASKS"] == "4"
        assert int(s["SLURM_PROCID"]) == rank
        assert int(s["SLURM_NODEID"]) == info["node_rank"] == rank // 2  # block distribution
        assert int(s["SLURM_LOCALID"]) == info["local_rank"] == rank % 2
        assert info["world_size"] == 4
        assert info["omp_num_threads"] == "1"  # from --cpus-per-task=1
        hosts.setdefault(info["node_rank"], set()).add(info["hostname"])
        # MASTER_ADDR is the first node; the port derives from the job id
        assert info["master"] == f"{first}:{10000 + 2 * (int(job) % 10000)}"
        # each node detected its own interface from the route to MASTER_ADDR (on n1 that is not `lo`)
        assert info["ifname"] == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert hosts == {0: {first}, 1: {second}}


@slurm
def test_two_nodes_measure_their_one_link_once_and_name_both_ends(two_node_run: tuple[Path, str, str],
                                                                  slurm_cluster: Any) -> None:
    run, _, _ = two_node_run
    report = json.loads((run / "preflight.json").read_text())
    nodes = slurm_cluster.nodes[:2]
    [link] = report["bandwidth"]["pairs"]
    assert link["nodes"] == nodes and link["from"] == "job" and link["busbw_gbps"] > 0  # no second probe
    assert [(c["node"], c["status"]) for c in report["checks"] if c["name"] == "busbw node"] == \
        [(n, "pass") for n in nodes]


@slurm
def test_training_finishes_and_status_says_completed(two_node_run: tuple[Path, str, str],
                                                     env: dict[str, str]) -> None:
    run, job, followed = two_node_run
    assert (run / "finished").exists()
    row = json.loads(runner("status", str(run), "--json", env=env).stdout)[0]
    assert row["state"] == "completed" and row["job_id"] == job and row["last_checkpoint_step"] == STEPS
    exit_status = json.loads((run / "exit_status.json").read_text())
    assert exit_status["exit_code"] == 0 and exit_status["job_id"] == job
    events = [e["event"] for e in map(json.loads, (run / "ledger.jsonl").read_text().splitlines())]
    assert {"submitted", "start", "train_start", "finished", "exit"} <= set(events)
    table = runner("status", "--root", str(run.parent), env=env).stdout
    assert re.search(rf"{run.name}\s+completed\s+{job}\s+{STEPS}", table), table
    # Slurm itself agrees (sacct once accounting caught up, else the controller)
    from runner.host import slurm

    os.environ.setdefault("SLURM_CONF", env["SLURM_CONF"])
    def completed() -> bool:
        info = slurm.query(job)
        return info is not None and info.state == "COMPLETED"
    until(f"Slurm to show job {job} COMPLETED", completed, 10, every=0.2, detail=lambda: slurm.query(job))
    # `runner logs --follow` printed rank 0's log and returned when the run ended
    assert "rank 0/4" in followed and f"runner.job.launch: finished at step {STEPS}" in followed
    assert "rank 3/4" in runner("logs", str(run), "--rank", "3", env=env).stdout
    assert runner("logs", str(run), "--rank", "7", env=env, check=False).returncode != 0
    runner("logs", str(run), "--batch", env=env)  # Slurm's output of the batch script exists


@slurm
def test_weights_identical_on_every_rank_and_bitwise_equal_to_local(two_node_run: tuple[Path, str, str],
                                                                    env: dict[str, str],
                                                                    tmp_path: Path) -> None:
    run, _, _ = two_node_run
    slurm_w = weights(run)
    assert len(slurm_w) == 4
    for w in slurm_w[1:]:
        assert_bitwise(slurm_w[0], w)
    # the same config with scheduler: local runs 4 processes here (NODE_RANK 0 and 1, same world size)
    out = runner("submit", str(CONF), "scheduler=local", f"run_root={tmp_path}", f"trainer.max_steps={STEPS}",
                 env=env)
    [local] = tmp_path.glob("slurm-2node-*")
    assert (local / "finished").exists(), out.stdout
    local_w = weights(local)
    assert len(local_w) == 4
    assert sorted(json.loads(p.read_text())["node_rank"] for p in (local / "ranks").glob("*.json")) == [0, 0, 1, 1]
    for a, b in zip(slurm_w, local_w, strict=True):
        assert_bitwise(a, b)


@slurm
@pytest.mark.parametrize("overrides, sbatch_says", [
    (["slurm.gpus_per_node=9"], "Requested node configuration is not available"),
    (["num_nodes=3", "global_batch_size=48", "dataloader.train.total_shards=6", "dataloader.valid.total_shards=6"],
     "Node count specification invalid"),
])
def test_refused_submission_is_one_line_and_leaves_nothing(overrides: list[str], sbatch_says: str,
                                                           env: dict[str, str], tmp_path: Path) -> None:
    out = runner("submit", str(CONF), f"run_root={tmp_path}", *overrides, env=env, check=False)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("runner: error: sbatch refused the job: ") and sbatch_says in lines[0], lines[0]
    assert "Traceback" not in out.stderr and "submitted" not in out.stdout
    assert list(tmp_path.iterdir()) == []  # no half-made run directory
    assert runner("status", "--root", str(tmp_path), env=env).stdout.strip() == "no runs"


@slurm
@pytest.mark.parametrize("older", ["n1", "n9"])  # n1 and n2: the whole 2-node partition; n9: no such node (any more)
def test_when_the_remembered_bad_nodes_refuse_the_job_the_oldest_are_let_back_in(older: str, env: dict[str, str],
                                                                                  tmp_path: Path) -> None:
    from runner.host import nodes

    nodes.record(tmp_path, [older], "hang", "earlier-run", now=time.time() - 60)
    nodes.record(tmp_path, ["n2"], "preflight", "earlier-run")
    out = runner("submit", str(CONF), f"run_root={tmp_path}", "num_nodes=1", "trainer.max_steps=1000000", env=env)
    run = Path(re.search(r"submitted job (\d+): (\S+)", out.stdout).group(2))  # type: ignore[union-attr]
    job = (run / "job_id").read_text().strip()
    try:
        [submitted] = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()
                       if json.loads(x)["event"] == "submitted"]
        assert submitted["bad_nodes_let_in"] == [older]  # the older exclusion; n2 stays out
        shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env).stdout
        assert "ExcNodeList=n2" in shown, shown
    finally:
        runner("cancel", str(run), env=env)


@slurm
def test_a_job_the_partition_cannot_hold_without_a_bad_node_is_submitted_with_it(env: dict[str, str],
                                                                                  tmp_path: Path) -> None:
    """2 nodes on the 2-node partition, n2 remembered as bad: the exclusion is decided before sbatch (sinfo), so the
    one job submitted runs on both nodes; no job Slurm could never place is made first."""
    from runner.host import nodes

    nodes.record(tmp_path, ["n2"], "preflight", "earlier-run")
    out = runner("submit", str(CONF), f"run_root={tmp_path}", "trainer.max_steps=1000000", env=env)
    run = Path(re.search(r"submitted job (\d+): (\S+)", out.stdout).group(2))  # type: ignore[union-attr]
    job = (run / "job_id").read_text().strip()
    try:
        [submitted] = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()
                       if json.loads(x)["event"] == "submitted"]
        assert submitted["bad_nodes_let_in"] == ["n2"]
        shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env).stdout
        assert "ExcNodeList=(null)" in shown, shown
        assert "sbatch refused" not in out.stdout + out.stderr
    finally:
        runner("cancel", str(run), env=env)


@slurm
def test_cancel_a_running_job(env: dict[str, str], tmp_path: Path) -> None:
    out = runner("submit", str(CONF), f"run_root={tmp_path}", "trainer.max_steps=1000000",
                 "checkpoint.every_n_steps=1000000", env=env)
    run = Path(re.search(r"submitted job \d+: (\S+)", out.stdout).group(1))  # type: ignore[union-attr]
    until("training to start", lambda: any((run / "ranks").glob("*.json"))
          and "train_start" in (run / "ledger.jsonl").read_text(), 45, every=0.2)
    row = json.loads(runner("status", str(run), "--json", env=env).stdout)[0]
    assert row["state"] == "running" and row["slurm_state"] == "RUNNING"
    out = runner("cancel", str(run), env=env)
    assert "cancelled" in out.stdout
    row = wait_state(run, env, {"cancelled"}, timeout=20)
    assert row["slurm_state"] == "CANCELLED"
    assert not (run / "finished").exists()
    # `logs --follow` on an ended run prints and returns at once
    runner("logs", str(run), "--follow", env=env, timeout=15)
