"""The run's one-file records (runner/records.py): one writer and one reader each, through RunDir; whatever a file
holds comes back as the type or as None, never as an exception."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from runner import records
from runner.rundir import RunDir

pytestmark = pytest.mark.unit

RUNNER = Path(__file__).resolve().parents[1] / "runner"


@pytest.mark.parametrize(("raw", "read"), [
    # as the exit hook writes it
    ({"exit_code": 1, "job_id": "7", "attempt": 2, "signal": None, "event": "failed", "time": 5.0},
     {"exit_code": 1, "job_id": "7", "attempt": 2, "signal": None, "event": "failed", "time": 5.0}),
    # as the local driver writes it
    ({"exit_code": 75, "codes": [75, 75], "event": "preempted", "attempt": 1, "time": 3},
     {"exit_code": 75, "codes": [75, 75], "event": "preempted", "attempt": 1, "time": 3.0}),
    # a local cancel of a run none of whose processes lived: no code, the user's word
    ({"cancelled": True, "time": 9.5}, {"exit_code": None, "cancelled": True, "time": 9.5}),
    # older and hand-made shapes: what cannot be read as its type is dropped
    ({"exit_code": 1, "job_id": "100", "event": "failed"}, {"exit_code": 1, "job_id": "100", "event": "failed",
                                                           "time": 0.0}),
    ({"exit_code": 0, "time": float("nan"), "attempt": True, "codes": [0, "1"], "job_id": 5},
     {"exit_code": 0, "time": 0.0}),
    ({"exit_code": True}, None),  # a bool is no exit code
    ({"exit_code": "1"}, None),
    ({"cancelled": "yes"}, None),
    ({}, None), ([], None), (None, None), ("exit", None), (1, None),
])
def test_an_exit_status_reads_back_as_its_type(raw: Any, read: Any) -> None:
    assert records.exit_status(raw) == read


def test_the_run_directory_writes_and_reads_it(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert run.exit_status_record() is None
    run.write_exit_status({"exit_code": 3, "event": "failed", "time": 1.0})
    assert run.exit_status_record() == {"exit_code": 3, "event": "failed", "time": 1.0}
    run.exit_status.write_text('{"exit_code": 3, "ev')  # torn by a full disk or a crash
    assert run.exit_status_record() is None
    run.exit_status.write_text(json.dumps([{"exit_code": 3}]))
    assert run.exit_status_record() is None


def test_only_the_records_and_the_run_directory_name_the_file() -> None:
    named = [str(p.relative_to(RUNNER)) for p in sorted(RUNNER.rglob("*.py"))
             if re.search(r"""["']exit_status\.json["']""", p.read_text())]
    assert named == ["rundir.py"]
    writers = [f"{p.relative_to(RUNNER)}: {line.strip()}" for p in sorted(RUNNER.rglob("*.py")) if p.name != "rundir.py"
               for line in p.read_text().splitlines() if re.search(r"(write_text|atomic_write)\(.*exit_status\b", line)]
    assert writers == [], "exit_status.json is written through RunDir.write_exit_status"
