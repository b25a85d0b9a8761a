"""Fault injection on the real local Slurm cluster: every run survives, ends bit for bit where an undisturbed
run ends, loses at most one checkpoint interval, and the right alerts reach a real HTTP server in order.

The webhook server listens on the cluster bridge's host address (jobs run in the nodes' network namespaces,
where 127.0.0.1 is the node's own loopback).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runner.dev import devcluster
from runner.rundir import RunDir
from tests.conftest import fixture_tier
from tests.waiting import alerts_all_sent, until

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf" / "slurm-2node.yaml"
STEPS = 80
EVERY = 10
# ~0.1 s a step: the run lasts long enough to be hit mid-training, and is still quick.
BASE = [f"trainer.max_steps={STEPS}", f"checkpoint.every_n_steps={EVERY}", "checkpoint.keep_last=20",
        "model.step_time_s=0.1", "alerts.kind=json", "alerts.backoff_s=0.2", "resume.backoff_s=0"]


@pytest.fixture
def hook(slurm_cluster: devcluster.Cluster) -> Iterator[Any]:
    from tests.webhook_server import WebhookServer

    server = WebhookServer(host=devcluster.CONTROLLER_ADDR)
    try:
        yield server
    finally:
        server.stop()


def env_for(cluster: devcluster.Cluster, hook: Any) -> dict[str, str]:
    return {**os.environ, **cluster.env(), "OMP_NUM_THREADS": "1", "RUNNER_WEBHOOK_URL": hook.url}


def runner(env: dict[str, str], *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, env=env,
                         timeout=timeout, cwd=REPO)
    if check:
        assert out.returncode == 0, f"runner {' '.join(args)}:\n{out.stdout}{out.stderr}"
    return out


def submit(env: dict[str, str], root: Path, *overrides: str) -> Path:
    runner(env, "submit", str(CONF), f"run_root={root}", *BASE, *overrides)
    [run] = root.glob("slurm-2node-*")
    return run


# Slurm states a job does not leave (sacct's, as `runner status --json` shows them in slurm_state).
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def run_logs(run: Path) -> str:
    """The tail of every log of a run and its ledger: what a timed-out wait shows."""
    logs = "".join(f"--- {p.relative_to(run)}\n{p.read_text(errors='replace')[-2500:]}\n"
                   for p in sorted((run / "logs").rglob("*.*")))
    return logs + "--- ledger\n" + (run / "ledger.jsonl").read_text()


def wait_for(what: str, pred: Any, timeout: float, run: Path | None = None) -> None:
    until(what, pred, timeout, every=0.1, detail=None if run is None else lambda: run_logs(run))


def checkpoint_done(run: Path, step: int) -> bool:
    return (run / "checkpoints" / f"step-{step:07d}" / "COMPLETE").exists()


def events(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]


def job_id(run: Path) -> str:
    return (run / "job_id").read_text().strip()


def status(env: dict[str, str], run: Path) -> dict[str, Any]:
    return json.loads(runner(env, "status", str(run), "--json").stdout)[0]


@pytest.fixture(scope="module")
@fixture_tier("local")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """The undisturbed run (same world size, run locally): the weights every disturbed run must end with."""
    root = tmp_path_factory.mktemp("reference")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "runner", "submit", str(CONF), "scheduler=local",
                          f"run_root={root}", *BASE, "model.step_time_s=0"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    [run] = root.glob("slurm-2node-*")
    return final_weights(run)


def final_weights(run: Path) -> list[Any]:
    import torch

    files = sorted((run / "final").glob("rank-*.pt"))
    assert len(files) == 4, files
    return [torch.load(f, weights_only=True) for f in files]


def assert_recovered(run: Path, reference: list[Any], hook: Any, alerts: list[str]) -> None:
    """The promises: finished, bitwise equal, at most one interval lost, alerts in order, no secret."""
    import torch

    assert (run / "finished").exists()
    for mine, ref in zip(final_weights(run), reference, strict=True):
        assert all(torch.equal(mine[k], ref[k]) for k in ref)
    lost = [e.get("lost_steps", 0) for e in events(run) if e["event"] == "train_start"]
    assert max(lost) <= EVERY, lost
    got = [a["event"] for a in hook.wait_for(len(alerts), timeout=30)]
    assert got == alerts, got
    for path in run.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert hook.secret.encode() not in data and hook.url.encode() not in data, path


def test_preemption_notice_checkpoints_requeues_and_resumes(slurm_cluster: devcluster.Cluster, hook: Any,
                                                            reference: list[Any], tmp_path: Path) -> None:
    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path)
    wait_for("checkpoint 20", lambda: checkpoint_done(run, 20), 120, run)
    first = job_id(run)
    subprocess.run(["scancel", "--batch", "--signal=USR2", first], env=env, check=True, timeout=30)
    wait_for("the requeued job to finish", lambda: (run / "finished").exists(), 180, run)
    names = [e["event"] for e in events(run)]
    assert names.count("requeued") == 1 and "exit" in names
    exits = [e for e in events(run) if e["event"] == "exit"]
    assert exits[0]["exit_code"] == 75 and exits[0]["outcome"] == "preempted"
    assert_recovered(run, reference, hook, ["preempted", "requeued", "completed"])
    row = status(env, run)
    assert row["state"] == "completed" and row["restarts"] == 1
    assert len(row["lost_steps"]) == 1 and row["lost_steps"][0] <= EVERY
    assert 0 < row["goodput"] < 1 and row["last_outcome"] == "completed"
    # The requeued job appended to its batch output: each attempt shows its own part, one after the other (the
    # second's exit hook may still be writing its last lines: the file read afterwards may be longer).
    parts = [runner(env, "logs", str(run), "--batch", "--attempt", str(n)).stdout for n in (1, 2)]
    whole = (run / "logs" / f"slurm-{first}.out").read_text(errors="replace")
    assert all(parts) and whole.startswith("".join(parts)) and len(parts[0]) < len(whole), parts


def test_a_notice_as_the_job_starts_stops_every_rank_at_its_first_step(slurm_cluster: devcluster.Cluster, hook: Any,
                                                                        reference: list[Any], tmp_path: Path) -> None:
    """Slurm's timer may signal seconds after the start, before the ranks have their handlers (SIGUSR2's default
    kills): the batch script writes it down and sends it once every rank is ready; none dies of it."""
    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path)
    wait_for("the first attempt's folder", lambda: (run / "logs" / "attempt-1").is_dir(), 120, run)
    subprocess.run(["scancel", "--batch", "--signal=USR2", job_id(run)], env=env, check=True, timeout=30)
    wait_for("the requeued job to finish", lambda: (run / "finished").exists(), 240, run)
    exits = [e for e in events(run) if e["event"] == "exit"]
    assert (exits[0]["exit_code"], exits[0]["outcome"]) == (75, "preempted"), exits
    first = sorted((run / "logs" / "attempt-1").glob("rank-*.log"))
    assert len(first) == 4 and all("received SIGUSR2" in p.read_text() for p in first)
    assert_recovered(run, reference, hook, ["preempted", "requeued", "completed"])


def test_time_limit_signals_before_the_limit(slurm_cluster: devcluster.Cluster, hook: Any,
                                             reference: list[Any], tmp_path: Path) -> None:
    # A 1-minute limit and a 45 s lead: Slurm signals ~15-45 s into each attempt; training needs ~3 attempts.
    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path, "slurm.time=1", "slurm.signal_lead_s=45", "model.step_time_s=0.3",
                 "resume.max_restarts=8")
    wait_for("the run to finish across time limits", lambda: any(e.get("outcome") == "completed"
                                                                 for e in events(run)), 400, run)
    outcomes = [e.get("outcome") for e in events(run) if e["event"] == "exit"]
    assert outcomes[-1] == "completed" and "timeout" in outcomes, outcomes
    n = outcomes.count("timeout")
    assert_recovered(run, reference, hook, ["timeout", "requeued"] * n + ["completed"])


def test_killed_rank_fails_job_and_cron_resumes_once(slurm_cluster: devcluster.Cluster, hook: Any,
                                                     reference: list[Any], tmp_path: Path) -> None:
    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path)
    wait_for("checkpoint 20", lambda: checkpoint_done(run, 20), 120, run)
    hook.stop()  # the webhook is down when the job fails: the alert is queued in the run directory
    pid = json.loads((run / "ranks" / "rank-00003.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for("the job to fail", lambda: status(env, run)["state"] == "failed", 60, run)
    assert list((run / "alerts" / "queue").glob("*-failed.json"))
    # A kill while a checkpoint was being written leaves these; they must be ignored.
    ckpts = run / "checkpoints"
    newest = max(int(p.name[5:]) for p in ckpts.glob("step-*") if (p / "COMPLETE").exists())
    (ckpts / f".staging-step-{newest + EVERY:07d}").mkdir()
    (ckpts / f"step-{newest + 2 * EVERY:07d}").mkdir()
    hook.start()
    hook.set_responses([500, hook.Response(429, {"Retry-After": "1"})])
    crons = [subprocess.Popen([sys.executable, "-m", "runner", "cron", "--root", str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [c.communicate(timeout=120)[0] for c in crons]
    assert sum(o.count("resubmit:") for o in outs) == 1, outs  # two crons at once: exactly one resubmission
    wait_for("the resubmitted job to finish", lambda: (run / "finished").exists(), 180, run)
    assert [e["event"] for e in events(run)].count("resubmitted") == 1
    log = RunDir(run).rank_log(0).read_text()
    assert f"resuming from {ckpts / f'step-{newest:07d}'}" in log
    assert_recovered(run, reference, hook, ["failed", "resubmitted", "completed"])
    runner(env, "cron", "--root", str(tmp_path))  # finished: nothing more happens
    assert [e["event"] for e in events(run)].count("resubmitted") == 1


def test_lost_node_resumes_when_capacity_is_back(slurm_cluster: devcluster.Cluster, hook: Any,
                                                 reference: list[Any], tmp_path: Path) -> None:
    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path)
    wait_for("checkpoint 20", lambda: checkpoint_done(run, 20), 120, run)
    second = slurm_cluster.nodes[1]
    devcluster.kill_node(slurm_cluster, second)
    try:
        wait_for("the job to stop running", lambda: status(env, run)["state"] != "running", 90, run)
        runner(env, "cron", "--root", str(tmp_path))  # resubmits if Slurm did not requeue it itself
    finally:
        devcluster.revive_node(slurm_cluster, second)
    def finished() -> bool:
        if (run / "finished").exists():
            return True
        runner(env, "cron", "--root", str(tmp_path))
        return False
    until("the run to finish, cron resubmitting it", finished, 240, every=2,
          detail=lambda: (run / "ledger.jsonl").read_text())
    assert (run / "finished").exists(), (run / "ledger.jsonl").read_text()
    import torch

    for mine, ref in zip(final_weights(run), reference, strict=True):
        assert all(torch.equal(mine[k], ref[k]) for k in ref)
    assert max(e.get("lost_steps", 0) for e in events(run) if e["event"] == "train_start") <= EVERY


def test_user_cancel_is_final_and_quiet(slurm_cluster: devcluster.Cluster, hook: Any, tmp_path: Path) -> None:
    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path)
    wait_for("checkpoint 10", lambda: checkpoint_done(run, 10), 120, run)
    runner(env, "cancel", str(run))
    for _ in range(2):
        runner(env, "cron", "--root", str(tmp_path))
    # Slurm has ended the job, so its exit hook is done too: whatever either would do wrong has been done.
    wait_for("Slurm to end the job", lambda: status(env, run).get("slurm_state") in FINAL, 60, run)
    assert status(env, run)["state"] == "cancelled"
    assert "resubmitted" not in [e["event"] for e in events(run)]
    assert [r["event"] for r in hook.received] == []  # the user knows: no alert storm


def test_gives_up_after_max_restarts(slurm_cluster: devcluster.Cluster, hook: Any, tmp_path: Path) -> None:
    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path, "resume.max_restarts=0")
    wait_for("checkpoint 10", lambda: checkpoint_done(run, 10), 120, run)
    pid = json.loads((run / "ranks" / "rank-00001.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for("the job to fail", lambda: status(env, run)["state"] == "failed", 60, run)
    wait_for("the exit hook", lambda: status(env, run)["last_outcome"] == "failed", 30, run)
    cause = status(env, run)["last_cause"] or ""
    assert "rank 1" in cause and "killed" in cause, cause  # "rank 1 on n1: killed (srun: Killed)"
    out = runner(env, "cron", "--root", str(tmp_path)).stdout
    assert "give_up" in out
    runner(env, "cron", "--root", str(tmp_path))
    assert [e["event"] for e in events(run)].count("gave_up") == 1
    assert "resubmitted" not in [e["event"] for e in events(run)]
    assert [a["event"] for a in hook.wait_for(2, timeout=30)] == ["failed", "gave_up"]
    wait_for("every queued alert to be sent", lambda: alerts_all_sent(run), 30, run)
    assert len(hook.received) == 2
