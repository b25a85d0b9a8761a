"""The Python API in-process: the package's names, the file system's refusal as the CLI's one-line error, the ledger
as typed records (processes: tests/test_api_local.py)."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

import runner
from runner import api
from runner.errors import InputError, RunnerError, refused_by_filesystem

pytestmark = pytest.mark.unit


def test_every_name_the_package_exports_is_there_and_others_are_not() -> None:
    for name in runner.__all__:
        assert getattr(runner, name) is not None, name
    assert runner.submit is api.submit and runner.Run is api.Run
    with pytest.raises(AttributeError, match="no attribute 'submitt'"):
        runner.submitt  # noqa: B018


@pytest.mark.parametrize(("code", "refused"), [(errno.EROFS, True), (errno.EACCES, True), (errno.ENOSPC, True),
                                               (errno.ENOENT, False), (errno.EIO, False)])
def test_the_file_systems_refusal_is_the_users_to_fix(code: int, refused: bool) -> None:
    e = OSError(code, "Read-only file system", "/runs/x")
    got = refused_by_filesystem(e)
    assert (got is not None) == refused
    if got is not None:
        assert isinstance(got, InputError) and got.exit_code == 2
        assert str(got) == ("/runs/x: cannot write it: read-only file system; expected a path this user can write. "
                            "hint: check its owner and mode, the mount, and the free space")


def test_the_api_raises_the_refusal_as_that_error_and_any_other_oserror_as_it_is() -> None:
    with pytest.raises(InputError, match="/r: cannot write it"), api._said():
        raise PermissionError(errno.EACCES, "Permission denied", "/r")
    with pytest.raises(FileNotFoundError), api._said():
        raise FileNotFoundError(errno.ENOENT, "No such file", "/r")
    with pytest.raises(RunnerError, match="one line"), api._said():
        raise RunnerError("one line")


def test_events_are_the_ledger_as_typed_records(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("name: x\n")
    lines = [{"event": "submitted", "time": 1.0, "scheduler": "local", "world_size": 2},
             {"event": "from_a_newer_runner", "time": 2.0},
             {"event": "finished", "time": 3.0, "step": 6}]
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    events = api.Run(tmp_path).events()
    assert [(e.event, e.time) for e in events] == [("submitted", 1.0), ("finished", 3.0)]
    assert events[0].fields == {"scheduler": "local", "world_size": 2} and events[1].fields == {"step": 6}
