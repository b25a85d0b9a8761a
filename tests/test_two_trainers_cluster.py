"""Issue 39's two trainers, on the dev cluster: a rank's launcher SIGKILLed while its program trains, for every shape
a command takes (``python SCRIPT`` and ``python -m`` run in the launcher's own process; a shell that execs the
program, and one that forks it as a grandchild, run it as a child). On Slurm the step's process tracking ends what
the task left; this shows it does for each shape: when the job's end is recorded no process of the program lives,
so the resubmitted job's program is the run's only trainer. (tests/test_local_lifecycle.py shows the same for
local runs, where runner's own driver does it.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner.dev import devcluster
from tests.test_failures import wait_for
from tests.test_program_cluster import SETTINGS, cluster_env, exits
from tests.waiting import alive

pytestmark = pytest.mark.slurm

# The program: says who it is, then trains (sleeps) far longer than the test lasts.
SLEEPER = """import os, sys, time
open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""
SHAPES = {
    "python SCRIPT": "python sleeper.py PIDFILE",
    "python -m": "python -m sleeper PIDFILE",
    "a shell that execs it": "bash -c 'exec python sleeper.py PIDFILE'",
    "a shell that forks a grandchild": "bash -c 'python sleeper.py PIDFILE & wait'",
}


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _launcher(run: Path) -> int | None:
    try:
        return int(json.loads((run / "ranks" / "rank-00000.json").read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@pytest.mark.parametrize("shape", list(SHAPES))
def test_no_process_of_a_program_outlives_its_killed_launcher_on_slurm(slurm_cluster: devcluster.Cluster,
                                                                        tmp_path: Path, shape: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "sleeper.py").write_text(SLEEPER)
    pidfile = tmp_path / "program.pid"
    doc: dict[str, Any] = {"num_nodes": 1, "num_device": 1,
                           "command": SHAPES[shape].replace("PIDFILE", str(pidfile)),
                           "runner": {"name": "two-trainers", **SETTINGS}}
    (work / "program.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    env = cluster_env(slurm_cluster)
    root = tmp_path / "runs"

    def runner(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, env=env,
                              timeout=180, cwd=work)

    out = runner("submit", "program.yaml", f"runner.run_root={root}")
    assert out.returncode == 0, out.stdout + out.stderr
    [run] = root.iterdir()
    wait_for("the program's pid", lambda: _pid(pidfile) and _launcher(run), 180, run)
    program, launcher = _pid(pidfile), _launcher(run)
    assert program is not None and launcher is not None
    assert (program == launcher) == (shape in ("python SCRIPT", "python -m"))  # in the launcher, or its child
    pidfile.unlink()
    os.kill(launcher, signal.SIGKILL)
    wait_for("the job's end in the ledger", lambda: exits(run), 120, run)
    assert not alive(program), f"{shape}: the program (pid {program}) outlived its rank's job"
    assert exits(run)[-1]["outcome"] == "failed", exits(run)

    again = runner("resume", str(run))  # the run is free: the next job's program is its one trainer
    assert again.returncode == 0, again.stdout + again.stderr
    wait_for("the resumed program's pid", lambda: _pid(pidfile), 180, run)
    assert _pid(pidfile) != program and not alive(program)
    stop = runner("cancel", str(run))
    assert stop.returncode == 0, stop.stdout + stop.stderr
    wait_for("the resumed job's end", lambda: len(exits(run)) == 2, 120, run)
