"""`runner report --sweep`, the unit tier: its bad input (one line, exit 2) and the page of a sweep none of whose runs
was written (the page of written runs: tests/test_sweep_report.py; in Chromium: tests/test_sweep_report_browser.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_report import run_cli, self_contained
from tests.test_sweep_report import SweepPage, cells

pytestmark = pytest.mark.unit


def _sweep(root: Path, name: str, record: str) -> Path:
    folder = root / "sweeps" / name
    folder.mkdir(parents=True)
    (folder / "sweep.json").write_text(record)
    return folder


@pytest.mark.parametrize(("argv", "record", "said"), [
    (["--sweep", "nosuch"], None, "sweep 'nosuch': found no sweep under"),
    (["--sweep", "s1"], "garbage", "sweep.json: found no readable JSON (JSONDecodeError)"),
    (["--sweep", "s1"], '{"points": 3}', "sweep.json: found no list of points"),
    (["s1"], '["not", "a", "record"]', "sweep.json: found no list of points"),
    (["--sweep", "s1", "somerun"], '{"points": []}', "found a run beside it (somerun); expected one of them"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                          record: str | None, said: str) -> None:
    root = tmp_path / "runs"
    root.mkdir()
    if record is not None:
        _sweep(root, "s1", record)
    code, out, err = run_cli(capsys, "report", *argv, "--root", str(root))
    assert (code, out) == (2, "")
    assert len(err.strip().splitlines()) == 1 and said in err, err
    assert not (root / "sweeps" / "s1" / "report.html").exists()


def test_points_never_written_are_rows_that_say_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The sweep's driver died before it wrote any run: every point is still a row, with its values (a key with one
    value everywhere is said once above the table), and no link."""
    root = tmp_path / "runs"
    points = [{"model.lr": lr, "trainer.max_steps": "3", "model.hidden": h} for lr in ("0.01", "0.1") for h in ("8",)]
    points.append({"model.lr": "1", "trainer.max_steps": "3"})  # an explicit point without model.hidden
    folder = _sweep(root, "sweep-x", json.dumps({"id": "sweep-x", "config_file": "conf/q.yaml", "scheduler": "local",
                                                 "points": points, "created": 1.0e9}))
    code, out, err = run_cli(capsys, "report", str(folder))
    assert code == 0, err
    assert Path(out.strip()) == folder / "report.html"
    text = (folder / "report.html").read_text()
    self_contained(text)
    page = SweepPage(text)
    assert page.heads[2:4] == ["model.lr", "model.hidden"]
    assert [r["state"] for r in page.rows] == ["not written"] * 3
    assert [(cells(page, i)["model.lr"], cells(page, i)["model.hidden"]) for i in range(3)] == [
        ("0.01", "8"), ("0.1", "8"), ("1", "")]
    assert all(r["href"] is None for r in page.rows)
    assert "<code>trainer.max_steps=3</code>" in text
