"""`runner report`: the page of a run's whole life, its index, `cron --report`, and goodput with its losses.

The run directories are written by runner's own writers (tests/report_runs.py): the fault run is synthesized
from them, not trained. The browser test (tests/test_report_browser.py) opens the page in Debian's headless
Chromium (skipped on a laptop without it, failed under CI=true).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from runner import cli, goodput
from runner.host import cron, report, status
from runner.rundir import RunDir
from tests import report_runs

pytestmark = pytest.mark.local

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("RUNNER_TEST_ARTIFACTS", REPO / "test-artifacts"))
URL = re.compile(r"https?://", re.I)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def status_json(rd: RunDir) -> dict[str, Any]:
    """`runner status RUN --json` in its own process, as a user runs it."""
    out = subprocess.run([sys.executable, "-m", "runner", "status", str(rd.root), "--json"], capture_output=True,
                         text=True, check=True, cwd=REPO)
    rows = json.loads(out.stdout)
    assert len(rows) == 1
    return dict(rows[0])


class Page(HTMLParser):
    """The parts of a page the tests read: rows of the attempts table, the goodput, every URL-bearing attribute."""

    def __init__(self, text: str):
        super().__init__()
        self.attempts: list[dict[str, str]] = []
        self.goodput: str | None = None
        self.refs: list[str] = []
        self.tags: set[str] = set()
        self.csp = ""
        self.missing = False
        self._cell: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.tags.add(tag)
        self.refs += [v for k, v in a.items() if k in ("href", "src", "action", "data", "poster", "srcset")]
        if tag == "meta" and a.get("http-equiv", "").lower() == "content-security-policy":
            self.csp = a.get("content", "")
        if tag == "tr" and "attempt" in a.get("class", ""):
            self.attempts.append({"outcome": a["data-outcome"], "lost": a["data-lost"], "cells": ""})
            self._cell = []
        if tag == "strong" and a.get("id") == "goodput-value":
            self.goodput = a["data-goodput"]
        if tag == "section" and a.get("id") == "missing":
            self.missing = True

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr" and self._cell is not None:
            self.attempts[-1]["cells"] = " ".join(" ".join(self._cell).split())
            self._cell = None


def self_contained(text: str) -> None:
    """Nothing on the page can fetch: no URL at all, a policy that forbids every fetch, no script."""
    page = Page(text)
    assert not URL.search(text), URL.search(text)
    assert "default-src 'none'" in page.csp
    assert "script" not in page.tags and "link" not in page.tags and "iframe" not in page.tags
    assert not page.refs or all(r.endswith("report.html") and "/" in r and ":" not in r for r in page.refs)


# ---------------------------------------------------------------------------------------------------------------
# Unit tests on generated run directories


def test_clean_run_page_says_what_a_newcomer_needs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rd = report_runs.clean_run(tmp_path / "runs")
    code, out, _ = run_cli(capsys, "report", rd.name, "--root", str(tmp_path / "runs"))
    assert code == 0 and out.strip() == str(rd.root / "report.html")
    text = Path(out.strip()).read_text()
    page = Page(text)
    self_contained(text)
    assert not page.missing, "a clean run has every file"
    assert [a["outcome"] for a in page.attempts] == ["completed"]
    assert "0 → 60" in page.attempts[0]["cells"]
    row = status_json(rd)
    assert page.goodput == str(row["goodput"]) and row["goodput"] > 0
    assert "What goodput counts" in text and "productive training time over wall time since submission" in text


def test_report_never_imports_torch(tmp_path: Path) -> None:
    """The login-node path stays light: `runner report` and the index load neither torch, lightning nor numpy."""
    rd = report_runs.clean_run(tmp_path / "runs")
    code = ("import sys; from runner import cli; "
            f"assert cli.main(['report', {str(rd.root)!r}]) == 0; "
            f"assert cli.main(['report', '--root', {str(rd.root.parent)!r}]) == 0; "
            "print(sorted(m for m in ('torch', 'lightning', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_torn_ledger_line_renders_and_is_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rd = report_runs.clean_run(tmp_path / "runs")
    with open(rd.ledger, "a") as f:
        f.write('{"time": 17, "event": "exi')  # a crash mid-append
    assert run_cli(capsys, "report", str(rd.root))[0] == 0
    page = (rd.root / "report.html").read_text()
    assert Page(page).missing
    assert re.search(r"ledger.jsonl: 1 of \d+ lines are torn", page)
    assert [a["outcome"] for a in Page(page).attempts] == ["completed"], "the other lines still count"


@pytest.mark.parametrize(("gone", "said"), [
    ("progress.json", "progress.json is missing"),
    ("preflight.json", "preflight.json is missing"),
    ("heartbeats", "No rank timings: heartbeats/ holds none"),
    ("manifest.json", "manifest.json is missing"),
    ("ledger.jsonl", "ledger.jsonl is missing"),
    ("checkpoints", "checkpoints/ is missing"),
    ("config.yaml", "config.yaml is missing"),
])
def test_missing_file_renders_and_is_said(tmp_path: Path, gone: str, said: str) -> None:
    rd = report_runs.clean_run(tmp_path / "runs")
    target = rd.root / gone
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    text = report.render(report.collect(rd))
    assert said in text and (Page(text).missing or gone == "heartbeats")
    self_contained(text)


def test_hostile_text_is_escaped_and_webhook_urls_never_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "https://chat.example.org/hooks/T0KEN-abcdef123456"
    monkeypatch.setenv("RUNNER_WEBHOOK_URL", secret)
    rd = report_runs.clean_run(tmp_path / "runs")
    rd.record("resubmitted", scheduler="local")
    rd.record("exit", exit_code=1, outcome="failed", cause=f"<script>alert(1)</script> posting to {secret} and "
              "https://hooks.slack.com/services/T000/B000/XXXXXXXXXXXXXXXX failed", attempt=2)
    (rd.root / "heartbeats" / "rank-00000.json").write_text(json.dumps(
        {"rank": 0, "host": "<img src=x onerror=alert(1)>", "step": 1, "attempt": 1, "compute_s": 0.1,
         "data_s": 0.1}))
    text = report.render(report.collect(rd), report._secrets(rd))
    assert "<script>alert" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "<img" not in text and "&lt;img src=x" in text
    assert "T0KEN" not in text and "hooks.slack.com" not in text and "[webhook URL redacted]" in text
    self_contained(text)


def test_index_and_cron_report_show_every_run_with_its_headline(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "runs"
    clean, faults = report_runs.clean_run(root), report_runs.fault_run(root)
    assert cron.run_once([root], report=True) == 0
    for rd in (clean, faults):
        assert (rd.root / "report.html").is_file()
    text = (root / "index.html").read_text()
    self_contained(text)
    rows = {r["run"]: r for r in status.collect(None, root)}
    for rd in (clean, faults):
        assert f'href="{rd.name}/report.html"' in text
        assert f"{rows[rd.name]['goodput']:.1%}" in text
    before = (clean.root / "report.html").stat().st_mtime_ns
    assert report.refresh(root) == 0, "nothing changed: no page rewritten"
    assert (clean.root / "report.html").stat().st_mtime_ns == before
    code, out, _ = run_cli(capsys, "report", "--root", str(root))
    assert code == 0 and out.strip() == str(root / "index.html")
    code, out, _ = run_cli(capsys, "cron", "--install", "--report", "--root", str(root))
    assert code == 0 and out.splitlines()[0].endswith(f"--root {root.resolve()} --report >> "
                                                      f"{root.resolve()}/.runner-cron.log 2>&1")


def test_open_uses_a_browser_where_there_is_one(tmp_path: Path) -> None:
    """``--open`` hands the page to the user's browser ($BROWSER here, a script that notes what it was given);
    with none at all it says so in one line and the page is still written (exit 0)."""
    rd = report_runs.clean_run(tmp_path / "runs")
    seen = tmp_path / "opened"
    browser = tmp_path / "browser"
    browser.write_text(f"#!/bin/sh\necho \"$1\" > {seen}\n")
    browser.chmod(0o755)
    bare = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "BROWSER")}
    argv = [sys.executable, "-m", "runner", "report", str(rd.root), "--open"]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env={**bare, "BROWSER": f"{browser} %s"})
    assert out.returncode == 0 and seen.read_text().strip() == (rd.root / "report.html").as_uri()
    out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env={**bare, "PATH": str(tmp_path)})
    assert out.returncode == 0 and out.stdout.strip() == str(rd.root / "report.html")
    assert len(out.stderr.strip().splitlines()) == 1 and "no browser found here" in out.stderr


def test_thirty_day_run_reports_in_under_5s_and_5mb(tmp_path: Path) -> None:
    rd = report_runs.thirty_day_run(tmp_path / "runs")
    t = time.perf_counter()
    path = report.write(rd)
    took = time.perf_counter() - t
    size = path.stat().st_size
    assert took < 5.0 and size < 5 * 2**20, (took, size)
    page = Page(path.read_text())
    assert len(page.attempts) == 200 and page.goodput == str(status_json(rd)["goodput"])


# ---------------------------------------------------------------------------------------------------------------
# Goodput: one accounting, shown alike by status and report


def test_status_shows_goodput_where_it_tells_something(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    clean, faults = report_runs.clean_run(root), report_runs.fault_run(root)
    rows = {r["run"]: r for r in status.collect(None, root)}
    table = status.table(list(rows.values())).splitlines()
    line = {name: next(x for x in table if x.startswith(name)) for name in rows}
    assert rows[clean.name]["goodput"] is not None and "%" not in line[clean.name], \
        "a 1-second clean run: startup dominates, the table leaves goodput to --json and the report"
    assert f"{rows[faults.name]['goodput']:.0%}" in line[faults.name], "after restarts it tells what they cost"
    assert set(rows[faults.name]["losses_s"]) == set(goodput.LOSSES)
    assert rows[faults.name]["losses_s"]["recomputed steps"] > 0 and rows[faults.name]["losses_s"][
        "hang detection"] > 0


# ---------------------------------------------------------------------------------------------------------------
# In a real browser


# Chromium's own background requests, which no flag turns off in Chromium 156 (component updater, network time,
# account sign-in check): they go through the proxy whatever page is open. Anything else would be the page's.
CHROMIUM_OWN = re.compile(rb"^(CONNECT (update\.googleapis\.com|accounts\.google\.com|redirector\.gvt1\.com):443 "
                          rb"|(GET|POST) http://(clients2\.google\.com/time/|update\.googleapis\.com/service/update2/)"
                          rb"|$)")


class Recorder:
    """A TCP listener that records every connection: Chromium's proxy, so any fetch the page makes lands here."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.seen: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    self.seen.append(conn.recv(4096))
                except OSError:
                    self.seen.append(b"?")

    def close(self) -> None:
        self.sock.close()


def chromium(page: Path, proxy_port: int, tmp: Path, *how: str) -> str:
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    profile.mkdir()
    argv = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--no-first-run", "--disable-component-update", "--disable-sync", "--no-pings",
            "--disable-features=NetworkTimeServiceQuerying", f"--user-data-dir={profile}", f"--proxy-server=http://127.0.0.1:{proxy_port}",
            "--proxy-bypass-list=<-loopback>", "--window-size=1280,2400", *how, page.resolve().as_uri()]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def open_in_chromium(page: Path, tmp_path: Path, shot_name: str) -> tuple[str, Path, list[bytes]]:
    """The page rendered by headless Chromium behind a proxy that records every connection: its DOM, a screenshot
    (in ARTIFACTS) and the first line of every request the page made (Chromium's own background requests excused)."""
    recorder = Recorder()
    try:
        dom = chromium(page, recorder.port, tmp_path, "--dump-dom")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / shot_name
        shot.unlink(missing_ok=True)
        chromium(page, recorder.port, tmp_path, f"--screenshot={shot}")
    finally:
        recorder.close()
    return dom, shot, [r.split(b"\r\n")[0] for r in recorder.seen if not CHROMIUM_OWN.match(r)]
