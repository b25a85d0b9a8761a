"""Bad-node memory through a real submission (the local tier; the rules: tests/test_nodes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner import cli
from runner.host import nodes

pytestmark = pytest.mark.local


def test_a_submission_under_the_root_leaves_the_remembered_nodes_out(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    conf = Path(__file__).resolve().parents[1] / "conf" / "slurm-2node.yaml"
    nodes.record(tmp_path, ["n2"], "hang", "earlier-run")
    assert cli.main(["submit", str(conf), f"run_root={tmp_path}", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "command:       sbatch --parsable --exclude=n2 " in out
    assert "n2 left out" in out and "let back in" in out  # the plan says sbatch may not get this line
