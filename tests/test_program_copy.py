"""The program's copy of its config (``program_copy``): which one a command gets, what the resolved copy leaves out
and fills in, and what a resize writes into it (table tests on spec.load and on a run directory's files; no process
starts). LightningCLI end to end: tests/test_lightning_cli_local.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from runner import spec
from runner.errors import ConfigError, SubmitError
from runner.host.submit import _program_layout
from runner.rundir import RunDir
from runner.spec.program_copy import lightning_cli
from tests.test_program_config import BLOCK, SEED, in_the_project, write

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures(in_the_project.__name__)]

# Lightning's LightningCLI example's config as its users write it (trainer:, model:, data:), with runner's keys.
CLI = """\
command: python main.py fit --config ${program_config}
num_nodes: 1
num_device: 2
runner: {scheduler: local, seed: 3, checkpoint: {every_n_steps: 10}}
seed_everything: 7
trainer:
  accelerator: cpu
  devices: ${num_device}
  num_nodes: ${num_nodes}
  max_steps: 40
  accumulate_grad_batches: 1
model:
  out_dim: 10
  learning_rate: 0.02
"""


@pytest.fixture(autouse=True)
def main_py(tmp_path: Path) -> None:
    (tmp_path / "main.py").write_text("")


def copy_of(tmp_path: Path, text: str, overrides: list[str] | None = None) -> tuple[dict[str, Any], spec.Config]:
    cfg = spec.load(write(tmp_path, text), overrides or [], run_dir="/runs/r")
    assert cfg.document is not None
    return cfg.document, cfg


CHOSEN = [
    # (command, program_copy as written (None: unset), the one it gets)
    ("python main.py fit --config ${program_config}", None, "resolved"),
    ("python main.py fit -c ${program_config}", None, "resolved"),
    ("python main.py fit --config=${program_config} --trainer.max_steps 5", None, "resolved"),
    ("python -m main fit --config ${program_config}", None, "resolved"),
    ("python main.py validate --config ${program_config}", None, "resolved"),
    ("python train.py --config ${program_config}", None, "as_written"),  # ESPnet3's shape
    ("python main.py --stage fit --config ${program_config}", None, "as_written"),  # fit is an option's value
    ("python main.py fit --config other.yaml", None, "as_written"),  # it does not read runner's copy
    ("python main.py fit", None, "as_written"),
    ("python main.py fit --config ${program_config}", "as_written", "as_written"),  # a written value wins
    ("python train.py --config ${program_config}", "resolved", "resolved"),
]


@pytest.mark.parametrize(("command", "written", "chosen"), CHOSEN)
def test_a_lightning_cli_command_gets_the_resolved_copy_unless_the_config_says(tmp_path: Path, command: str,
                                                                               written: str | None,
                                                                               chosen: str) -> None:
    block = f"runner: {{program_copy: {written}}}\n" if written else ""
    cfg = spec.load(write(tmp_path, f"command: {command}\n{block}"))
    assert cfg.data["program_copy"] == chosen
    said = [n for n in cfg.notes if "program_copy" in n]
    if written == "as_written" and "fit" in command:  # what jsonargparse would refuse, said before any rank starts
        [note] = said
        assert "LightningCLI command (fit --config ${program_config})" in note
        assert note.endswith("hint: runner.program_copy: resolved")
    else:
        assert not said


def test_the_resolved_copy_holds_the_programs_keys_and_trainer_with_integers(tmp_path: Path) -> None:
    doc, cfg = copy_of(tmp_path, CLI)
    assert doc == {"seed_everything": 7, "model": {"out_dim": 10, "learning_rate": 0.02},
                   "trainer": {"accelerator": "cpu", "devices": 2, "num_nodes": 1, "max_steps": 40,
                               "accumulate_grad_batches": 1}}
    assert type(doc["trainer"]["devices"]) is int and type(doc["trainer"]["num_nodes"]) is int
    assert list(doc) == ["seed_everything", "trainer", "model"]  # in the file's order
    assert yaml.safe_load(spec.dump(doc)) == doc  # as it is written to program/
    assert cfg.data["command"][-1] == "/runs/r/program/conf.yaml"


LEFT_OUT = [
    # (config, top-level keys the resolved copy has)
    (CLI, {"seed_everything", "trainer", "model"}),
    # runner's settings at the top level (no runner: block): left out with command, num_nodes and num_device
    ("command: python main.py fit --config ${program_config}\nnum_device: 2\nscheduler: local\nseed: 3\n"
     "checkpoint: {every_n_steps: 5}\nprogram_copy: resolved\nseed_everything: 1\n", {"seed_everything", "trainer"}),
    # with a runner: block, a top-level seed: and scheduler: are the program's (ESPnet3's); dataloader: and parallel:
    # are runner's (its sharding, its Dask workers) and left out
    (SEED + BLOCK + "program_copy_note: x\n" + "parallel: {n_workers: 2}\n",
     {"stats_dir", "trainer", "scheduler", "seed", "exp_name", "home", "program_copy_note"}),
    ("command: python main.py fit --config ${program_config}\nrunner: {scheduler: local}\n", {"trainer"}),
]


@pytest.mark.parametrize(("text", "keys"), LEFT_OUT)
def test_runners_own_keys_are_left_out(tmp_path: Path, text: str, keys: set[str]) -> None:
    doc, _ = copy_of(tmp_path, text.replace("python train.py", "python main.py fit"))
    assert set(doc) == keys
    assert {"runner", "command", "num_nodes", "num_device", "dataloader", "parallel"}.isdisjoint(doc)
    assert doc["trainer"]["devices"] == spec.load(write(tmp_path, text), []).data["num_device"]


RESOLVED = [
    # (extra lines, override, dotted key in the copy, value)
    ("lr: 0.5\nmodel: {learning_rate: '${lr}'}\n", [], "model.learning_rate", 0.5),  # a program's key, its type
    ("model: {out_dim: '${num_nodes * num_device}'}\n", [], "model.out_dim", 2),  # runner's arithmetic
    ("model: {out_dim: '${num_device}'}\n", ["num_device=4"], "model.out_dim", 4),  # after the overrides
    ("model: {name: 'm-${num_device}-${runner.seed}'}\n", [], "model.name", "m-2-3"),  # inside a string
    ("model: {out_dim: 10}\n", ["model.out_dim=3"], "model.out_dim", 3),
    ("data: {root: '${run_dir}/data'}\n", [], "data.root", "/runs/r/data"),  # runner's own names
    ("data: {cfg: '${program_config}'}\n", [], "data.cfg", "/runs/r/program/conf.yaml"),
    ("data: {py: '${container_python}'}\n", [], "data.py", "${container_python}"),  # submit writes it out
    ("data: {files: ['${num_device}', x]}\n", [], "data.files", [2, "x"]),
    ("data: {home: '${oc.env:HOME}'}\n", [], "data.home", "${oc.env:HOME}"),  # a resolver: left, said
    ("data: {m: '${no.such.key}'}\n", [], "data.m", "${no.such.key}"),  # no such key: left, said
    ("", ["trainer.max_steps=5"], "trainer.max_steps", 5),
    ("", ["num_device=4"], "trainer.devices", 4),
]


@pytest.mark.parametrize(("extra", "overrides", "key", "value"), RESOLVED)
def test_every_value_runner_can_resolve_is_filled_in(tmp_path: Path, extra: str, overrides: list[str], key: str,
                                                      value: Any) -> None:
    text = CLI.replace("model:\n  out_dim: 10\n  learning_rate: 0.02\n", "") + extra
    doc, cfg = copy_of(tmp_path, text, overrides)
    node: Any = doc
    for part in key.split("."):
        node = node[part]
    assert node == value and type(node) is type(value)
    said = [n for n in cfg.notes if "left as written" in n]
    if isinstance(value, str) and value.startswith("${") and "container_python" not in value:
        assert said == [f"runner.program_copy: resolved: {key} left as written (a ${{...}} runner cannot resolve: an "
                        "OmegaConf resolver or a key it does not have)"]
    else:
        assert not said


def test_the_as_written_copy_is_unchanged(tmp_path: Path) -> None:
    """ESPnet3's copy: the file after the overrides, without the runner: block, its ${...} left for OmegaConf."""
    doc, cfg = copy_of(tmp_path, SEED + BLOCK)
    assert cfg.data["program_copy"] == "as_written"
    raw = yaml.safe_load(SEED + BLOCK)
    del raw["runner"]
    raw["command"] = "python train.py --config /runs/r/program/conf.yaml"
    assert doc == raw and doc["trainer"]["devices"] == "${num_device}"


@pytest.mark.parametrize("command", ["python main.py fit --config ${program_config} --trainer.devices ${num_device}",
                                     "python main.py fit -c ${program_config} --trainer.num_nodes=${ num_nodes }"])
def test_a_resolved_copy_with_the_layout_on_the_command_line_is_refused(tmp_path: Path, command: str) -> None:
    """A resize rewrites the layout in the program's config; a command carrying it would train the old one."""
    with pytest.raises(ConfigError) as e:
        spec.load(write(tmp_path, CLI.replace("command: python main.py fit --config ${program_config}",
                                              f"command: {command}")))
    [line] = e.value.problems
    assert ": command: " in line and "the layout only in the program's config" in line and "remove" in line


@pytest.mark.parametrize("text", [CLI, SEED + BLOCK])
def test_the_setting_leaves_the_config_hash_as_it_was(tmp_path: Path, text: str) -> None:
    """A run directory's config.yaml from before the key (none there) resumes under the same hash."""
    cfg = spec.load(write(tmp_path, text))
    hashes = {spec.load(write(tmp_path, text), [f"runner.program_copy={v}"]).hash() for v in ("as_written",
                                                                                               "resolved")}
    old = {k: v for k, v in cfg.data.items() if k != "program_copy"}
    assert hashes == {cfg.hash(), spec.from_dict(old, cfg.path).hash()}


@pytest.mark.parametrize(("argv", "sub"), [
    (["python", "main.py", "fit", "--config", "C"], "fit"),
    (["python", "main.py", "test", "-c", "C"], "test"),
    (["./main.py", "predict", "--config=C"], "predict"),
    (["python", "main.py", "fit", "--config", "D"], None),
    (["python", "main.py", "fit", "--config"], None),
    (["python", "main.py", "--mode", "fit", "--config", "C"], None),
    (["python", "fit", "--config", "C"], "fit"),  # a script called fit: runner cannot tell; it is LightningCLI's shape
])
def test_lightning_cli_is_told_by_its_subcommand_and_config(argv: list[str], sub: str | None) -> None:
    assert lightning_cli(argv, "C") == sub


def resize(tmp_path: Path, doc: dict[str, Any], overrides: list[str],
           world: int) -> tuple[tuple[int, int], dict[str, Any]]:
    """The layout a resize of a 2 x 2 run writes into its resolved copy (as `runner resume RUN ...` would)."""
    run = RunDir(tmp_path / "run")
    path = run.program_config("conf.yaml")
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump(doc))
    before = spec.from_dict({"command": ["python", "main.py", "fit", "--config", str(path)], "num_nodes": 2,
                             "num_device": 2, "program_copy": "resolved"}, run.config)
    layout = _program_layout(run, before, overrides, world)
    return layout.accumulate, layout.config


TRAINER = {"accelerator": "cpu", "devices": 2, "num_nodes": 2, "accumulate_grad_batches": 1, "max_steps": 40}
RESIZED = [
    # (trainer before, overrides, new world, (accumulate before, after), trainer after)
    (TRAINER, ["num_device=1"], 2, (1, 2), {**TRAINER, "devices": 1, "accumulate_grad_batches": 2}),
    (TRAINER, ["num_nodes=1", "num_device=1"], 1, (1, 4), {**TRAINER, "devices": 1, "num_nodes": 1,
                                                           "accumulate_grad_batches": 4}),
    ({**TRAINER, "accumulate_grad_batches": 4}, ["num_nodes=4", "num_device=4"], 16, (4, 1),
     {**TRAINER, "devices": 4, "num_nodes": 4, "accumulate_grad_batches": 1}),
    ({k: v for k, v in TRAINER.items() if k != "accumulate_grad_batches"}, ["num_device=1"], 2, (1, 2),
     {**TRAINER, "devices": 1, "accumulate_grad_batches": 2}),  # Lightning's default accumulation, 1, written
]


@pytest.mark.parametrize(("trainer", "overrides", "world", "acc", "after"), RESIZED)
def test_a_resize_writes_the_layout_into_trainer_alone(tmp_path: Path, trainer: dict[str, Any],
                                                       overrides: list[str], world: int, acc: tuple[int, int],
                                                       after: dict[str, Any]) -> None:
    doc = {"seed_everything": 7, "trainer": trainer, "model": {"out_dim": 10}}
    got, new = resize(tmp_path, doc, overrides, world)
    assert got == acc and new == {**doc, "trainer": after}  # no num_nodes/num_device at its top: LightningCLI's keys
    assert all(type(new["trainer"][k]) is int for k in ("devices", "num_nodes", "accumulate_grad_batches"))


def test_a_resize_that_cannot_keep_the_global_batch_is_refused_as_before(tmp_path: Path) -> None:
    with pytest.raises(SubmitError) as e:
        resize(tmp_path, {"trainer": TRAINER}, ["num_device=3"], 6)
    assert "found 6 ranks for 4 rank-batches per optimizer step" in str(e.value)
