"""`runner resume RUN num_nodes=N num_device=M` for a program: what runner writes into the program's own config,
and what it refuses (table tests on a run directory's files; no process starts). The end-to-end run is in
tests/test_espnet3.py (ESPnet3 stopped on 2 ranks, resumed on 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from runner import spec
from runner.errors import SubmitError
from runner.host.submit import _program_layout
from runner.rundir import RunDir

pytestmark = pytest.mark.unit

ESPNET3 = {  # the shape of ESPnet3's training.yaml, as runner stores it in program/ (uninterpolated)
    "num_nodes": 2, "num_device": 2, "command": "python run.py --training_config PROGRAM",
    "trainer": {"devices": "${num_device}", "num_nodes": "${num_nodes}", "accumulate_grad_batches": 1},
    "dataloader": {"train": {"total_shards": 4, "dist_world_size": 4}, "valid": {"batch_size": 2}},
}


def layout(tmp_path: Path, doc: Any, overrides: list[str], *, world: int = 4,
           command: str = "python run.py --training_config PROGRAM") -> tuple[tuple[int, int], dict[str, Any]]:
    run = RunDir(tmp_path / "run")
    path = run.program_config("training.yaml")
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump(doc).replace("PROGRAM", str(path)))
    before = spec.from_dict({"command": command.replace("PROGRAM", str(path)).split(), "num_nodes": 2,
                             "num_device": 2}, run.config)
    layout = _program_layout(run, before, overrides, world)
    return layout.accumulate, layout.config


def with_(**changes: Any) -> dict[str, Any]:
    doc = yaml.safe_load(yaml.safe_dump(ESPNET3))
    for key, value in changes.items():
        *parents, last = key.split("__")
        node = doc
        for p in parents:
            node = node[p]
        node[last] = value
    return doc


WRITTEN = [
    # (program's config, overrides, new world, (accumulate before, after), expected keys in the new config)
    (ESPNET3, ["num_nodes=1"], 2, (1, 2),
     {"num_nodes": 1, "num_device": 2, "trainer": {"devices": "${num_device}", "num_nodes": "${num_nodes}",
                                                   "accumulate_grad_batches": 2},
      "dataloader": {"train": {"total_shards": 4, "dist_world_size": 2}, "valid": {"batch_size": 2}}}),
    (with_(trainer__accumulate_grad_batches=2), ["num_nodes=1", "num_device=1"], 1, (2, 8),
     {"num_nodes": 1, "num_device": 1}),
    (with_(trainer__devices=2, trainer__num_nodes=2), ["num_device=4", "num_nodes=1"], 4, (1, 1),
     {"trainer": {"devices": 4, "num_nodes": 1, "accumulate_grad_batches": 1}}),
    (with_(trainer={"max_epochs": 3}), ["num_nodes=1"], 2, (1, 2),  # Lightning's default accumulation, 1, written
     {"trainer": {"max_epochs": 3, "accumulate_grad_batches": 2}}),
]


@pytest.mark.parametrize(("doc", "overrides", "world", "acc", "expected"), WRITTEN)
def test_the_layout_is_written_where_the_program_reads_it(tmp_path: Path, doc: dict, overrides: list[str],
                                                          world: int, acc: tuple[int, int], expected: dict) -> None:
    got_acc, new = layout(tmp_path, doc, overrides, world=world)
    assert got_acc == acc
    for key, value in expected.items():
        assert new[key] == value, key


REFUSED = [
    # (program's config, command, new world, words of the one-line refusal)
    (ESPNET3, "python train.py --devices 2", 2, "does not read ${program_config}"),
    (with_(command="python run.py --config PROGRAM --devices ${num_device}"), None, 2,
     "found num_nodes or num_device in the command line"),
    (with_(trainer__accumulate_grad_batches="${acc}"), None, 2, "found trainer.accumulate_grad_batches='${acc}'"),
    (with_(trainer=None), None, 2, "found no trainer: mapping"),
    (["a", "list"], None, 2, "found no trainer: mapping"),
    (ESPNET3, None, 3, "found 3 ranks for 4 rank-batches per optimizer step"),
]


@pytest.mark.parametrize(("doc", "command", "world", "words"), REFUSED)
def test_what_cannot_keep_the_global_batch_is_refused_in_one_line(tmp_path: Path, doc: Any, command: str | None,
                                                                  world: int, words: str) -> None:
    with pytest.raises(SubmitError) as e:
        layout(tmp_path, doc, ["num_device=1"], world=world,
               **({"command": command} if command else {}))
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
