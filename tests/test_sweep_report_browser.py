"""`runner report --sweep`'s page of a 3-point local sweep that trained, in headless Chromium (the browser tier; the
page's content from synthesized runs: tests/test_sweep_report.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from runner.host import sweep
from tests.ci import need
from tests.test_report import CHROMIUM_OWN, Recorder, chromium, open_in_chromium, run_cli, self_contained
from tests.test_sweep_report import SweepPage, cells

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "conf" / "quickstart.yaml"
LRS = ["0.003", "0.01", "0.03"]


def test_sweep_page_in_headless_chromium_shows_its_runs_and_links_their_pages(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Three quickstart points that differ in model.lr, trained one after another: Chromium renders one row per run
    with its value, state, steps and loss, fetching nothing, and each row's link opens that run's own page."""
    need(shutil.which("chromium") is not None, "chromium is not installed (scripts/install-chromium.sh, as root)")
    root = tmp_path / "runs"
    out = subprocess.run([sys.executable, "-m", "runner", "sweep", str(QUICKSTART), f"model.lr={','.join(LRS)}",
                          "trainer.max_steps=10", "checkpoint.every_n_steps=5", f"run_root={root}"],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    folder = sweep.SweepDir(next((root / "sweeps").iterdir()))
    runs = folder.runs()
    assert sorted(runs) == [0, 1, 2]

    code, printed, err = run_cli(capsys, "report", "--sweep", folder.id, "--root", str(root))
    assert code == 0, err
    page = Path(printed.strip())
    assert page == folder.report_page
    self_contained(page.read_text())
    dom, shot, fetched = open_in_chromium(page, tmp_path, "report-sweep.png")
    assert fetched == [], f"the page fetched: {fetched}"
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rendered = SweepPage(dom)
    assert [(r["run"], r["state"]) for r in rendered.rows] == [(runs[i].name, "completed") for i in range(3)]
    shown = [cells(rendered, i) for i in range(3)]
    assert [c["model.lr"] for c in shown] == LRS
    assert [c["steps"] for c in shown] == ["10"] * 3
    losses = [float(c["last loss"]) for c in shown]  # taken at the last step: no "(step N)" beside it
    assert len(set(losses)) == 3, f"each learning rate trained its own model: {losses}"

    recorder = Recorder()
    try:
        for i, row in enumerate(rendered.rows):
            target = urllib.parse.urljoin(page.resolve().as_uri(), str(row["href"]))  # as the browser resolves it
            opened = Path(urllib.request.url2pathname(urllib.parse.urlparse(target).path))
            assert opened == runs[i].report_page, (row["href"], opened)
            run_dom = chromium(opened, recorder.port, tmp_path, "--dump-dom")
            assert f"<title>runner report: {runs[i].name}</title>" in run_dom
            assert 'id="headline-state">completed<' in run_dom and 'id="headline-last-step">10<' in run_dom
    finally:
        recorder.close()
    assert [r for r in recorder.seen if not CHROMIUM_OWN.match(r)] == [], "a run's page fetched"
