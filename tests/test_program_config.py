"""Program mode, the config side: `command:`, the program's keys passed through, the `runner:` block, program.yaml.

Real YAML files, read the way a user runs them (`python -m runner validate`, `runner submit --dry-run`) or
through `runner.spec.load`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from runner import spec
from runner.errors import ConfigError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
# The seed's multi-node example (ESPnet3's guide), with the command that runs it.
SEED = """\
command: python train.py --config ${program_config}
num_device: 8
num_nodes: 2
stats_dir: exp/stats
trainer:
  accelerator: gpu
  devices: ${num_device}
  num_nodes: ${num_nodes}
  strategy: ddp
dataloader:
  collate_fn:
    _target_: espnet2.train.collate_fn.CommonCollateFn
    int_pad_value: -1
  train:
    total_shards: 16
    dist_world_size: 16
    iter_factory:
      _target_: espnet2.iterators.sequence_iter_factory.SequenceIterFactory
      shuffle: true
      collate_fn: ${dataloader.collate_fn}
      batches:
        type: unsorted
        shape_files:
        - ${stats_dir}/train/feats_shape
        batch_bins: 4000000
  valid:
    total_shards: 16
    dist_world_size: 16
    iter_factory:
      _target_: espnet2.iterators.sequence_iter_factory.SequenceIterFactory
      shuffle: false
      collate_fn: ${dataloader.collate_fn}
      batches:
        type: unsorted
        shape_files:
        - ${stats_dir}/valid/feats_shape
        batch_bins: ${dataloader.train.iter_factory.batches.batch_bins}
"""
# runner's own settings in one block, beside ESPnet3's own top-level scheduler: (its LR scheduler) and seed:.
BLOCK = """\
runner:
  scheduler: slurm
  seed: 3
  run_root: runs
  slurm:
    partition: gpu
    time: "4:00:00"
  container:
    runtime: none
scheduler:
  _target_: torch.optim.lr_scheduler.StepLR
  step_size: 10
seed: 7
exp_name: ${self_name:}
home: ${oc.env:HOME}
"""


SCRIPTS = ("train.py", "x.py", "t.py", "other.py", "my train.py")  # what these configs' commands run


@pytest.fixture(autouse=True)
def in_the_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks start where runner runs (validate checks that a command's script is there): the scripts these
    configs name are in the test's directory, and runner runs in it."""
    monkeypatch.chdir(tmp_path)
    for name in SCRIPTS:
        (tmp_path / name).write_text("")


def write(tmp_path: Path, text: str, name: str = "conf.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems(path: Path, overrides: list[str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as err:
        spec.load(path, overrides or [])
    return err.value.problems


def test_runner_block_keeps_espnet3_scheduler_and_seed_for_the_program(tmp_path: Path) -> None:
    cfg = spec.load(write(tmp_path, SEED + BLOCK))
    assert (cfg.data["scheduler"], cfg.data["seed"], cfg.data["slurm"]["time"]) == ("slurm", 3, "4:00:00")
    program = cfg.data["program"]
    assert program["scheduler"] == {"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 10}
    assert (program["seed"], program["exp_name"], program["home"]) == (7, "${self_name:}", "${oc.env:HOME}")
    assert "runner" not in program and "num_nodes" not in program and "trainer" not in program
    # Overrides name keys as the file does: runner.KEY for runner's, the top-level key for the program's.
    cfg = spec.load(cfg.path, ["runner.scheduler=local", "scheduler.step_size=5", "seed=8"])
    assert (cfg.data["scheduler"], cfg.data["seed"]) == ("local", 3)
    assert (cfg.data["program"]["scheduler"]["step_size"], cfg.data["program"]["seed"]) == (5, 8)


@pytest.mark.parametrize(("text", "key", "needle"), [
    ("trainner:\n  max_epochs: 3\n", "trainner", "did you mean trainer?"),
    ("num_nodse: 2\n", "num_nodse", "did you mean num_nodes?"),
    ("runer:\n  scheduler: slurm\n", "runer", "did you mean runner?"),
    ("dataloder: {}\n", "dataloder", "did you mean dataloader?"),
    ("comand: python x.py\n", "comand", "did you mean command?"),
], ids=lambda v: v.split(":")[0] if isinstance(v, str) else "")
def test_a_near_miss_of_a_runner_key_is_an_error(tmp_path: Path, text: str, key: str, needle: str) -> None:
    path = write(tmp_path, SEED + text)
    [line] = problems(path)
    assert line.startswith(f"{path}:{SEED.count(chr(10)) + 1}: {key}: found {key!r}; expected "), line
    assert line.endswith(needle)


@pytest.mark.parametrize("key", ["stats", "trainer_cfg", "beta", "dates", "optim", "scheduler_conf", "lr"])
def test_other_top_level_keys_are_the_programs(tmp_path: Path, key: str) -> None:
    cfg = spec.load(write(tmp_path, SEED + f"{key}: 1\n"))
    assert cfg.data["program"][key] == 1


def test_own_mode_user_variables_resolve_and_pass_through(tmp_path: Path) -> None:
    text = (REPO / "conf" / "quickstart.yaml").read_text() + (
        "stats_dir: exp/stats\nlabel: ${self_name:}\nrunner_root: /tmp/runs\n"
        "preflight:\n  paths: ['${stats_dir}']\n")
    cfg = spec.load(write(tmp_path, text))
    assert cfg.data["preflight"]["paths"] == ["exp/stats"]
    assert cfg.data["program"] == {"stats_dir": "exp/stats", "label": "${self_name:}", "runner_root": "/tmp/runs"}
    assert cfg.data["command"] is None and not cfg.program_mode and cfg.global_batch == 32
    assert cfg.hash() == spec.load(REPO / "conf" / "quickstart.yaml", ["preflight.paths=[exp/stats]"]).hash()


@pytest.mark.parametrize(("text", "key", "needle"), [
    ("runner:\n  schedular: slurm\n", "runner.schedular", "did you mean runner.scheduler?"),
    ("runner:\n  slurm:\n    tme: '1:00:00'\n", "runner.slurm.tme", "did you mean runner.slurm.time?"),
    ("runner:\n  num_nodes: 2\n", "runner.num_nodes", "put num_nodes at the top level"),
    ("runner:\n  command: python x.py\n", "runner.command", "put command at the top level"),
    ("runner:\n  slurm:\n    time: forever\n", "runner.slurm.time", "expected Slurm time"),
    ("runner: slurm\n", "runner", "expected a mapping of runner's own settings"),
    ("runner: []\n", "runner", "expected a mapping of runner's own settings"),
])
def test_runner_block_errors_name_the_key_as_written(tmp_path: Path, text: str, key: str, needle: str) -> None:
    path = write(tmp_path, SEED + text)
    line_no = (SEED + text).count("\n")  # the snippet's last line holds the key
    [found] = problems(path)
    assert found.startswith(f"{path}:") and f": {key}: " in found and needle in found, found
    assert found.startswith(f"{path}:{line_no}: "), (found, line_no)


@pytest.mark.parametrize(("text", "key", "needle"), [
    ("model:\n  _target_: runner.dev.example.TinyRegressor\n", "model", "found both command and model; expected "
                                                                       "one of them"),
    ("runner:\n  global_batch_size: 64\n", "runner.global_batch_size", "hint: runner cannot derive a program's "
                                                                        "accumulation"),
    ("num_device: ${oc.env:NGPU}\n", "num_device", "found an OmegaConf resolver ${oc.env:NGPU}; expected a value "
                                                   "runner can read"),
    ("runner:\n  slurm:\n    partition: ${self_name:}\n", "runner.slurm.partition", "OmegaConf resolver"),
])
def test_program_mode_refusals(tmp_path: Path, text: str, key: str, needle: str) -> None:
    base = SEED.replace("num_device: 8\n", "") if text.startswith("num_device") else SEED
    path = write(tmp_path, base + text)
    found = problems(path)
    line = next((p for p in found if f": {key}: " in p), None)
    assert line is not None and needle in line, found
    assert len([p for p in found if f": {key}: " in p]) == 1  # said once, not again by the type check


@pytest.mark.parametrize(("command", "argv"), [
    ("python train.py --lr 1e-3", ["python", "train.py", "--lr", "1e-3"]),
    ("python 'my train.py' --name \"a b\"", ["python", "my train.py", "--name", "a b"]),
    ("torchrun --nproc-per-node ${num_device} t.py", ["torchrun", "--nproc-per-node", "8", "t.py"]),
    ("python t.py --out $HOME/x  # a YAML comment", ["python", "t.py", "--out", "$HOME/x"]),  # no expansion
    ("[python, t.py, --devices, '${num_device}']", ["python", "t.py", "--devices", "8"]),
    ("[python, t.py, '--lr=1e-3']", ["python", "t.py", "--lr=1e-3"]),
])
def test_command_is_an_argv(tmp_path: Path, command: str, argv: list[str]) -> None:
    cfg = spec.load(write(tmp_path, SEED.replace("python train.py --config ${program_config}", command)))
    assert cfg.data["command"] == argv


@pytest.mark.parametrize(("name", "value", "command", "argv"), [
    # The command is split as written, then each ${...} is substituted inside its word: no value makes or removes
    # a word, and no quote in a value is read as the command's own.
    ("my prog.yaml", "", "python t.py --config ${program_config}",
     ["python", "t.py", "--config", "/runs/r x/program/my prog.yaml"]),
    ("it's.yaml", "", "python t.py --config=${program_config}",
     ["python", "t.py", "--config=/runs/r x/program/it's.yaml"]),
    ("c.yaml", "a b  c", "python t.py --tag ${tag} --n ${num_device}",
     ["python", "t.py", "--tag", "a b  c", "--n", "8"]),
    ("c.yaml", "it's \"x\"", "python t.py '--tag=${tag}!'", ["python", "t.py", "--tag=it's \"x\"!"]),
    ("c.yaml", "$HOME $(id) `id` \\", "python t.py ${tag}", ["python", "t.py", "$HOME $(id) `id` \\"]),
    ("c.yaml", "", "python t.py --tag ${tag} last", ["python", "t.py", "--tag", "", "last"]),
    ("c.yaml", "x", "python t.py \"${tag} ${tag}\" pre${tag}post", ["python", "t.py", "x x", "prexpost"]),
    # A list, a word of its own, is one word per item ("$@"): ESPnet3's --stages takes its stages so.
    ("c.yaml", ["infer", "measure"], "python run.py --stages ${tag} --x", ["python", "run.py", "--stages", "infer",
                                                                          "measure", "--x"]),
    ("c.yaml", ["a b", 2], "python t.py ${tag}", ["python", "t.py", "a b", "2"]),
    ("c.yaml", [], "python t.py ${tag} end", ["python", "t.py", "end"]),
    ("c.yaml", "x", "torchrun --nproc-per-node ${num_nodes * num_device} --run \"${run_dir}\" t.py",
     ["torchrun", "--nproc-per-node", "16", "--run", "/runs/r x", "t.py"]),
])
def test_a_command_is_split_as_written_then_each_word_substituted(tmp_path: Path, name: str, value: Any,
                                                                  command: str, argv: list[str]) -> None:
    rest = SEED.split("\n", 1)[1]  # the seed without its command line
    path = write(tmp_path, yaml.safe_dump({"command": command, "tag": value}, width=1000) + rest, name)
    assert spec.load(path, run_dir="/runs/r x", start=False).data["command"] == argv


@pytest.mark.parametrize(("value", "needle"), [
    ("[a, b]", "command: found '--tag=${tag}'; expected a value that is one argument (a string or a number), not a "
               "list"),
    ("{a: 1}", "not a mapping"),
    ("[a, [b]]", "not a list"),  # a list of lists: its items are no arguments either
    ("\"a\\nb\"", "command[2]: found '--tag=a\\nb'; expected an argument without control characters"),
])
def test_a_value_that_is_not_one_argument_is_one_line(tmp_path: Path, value: str, needle: str) -> None:
    path = write(tmp_path, SEED.replace("python train.py --config ${program_config}", "python t.py --tag=${tag}")
                 + f"tag: {value}\n")
    [line] = problems(path)
    assert needle in line, line


@pytest.mark.parametrize(("command", "needle"), [
    ("python \"train.py", "a command line with balanced quotes. hint: no closing quotation"),
    ("''", "expected the command every rank runs"),
    ("[]", "expected the command every rank runs"),
    ("[python, 0.5]", "command[1]: found 0.5; expected a string. hint: quote it"),
    ("[python, [a]]", "command[1]: found ['a']; expected a string"),
    ("\"python\\nx.py\"", "expected a command on one line"),
    ("{a: b}", "command: found {'a': 'b'}; expected a string or a list or null"),
])
def test_bad_commands(tmp_path: Path, command: str, needle: str) -> None:
    path = write(tmp_path, SEED.replace("python train.py --config ${program_config}", command))
    [line] = problems(path)
    assert line.startswith(f"{path}:1: command") and needle in line, line


def test_program_mode_leaves_the_trainer_and_loaders_to_the_program(tmp_path: Path) -> None:
    text = """\
command: [python, train.py]
num_device: 2
trainer:
  accelerator: cpu
  strategy: auto
  precision: 16-mixed
  logger:
  - _target_: lightning.pytorch.loggers.TensorBoardLogger
    name: ${self_name:}
    save_dir: ${run_dir}/tb
  callbacks: ${callbacks}
  gradient_clip_val: ${oc.select:clip,1.0}
dataloader:
  collate_fn: {_target_: my.collate}
  train: {iter_factory: {_target_: my.Factory, batch_bins: 100}}
  test: {total_shards: 4}
"""
    cfg = spec.load(write(tmp_path, text))
    tr = cfg.data["trainer"]
    assert (tr["devices"], tr["num_nodes"], tr["strategy"], tr["precision"]) == (2, 1, "auto", "16-mixed")
    assert tr["logger"][0] == {"_target_": "lightning.pytorch.loggers.TensorBoardLogger", "name": "${self_name:}",
                               "save_dir": "${run_dir}/tb"}
    assert (tr["callbacks"], tr["gradient_clip_val"]) == ("${callbacks}", "${oc.select:clip,1.0}")  # left as text
    assert (tr["max_steps"], tr["max_epochs"], tr["accumulate_grad_batches"]) == (-1, None, 1)
    dl = cfg.data["dataloader"]
    assert dl["collate_fn"] == {"_target_": "my.collate"} and dl["train"]["iter_factory"]["batch_bins"] == 100
    assert dl["test"] == {"total_shards": 4}  # checked against the world (2), no dist_world_size invented
    assert (dl["train"]["total_shards"], dl["train"]["dist_world_size"]) == (None, None)
    assert (cfg.local_batch, cfg.accumulate, cfg.global_batch) == (None, None, None)
    bad = problems(write(tmp_path, text.replace("test: {total_shards: 4}", "test: {total_shards: 3}"), "b.yaml"))
    assert len(bad) == 1 and ": dataloader.test.total_shards: found 3; expected a multiple of" in bad[0]


def test_program_hash_covers_the_command_and_the_programs_keys_not_the_layout(tmp_path: Path) -> None:
    text = ("command: python train.py\nnum_device: 2\nlr: 0.1\nrunner: {seed: 1}\nseed: 5\n"
            "dataloader: {train: {total_shards: 4}, valid: {total_shards: 4}}\n")
    path = write(tmp_path, text)
    h = spec.load(path).hash()
    assert spec.load(path, ["num_device=4"]).hash() == h
    assert spec.load(path, ["runner.scheduler=slurm"]).hash() == h
    assert spec.load(path, ["lr=0.2"]).hash() != h
    assert spec.load(path, ["seed=6"]).hash() != h  # the program's seed
    assert spec.load(path, ["command=python other.py"]).hash() != h
    assert spec.load(path, ["trainer.gradient_clip_val=1.0"]).hash() != h


def test_a_resolved_program_config_reads_back_as_itself(tmp_path: Path) -> None:
    """A run directory's config.yaml (resolved, the program's keys under program:) loads to the same config."""
    cfg = spec.load(write(tmp_path, SEED + BLOCK), run_dir="/runs/r")
    stored = write(tmp_path, spec.dump(cfg.data), "config.yaml")
    again = spec.load(stored, files=False)
    assert again.data == cfg.data and again.hash() == cfg.hash()


def test_beside_a_runner_block_a_programs_model_is_its_own(tmp_path: Path) -> None:
    """ESPnet3's top-level model: is its model's config: with runner's settings in a block, it is the program's."""
    model = "model:\n  encoder: conformer\n  vocab_size: 5000\n"
    cfg = spec.load(write(tmp_path, SEED + BLOCK + model))
    assert cfg.program_mode and cfg.data["program"]["model"] == {"encoder": "conformer", "vocab_size": 5000}
    assert "model" not in cfg.data and not cfg.notes


def test_runner_block_in_own_mode_gives_the_flat_files_config(tmp_path: Path) -> None:
    flat = yaml.safe_load((REPO / "conf" / "quickstart.yaml").read_text())
    shared = ("num_nodes", "num_device", "trainer", "dataloader")
    nested = {**{k: flat[k] for k in shared}, "runner": {k: v for k, v in flat.items() if k not in shared},
              "seed": "the program's", "slurm": {"time": "9:00:00"}}
    cfg = spec.load(write(tmp_path, yaml.safe_dump(nested, sort_keys=False)))
    plain = spec.load(REPO / "conf" / "quickstart.yaml")
    assert cfg.hash() == plain.hash() and cfg.data["seed"] == plain.data["seed"] == 1234
    assert cfg.data["program"] == {"seed": "the program's", "slurm": {"time": "9:00:00"}}
    assert cfg.notes == ["slurm: at the top level it is your program's (this config has a runner: block); "
                         "runner reads runner.slurm"]


def test_a_programs_wrong_dist_world_size_gets_a_hint_the_program_can_read(tmp_path: Path) -> None:
    """ESPnet3 reads its config with OmegaConf, whose interpolations have no arithmetic: the hint is the number."""
    path = write(tmp_path, SEED.replace("    dist_world_size: 16\n", "    dist_world_size: 8\n", 1))
    [found] = [p for p in problems(path) if "dist_world_size" in p]
    assert "hint: set dist_world_size: 16" in found and "${" not in found, found
