"""On the real local Slurm cluster: one trainer per run directory, the requeue before anything slow, and one broken
run directory never keeping cron from the others.

The webhook server listens on the cluster bridge's host address (jobs run in the nodes' network namespaces).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from runner.dev import devcluster
from runner.rundir import EXIT_SUPERSEDED, RunDir
from tests import test_failures
from tests.ci import need
from tests.waiting import alerts_all_sent

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]


# As the fault-injection tests: the webhook server on the cluster bridge's address, a run of the 2-node config
# (80 steps of 0.1 s, a checkpoint every 10; overrides given here win).
hook = test_failures.hook
env_for, checkpoint_done, runner, submit = (test_failures.env_for, test_failures.checkpoint_done,
                                            test_failures.runner, test_failures.submit)


# Root without the capabilities that let it read and write anything: permission bits hold for it as for any user
# (the venv's Python lives under /root, where user nobody cannot even start it).
AS_A_USER = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


def as_a_user(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([*AS_A_USER, sys.executable, "-m", "runner", *args], capture_output=True, text=True,
                         env=env, timeout=120, cwd=REPO)
    assert out.returncode == 0, f"runner {' '.join(args)}:\n{out.stdout}{out.stderr}"
    return out


def events(run: Path) -> list[dict[str, Any]]:
    return RunDir(run).events()


def wait_for(what: str, pred: Any, timeout: float, run: Path) -> None:
    test_failures.wait_for(what, pred, timeout, run)


def published(run: Path) -> set[int]:
    return {int(p.name[5:]) for p in (run / "checkpoints").glob("step-*") if (p / "COMPLETE").exists()}


def completed_in(log: str) -> set[int]:
    return {int(m) for m in re.findall(r"checkpoint step-(\d+) complete", log)}


def sacct_exit(env: dict[str, str], job: str) -> str:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "--format=State,ExitCode"], env=env,
                         capture_output=True, text=True, timeout=30)
    return out.stdout.strip()


def step_ended(env: dict[str, str], job: str) -> float:
    """When the first attempt's training step (JOB.0) ended, as sacct reports it (whole seconds, local time)."""
    out = subprocess.run(["sacct", "-n", "-P", "-D", "-j", job, "--format=JobID,End"], env=env, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    end = next(line.split("|")[1] for line in out.splitlines() if line.startswith(f"{job}.0|"))
    return time.mktime(time.strptime(end, "%Y-%m-%dT%H:%M:%S"))


def test_two_jobs_on_one_run_only_one_trains(slurm_cluster: devcluster.Cluster, hook: Any, tmp_path: Path) -> None:
    """A second job is made the run's owner while the first trains: the first stops at the same step on every
    rank within a few steps, writes no checkpoint after that, records only `superseded`; the second trains."""
    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path, "trainer.max_steps=150", "resume.owner_check_every_n_steps=5")
    wait_for("checkpoint 10", lambda: checkpoint_done(run, 10), 120, run)
    first = (run / "job_id").read_text().strip()
    # What a resubmission racing a live job would do (runner resume refuses it now; a hand-made sbatch does not).
    second = subprocess.run(["sbatch", "--parsable", str(run / "job.sbatch")], env=env, capture_output=True,
                            text=True, timeout=60, check=True).stdout.strip()
    (run / "job_id").write_text(second + "\n")
    before = published(run)
    wait_for("the first job to step aside", lambda: any(e["event"] == "superseded" and e["job_id"] == first
                                                        for e in events(run)), 90, run)
    first_logs = [p.read_text() for p in sorted((run / "logs" / "attempt-1").glob("rank-*.log"))]
    assert len(first_logs) == 4
    stops = [re.search(r"no longer owns .* stopping at step (\d+) without a checkpoint", log) for log in first_logs]
    assert all(stops), first_logs[0][-2000:]
    assert len({m.group(1) for m in stops if m}) == 1  # every rank stopped at the same step
    rank0 = first_logs[0]
    assert completed_in(rank0[rank0.index("no longer owns"):]) == set()  # nothing written after it
    assert completed_in(rank0) <= before  # each checkpoint of the first job was there before the switch
    wait_for("the second job to finish", lambda: any(e["event"] == "exit" for e in events(run)), 240, run)
    second_log = RunDir(run).rank_log(0, 2).read_text()
    assert published(run) == completed_in(rank0) | completed_in(second_log)
    exits = [e for e in events(run) if e["event"] == "exit"]
    assert [e["job_id"] for e in exits] == [second] and exits[0]["outcome"] == "completed"
    # Every rank exits 78 at the same step; when one leaves first, srun's --kill-on-bad-exit may end the others
    # with SIGTERM and report that instead: either way the job failed and wrote nothing (asserted above).
    assert sacct_exit(env, first) in (f"FAILED|{EXIT_SUPERSEDED}:0", "FAILED|15:0"), sacct_exit(env, first)
    assert [a["event"] for a in hook.wait_for(1, timeout=30)] == ["completed"]  # no alert for the superseded job


def test_resume_refuses_a_live_job(slurm_cluster: devcluster.Cluster, hook: Any, tmp_path: Path) -> None:
    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path, "trainer.max_steps=1000")
    wait_for("checkpoint 10", lambda: checkpoint_done(run, 10), 120, run)
    job = (run / "job_id").read_text().strip()
    out = runner(env, "resume", str(run), "--force", check=False)
    assert out.returncode == 1 and f"job {job} is RUNNING: one job trains a run at a time" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert "resubmitted" not in [e["event"] for e in events(run)]
    runner(env, "cancel", str(run))
    runner(env, "resume", str(run))  # once the job ended, resume goes ahead
    assert (run / "job_id").read_text().strip() != job
    runner(env, "cancel", str(run))


def test_requeue_comes_first_with_a_hung_webhook(slurm_cluster: devcluster.Cluster, hook: Any,
                                                 tmp_path: Path) -> None:
    """The webhook answers nothing for a minute: the requeue still follows the launcher's exit within seconds, and
    the alerts reach the webhook later from the queue."""
    hook.set_responses([hook.Response(200, delay_s=60)] * 20)
    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path, "trainer.max_steps=1000", "alerts.timeout_s=30")
    wait_for("checkpoint 10", lambda: checkpoint_done(run, 10), 120, run)
    job = (run / "job_id").read_text().strip()
    subprocess.run(["scancel", "--batch", "--signal=USR2", job], env=env, check=True, timeout=30)
    wait_for("the requeue", lambda: any(e["event"] == "requeued" for e in events(run)), 60, run)
    stopped = json.loads((run / "last_exit.json").read_text())
    assert stopped["code"] == 75
    names = [e["event"] for e in events(run)]
    requeued = next(e for e in events(run) if e["event"] == "requeued")
    step_end = step_ended(env, job)
    print(f"step end -> requeued recorded: {requeued['time'] - step_end:.2f} s (+- 1 s: sacct has whole seconds)")
    assert requeued["time"] - step_end < 3.0
    assert names.index("exit") < names.index("requeued") and "requeue_failed" not in names
    def queued() -> list[str]:
        return [p.name.rsplit("-", 1)[-1] for p in sorted((run / "alerts" / "queue").glob("*.json"))]

    wait_for("the alerts in the queue", lambda: len(queued()) >= 2, 10, run)
    assert queued()[:2] == ["preempted.json", "requeued.json"]  # queued, the webhook still holding the first
    wait_for("the requeued attempt to train", lambda: any(e["event"] == "train_start" and e.get("attempt") == 2
                                                          for e in events(run)), 120, run)
    runner(env, "cancel", str(run))


def test_a_failed_requeue_is_recorded_and_alerted_as_such(slurm_cluster: devcluster.Cluster, hook: Any,
                                                          tmp_path: Path) -> None:
    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path, "trainer.max_steps=1000")
    wait_for("checkpoint 10", lambda: checkpoint_done(run, 10), 120, run)
    job = (run / "job_id").read_text().strip()
    subprocess.run(["scontrol", "update", f"JobId={job}", "Requeue=0"], env=env, check=True, timeout=30)
    subprocess.run(["scancel", "--batch", "--signal=USR2", job], env=env, check=True, timeout=30)
    wait_for("the exit hook", lambda: any(e["event"] == "exit" for e in events(run)), 60, run)
    wait_for("the requeue's outcome", lambda: any(e["event"] in ("requeued", "requeue_failed")
                                                  for e in events(run)), 30, run)
    names = [e["event"] for e in events(run)]
    assert "requeue_failed" in names and "requeued" not in names, names
    [alert] = hook.wait_for(1, timeout=30)
    assert alert["event"] == "preempted" and "scontrol requeue failed" in alert["next_step"]
    wait_for("every queued alert to be sent", lambda: alerts_all_sent(run), 30, run)
    assert [a["event"] for a in hook.received] == ["preempted"]  # no "requeued" alert for a requeue that failed


def test_broken_runs_never_stop_cron_from_the_others(slurm_cluster: devcluster.Cluster, hook: Any) -> None:
    """Next to a failed run: a run with a malformed manifest.json, one the user cannot read, and garbage JSON lines
    in the failed run's own ledger. `runner status` and `runner cron`, run without the power to read what the
    permission bits deny, report each broken one in one line and go on: the failed run is resubmitted."""
    need(os.geteuid() == 0 and shutil.which("setpriv") is not None, "dropping capabilities needs root + setpriv")
    env = env_for(slurm_cluster, hook)
    root = Path(tempfile.mkdtemp(prefix="runner-broken-", dir="/tmp"))
    try:
        root.chmod(0o755)
        run = submit(env, root, "model.step_time_s=-1", "resume.max_restarts=3")  # every rank fails at step 1
        wait_for("the job to fail", lambda: any(e.get("outcome") == "failed" for e in events(run)), 120, run)
        wait_for("its alert", lambda: not list((run / "alerts" / "queue").glob("*.json")), 30, run)
        job = (run / "job_id").read_text().strip()  # the exit hook has recorded; the batch script is still ending
        squeue = ["squeue", "-h", "-j", job, "-o", "%T"]
        wait_for("Slurm to end the job", lambda: not subprocess.run(squeue, env=env, capture_output=True, text=True,
                                                                    timeout=30).stdout.strip(), 30, run)
        bad_manifest = root / "bad-manifest"
        shutil.copytree(run, bad_manifest)
        (bad_manifest / "manifest.json").write_text('{"scheduler": "slurm", ')
        locked = root / "locked"
        shutil.copytree(run, locked)
        with open(run / "ledger.jsonl", "a") as f:
            f.write('[1, 2]\n"start"\n42\n{"event": 5}\n{"time": "x", "event": "exit"}\n')
        locked.chmod(0o000)

        status = as_a_user(env, "status", "--root", str(root), "--json")
        rows = {r["run"]: r for r in json.loads(status.stdout)}
        assert rows[run.name]["state"] == "failed"
        assert rows["bad-manifest"]["state"] == "unreadable" and "invalid JSON" in rows["bad-manifest"]["error"]
        assert rows["locked"]["state"] == "unreadable" and "Permission" in rows["locked"]["error"]

        cron = as_a_user(env, "cron", "--root", str(root))
        assert "Traceback" not in cron.stderr, cron.stderr
        assert f"{run.name}: resubmit: job" in cron.stdout, cron.stdout + cron.stderr
        problems = [line for line in cron.stderr.splitlines() if "cannot read" in line]
        assert len(problems) == 2, cron.stderr
        assert any("bad-manifest" in line and "invalid JSON" in line for line in problems)
        assert any("locked" in line and "PermissionError" in line for line in problems)
        assert [e["event"] for e in events(run)].count("resubmitted") == 1
        as_a_user(env, "cancel", str(run))
    finally:
        shutil.rmtree(root, ignore_errors=True)
