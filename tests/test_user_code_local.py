"""User code in real local runs (the local tier): targets imported before training, the real global batch, resume
exactness (the rest: tests/test_user_code.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runner.job import honesty
from runner.rundir import EXIT_PREFLIGHT, RunDir

pytestmark = pytest.mark.local


REPO = Path(__file__).resolve().parents[1]


QUICKSTART = REPO / "conf" / "quickstart.yaml"


def submit(root: Path, *overrides: str, conf: Path = QUICKSTART) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = subprocess.run([sys.executable, "-m", "runner", "submit", str(conf), f"run_root={root}", *overrides],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    [run] = root.glob("quickstart-*")
    return out, run


def test_target_missing_in_the_image_stops_before_training(tmp_path: Path) -> None:
    out, run = submit(tmp_path, "data._target_=only_in_image_pkg.Data", "trainer.max_steps=3")
    assert out.returncode == EXIT_PREFLIGHT, out.stdout + out.stderr
    logs = "".join(p.read_text() for p in (run / "logs").rglob("rank-*.log"))
    assert "preflight: cannot import only_in_image_pkg for only_in_image_pkg.Data" in logs
    assert "Traceback" not in logs
    assert not list((run / "checkpoints").glob("step-*"))


def test_boring_model_global_batch_and_exactness_are_told(tmp_path: Path) -> None:
    conf = tmp_path / "boring.yaml"
    data = yaml.safe_load(QUICKSTART.read_text())
    data.update(name="quickstart", model={"_target_": "lightning.pytorch.demos.BoringModel"},
                data={"_target_": "lightning.pytorch.demos.BoringDataModule"})
    conf.write_text(yaml.safe_dump(data))
    out, run = submit(tmp_path, "trainer.max_steps=3", conf=conf)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "does not take `dataloader`" in out.stderr  # said at submit, before anything runs
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["data_module"] == {"target": "lightning.pytorch.demos.BoringDataModule",
                                       "takes_dataloader": False, "global_batch": "the data module's own"}
    [measured] = [e for e in RunDir(run).events() if e["event"] == "data"]
    assert measured["exactness"] == honesty.EXACT  # its DataLoader reads in order: replayed to a stop's batch
    # BoringDataModule's DataLoader has the default batch size 1: 1 x 2 ranks x 2 accumulation (the quickstart's),
    # not the config's own arithmetic (8 x 2 x 2 = 32).
    assert (measured["local_batch"], measured["global_batch"], measured["configured_global_batch"]) == (1, 4, 32)
    rank0 = next((run / "logs").rglob("rank-00000.log")).read_text()
    assert "global batch measured at the first step: 4" in rank0 and "replayed to its batch" in rank0


def test_runner_data_module_is_exact_and_measured_as_configured(tmp_path: Path) -> None:
    out, run = submit(tmp_path, "trainer.max_steps=3")
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads((run / "manifest.json").read_text())["data_module"]["takes_dataloader"] is True
    [measured] = [e for e in RunDir(run).events() if e["event"] == "data"]
    assert measured["exactness"] == honesty.EXACT
    assert measured["global_batch"] == measured["configured_global_batch"] == 32
