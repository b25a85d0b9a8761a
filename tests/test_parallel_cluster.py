"""`runner parallel` with Slurm worker jobs from dask-jobqueue on the dev cluster (the slurm tier; the rest:
tests/test_parallel.py, tests/test_parallel_local.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from runner.host import parallel as driver
from runner.parallel.store import Store
from tests.test_parallel import CONF, indices, run_of, runner, start, wait_for_chunks
from tests.waiting import until

pytestmark = pytest.mark.slurm


def _jobs(name: str, *flags: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i", *flags], capture_output=True, text=True, timeout=10)
    return out.stdout.split()


def test_slurm_worker_jobs_one_cancelled_midway_every_item_once(slurm_cluster: Any, tmp_path: Path) -> None:
    args = [f"run_root={tmp_path}", "parallel.env=slurm", "parallel.n_workers=2", "parallel.items=2000",
            "parallel.provider.num_samples=2000", "parallel.provider.sleep_s=0.005", "parallel.chunk_size=50",
            f"slurm.partition={slurm_cluster.partition}", "slurm.time=00:10:00"]
    run = run_of(tmp_path, *args)
    name = driver.plan(CONF, args).cluster_kwargs["job_name"]
    proc = start(*args)
    def two_running() -> list[str] | None:  # two worker jobs, each a Slurm job
        if len(jobs := _jobs(name, "-t", "RUNNING")) >= 2:
            return jobs
        assert proc.poll() is None, proc.communicate()
        return None
    running = until("the 2 worker jobs to start", two_running, 120, every=0.2)
    wait_for_chunks(run, 4, proc)
    subprocess.run(["scancel", running[0]], check=True, timeout=10)  # one worker job dies mid-way
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert indices(run) == list(range(2000))  # every item exactly once, though a worker died holding chunks
    assert Store(run).summary() == (2000, {})
    # the driver cancels its other worker job when it is done
    until("the worker jobs to end with the run (none may outlive it)", lambda: not _jobs(name, "-t", "PENDING,RUNNING"),
          30, every=0.5)
    sacct = subprocess.run(["sacct", "-X", "-n", "-P", "-j", running[0], "--format=State"], capture_output=True,
                           text=True, timeout=10).stdout
    assert "CANCELLED" in sacct
    assert list((run.logs / "workers").glob("*.err"))  # the worker jobs' own output, in the run directory
    again = runner("parallel", str(CONF), *args)
    assert again.returncode == 0 and "nothing to do" in again.stdout
