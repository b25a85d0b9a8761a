"""``runner.progress`` in-process: a no-op outside a run, cheap to import, its loss check as a table, and
``automatic`` stepping aside once ``progress`` was called (the runs themselves: tests/test_progress_local.py)."""

from __future__ import annotations

import ast
import math
import sys
from pathlib import Path
from typing import Any

import pytest

import runner
from runner import steps

pytestmark = pytest.mark.unit


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steps, "_run", None)
    monkeypatch.setattr(steps, "_manual", False)


def test_the_package_exposes_progress_and_its_module_imports_the_standard_library_alone() -> None:
    assert runner.progress is steps.progress
    tree = ast.parse(Path(steps.__file__).read_text())
    top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {str(n.module).split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert top <= set(sys.stdlib_module_names) | {"__future__"}, top


def test_outside_a_run_every_call_is_a_no_op(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUNNER_PROGRAM_RUN_DIR", raising=False)
    steps.progress(1, loss=float("nan"))  # no run: not even a NaN stops anything
    steps.automatic(2)
    assert steps._run is False


class Seen:
    """A rank's side with its parts replaced by what they were asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def step(self, step: int, loss: float | None) -> None:
        self.calls.append(("step", (step, loss)))


def test_automatic_steps_aside_once_progress_was_called(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = Seen()
    monkeypatch.setattr(steps, "_run", seen)
    steps.automatic(1)
    steps.progress(2, loss=0.5)
    steps.automatic(3)  # the program's own call wins from here on
    steps.progress(3, loss=0.4)
    assert seen.calls == [("step", (1, None)), ("step", (2, 0.5)), ("step", (3, 0.4))]


@pytest.mark.parametrize("loss, stops", [
    (0.0, False), (1.5, False), (-1e-300, False), (1e308, False), (None, False),
    (math.nan, True), (math.inf, True), (-math.inf, True),
])
def test_the_loss_check_stops_on_nan_and_inf_only(loss: float | None, stops: bool) -> None:
    run = steps._Run.__new__(steps._Run)
    stopped: list[int] = []
    run.wd, run.rank, run.next_progress = None, 1, 0.0
    run.nonfinite = lambda step, value: stopped.append(step)  # type: ignore[method-assign]
    run.step(7, loss)
    assert stopped == ([7] if stops else [])


@pytest.mark.parametrize("rank, first, last, seconds, expected", [
    (0, 1, 21, 10.0, (21, 10.5)),  # numbered from 1: 20 intervals of 0.5 s, the first step priced too
    (0, 100, 110, 5.0, (110, 55.0)),  # resumed from its own snapshot at step 100: the kept steps priced alike
    (0, 3, 3, 0.0, (3, None)),  # one step: no mean step time
    (1, 1, 21, 10.0, (None, None)),  # rank 0 says the step
], ids=["fresh", "resumed", "one-step", "rank-1"])
def test_what_a_program_showed_runner_prices_its_steps_at_their_mean(
        fresh: None, monkeypatch: pytest.MonkeyPatch, rank: int, first: int, last: int, seconds: float,
        expected: tuple[int | None, float | None]) -> None:
    assert steps.seen() is None  # no call yet
    monkeypatch.setattr(steps, "_run", False)
    assert steps.seen() is None  # outside a run
    run = steps._Run.__new__(steps._Run)
    run.rank, run.first, run.first_at, run.last, run.last_at = rank, first, 100.0, (last, None), 100.0 + seconds
    monkeypatch.setattr(steps, "_run", run)
    assert steps.seen() == expected
