"""Rendered artifacts checked by processes (the local tier): real linters, and the batch script run by bash (golden
files and hostile values: tests/test_render.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner import spec
from runner.host import render
from runner.rundir import EXIT_SUPERSEDED, RunDir
from tests import waiting
from tests.test_render import CONFIGS, GOLDEN_CONF, RUN_DIR, _begin_env, artifacts, lint

pytestmark = pytest.mark.local


@pytest.mark.parametrize(("path", "overrides"), CONFIGS)
def test_shellcheck_on_sbatch(path: Path, overrides: list[str], tmp_path: Path) -> None:
    lint("shellcheck", "-s", "bash", text=artifacts(overrides, path)["job.sbatch"], tmp_path=tmp_path,
         name="job.sbatch")


@pytest.mark.parametrize(("path", "overrides"), CONFIGS)
def test_hadolint_on_dockerfile(path: Path, overrides: list[str], tmp_path: Path) -> None:
    # -c explicitly: hadolint would otherwise pick up a .hadolint.yaml from the working directory.
    cfg = tmp_path / "hadolint.yaml"
    cfg.write_text("failure-threshold: warning\n")
    lint("hadolint", "-c", str(cfg), text=artifacts(overrides, path)["Dockerfile"], tmp_path=tmp_path,
         name="Dockerfile")


# Hostile values: quotes, newlines, $(...), backticks, globs. Each must arrive in the job's environment
# byte for byte, and none may run.
HOSTILE = st.text(alphabet=st.sampled_from(list("ab $()`'\"\\;&|<>*?!{}[]#~\n\t=%")), min_size=0, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.lists(HOSTILE, min_size=1, max_size=4))
def test_hostile_env_values_stay_literal(values: list[str], tmp_path: Path) -> None:
    canary = tmp_path / "pwned"
    values = [*values, f"$(touch {canary})", f"`touch {canary}`"]
    env = {f"V{i}": v for i, v in enumerate(values)}
    overrides = ["env={}"]
    cfg = spec.load(GOLDEN_CONF, overrides, run_dir=str(RUN_DIR))
    cfg.data["env"] = env
    script = render.sbatch(cfg, RUN_DIR, "/img.sif")
    # Execute only the part that sets variables (up to the private secrets file), then dump them NUL-separated.
    head = script.split("# env: values that are secrets")[0]
    probe = head + "\nfor v in " + " ".join(env) + '; do printf "%s\\0" "${!v}"; done\n'
    out = subprocess.run(["bash", "-c", probe], capture_output=True, timeout=30, env={"PATH": os.environ["PATH"]})
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode().split("\0")[:-1] == values
    assert not canary.exists()


def _begin(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner.host.jobhook", "begin", str(tmp_path)], capture_output=True,
                          text=True, timeout=60, env=_begin_env(tmp_path, **env))


@pytest.mark.parametrize(("owner", "trains"), [("14", False), ("13", True), ("", True), (None, True)])
def test_a_superseded_job_steps_aside(owner: str | None, trains: bool, tmp_path: Path) -> None:
    """Slurm may requeue a job that `runner cron` already resubmitted: the older job id must not train."""
    (tmp_path / "logs").mkdir()
    if owner is not None:
        (tmp_path / "job_id").write_text(owner + "\n")
    out = _begin(tmp_path)
    assert out.returncode == (0 if trains else EXIT_SUPERSEDED)  # the exit hook records 78 as superseded
    assert ("superseded by job 14" in out.stderr) == (not trains)
    assert ("export RUNNER_ATTEMPT=1\n" in out.stdout) == trains  # an attempt is claimed only to train
    assert RunDir(tmp_path).attempts() == ([1] if trains else [])


def test_the_script_exports_what_begin_prints_and_exits_with_its_code(tmp_path: Path) -> None:
    """The batch script only calls: a refusal's code ends it (the exit hook then records it), the attempt's
    variables reach the ranks' environment, even from a refused image (77), so the exit hook knows the attempt."""
    text = artifacts()["job.sbatch"]
    part = text[text.index("begun=$("):text.index("# Bookkeeping only")]
    for code in (0, 77, EXIT_SUPERSEDED):
        fake = tmp_path / "python"
        fake.write_text(f"#!/bin/sh\necho 'export RUNNER_ATTEMPT=4'\necho \"export MASTER_ADDR='n 1'\"\nexit {code}\n")
        fake.chmod(0o755)
        script = f"set -uo pipefail\nRUN_DIR={tmp_path}\nRUNNER_PY={fake}\ngot_signal=\n" \
                 f"trap 'printenv RUNNER_ATTEMPT MASTER_ADDR' EXIT\n{part}\necho TRAINING\n"
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=10)
        assert out.returncode == code and ("TRAINING" in out.stdout) == (code == 0)
        assert out.stdout.endswith("4\nn 1\n")


def test_each_batch_attempt_claims_its_own_log_folder(tmp_path: Path) -> None:
    """A requeue or resubmission runs the script again: each run claims a new logs/attempt-N, even at once."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "attempt-1").mkdir()  # the first attempt
    starts = [subprocess.Popen([sys.executable, "-m", "runner.host.jobhook", "begin", str(tmp_path)],
                               stdout=subprocess.PIPE, text=True, env=_begin_env(tmp_path)) for _ in range(4)]
    claimed = sorted(int(re.findall(r"RUNNER_ATTEMPT=(\d+)", p.communicate(timeout=60)[0])[0]) for p in starts)
    assert claimed == [2, 3, 4, 5]
    assert RunDir(tmp_path).attempts() == [1, 2, 3, 4, 5]
    (tmp_path / "logs").rename(tmp_path / "elsewhere")
    out = _begin(tmp_path)
    assert out.returncode == 1 and f"cannot create {tmp_path}/logs/attempt-1" in out.stderr and not out.stdout


def test_the_stop_signal_waits_for_every_rank_to_be_ready(tmp_path: Path) -> None:
    """The signal hook: written down at once; sent to the step only when all 32 ranks (4 nodes x 8) said they are
    ready, since a rank without its handler dies of SIGUSR2."""
    text = artifacts()["job.sbatch"]
    assert "--world 32 &" in text[text.index("to_ranks() {"):text.index("on_signal() {")]
    attempt = tmp_path / "signals" / "attempt-1"
    (attempt / "ready").mkdir(parents=True)
    got = tmp_path / "got"
    # The step: reports the signal it gets; a plain sleep stands in for srun.
    step = subprocess.Popen(["bash", "-c", f"trap 'echo USR2 > {got}; exit 0' USR2; while true; do sleep 0.05; done"])
    try:
        hook = subprocess.Popen([sys.executable, "-m", "runner.host.jobhook", "signal", "--name", "USR2", "--pid",
                                 str(step.pid), "--world", "32", str(tmp_path)],
                                env=_begin_env(tmp_path, RUNNER_ATTEMPT="1"))
        waiting.until("the signal written down", (attempt / "signal").exists, 30)
        assert (attempt / "signal").read_text() == "USR2\n"
        for rank in range(31):
            (attempt / "ready" / f"rank-{rank:05d}").touch()
        with pytest.raises(subprocess.TimeoutExpired):  # 31 of 32 ready: nothing sent
            step.wait(timeout=1)
        (attempt / "ready" / "rank-00031").touch()
        assert step.wait(timeout=10) == 0 and got.read_text() == "USR2\n"
        assert hook.wait(timeout=10) == 0
    finally:
        step.kill()
