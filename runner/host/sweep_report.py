"""``runner report --sweep ID``: one page that compares a sweep's runs, point by point.

It runs on the login node. Each point is a row: the values the sweep varies, its run's state, its last loss and step,
goodput, wall time, restarts and how its last attempt ended, and a link to the run's own page (``runner report RUN``,
written here where it is missing or older than the run's records). The states are read as ``runner status`` reads
them (``observe``, one question to Slurm for every run, ``status.row_of``); a run that cannot be read is a row that
says why. The page is the run page's kind: one file, the same style, no script, a Content-Security-Policy that
forbids every fetch, every text escaped by the template and the webhook URLs of the runs redacted. Its links are
relative (``../../RUN/report.html`` from ``RUN_ROOT/sweeps/ID/report.html``), so the run root can be copied whole.
"""

from __future__ import annotations

import logging
import math
import os
import time
import urllib.parse
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner import alerts, goodput
from runner import log as runner_log
from runner.host import observe, report, status
from runner.host.sweep import SweepDir, varied
from runner.rundir import RunDir, atomic_write, read_json

log = logging.getLogger(__name__)
NOT_WRITTEN = "not written"  # a point whose run directory was never written (its driver died first)


@dataclass
class PointRow:
    """One point of the sweep, in words."""

    index: int
    run: str  # its run directory's name; "" where it has none
    href: str  # its run's page, relative to the sweep's page and URL-quoted; "" where it has none
    values: list[str]  # one per varied key, in the keys' order ("" where the point does not set it)
    state: str
    loss: str
    loss_value: float | None
    best: bool  # the one lowest last loss of the sweep's completed runs
    steps: str
    goodput: str
    wall: str
    restarts: str
    last: str  # how its last attempt ended, and why
    error: str = ""


@dataclass
class SweepReport:
    id: str
    path: str
    config: str
    scheduler: str
    created: str
    generated: str
    keys: list[str]  # the keys the sweep varies: one column each
    fixed: list[tuple[str, str]]  # the values every point shares
    counts: list[tuple[str, int]]  # runs by state, the most common first
    rows: list[PointRow]
    missing: list[str] = field(default_factory=list)


def _last_loss(progress: Any, step: int | None) -> tuple[str, float | None]:
    """The loss of ``progress.json`` (rank 0 writes it every few seconds and at each checkpoint), with the step it
    was taken at where that is not the run's last step."""
    if not isinstance(progress, dict):
        return "-", None
    loss = progress.get("loss")
    if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss):
        return "-", None
    at = progress.get("step")
    return f"{loss:.4g}" + (f" (step {at})" if isinstance(at, int) and at != step else ""), float(loss)


def _last_step(run: RunDir, row: Mapping[str, Any], progress: Any) -> int | None:
    """The furthest step the run reached: its end (``finished``), else its last progress record, else its newest
    checkpoint."""
    for found in ((read_json(run.finished) or {}).get("step"), (progress or {}).get("step"),
                  row.get("last_checkpoint_step")):
        if isinstance(found, int) and not isinstance(found, bool):
            return found
    return None


def _last(outcome: Any, cause: Any) -> str:
    """How the last attempt ended and why, whole (``status.last_cell`` without its cut: a page has the room)."""
    if not outcome:
        return "-"
    text = " ".join(str(cause or "").split())
    text = text[len(f"{outcome}:"):].lstrip() if text.startswith(f"{outcome}:") else text
    return f"{outcome}: {text}" if text else str(outcome)


def _states(runs: Mapping[int, RunDir]) -> dict[int, dict[str, Any]]:
    """Each run's ``runner status`` row, Slurm asked once for all of them; a run that cannot be read is its
    ``broken_row``."""
    looks: dict[int, observe.Observation | Exception] = {}
    for i, run in runs.items():
        try:
            looks[i] = observe.look(run, observe.shown, strict=True)
        except Exception as e:  # said in its row
            looks[i] = e
    jobs = observe.ask(o for o in looks.values() if isinstance(o, observe.Observation))
    rows: dict[int, dict[str, Any]] = {}
    for i, seen in looks.items():
        try:
            if isinstance(seen, Exception):
                raise seen
            rows[i] = status.row_of(seen.answered(jobs))
        except Exception as e:  # one unreadable run must not hide the others
            log.debug("%s: cannot read", runs[i].root, exc_info=True)
            rows[i] = status.broken_row(runs[i], runner_log.one_line(e))
    return rows


def _page(run: RunDir, missing: list[str]) -> bool:
    """Write the run's own page where it is missing or older than the run's records (as ``runner cron --report``
    does); returns whether the run has a page to link to."""
    page = run.report_page
    try:
        newest = max((f.stat().st_mtime for f in (run.ledger, run.progress, run.finished) if f.exists()),
                     default=0.0)
        if not page.is_file() or page.stat().st_mtime < newest:
            report.write(run)
    except Exception as e:  # the comparison still shows the run, without its page
        missing.append(f"{run.name}: its page was not written ({runner_log.one_line(e)})")
    return page.is_file()


def _href(target: Path, page_dir: Path) -> str:
    """``target`` as a link from a page in ``page_dir``: relative, each part URL-quoted (a run's name may hold
    ``#``, ``?``, ``%`` or a space)."""
    rel = os.path.relpath(os.path.abspath(target), os.path.abspath(page_dir))
    return "/".join(urllib.parse.quote(part) for part in Path(rel).parts)


def collect(sweep: SweepDir, out: Path, runs: Mapping[int, RunDir] | None = None) -> SweepReport:
    """Everything the page at ``out`` shows, from the sweep's record and its runs (``runs``: where the caller found
    them already); each run's page is written where it is missing or stale.

    Raises:
        InputError: the sweep's record is missing or damaged (``SweepDir.points``).
    """
    points = sweep.points()
    keys = varied([tuple(p.items()) for p in points])
    fixed = [(k, v) for k, v in points[0].items() if k not in keys] if points else []
    runs = sweep.runs() if runs is None else runs
    missing: list[str] = []
    states = _states(runs)
    pages = {i: _page(run, missing) for i, run in runs.items()}
    rows: list[PointRow] = []
    for i, point in enumerate(points):
        values = [point.get(k, "") for k in keys]
        run = runs.get(i)
        if run is None:
            rows.append(PointRow(i, "", "", values, NOT_WRITTEN, "-", None, False, "-", "-", "-", "-", "-"))
            continue
        row = states[i]
        progress = read_json(run.progress)
        step = _last_step(run, row, progress)
        loss, loss_value = _last_loss(progress, step)
        gp = row.get("goodput")
        last = _last(row.get("last_outcome"), row.get("last_cause"))
        rows.append(PointRow(
            i, run.name, _href(run.report_page, out.parent) if pages[i] else "", values, str(row.get("state")), loss,
            loss_value, False, "-" if step is None else str(step), f"{gp:.1%}" if isinstance(gp, float) else "-",
            report.duration(row.get("wall_s")), "-" if row.get("restarts") is None else str(row["restarts"]), last,
            str(row.get("error") or "")))
    losses = sorted((r.loss_value, r.index) for r in rows if r.state == "completed" and r.loss_value is not None)
    if len(losses) > 1 and losses[0][0] < losses[1][0]:  # one lowest: a tie marks none
        rows[losses[0][1]].best = True
    rec = read_json(sweep.record) or {}
    created = rec.get("created")
    return SweepReport(
        sweep.id, str(sweep.root), str(rec.get("config_file") or "-"), str(rec.get("scheduler") or "-"),
        report.clock(created) if isinstance(created, (int, float)) else "-", report.clock(time.time()), keys, fixed,
        Counter(r.state for r in rows).most_common(), rows, missing)


def render(sr: SweepReport, secrets: Sequence[str] = ()) -> str:
    from runner.host import render as templates

    page = templates.environment().get_template("report-sweep.html.j2").render(s=sr, losses_defined=goodput.LOSSES)
    return alerts.redact(page, secrets)


def write(sweep: SweepDir, out: Path | None = None) -> Path:
    """Write the sweep's page (default: ``RUN_ROOT/sweeps/ID/report.html``) and each run's page it links to where
    missing or stale; returns the page's path.

    Raises:
        InputError: the sweep's record is missing or damaged.
    """
    path = out or sweep.report_page
    runs = sweep.runs()
    sr = collect(sweep, path, runs)
    url = os.environ.get(status.DEFAULT_URL_ENV, "").strip()  # the runs' own are each run's (report._secrets)
    secrets = dict.fromkeys([*([url] if url else []), *(s for run in runs.values() for s in report._secrets(run))])
    atomic_write(path, render(sr, list(secrets)))
    return path
