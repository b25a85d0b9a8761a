"""A first hour without surprises (issue 31): errors that name the fix, numbers that agree, and every alert's "Next:"
line true for what happens next, per scheduler and workload (a table)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
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
        # a SLURM_CONF that names no file is said at once (sbatch itself would wait 60 s for the file to appear)
        assert ("names no file" in line) == bool(conf), line
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


# Issue 38: `runner validate` and `runner submit` agree (one checking path), a local run needs no container: section,
# and ranks never wait on a terminal.

PROGRAM = "num_nodes: 1\nnum_device: 2\nname: fh\ncommand: {command}\n"


@pytest.mark.parametrize(("command", "overrides", "code", "says"), [
    ("python train.py", [], 0, None),  # no container: section, scheduler local: runtime none
    ("python train.py", ["container.runtime=apptainer"], 2, "container.runtime: found apptainer with scheduler: local"),
    ("python nope.py", [], 2, "no script 'nope.py' in"),
    ("python -", [], 2, "reads its program from stdin"),
    ("python", [], 2, "reads its program from stdin"),
])
def test_validate_and_submit_agree(tmp_path: Path, command: str, overrides: list[str], code: int,
                                   says: str | None) -> None:
    (tmp_path / "train.py").write_text("")
    (tmp_path / "conf.yaml").write_text(PROGRAM.format(command=command))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outs = [subprocess.run([sys.executable, "-m", "runner", *args, "conf.yaml", *overrides], capture_output=True,
                           text=True, timeout=120, cwd=tmp_path, env=env)
            for args in (["validate"], ["submit", "--dry-run"])]
    assert [o.returncode for o in outs] == [code, code], [o.stderr for o in outs]
    if says:
        assert all(says in one_line_error(o) for o in outs), [o.stderr for o in outs]
    else:
        assert "runtime: none" in outs[0].stdout and "image check" not in outs[1].stdout, outs[1].stdout


def test_a_local_program_without_a_container_section_runs_and_its_ranks_read_no_terminal(tmp_path: Path) -> None:
    """The first program-mode config a newcomer writes: no container:, a script that reads stdin (a prompt it
    forgot). The ranks get /dev/null, as under srun: the script reads EOF and goes on, though runner's own stdin
    stays open."""
    (tmp_path / "train.py").write_text("import sys\nprint('stdin said', repr(sys.stdin.read()))\n")
    (tmp_path / "conf.yaml").write_text(PROGRAM.format(command="python train.py"))
    with (tmp_path / "out.txt").open("w") as out, subprocess.Popen(
            [sys.executable, "-m", "runner", "submit", "conf.yaml"], cwd=tmp_path, stdin=subprocess.PIPE, stdout=out,
            stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}) as proc:
        proc.wait(timeout=120)  # its stdin open, never written: a rank that read it would wait forever
        assert proc.stdin is not None
        proc.stdin.close()
    [run] = (tmp_path / "runs").glob("fh-*")
    logs = sorted(run.glob("logs/attempt-1/rank-*.log"))
    said = (tmp_path / "out.txt").read_text()
    assert len(logs) == 2 and all("stdin said ''" in log.read_text() for log in logs), said


@pytest.mark.parametrize("how", ["ctrl-c", "cancel"])
def test_a_lightning_program_exits_once_runners_stop_checkpoint_is_written(tmp_path: Path, how: str) -> None:
    """Lightning's transformer example with a slow validation, its own ModelCheckpoint and work at each epoch's end
    (tests/programs/lightning_transformer.py): once runner's checkpoint of the stop is complete, the ranks exit
    within seconds (never after the epoch's end, a validation of a minute, the program's own checkpoint), and the
    attempt ends with an `exit` in the ledger."""
    from runner import checkpoint
    from runner.rundir import RunDir
    from tests.waiting import until

    shutil.copy(REPO / "tests" / "programs" / "lightning_transformer.py", tmp_path / "train.py")
    command = "python train.py --devices ${num_device} --num_nodes ${num_nodes} --sleep 0.1 --slow 1"
    (tmp_path / "conf.yaml").write_text(PROGRAM.format(command=command) + "checkpoint: {every_n_steps: 1000}\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with (tmp_path / "out.txt").open("w") as out, subprocess.Popen(
            [sys.executable, "-m", "runner", "submit", "conf.yaml"], cwd=tmp_path, stdout=out,
            stderr=subprocess.STDOUT, env=env) as proc:
        def step() -> int:
            assert proc.poll() is None, (tmp_path / "out.txt").read_text()
            runs = list((tmp_path / "runs").glob("fh-*/progress.json"))
            return int(json.loads(runs[0].read_text()).get("step") or 0) if runs else 0

        until("training's 10th step", lambda: step() >= 10, 120)
        [root] = (tmp_path / "runs").glob("fh-*")
        run = RunDir(root)
        if how == "ctrl-c":
            proc.send_signal(signal.SIGINT)
        else:
            cancel = subprocess.Popen([sys.executable, "-m", "runner", "cancel", str(root)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        until("runner's checkpoint of the stop", lambda: checkpoint.complete(run.checkpoints), 60, every=0.02)
        written = time.monotonic()
        proc.wait(timeout=120)
        took = time.monotonic() - written
    said = (tmp_path / "out.txt").read_text()
    assert took < 10, f"the ranks exited {took:.0f} s after runner's checkpoint of the stop\n{said}"
    if how == "cancel":
        told, _ = cancel.communicate(timeout=60)
        assert "stopped" in told and "killed" not in told, told
    [end] = [e for e in run.events() if e["event"] == "exit"]
    assert end["outcome"] == ("interrupted" if how == "ctrl-c" else "cancelled"), end
    assert not list(tmp_path.glob("checkpoints-own/*.ckpt")), "the program's own checkpoint ran after the stop"
