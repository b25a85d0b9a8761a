"""Program mode, the config side, through the CLI as a user runs it (the local tier; the rest:
tests/test_program_config.py)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runner import spec
from runner.host import submit
from runner.rundir import RunDir
from tests.test_program_config import BLOCK, REPO, SCRIPTS, SEED, in_the_project, write

pytestmark = [pytest.mark.local, pytest.mark.usefixtures(in_the_project.__name__)]


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)


@pytest.mark.parametrize("extra", ["", BLOCK], ids=["as written", "with a runner: block"])
def test_seed_example_with_a_command_validates_with_world_size_16(tmp_path: Path, extra: str) -> None:
    out = cli(tmp_path, "validate", str(write(tmp_path, SEED + extra)))
    assert out.returncode == 0, out.stderr
    summary = out.stdout.strip().splitlines()[-1]
    assert summary.startswith("# world size 16; global batch: the program's own"), summary
    resolved = yaml.safe_load(out.stdout)
    assert resolved["command"] == ["python", "train.py", "--config", "${run_dir}/program/conf.yaml"]
    train = resolved["dataloader"]["train"]
    assert train["iter_factory"]["batches"]["shape_files"] == ["exp/stats/train/feats_shape"]
    assert resolved["program"]["stats_dir"] == "exp/stats"


@pytest.mark.parametrize(("override", "key", "needle"), [
    ("dataloader.train.dist_world_size=8", "dataloader.train.dist_world_size", "found 8; expected 16 (= num_nodes x "
                                                                                 "num_device)"),
    ("dataloader.valid.total_shards=24", "dataloader.valid.total_shards", "found 24; expected a multiple of "
                                                                           "dist_world_size=16"),
    ("dataloader.train.total_shards=ten", "dataloader.train.total_shards", "expected an integer"),
    ("trainer.devices=4", "trainer.devices", "expected 8 (= num_device)"),
    ("trainer.strategy=horovod", "trainer.strategy", "one of ddp, ddp_find_unused_parameters_true, fsdp, auto"),
])
def test_a_rule_runner_reads_is_refused_in_one_line(tmp_path: Path, override: str, key: str, needle: str) -> None:
    path = write(tmp_path, SEED)
    out = cli(tmp_path, "validate", str(path), override)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line.startswith(f"runner: error: {path}:") and f": {key}: " in line and needle in line, line


def test_program_yaml_is_the_file_as_written_without_the_runner_block(tmp_path: Path) -> None:
    extra = BLOCK.replace("run_root: runs", f"run_root: {tmp_path / 'runs'}")
    path = write(tmp_path, SEED + extra + "trainer_logger_name: ${self_name:}\n")
    plan = submit.plan(path, ["dataloader.train.iter_factory.batches.batch_bins=5000000"])
    submit.write(plan)  # the run directory as `runner submit` leaves it (nothing is started)
    text = plan.run.program_config("conf.yaml").read_text()
    # Under the config's own name: ESPnet3 names its experiment after it (exp_tag: ${self_name:}).
    assert plan.run.program_config("conf.yaml") == RunDir(plan.run.root).root / "program" / "conf.yaml"
    doc = yaml.safe_load(text)
    assert "runner" not in doc
    assert doc["exp_name"] == doc["trainer_logger_name"] == "${self_name:}"  # the program's resolvers, verbatim
    assert doc["home"] == "${oc.env:HOME}" and doc["seed"] == 7 and doc["scheduler"]["step_size"] == 10
    assert doc["trainer"]["devices"] == "${num_device}"  # not interpolated: the program resolves it
    assert doc["dataloader"]["valid"]["iter_factory"]["collate_fn"] == "${dataloader.collate_fn}"
    assert doc["dataloader"]["train"]["iter_factory"]["batches"]["batch_bins"] == 5000000  # the override
    # runner's own names are the only ones written out: the program could not resolve them.
    assert doc["command"] == f"python train.py --config {plan.run.program_config('conf.yaml')}"
    resolved = yaml.safe_load(plan.run.config.read_text())
    assert resolved["command"][-1] == str(plan.run.program_config("conf.yaml"))
    manifest = json.loads(plan.run.manifest.read_text())
    assert manifest["global_batch"] is None and manifest["data_module"]["global_batch"] == "the program's own"
    assert not list(plan.run.root.glob(".*.tmp-*"))  # written atomically, no temp file left


PARALLEL = """\
parallel:
  env: slurm
  n_workers: 2
  options:
    cores: 1
    memory: 1000MB
    python: ${container_python}
"""


@pytest.mark.local  # submit.plan asks git for the config's provenance
@pytest.mark.parametrize("runtime", ["podman", "none"])
def test_container_python_starts_the_programs_own_jobs_in_the_runs_image(tmp_path: Path, runtime: str) -> None:
    """ESPnet3's dask-jobqueue workers (``parallel.options.python``) start as the ranks do: in the run's image, with
    their binds and environment, in the program's directory; with runtime none, this Python."""
    extra = BLOCK.replace("run_root: runs", f"run_root: {tmp_path / 'runs'}").replace("runtime: none",
                                                                                      f"runtime: {runtime}")
    path = write(tmp_path, SEED + extra + PARALLEL)
    assert "container_python" not in " ".join(spec.load(path).notes)  # validates: a name runner knows
    plan = submit.plan(path, [], allow_missing_image=True)
    submit.write(plan)
    python = yaml.safe_load(plan.run.program_config("conf.yaml").read_text())["parallel"]["options"]["python"]
    manifest = json.loads(plan.run.manifest.read_text())
    if runtime == "none":
        assert python == sys.executable
        return
    words = shlex.split(python)
    assert words[:3] == ["podman", "run", "--rm"] and words[-2:] == [manifest["image"], "python"]
    assert words[words.index("--workdir") + 1] == manifest["cwd"]
    for bind in (str(tmp_path / "runs"), manifest["cwd"]):
        assert words[words.index(f"{bind}:{bind}") - 1] == "--volume"
    for name in ("SLURM_*", "OMP_NUM_THREADS", "RUNNER_RUN_DIR"):
        assert words[words.index(name) - 1] == "--env"


def test_own_mode_writes_no_program_yaml(tmp_path: Path) -> None:
    plan = submit.plan(REPO / "conf" / "quickstart.yaml", [f"run_root={tmp_path / 'runs'}"])
    assert set(plan.files) == {"config.yaml", "manifest.json", "job.sbatch"}


def test_dry_run_of_a_program_prints_its_command_and_config_and_writes_nothing(tmp_path: Path) -> None:
    path = write(tmp_path, SEED + BLOCK)
    out = cli(tmp_path, "submit", "--dry-run", str(path))
    assert out.returncode == 0, out.stderr
    run = out.stdout.splitlines()[0].removeprefix("run directory: ")
    assert "world size:    16" in out.stdout
    assert f"program:       python train.py --config {run}/program/conf.yaml (on every rank" in out.stdout
    assert "global batch:  the program's own" in out.stdout
    for name in ("config.yaml", "manifest.json", "job.sbatch", "program/conf.yaml"):
        assert f"--- {name} ---" in out.stdout
    program_yaml = yaml.safe_load(out.stdout.split("--- program/conf.yaml ---", 1)[1])
    assert program_yaml["exp_name"] == "${self_name:}" and "runner" not in program_yaml
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["conf.yaml", *SCRIPTS])  # no run directory


ARGV_PROBE = """import json, sys
json.dump(sys.argv[1:], open(sys.argv[1], "w"))
"""


def test_a_program_gets_each_interpolated_value_as_the_one_argument_it_was_written_in(tmp_path: Path) -> None:
    """A config named `my prog's.yaml` and a value with spaces and quotes: `runner submit` runs
    the program with the path of its config as one argument and the value as one, as the command was written."""
    (tmp_path / "probe.py").write_text(ARGV_PROBE)
    path = tmp_path / "my prog's.yaml"
    path.write_text(yaml.safe_dump({
        "num_nodes": 1, "num_device": 1, "tag": "a b  'c'",
        "command": "python probe.py seen.json --config ${program_config} --tag=${tag} '${tag}'",
        "runner": {"name": "argv", "scheduler": "local", "run_root": str(tmp_path / "runs"),
                   "container": {"runtime": "none"}}}))
    out = subprocess.run([sys.executable, "-m", "runner", "submit", str(path)], capture_output=True, text=True,
                         timeout=240, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    [run] = (tmp_path / "runs").iterdir()
    program_config = RunDir(run).program_config(path.name)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == ["seen.json", "--config", str(program_config), "--tag=a b  'c'", "a b  'c'"]
    assert yaml.safe_load(program_config.read_text())["tag"] == "a b  'c'"  # the program reads its config there
