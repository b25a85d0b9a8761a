"""A recipe's stages as runs (issue 40): the stage a program's command names, and `runner status` grouping a
recipe's stage runs under one line. Tables; no run starts."""

from __future__ import annotations

from typing import Any

import pytest

from runner.host import status, submit

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("command", "stage"), [
    (["python", "run.py", "--stages", "train", "--training_config", "c.yaml"], "train"),
    (["python", "run.py", "--stages", "infer", "measure", "--inference_config", "i.yaml"], "infer measure"),
    (["python", "run.py", "--training_config", "c.yaml", "--stages", "collect_stats"], "collect_stats"),
    (["python", "run.py", "--stages", "--x"], None),  # names none
    (["python", "train.py", "--config", "c.yaml"], None),  # a plain script
    (None, None),  # runner's own training
])
def test_the_stage_is_what_the_command_runs(command: Any, stage: str | None) -> None:
    assert submit.stage(command) == stage


def row(run: str, state: str, age: float, stage: str | None = None, recipe: str = "/r/mini_an4") -> dict[str, Any]:
    out: dict[str, Any] = {"run": run, "state": state, "job_id": None, "last_checkpoint_step": None, "restarts": 0,
                           "lost_steps": [], "goodput": 1.0, "last_outcome": None, "age_s": age}
    return {**out, "stage": stage, "recipe": recipe} if stage else out


def test_status_groups_a_recipes_stages_oldest_first_under_one_line() -> None:
    rows = [row("plain-1", "completed", 50.0), row("a-3", "running", 10.0, "train"),
            row("a-1", "completed", 300.0, "create_dataset"), row("b-1", "failed", 20.0, "infer", "/r/other"),
            row("a-2", "completed", 200.0, "train_tokenizer collect_stats")]
    lines = status.stages_table(rows).split("\n")
    assert lines[0].startswith("RUN")
    assert lines[1].startswith("plain-1")  # a run of no recipe keeps its place
    assert lines[2] == "recipe /r/mini_an4: create_dataset completed, train_tokenizer collect_stats completed, " \
                       "train running"
    assert [line.split()[:2] for line in lines[3:6]] == [["a-1", "[create_dataset]"],
                                                         ["a-2", "[train_tokenizer"], ["a-3", "[train]"]]
    assert lines[6] == "recipe /r/other: infer failed" and lines[7].split()[:2] == ["b-1", "[infer]"]
    assert len(lines) == 8


def test_without_stages_the_table_is_the_plain_one() -> None:
    rows = [row("x", "completed", 1.0), row("y", "failed", 2.0)]
    assert status.stages_table(rows) == status.table(rows)
