"""`runner report --sweep`: the page comparing a sweep's runs, from run directories that runner's own writers wrote
(the sweep planned and written by `runner.host.sweep`, the runs' records as the job writes them; nothing trained). In
headless Chromium, of a sweep that trained: tests/test_sweep_report_browser.py; bad input:
tests/test_sweep_report_unit.py.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.parse
from html.parser import HTMLParser
from pathlib import Path

import markupsafe
import pytest

import runner
from runner.host import sweep
from runner.rundir import RunDir, atomic_write
from tests.test_report import run_cli, self_contained

pytestmark = pytest.mark.local

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "conf" / "quickstart.yaml"
HOSTILE = ["<script>alert(1)</script>", "a&b 'q' <!-- \"x\""]  # two values of a varied key, as the user typed them
SECRET = "https://hooks.example.com/services/T0/B0/sweepsecret"


class SweepPage(HTMLParser):
    """The rows of the sweep's table as a reader sees them: each cell's text (entities decoded), each row's link."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.heads: list[str] = []
        self.rows: list[dict[str, object]] = []
        self._cell: list[str] | None = None
        self._in_th = False
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "tr" and a.get("class") == "point":
            self.rows.append({"index": a["data-index"], "run": a["data-run"], "state": a["data-state"], "cells": [],
                              "href": None})
        if tag in ("td", "th"):
            self._cell = []
            self._in_th = tag == "th"
        if tag == "a" and self.rows:
            self.rows[-1]["href"] = a["href"]

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            text = "".join(self._cell)
            if self._in_th:
                self.heads.append(text)
            elif self.rows:
                self.rows[-1]["cells"].append(text)  # type: ignore[attr-defined]
            self._cell = None


def cells(page: SweepPage, row: int) -> dict[str, str]:
    """A row's cells by their column's heading."""
    return dict(zip(page.heads, page.rows[row]["cells"], strict=True))  # type: ignore[arg-type]


def trained(rd: RunDir, steps: int, loss: float, outcome: str = "completed", cause: str | None = None) -> None:
    """What a local run's driver and rank 0 leave: the attempt, its progress with its loss, its end."""
    rd.record("submitted", scheduler="local", world_size=2)
    attempt = rd.new_attempt()
    rd.record("train_start", step=0, lost_steps=0, attempt=attempt, resumed_from=None)
    atomic_write(rd.progress, json.dumps({"step": steps, "time": time.time(), "attempt": attempt, "loss": loss}) + "\n")
    if outcome == "completed":
        atomic_write(rd.finished, json.dumps({"step": steps, "time": time.time(), "productive_s": 0.01}) + "\n")
        rd.record("finished", step=steps)
        rd.record("exit", exit_code=0, outcome="completed", attempt=attempt)
    else:
        rd.write_exit_status({"exit_code": 1, "attempt": attempt, "event": outcome, "time": time.time()})
        rd.record("exit", exit_code=1, outcome=outcome, attempt=attempt, cause=cause)


def test_the_page_compares_every_point_with_its_values_state_loss_and_link(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Four points (hostile values of a varied key, hostile run names): a completed run with the lowest loss, a failed
    one whose cause quotes the webhook URL, one pending, one whose run directory was never written. Each row says its
    values as typed, its state, loss and steps, and links to its run's own page (written by the same command)."""
    monkeypatch.setenv("RUNNER_WEBHOOK_URL", SECRET)
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "runs"
    sp = sweep.write(sweep.plan(QUICKSTART, [f"env.NOTE={HOSTILE[0]},{HOSTILE[1]}", "model.lr=0.01,0.1",
                                             f"run_root={root}"]))
    runs = [p.run for p in sp.plans]
    assert len(runs) == 4
    names = ['a<b>"c"&d #1?x=%41', "run'<i>x &amp; y", "plain"]
    moved = [RunDir(r.root.rename(r.root.with_name(n))) for r, n in zip(runs, names, strict=False)]
    trained(moved[0], 20, 0.25)
    trained(moved[1], 13, 0.5, "failed", f"rank 1 died: posting to {SECRET} refused")
    trained(moved[2], 20, 0.75)
    shutil.rmtree(runs[3].root)  # its driver died before it wrote this one

    code, out, err = run_cli(capsys, "report", "--sweep", sp.id, "--root", str(root))
    assert code == 0, err
    path = Path(out.strip())
    assert path == sp.sweep.report_page
    text = path.read_text()
    self_contained(text)
    assert SECRET not in text and "sweepsecret" not in text
    for raw in HOSTILE:
        assert raw not in text, "a value lands escaped, never as markup"
    assert "<script" not in text

    page = SweepPage(text)
    assert page.heads[:4] == ["point", "run", "env.NOTE", "model.lr"]
    assert [r["state"] for r in page.rows] == ["completed", "failed", "completed", "not written"]
    got = [cells(page, i) for i in range(4)]
    typed = HOSTILE
    assert [(c["env.NOTE"], c["model.lr"]) for c in got] == [(typed[0], "0.01"), (typed[0], "0.1"),
                                                              (typed[1], "0.01"), (typed[1], "0.1")]
    assert [c["run"] for c in got] == [m.name for m in moved] + ["-"]
    assert [c["steps"] for c in got] == ["20", "13", "20", "-"]
    assert [c["last loss"] for c in got] == ["0.25", "0.5", "0.75", "-"]
    assert "<strong>0.25</strong>" in text, "the lowest loss of the completed runs stands out"
    assert got[1]["last outcome"].startswith("failed: rank 1 died: posting to ")
    # each link leads to that run's own page, written by the same command
    for row, run in zip(page.rows[:3], moved, strict=True):
        href = str(row["href"])
        target = Path(urllib.parse.unquote(urllib.parse.urljoin(path.as_uri(), href).removeprefix("file://")))
        assert target == run.report_page and target.is_file(), (href, target)
        assert f"<title>runner report: {markupsafe.escape(run.name)}</title>" in target.read_text()
    assert page.rows[3]["href"] is None

    # the Python API writes the same page
    assert runner.find_sweep(sp.id, root).report() == path
