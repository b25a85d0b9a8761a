"""The report of a real run on the dev cluster with a preemption, a killed rank, a hang and a skipped NaN.

tests/test_report.py shows the same page for a run synthesized from runner's writers; this one trains it: one
node of two ranks (so the node a hang names can be left out and the run goes on on the other), each fault
injected as tests/test_failures.py and tests/test_resilience.py do, then the page opened in headless Chromium.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from runner.dev import devcluster
from tests.ci import need
from tests.test_failures import checkpoint_done, env_for, events, hook, job_id, runner, status, submit, wait_for
from tests.test_report import Page, open_in_chromium, self_contained

pytestmark = pytest.mark.slurm
__all__ = ["hook"]  # the webhook fixture, shared with test_failures


def _train_starts(run: Path) -> int:
    return sum(1 for e in events(run) if e["event"] == "train_start")


def _past(run: Path, step: int) -> bool:
    """Training went on past ``step`` (progress.json): a fault now loses the steps since the last checkpoint."""
    try:
        return int(json.loads((run / "progress.json").read_text())["step"]) >= step
    except (OSError, ValueError, KeyError):
        return False


def _pid(run: Path, rank: int) -> int:
    return int(json.loads((run / "ranks" / f"rank-{rank:05d}.json").read_text())["pid"])


def test_report_of_a_real_run_with_every_fault(slurm_cluster: devcluster.Cluster, hook: Any, tmp_path: Path) -> None:
    need(shutil.which("chromium") is not None, "chromium is not installed (scripts/install-chromium.sh, as root)")
    env = env_for(slurm_cluster, hook)
    # Checkpoints every 40 steps of 0.05 s: progress.json (every 2 s) lands between two, so a fault's lost steps
    # are counted.
    run = submit(env, tmp_path, "num_nodes=1", "trainer.max_steps=240", "checkpoint.every_n_steps=40",
                 "watchdog.floor_s=5", "nonfinite.action=skip", "model.faults.nan_at_step=210",
                 "model.step_time_s=0.05")
    # 1: a preemption notice after step 40: checkpointed, requeued
    wait_for("checkpoint 40", lambda: checkpoint_done(run, 40), 120, run)
    subprocess.run(["scancel", "--batch", "--signal=USR2", job_id(run)], env=env, check=True, timeout=30)
    # 2: rank 1 killed past step 85: the job fails, cron resubmits it
    wait_for("the second attempt past step 85", lambda: _train_starts(run) == 2 and checkpoint_done(run, 80)
             and _past(run, 85), 180, run)
    os.kill(_pid(run, 1), signal.SIGKILL)
    wait_for("the job to fail", lambda: status(env, run)["state"] == "failed", 90, run)
    runner(env, "cron", "--root", str(tmp_path))
    # 3: rank 1 stopped past step 165: the watchdog names the hang and its node, resubmitted without it
    wait_for("the third attempt past step 165", lambda: _train_starts(run) == 3 and checkpoint_done(run, 160)
             and _past(run, 165), 180, run)
    stopped = json.loads((run / "ranks" / "rank-00001.json").read_text())
    os.kill(stopped["pid"], signal.SIGSTOP)
    # 4: on the other node; the NaN at step 210 is skipped; finished at 240
    wait_for("the run to finish and its job to end", lambda: any(e.get("outcome") == "completed"
                                                                for e in events(run)), 300, run)
    outcomes = [e.get("outcome") for e in events(run) if e["event"] == "exit"]
    assert outcomes == ["preempted", "failed", "hang", "completed"], outcomes
    out = runner(env, "report", str(run))
    page = Path(out.stdout.strip())
    dom, _, fetched = open_in_chromium(page, tmp_path, "report-dev-cluster-run.png")
    assert fetched == [], f"the page fetched: {fetched}"
    rendered = Page(dom)
    assert [a["outcome"] for a in rendered.attempts] == outcomes
    cells = [a["cells"] for a in rendered.attempts]
    assert "hang: " in cells[2] and f"rank 1 on {stopped['hostname']}" in cells[2]
    assert "non-finite loss nan at step 210: skipped" in cells[3]
    assert f"{stopped['hostname']} (hang)" in cells[3], "the hung node was kept out of the last attempt"
    lost = [int(a["lost"]) for a in rendered.attempts]
    assert lost == [e.get("lost_steps", 0) for e in events(run) if e["event"] == "train_start"]
    assert lost[0] == lost[1] == 0 and lost[2] > 0 and lost[3] > 0, "a preemption checkpoints; a kill and a hang lose"
    assert rendered.goodput == str(status(env, run)["goodput"])
    assert hook.url not in dom
    self_contained(page.read_text())
