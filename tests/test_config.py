"""Config validation: every bad input gets one line naming the file, the key, what was found and a hint."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from runner import spec
from runner.errors import ConfigError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = yaml.safe_load((REPO / "conf" / "quickstart.yaml").read_text())


def write(tmp_path: Path, data: dict | str, name: str = "conf.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def problems(tmp_path: Path, overrides: list[str], base: dict | None = None) -> list[str]:
    path = write(tmp_path, base or QUICKSTART)
    with pytest.raises(ConfigError) as err:
        spec.load(path, overrides)
    return err.value.problems


def test_quickstart_resolves_interpolation_and_global_batch(tmp_path: Path) -> None:
    cfg = spec.load(REPO / "conf" / "quickstart.yaml", ["num_device=4", "global_batch_size=64"])
    assert cfg.data["trainer"]["devices"] == 4
    assert cfg.data["dataloader"]["train"]["dist_world_size"] == 4  # ${num_nodes * num_device}
    assert cfg.accumulate == 2 and cfg.global_batch == 64  # 8 x 4 x 2


@pytest.mark.parametrize(("overrides", "key", "needle"), [
    (["dataloader.train.dist_world_size=3"], "dataloader.train.dist_world_size", "num_nodes x num_device"),
    (["dataloader.train.total_shards=3"], "dataloader.train.total_shards", "multiple of dist_world_size=2"),
    (["trainer.devices=4"], "trainer.devices", "(= num_device)"),
    (["trainer.num_nodes=3"], "trainer.num_nodes", "(= num_nodes)"),
    (["trainer.max_step=10"], "trainer.max_step", "did you mean trainer.max_steps"),
    (["chekpoint.every_n_steps=5"], "chekpoint", "did you mean checkpoint"),
    (["trainer.strategy=horovod"], "trainer.strategy", "one of ddp, ddp_find_unused_parameters_true, fsdp"),
    (["num_nodes=0", "trainer.num_nodes=0"], "num_nodes", "a value >= 1"),
    (["num_device=-2", "trainer.devices=-2"], "num_device", "a value >= 1"),
    (["checkpoint.every_n_steps=ten"], "checkpoint.every_n_steps", "an integer"),
    (["seed=true"], "seed", "an integer"),
    (["container.ngc_tag=24.10"], "container.ngc_tag", "quote it: YAML reads 24.1 as a number"),
    (["container.ngc_tag='24.1'"], "container.ngc_tag", "NGC release tag"),
    (["container.ngc_tag=latest"], "container.ngc_tag", "NGC release tag"),
    (["trainer.devices=${num_devices}"], "trainer.devices", "interpolation"),
    (["model._target_=runner.dev.example.NoSuchModel"], "model._target_", "NoSuchModel"),
    (["global_batch_size=20"], "global_batch_size", "multiple of batch_size x world size = 16"),
    (["slurm.partition=gpu;rm -rf"], "slurm.partition", "found 'gpu;rm -rf'"),
    (["slurm.extra_flags=[--mail-user=a b]"], "slurm.extra_flags[0]", "sbatch flag"),
    (["env.BAD-NAME=1"], "env.BAD-NAME", "environment variable name"),
    (["slurm.time=forever"], "slurm.time", "Slurm time"),
])
def test_each_error_names_its_key(tmp_path: Path, overrides: list[str], key: str, needle: str) -> None:
    found = problems(tmp_path, overrides)
    line = next((p for p in found if f": {key}: " in p), None)
    assert line is not None, found
    assert needle in line
    assert line.startswith(str(tmp_path / "conf.yaml"))
    assert "\n" not in line and "found" in line and "expected" in line


def test_trainer_settings_under_parallel(tmp_path: Path) -> None:
    data = {**QUICKSTART, "parallel": {"env": "slurm", "options": {"strategy": "ddp", "num_nodes": 2}}}
    [line] = problems(tmp_path, [], data)
    assert ": parallel: " in line and "strategy" in line and "trainer:" in line


def test_all_problems_reported_at_once_with_line_numbers(tmp_path: Path) -> None:
    text = (REPO / "conf" / "quickstart.yaml").read_text()
    text = text.replace("total_shards: 4", "total_shards: 4\n    totl_shards: 4").replace("seed: 1234", "seed: x")
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        spec.load(path)
    assert len(err.value.problems) == 3  # seed, and the typo in both loaders
    lines = {p.split(": ")[1]: p.split(": ")[0] for p in err.value.problems}
    seed_line = text.splitlines().index("seed: x") + 1
    assert lines["seed"] == f"{path}:{seed_line}"
    assert "dataloader.train.totl_shards" in lines


def test_yaml_syntax_error_has_line_number(tmp_path: Path) -> None:
    path = write(tmp_path, "num_nodes: 1\ntrainer:\n  devices: [1, 2\n  max_steps: 3\n")
    with pytest.raises(ConfigError) as err:
        spec.load(path)
    [line] = err.value.problems
    assert line.startswith(f"{path}:4: YAML syntax error")


def test_overrides_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        spec.load(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="expected key.path=value"):
        spec.load(REPO / "conf" / "quickstart.yaml", ["trainer.max_steps"])


def test_world_size_change_keeps_config_hash_and_global_batch() -> None:
    a = spec.load(REPO / "conf" / "quickstart.yaml")
    b = spec.load(REPO / "conf" / "quickstart.yaml", ["num_device=4"])
    assert (a.global_batch, b.global_batch) == (32, 32)
    assert (a.accumulate, b.accumulate) == (2, 1)
    assert a.hash() == b.hash()
    assert a.hash() != spec.load(REPO / "conf" / "quickstart.yaml", ["seed=7"]).hash()
