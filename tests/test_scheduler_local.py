"""The scheduler seam through the CLI: the dry run names what each scheduler starts (the local tier; the rest:
tests/test_scheduler.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.host import submit
from tests.test_scheduler import QUICKSTART

pytestmark = pytest.mark.local


@pytest.mark.local  # plan() asks git for the provenance
def test_the_dry_run_names_the_command_each_scheduler_starts(tmp_path: Path) -> None:
    local = submit.plan(QUICKSTART, [f"run_root={tmp_path / 'runs'}"])
    assert local.argv[1:] == ["-m", "runner.job.launch", str(local.run.root)]
    slurm = submit.plan(QUICKSTART, [f"run_root={tmp_path / 'runs'}", "scheduler=slurm",
                                                 "container.runtime=none", "resume.successor=true"])
    assert slurm.argv[0] == "sbatch" and slurm.argv[-1] == str(slurm.run.script)
    assert any(n.startswith("successor:") for n in slurm.notes)
    assert not any(n.startswith("successor:") for n in local.notes)
