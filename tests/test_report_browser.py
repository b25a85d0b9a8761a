"""`runner report`'s page of a fault run in headless Chromium (the browser tier; the rest: tests/test_report.py)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests import report_runs
from tests.ci import need
from tests.test_report import Page, open_in_chromium, run_cli, self_contained, status_json

pytestmark = pytest.mark.browser


def test_fault_run_page_in_headless_chromium(tmp_path: Path, webhook: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """A run with a preemption, a killed rank, a hang and a skipped NaN (synthesized from runner's own writers):
    Chromium renders every attempt with its cause, the lost steps and status's goodput, fetching nothing."""
    need(shutil.which("chromium") is not None, "chromium is not installed (scripts/install-chromium.sh, as root)")
    rd = report_runs.fault_run(tmp_path / "runs", webhook_url=webhook.url)
    code, out, _ = run_cli(capsys, "report", str(rd.root))
    assert code == 0
    page = Path(out.strip())
    dom, shot, fetched = open_in_chromium(page, tmp_path, "report-fault-run.png")
    assert fetched == [], f"the page fetched: {fetched}"
    assert shot.stat().st_size > 20_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rendered = Page(dom)
    assert [a["outcome"] for a in rendered.attempts] == ["preempted", "failed", "hang", "completed"]
    cells = [a["cells"] for a in rendered.attempts]
    assert "task 3: Killed" in cells[1]
    assert "hang: 3 of 4 ranks in collective; rank 2 on n2 (in data)" in cells[2]
    assert "non-finite loss nan at step 93: skipped" in cells[3] and "n2 (hang)" in cells[3]
    assert [a["lost"] for a in rendered.attempts] == ["0", "0", "7", "5"]
    assert "40 → 67" in cells[1] and "60 → 85" in cells[2] and "80 → 100" in cells[3]
    assert rendered.goodput == str(status_json(rd)["goodput"])
    assert 'id="headline-steps-lost">12<' in dom
    assert "preempted" in dom and "alerts" in dom
    assert {"preempted", "failed", "hang", "resubmitted", "completed"} <= {
        m.group(1) for m in re.finditer(r"<td>sent</td><td>(\w+)</td>", dom)}, "the alerts that were sent"
    assert webhook.url not in dom
    self_contained(page.read_text())
