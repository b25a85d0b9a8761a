"""A first hour without surprises (issue 31): errors that name the fix, numbers that agree, and every alert's "Next:"
line true for what happens next, per scheduler and workload (a table)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.ci import need

pytestmark = pytest.mark.local

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "conf" / "quickstart.yaml"
SLURM_CONF = REPO / "conf" / "slurm-2node.yaml"


def runner(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, timeout=120,
                          env=env if env is not None else {**os.environ, "OMP_NUM_THREADS": "1"})


def one_line_error(out: subprocess.CompletedProcess[str]) -> str:
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_local_run_of_a_runtime_that_needs_an_image_names_both_fixes(tmp_path: Path, dry_run: bool) -> None:
    out = runner("submit", str(QUICKSTART), f"run_root={tmp_path}", "container.runtime=apptainer",
                 *(["--dry-run"] if dry_run else []))
    assert out.returncode == 2, out.stdout + out.stderr
    line = one_line_error(out)
    assert "container.runtime: found apptainer with scheduler: local" in line
    assert "container.runtime: none" in line and "runner build" in line and "scheduler: slurm" in line
    assert not list(tmp_path.iterdir())  # no run directory of a run that cannot start


def test_validate_says_the_data_modules_own_global_batch_when_dataloader_is_not_applied(tmp_path: Path) -> None:
    data = yaml.safe_load(QUICKSTART.read_text())
    data.update(model={"_target_": "lightning.pytorch.demos.BoringModel"},
                data={"_target_": "lightning.pytorch.demos.BoringDataModule"})
    conf = tmp_path / "boring.yaml"
    conf.write_text(yaml.safe_dump(data))
    out = runner("validate", str(conf))
    assert out.returncode == 0, out.stderr
    assert "global batch: the data module's own" in out.stdout and "= 8 (batch_size)" not in out.stdout
    plan = runner("submit", str(conf), f"run_root={tmp_path / 'runs'}", "--dry-run")
    assert "global batch:  the data module's own" in plan.stdout and "8 x 2 ranks" not in plan.stdout
    mine = runner("validate", str(QUICKSTART))  # runner's own data module: runner's arithmetic
    assert "global batch 32 = 8 (batch_size) x 2 (ranks) x 2 (accumulate_grad_batches)" in mine.stdout


def test_an_unreachable_slurm_controller_is_named_as_such(tmp_path: Path) -> None:
    need(shutil.which("sbatch") is not None, "sbatch is not installed (scripts/install-slurm.sh installs it)")
    for conf in (None, str(tmp_path / "nowhere" / "slurm.conf")):
        env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
        if conf:
            env["SLURM_CONF"] = conf
        out = runner("submit", str(SLURM_CONF), f"run_root={tmp_path / 'runs'}", env=env)
        assert out.returncode != 0
        line = one_line_error(out)
        assert "no Slurm controller answers" in line and "SLURM_CONF" in line, line
        assert "num_nodes" not in line  # the config is not what is wrong
        assert not list((tmp_path / "runs").glob("*"))


def test_hints_list_each_known_key_once(tmp_path: Path) -> None:
    out = runner("validate", str(QUICKSTART), "trainer.bogus=1")
    assert out.returncode == 2
    known = one_line_error(out).split("known keys: ", 1)[1].split(", ")
    assert len(known) == len(set(known)) and "callbacks" in known, known


def test_a_trainer_object_argument_of_the_wrong_shape_is_one_line(tmp_path: Path) -> None:
    out = runner("validate", str(QUICKSTART), "trainer.callbacks=[3]")
    assert out.returncode == 2
    assert "trainer.callbacks.0: found 3; expected a mapping with _target_" in one_line_error(out)
    out = runner("validate", str(QUICKSTART), "trainer.callbacks=[{_target_: lightning.pytorch.callbacks.Timerr}]")
    assert out.returncode == 2 and "trainer.callbacks.0._target_" in one_line_error(out)


@pytest.mark.local
def test_lightning_trainer_objects_pass_to_the_trainer(tmp_path: Path) -> None:
    out = runner("submit", str(QUICKSTART), f"run_root={tmp_path}", "trainer.max_steps=20",
                 "trainer.callbacks=[{_target_: lightning.pytorch.callbacks.Timer, duration: '00:01:00:00'}]",
                 "trainer.logger={_target_: lightning.pytorch.loggers.CSVLogger, save_dir: '${run_dir}/csv'}")
    assert out.returncode == 0, out.stdout + out.stderr
    [run] = tmp_path.glob("quickstart-*")
    assert (run / "finished").exists()
    [metrics] = (run / "csv").rglob("metrics.csv")  # the user's logger got the model's self.log values
    assert "train_loss" in metrics.read_text()


@pytest.mark.local
def test_a_target_module_beside_the_config_is_found_from_any_directory(tmp_path: Path) -> None:
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "mymodel.py").write_text("from runner.dev.example import TinyRegressor\n\n\n"
                                        "class Model(TinyRegressor):\n    pass\n")
    data = yaml.safe_load(QUICKSTART.read_text())
    data["model"]["_target_"] = "mymodel.Model"
    conf = project / "conf.yaml"
    conf.write_text(yaml.safe_dump(data))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for args in (["validate", str(conf)], ["submit", str(conf), f"run_root={tmp_path / 'runs'}",
                                            "trainer.max_steps=10"]):
        out = subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, timeout=240,
                             cwd=elsewhere, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
    [run] = (tmp_path / "runs").glob("quickstart-*")
    assert (run / "finished").exists()
