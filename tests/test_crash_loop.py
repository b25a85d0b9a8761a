"""A crash loop: the same exception at the same step in two attempts in a row stops the resubmissions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runner import policy
from runner.rundir import RunDir

BOOM = {"type": "RuntimeError", "frame": "model.py:40 in training_step", "step": 120, "message": "boom"}


def _exit(crash: dict[str, Any] | None, outcome: str = "failed") -> dict[str, Any]:
    return {"event": "exit", "outcome": outcome, "crash": crash}


SUB = {"event": "submitted"}
CRON = {"event": "resubmitted", "by": "cron"}
USER = {"event": "resubmitted", "by": "user"}
LOOPS = [
    # (ledger, a crash loop?)
    ([SUB, _exit(BOOM), CRON, _exit(BOOM)], True),
    ([SUB, _exit(BOOM), CRON, _exit({**BOOM, "message": "boom at 0x7f3a"})], True),  # the message may differ
    ([SUB, _exit(BOOM), CRON, _exit({**BOOM, "step": 121})], False),  # got further: not a loop
    ([SUB, _exit(BOOM), CRON, _exit({**BOOM, "frame": "data.py:9 in __getitem__"})], False),
    ([SUB, _exit(BOOM), CRON, _exit({**BOOM, "type": "ValueError"})], False),
    ([SUB, _exit(BOOM)], False),  # once is bad luck
    ([SUB, _exit(BOOM), USER, _exit(BOOM)], False),  # the user resumed after the first: give it its chance
    ([SUB, _exit(BOOM), CRON, _exit(BOOM), USER], False),  # a resume lifts the stop
    ([SUB, _exit(BOOM), CRON, _exit(BOOM, "preempted"), CRON, _exit(BOOM)], True),  # a preemption between
    ([SUB, _exit(None), CRON, _exit(None)], False),  # no crash record (killed, OOM): not a loop by this rule
    ([SUB, _exit({"type": "RuntimeError", "frame": None, "step": None}), CRON,
      _exit({"type": "RuntimeError", "frame": None, "step": None})], False),  # no step known: cannot tell
]


@pytest.mark.parametrize(("events", "loop"), LOOPS)
def test_crash_loop_table(events: list[dict[str, Any]], loop: bool) -> None:
    assert (policy.crash_loop(events) is not None) == loop


def test_the_launcher_records_the_raising_line_and_the_earliest_crash_wins(tmp_path: Path) -> None:
    from runner.job.guards import record_crash

    rd = RunDir(tmp_path)

    def training_step() -> None:
        raise RuntimeError("injected fault at step 7")

    try:
        training_step()
    except RuntimeError as e:
        first = record_crash(rd, 1, 2, 7, e)
    try:
        raise ConnectionError("peer closed")
    except ConnectionError as e:
        record_crash(rd, 1, 0, 7, e)
    assert first["frame"].endswith(f"{Path(__file__).name}:{training_step.__code__.co_firstlineno + 1} in "
                                   "training_step")
    assert rd.first_crash(1)["type"] == "RuntimeError"  # the other rank's error is its echo
    assert rd.first_crash(2) is None
