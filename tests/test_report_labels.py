"""How the report labels what runner could not see, as tables: a program that showed runner no step ("the program
ran", not startup; said once; no steps chart) against one that did (``runner.progress``) and runner's own mode, and
the steps axis's ticks (whole steps, each once). The pages themselves: tests/test_progress_local.py."""

from __future__ import annotations

from typing import Any

import pytest

from runner import goodput
from runner.host import report

pytestmark = pytest.mark.unit


def _ev(t: float, event: str, **fields: Any) -> dict[str, Any]:
    return {"time": t, "event": event, **fields}


# A local attempt submitted at 0: the launcher starts (runner's startup) until its preflight ends at 10 (2 s of
# preflight), then the program runs until it exits at 40.
START = [_ev(0, "submitted"), _ev(10, "preflight", status="pass", duration_s=2.0)]
PLAIN = [*START, _ev(40, "exit", outcome="completed", exit_code=0)]
STEPS = [*START, _ev(15, "train_start", step=1, lost_steps=0, attempt=1), _ev(40, "exit", outcome="completed",
                                                                                exit_code=0)]
NO_PREFLIGHT = [_ev(0, "submitted"), _ev(40, "exit", outcome="failed", exit_code=1)]
FAILED_PREFLIGHT = [_ev(0, "submitted"), _ev(10, "preflight", status="fail", duration_s=2.0),
                    _ev(11, "exit", outcome="preflight_failed", exit_code=77)]


@pytest.mark.parametrize("events, program, unseen, startup, ran, bars", [
    # runner sees no step of a program: runner's startup until the preflight's end, then "the program ran"
    (PLAIN, True, [1], 8.0, 30.0, ["startup", "program", "preflight"]),
    # the same program with runner.progress: its first step ends startup, the rest is training
    (STEPS, True, [], 13.0, 0.0, ["startup", "preflight", "train"]),
    # runner's own mode never reaching a step: all of it startup, as always
    (PLAIN, False, [], 38.0, 0.0, ["startup", "preflight"]),
    # a program without a preflight: it ran from the attempt's start
    (NO_PREFLIGHT, True, [1], 0.0, 40.0, ["startup", "program"]),
    # a failed preflight never started the program
    (FAILED_PREFLIGHT, True, [], 9.0, 0.0, ["startup", "preflight", "person"]),
], ids=["program-no-steps", "program-with-progress", "own-mode-no-step", "program-no-preflight",
        "program-preflight-failed"])
def test_time_runner_saw_no_step_of_is_the_program_ran_not_startup(events: list[dict[str, Any]], program: bool,
                                                                   unseen: list[int], startup: float, ran: float,
                                                                   bars: list[str]) -> None:
    runs = goodput.attempts(events)
    end = float(events[-1]["time"])
    g = goodput.account(runs, created=0.0, end=end, productive_s=None, kept_step=None, program=program)
    assert (g.losses["startup"], g.losses["the program ran"]) == (startup, ran)
    assert report.unseen(runs, program) == unseen
    kinds = [s.kind for s in report._timeline(runs, report._Scale(0.0, end), end, report.unseen(runs, program))]
    assert [k for k in kinds if k != "wait"] == bars


def test_the_attempts_table_says_the_program_ran_where_runner_saw_no_step() -> None:
    runs = goodput.attempts(PLAIN)
    rows = report._ran(report._rows(runs, PLAIN, {}, {}, 40.0, None), runs, [1], 40.0)
    assert (rows[0].startup, rows[0].trained) == ("8.0 s", "the program ran 30.0 s")
    seen = goodput.attempts(STEPS)
    rows = report._ran(report._rows(seen, STEPS, {}, {}, 40.0, None), seen, [], 40.0)
    assert (rows[0].startup, rows[0].trained) == ("13.0 s", "25.0 s")


@pytest.mark.parametrize("top, ticks", [
    (0, ["0", "1"]), (1, ["0", "1"]), (2, ["0", "1", "2"]), (4, ["0", "1", "2", "3", "4"]),
    (30, ["0", "8", "15", "22", "30"]), (1000, ["0", "250", "500", "750", "1000"]),
])
def test_the_steps_axis_has_whole_steps_each_once(top: int, ticks: list[str]) -> None:
    got = report.step_ticks(top, 240.0)
    assert [label for _, label in got] == ticks
    assert got[0][0] == 240.0 and got[-1][0] == 0.0  # from the bottom to the top of the chart
