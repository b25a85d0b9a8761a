"""The ledger's names and shapes (runner.ledger): every writer uses a known event with its fields, and a reader of an
older run directory still reads its lines."""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import pytest

from runner import ledger
from runner.rundir import RunDir

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


def test_every_event_name_has_its_fields() -> None:
    assert set(ledger.EVENT_FIELDS) == set(ledger.EVENT_NAMES)
    assert len(ledger.EVENT_NAMES) == len(set(ledger.EVENT_NAMES))


def written_names() -> set[str]:
    """The event names runner's own code writes: ``record("name", ...)`` in Python, ``"event": "name"`` in bash."""
    found: set[str] = set()
    for path in (REPO / "runner").rglob("*.py"):
        for call in re.findall(r"\.record\(([^,)]*)", path.read_text()):  # "name", or "a" if ... else "b"
            found |= set(re.findall(r'"(\w+)"', call))
    found |= set(re.findall(r'"event": "(\w+)"', (REPO / "templates" / "sbatch.sh.j2").read_text()))
    return found


def test_every_name_written_is_a_ledger_event() -> None:
    names = written_names()
    assert "exit" in names and "hook_failed" in names
    assert names <= set(ledger.EVENT_NAMES), names - set(ledger.EVENT_NAMES)


def test_the_batch_scripts_hook_failed_line_has_the_fields_of_its_event() -> None:
    line = next(x for x in (REPO / "templates" / "sbatch.sh.j2").read_text().splitlines() if '"hook_failed"' in x)
    keys = set(re.findall(r'"(\w+)": ', line)) - {"event", "time"}
    assert keys == set(typing.get_type_hints(ledger.HookFailed))


def test_an_unknown_event_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    with pytest.raises(ledger.UnknownEvent, match="unknown ledger event 'exited'"):
        run.record("exited", exit_code=1)  # type: ignore[call-overload]
    assert run.events() == []


def test_an_exit_has_one_shape_and_older_lines_read_in_it(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    old = {"time": 1.0, "event": "exit", "outcome": "failed", "rc": 1, "items_done": 3, "items_failed": 1}
    run.ledger.write_text(json.dumps(old) + "\n")  # runner parallel before the one shape
    run.record("exit", outcome="completed", exit_code=0, attempt=2, items_done=4, items_failed=0)
    first, second = run.events()
    assert first["exit_code"] == 1 and "rc" not in first and first["outcome"] == "failed"
    assert second["exit_code"] == 0 and second["attempt"] == 2
    required = ledger.Exit.__required_keys__
    assert required == {"outcome", "exit_code", "attempt"}


def test_a_line_of_a_name_runner_no_longer_writes_is_still_read(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.ledger.write_text(json.dumps({"time": 1.0, "event": "something_old", "x": 1}) + "\n")
    assert [e["event"] for e in run.events()] == ["something_old"]


def read_names() -> set[str]:
    """The event names runner's code compares a ledger line's ``event`` with (``e["event"] == "exit"``, ``in (...)``),
    and the names of goodput's and policy's own tuples of them."""
    found: set[str] = set()
    for path in (REPO / "runner").rglob("*.py"):
        text = path.read_text()
        for group in re.findall(r'\["event"\] (?:==|!=|in|not in) (\([^)]*\)|"\w+")', text):
            found |= set(re.findall(r'"(\w+)"', group))
        found |= set(re.findall(r'"(\w+)" in _names\(', text))
    return found


def test_every_name_a_reader_asks_for_is_a_ledger_event() -> None:
    """A typo in a reader (``e["event"] == "exited"``) would never match: a decision that silently never happens."""
    from runner import goodput

    names = read_names() | set(goodput.OPENERS)
    assert {"exit", "start", "straggler_alert", "gave_up"} <= names
    assert names <= set(ledger.EVENT_NAMES), names - set(ledger.EVENT_NAMES)
