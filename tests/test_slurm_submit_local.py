"""`runner submit`'s batch script for Slurm without a cluster (the local tier): the runtimes' exec prefix and the
rendezvous lines, rendered, and the rendezvous run by bash (the real cluster: tests/test_slurm_submit.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.host import render, submit
from tests.test_slurm_submit import CONF

pytestmark = pytest.mark.local


def render_for(*overrides: str) -> str:
    plan = submit.plan(CONF, ["run_root=/shared/runs", *overrides])
    return plan.files["job.sbatch"].replace(str(plan.run.root), "RUN_DIR")


def test_apptainer_and_none_differ_only_in_the_exec_prefix() -> None:
    none = [x.strip() for x in render_for("container.runtime=none").splitlines()]
    app = [x.strip() for x in render_for("container.runtime=apptainer", "container.image=/shared/img.sif").splitlines()]
    changed = [(a, b) for a, b in zip(none, app, strict=True) if a != b]
    assert len(changed) == 1, changed
    a, b = changed[0]
    assert a.startswith("env -u RUNNER_WEBHOOK_URL srun ") and b.startswith("env -u RUNNER_WEBHOOK_URL srun ")
    prefix_none, _, tail_none = a.partition(" -m runner.job.launch ")
    prefix_app, _, tail_app = b.partition(" -m runner.job.launch ")
    assert tail_none == tail_app == '"$RUN_DIR" &'
    assert prefix_none.endswith(render.q(sys.executable))
    assert "apptainer exec --nv" in prefix_app and "/shared/img.sif python" in prefix_app
    # what the launcher needs crosses into the container explicitly (--cleanenv would drop it)
    for name in render.CONTAINER_ENV:
        assert f'--env "{name}=${name}"' in prefix_app


def test_rendezvous_lines() -> None:
    text = render_for()
    lines = [x.strip() for x in text.splitlines()]  # the attempt's lines are indented in resume.in_job's loop
    assert any(x.startswith('begun=$("$RUNNER_PY" -m runner.host.jobhook begin') for x in lines)  # the rendezvous
    assert 'export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-1}"' in lines
    assert "#SBATCH --cpus-per-task=1" in lines and "#SBATCH --nodes=2" in lines
    assert "#SBATCH --ntasks-per-node=2" in lines and not any("--gres" in x for x in lines)
    assert "GLOO_SOCKET_IFNAME=" not in text  # detected per node by the launcher
    fixed = render_for("network.ifname=ib0", "container.runtime=apptainer", "container.image=/i.sif")
    assert "export GLOO_SOCKET_IFNAME=ib0" in fixed.splitlines()
    assert "export NCCL_SOCKET_IFNAME=ib0" in fixed.splitlines()
    assert '--env "GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME"' in fixed
    assert '--env "NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME"' in fixed


def test_rendezvous_shell_part_runs(tmp_path: Path) -> None:
    """The rendezvous as the batch host makes it: job 12345 on n[3-4], the hostlist expanded by scontrol (a stub
    here: no controller is needed to expand a hostlist, only the command's interface); the threads per task in bash."""
    text = render_for()
    part = text[text.index("# One thread per CPU"):text.index("# Host-side hooks")]
    stub = tmp_path / "scontrol"
    stub.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames n[3-4]" ] && printf "n3\\nn4\\n"\n')
    stub.chmod(0o755)
    probe = part + 'echo "$OMP_NUM_THREADS $SRUN_CPUS_PER_TASK"\n'
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n[3-4]", "SLURM_JOB_ID": "12345",
           "SLURM_CPUS_PER_TASK": "3", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run(["bash", "-uc", probe], capture_output=True, text=True, env=env, timeout=10)
    assert out.stdout.split() == ["3", "3"], out.stderr
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    begin = [sys.executable, "-m", "runner.host.jobhook", "begin", str(run)]
    out = subprocess.run(begin, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "export MASTER_ADDR=n3\n" in out.stdout and f"export MASTER_PORT={10000 + 2 * (12345 % 10000)}\n" in \
        out.stdout and f"export RUNNER_PREFLIGHT_PORT={10000 + 2 * (12345 % 10000) + 1}\n" in out.stdout
    env["SLURM_JOB_NODELIST"] = "n[9"
    out = subprocess.run(begin, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode != 0 and "cannot read the first node" in out.stderr and not out.stdout
