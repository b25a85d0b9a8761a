"""`runner report` at scale (issue 39), the unit tier: each per-attempt lookup walks the run once (the nodes kept out
of each attempt, the step each attempt reached, its world size), as tables; and a run of more attempts than the page
draws shows the newest and counts them all. The time it takes: bench/report --attempts 50000."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runner import alerts, goodput
from runner.host import nodes, report
from runner.rundir import RunDir

pytestmark = pytest.mark.unit


def _ev(t: float, event: str, **fields: Any) -> dict[str, Any]:
    return {"time": t, "event": event, **fields}


def _queued(*times: float) -> list[goodput.Attempt]:
    return [goodput.Attempt(i + 1, t, "submitted") for i, t in enumerate(times)]


def _bad(node: str, t: float) -> dict[str, Any]:
    return {"node": node, "cause": "hang", "run": "r", "detail": "", "time": t}


@pytest.mark.parametrize("memory, queued, excluded", [
    # recorded before the attempt was queued, within the window: kept out
    ([_bad("n1", 10)], [5, 20], ["", "n1 (hang)"]),
    # older than the window (100 s) when queued: let in again
    ([_bad("n1", 10)], [50, 111], ["n1 (hang)", ""]),
    # cleared before the second attempt: let in from then on; recorded again: kept out again
    ([_bad("n1", 10), {"clear": "n1", "time": 30}, _bad("n1", 50)], [20, 40, 60], ["n1 (hang)", "", "n1 (hang)"]),
    # the newest entry of a node counts: a re-record restarts its window
    ([_bad("n1", 10), _bad("n1", 90)], [105, 150], ["n1 (hang)", "n1 (hang)"]),
    # several nodes, in name order
    ([_bad("n2", 10), _bad("n1", 11)], [20], ["n1 (hang), n2 (hang)"]),
    # attempts whose queue times go back (a clock step): each sees the memory as of its own queueing
    ([_bad("n1", 10), {"clear": "n1", "time": 30}], [40, 20], ["", "n1 (hang)"]),
], ids=["kept-out", "window", "clear-and-again", "newest-entry", "sorted", "clock-step"])
def test_nodes_kept_out_of_each_attempt(tmp_path: Path, memory: list[dict[str, Any]], queued: list[float],
                                        excluded: list[str]) -> None:
    nodes.path(tmp_path).write_text("".join(json.dumps(m) + "\n" for m in memory))
    missing: list[str] = []
    found = report._excluded(tmp_path, _queued(*queued), 100.0, missing)
    assert [found[n] for n in range(1, len(queued) + 1)] == excluded and missing == []


TRAINED = [_ev(0, "submitted"), _ev(1, "train_start", step=0, lost_steps=0, attempt=1),
           _ev(5, "exit", outcome="failed"), _ev(6, "resubmitted"), _ev(7, "preflight", status="fail", duration_s=1.0),
           _ev(8, "exit", outcome="preflight_failed"), _ev(9, "resubmitted"),
           _ev(10, "preflight", status="fail", duration_s=1.0), _ev(11, "exit", outcome="preflight_failed"),
           _ev(12, "resubmitted"), _ev(13, "train_start", step=40, lost_steps=7, attempt=4),
           _ev(20, "hang", step=60, summary="hang", nodes=[]), _ev(21, "exit", outcome="hang")]


def test_each_attempt_reached_the_next_trained_attempts_start() -> None:
    """Attempt 1 trained to where attempt 4 (past 2 and 3, which never trained) resumed, plus the steps 4 lost;
    attempt 4, the last, to its hang's step."""
    runs = goodput.attempts(TRAINED)
    nexts = report._trained_next(runs)
    assert [n.number if n else None for n in nexts] == [4, 4, 4, None]
    assert [report._reached(a, n, 80) for a, n in zip(runs, nexts, strict=True)] == [47, 47, 47, 60]
    rows = report._rows(runs, TRAINED, {"world_size": 4}, {}, 30.0, 80)
    assert [r.steps for r in rows] == ["0 → 47", "-", "-", "40 → 60"]


def test_each_attempt_has_the_world_size_of_the_last_resize_before_it_was_queued() -> None:
    events = [_ev(0, "submitted"), _ev(5, "exit", outcome="failed"),
              _ev(6, "resized", change="2 x 2 -> 1 x 2", world_size=2, accumulate=2), _ev(7, "resubmitted"),
              _ev(8, "exit", outcome="failed"), _ev(9, "resubmitted"), _ev(10, "exit", outcome="failed"),
              _ev(11, "resized", change="1 x 2 -> 2 x 4", world_size=8, accumulate=1), _ev(12, "resubmitted")]
    runs = goodput.attempts(events)
    rows = report._rows(runs, events, {"world_size": 4}, {}, 20.0, None)
    assert [r.world for r in rows] == ["4", "2", "2", "8"]


def test_a_page_of_more_attempts_than_it_draws_shows_the_newest_and_counts_all(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report, "MAX_ATTEMPTS", 3)
    run = RunDir(tmp_path / "runs" / "r")
    run.root.mkdir(parents=True)
    run.config.write_text("scheduler: local\n")
    run.manifest.write_text(json.dumps({"scheduler": "local", "config_hash": "x", "created": 0.0}))
    outcomes = ["preempted", "failed", "preempted", "hang", "failed", "completed"]
    lines = [_ev(0, "submitted")]
    for i, outcome in enumerate(outcomes):
        t = 10.0 * i
        if i:
            lines.append(_ev(t, "resubmitted"))
        lines += [_ev(t + 1, "train_start", step=10 * i, lost_steps=0, attempt=i + 1),
                  _ev(t + 9, "exit", outcome=outcome, exit_code=0)]
    run.ledger.write_text("".join(json.dumps(e) + "\n" for e in lines))
    r = report.collect(run)
    assert [row.number for row in r.rows] == [4, 5, 6] and r.headline["attempts"] == "6"
    assert {s.y for s in r.segments} == {0, report.ROW_H, 2 * report.ROW_H}, "rows drawn from the top"
    assert r.cut.startswith("6 attempts: ") and "newest 3, from attempt 4" in r.cut
    assert r.cut.endswith("Attempts 1 to 3 ended: 2 preempted, 1 failed")
    page = report.render(r)
    assert page.count('class="attempt"') == 3 and 'id="attempts-cut"' in page
    monkeypatch.setattr(report, "MAX_ATTEMPTS", 6)
    assert report.collect(run).cut == "" and 'id="attempts-cut"' not in report.render(report.collect(run))


def test_nodes_named_again_and_again_and_many_alerts_stay_a_few_rows(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report, "MAX_ATTEMPTS", 3)
    run = RunDir(tmp_path / "runs" / "r")
    run.root.mkdir(parents=True)
    run.config.write_text("scheduler: local\n")
    named = [_bad("n1", 10), _bad("n2", 20) | {"cause": "preflight"}, _bad("n1", 30) | {"cause": "crashes"},
             _bad("n3", 40), _bad("n1", 50), _bad("n9", 60) | {"run": "q"}]
    nodes.path(run.root.parent).write_text("".join(json.dumps(e) + "\n" for e in named))
    assert report._bad_nodes(run) == [
        {"node": "n2", "times": "1", "cause": "preflight", "time": report.clock(20), "detail": ""},
        {"node": "n3", "times": "1", "cause": "hang", "time": report.clock(40), "detail": ""},
        {"node": "n1", "times": "3", "cause": "hang", "time": report.clock(50), "detail": ""}], \
        "each node once, by its last time; another run's (n9) left out"
    sent = alerts.delivery.sent_log(run.root)
    sent.parent.mkdir(parents=True, exist_ok=True)
    sent.write_text("".join(json.dumps({"run": "r", "event": "failed", "attempt": a, "time": float(a)}) + "\n"
                            for a in range(1, 6)))
    r = report.collect(run)
    assert [a["text"] for a in r.alerts_sent] == [f"r failed (job -, attempt {a})" for a in (3, 4, 5)]
    assert r.alerts_cut == "5 alerts: the newest 3 are listed" and 'id="alerts-cut"' in report.render(r)
