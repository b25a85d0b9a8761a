"""The ranks agree on the step at which training stops: on a signal, or when another job owns the run."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from runner.job import owner
from runner.job.agreement import STOP, SUPERSEDED, Agreement
from runner.job.stopflag import StopFlag
from runner.rundir import RunDir

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("job", "owners", "expected"), [
    # read at steps 0, 5, 10 (every 5 steps), False in between; the file names job 7 until step 6, then job 9
    ("7", {0: "7", 6: "9"}, [False] * 10 + [True] * 2),
    (None, {0: "9"}, [False] * 12),  # no Slurm job (a local run): never superseded
    ("7", {}, [False] * 12),  # no job_id file (or unreadable): a blip is no reason to stop
])
def test_the_owner_is_read_every_n_steps(job: str | None, owners: dict[int, str], expected: list[bool],
                                         tmp_path: Path) -> None:
    rd = RunDir(tmp_path)
    superseded = owner.Reader(rd, 5, job)  # job: this rank's SLURM_JOB_ID (JobEnv)
    got = []
    for step in range(12):
        if step in owners:
            rd.job_id_file.write_text(owners[step] + "\n")
        got.append(superseded(step))
    assert got == expected


def test_a_single_rank_decides_at_once(tmp_path: Path) -> None:
    flag = StopFlag()
    agreement = Agreement(flag, lambda step: step == 3)
    trainer = SimpleNamespace(world_size=1, global_rank=0, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    assert [agreement.check(trainer, s) for s in range(3)] == [None] * 3
    assert agreement.check(trainer, 3) == SUPERSEDED
    flag.signum = signal.SIGTERM
    assert agreement.check(trainer, 4) == STOP
