"""``runner report``: one self-contained HTML page of a run's whole life, and an index of a run root.

Everything on the page comes from what the run directory already holds (the ledger, checkpoint manifests,
heartbeats, hang reports, the preflight report, the root's bad-node memory, the alerts sent); nothing is asked of
Slurm but the state ``runner status`` shows. The page needs no network to be viewed: CSS and SVG are inline, no
script runs (its Content-Security-Policy forbids any), and it links nowhere. Every text from the run directory
is escaped by the template (it may hold anything a log line held) and passed through the alerts' redaction, so a
webhook URL never lands on the page. A file that is missing or torn is said on the page, never an error.
"""

from __future__ import annotations

import bisect
import gc
import json
import logging
import os
import time
import webbrowser
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner import alerts, checkpoint, goodput, stragglers
from runner.errors import RunnerError
from runner.host import nodes, observe, scheduler, status
from runner.records import GitState, RunManifest
from runner.rundir import MAX_LEDGER, REPORT_PAGE, RunDir, Unreadable, atomic_write, read_json, read_regular
from runner.spec.typed import read_resolved

log = logging.getLogger(__name__)

PAGE = REPORT_PAGE  # in the run directory (RunDir.report_page); the index is ROOT/index.html
INDEX = "index.html"
WIDTH = 960  # SVG user units of both charts
ROW_H = 16
MAX_POINTS = 2000  # checkpoints drawn in the steps chart (a 30-day run has thousands)
MAX_ATTEMPTS = 1000  # attempts drawn and listed: the newest (a run restarted every minute for a month has 50,000)
OUTCOME_CLASS = {"completed": "ok", "preempted": "warn", "timeout": "warn", "requeued": "warn"}


@dataclass
class Segment:
    """One bar of the timeline (SVG rect) with its words (tooltip)."""

    x: float
    y: float
    w: float
    kind: str
    title: str


@dataclass
class AttemptRow:
    number: int
    job: str
    queued: str
    waited: str
    preflight: str
    startup: str
    trained: str
    steps: str
    outcome: str
    outcome_class: str
    cause: str
    lost_steps: int
    then: str
    nodes: str
    excluded: str
    world: str
    notes: list[str]


@dataclass
class Line:
    """A polyline of the steps chart."""

    points: str
    kind: str
    title: str


@dataclass
class Report:
    run: str
    path: str
    state: str
    generated: str
    headline: dict[str, str]
    goodput: goodput.Goodput
    losses: list[tuple[str, str, float, float, int]]  # name, duration, share of wall (%), its bar's start, colour
    rows: list[AttemptRow]
    segments: list[Segment]
    timeline_h: float
    ticks: list[tuple[float, str]]
    lines: list[Line]
    marks: list[Segment]
    chart_h: float
    step_ticks: list[tuple[float, str]]
    ranks: list[dict[str, Any]]
    rank_attempt: int | None
    preflight: list[dict[str, Any]]
    preflight_summary: str
    hang: dict[str, Any] | None
    bad_nodes: list[dict[str, str]]
    alerts_sent: list[dict[str, str]]
    identity: list[tuple[str, str]]
    config: str
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what runner cannot see of this run, said once at the top
    cut: str = ""  # which attempts the timeline, the steps chart and the table leave out (``MAX_ATTEMPTS``)
    alerts_cut: str = ""  # the alerts listed are the newest MAX_ATTEMPTS


def clock(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + "Z"


def duration(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{s // 60:.0f} m {s % 60:02.0f} s"
    if s < 86400:
        return f"{s // 3600:.0f} h {s % 3600 // 60:02.0f} m"
    return f"{s // 86400:.0f} d {s % 86400 // 3600:02.0f} h"


def _ledger(run: RunDir, missing: list[str]) -> list[dict[str, Any]]:
    """The ledger as ``RunDir.events`` reads it, saying how many lines could not be read."""
    if not run.ledger.is_file():
        missing.append("ledger.jsonl is missing: no attempts, exits or causes to show")
        return []
    events = run.events()
    try:
        text = read_regular(run.ledger, MAX_LEDGER).decode("utf-8", "replace")
        lines = sum(1 for line in text.splitlines() if line.strip())
    except (OSError, Unreadable) as e:
        missing.append(f"ledger.jsonl cannot be read ({getattr(e, 'found', None) or e})")
        return []
    if lines > len(events):
        missing.append(f"ledger.jsonl: {lines - len(events)} of {lines} lines are torn or not runner's (skipped)")
    return events


def _checkpoints(run: RunDir) -> list[dict[str, Any]]:
    """Every complete checkpoint's manifest (step, time, productive_s), oldest first."""
    out = []
    for _, p in checkpoint.CheckpointDir(run.checkpoints).steps():
        if checkpoint.CheckpointDir.marker(p).is_file():
            m = checkpoint.manifest_of(p)
            if isinstance(m.get("step"), int) and isinstance(m.get("time"), float):
                out.append(dict(m))
    return sorted(out, key=lambda m: (m["time"], m["step"]))


def _world_sizes(events: Sequence[Mapping[str, Any]]) -> dict[float, int]:
    """The world size from each ``resized`` on (by time): the manifest's before the first."""
    return {float(e["time"]): int(e["world_size"]) for e in events
            if e["event"] == "resized" and isinstance(e.get("world_size"), int)}


def _trained_next(runs: Sequence[goodput.Attempt]) -> list[goodput.Attempt | None]:
    """Per attempt, the next one that trained (its ``from_step`` known), in one pass from the end: attempts that
    never trained (a failed preflight) are skipped without rescanning the rest for each."""
    out: list[goodput.Attempt | None] = [None] * len(runs)
    found = None
    for i in range(len(runs) - 1, -1, -1):
        out[i] = found
        if runs[i].from_step is not None:
            found = runs[i]
    return out


def _reached(a: goodput.Attempt, nxt: goodput.Attempt | None, end_step: int | None) -> int | None:
    """The furthest step attempt ``a`` trained: the next attempt that trained (``_trained_next``) started there
    plus the steps it lost, else the last step the run recorded."""
    if nxt is not None and nxt.from_step is not None:
        return nxt.from_step + nxt.lost_steps
    return a.last_step if a.last_step is not None else end_step


class _Scale:
    def __init__(self, t0: float, t1: float, width: float = WIDTH):
        self.t0, self.span, self.width = t0, max(t1 - t0, 1e-6), width

    def x(self, t: float) -> float:
        return round(min(max((t - self.t0) / self.span, 0.0), 1.0) * self.width, 2)

    def ticks(self, n: int = 6) -> list[tuple[float, str]]:
        return [(round(i * self.width / n, 2), duration(i * self.span / n)) for i in range(n + 1)]


# Said once on the page of a program that ran without showing runner a step.
NO_STEPS = ("runner sees no steps of this program: it calls no runner.progress (and trains no Lightning Trainer with "
            "runner's callback), so runner cannot tell its start from its training (that time is \"the program "
            "ran\", not startup), and its hang watchdog, non-finite guard and steps chart do not apply. One line in "
            "its training loop gives them: runner.progress(step, loss=loss.item()) (README: program mode)")
NO_CHECKPOINT = ("runner kept no checkpoint of this program: what it saves itself is its own (runner neither "
                 "sees nor counts it)")


def unseen(runs: Sequence[goodput.Attempt], program: bool) -> list[int]:
    """The attempts of a program that ran without showing runner a step (no ``train_start``; a failed preflight
    never started it): their time after the preflight is "the program ran"."""
    return [a.number for a in runs if goodput.unseen(a, program)]


def step_ticks(top: int, height: float) -> list[tuple[float, str]]:
    """The steps axis: whole steps only, each once (a chart up to step 1 has ticks 0 and 1, never 0, 0, 0, 1, 1)."""
    top = max(top, 1)
    return [(round(height - v / top * height, 2), str(v)) for v in sorted({round(f * top) for f in
                                                                             (0, 0.25, 0.5, 0.75, 1)})]


def _timeline(runs: Sequence[goodput.Attempt], sc: _Scale, end: float, blind: Sequence[int] = ()) -> list[Segment]:
    """One row of bars per attempt; ``blind``: the attempts whose time after the preflight is "the program ran"
    (``unseen``)."""
    segs: list[Segment] = []

    def bar(a: goodput.Attempt, t0: float | None, t1: float | None, kind: str, words: str) -> None:
        if t0 is None or t1 is None or t1 < t0:
            return
        x0, x1 = sc.x(t0), sc.x(t1)
        segs.append(Segment(x0, (a.number - runs[0].number) * ROW_H, max(x1 - x0, 0.8), kind,
                            f"attempt {a.number}: {words}, {duration(t1 - t0)} ({clock(t0)} to {clock(t1)})"))

    for i, a in enumerate(runs):
        nxt = runs[i + 1] if i + 1 < len(runs) else None
        stop = a.stop(end)
        bar(a, a.queued, a.started, "wait", "waiting for Slurm")
        if a.number in blind:
            ran = goodput.program_start(a)
            bar(a, a.began, ran, "startup", "startup")
            bar(a, ran, stop, "program", "the program ran (runner sees no steps of it)")
        else:
            bar(a, a.began, a.train_start if a.train_start is not None else stop, "startup", "startup")
        if a.preflight_end is not None:
            bar(a, a.preflight_end - a.preflight_s, a.preflight_end, "preflight",
                f"preflight {a.preflight_status or '?'}")
        bar(a, a.train_start, stop, "train", f"training from step {a.from_step}")
        if a.ended is not None:
            gap_end = nxt.queued if nxt else (a.ended if a.finished is not None else end)
            person = goodput._waited_for_person(a, nxt)
            bar(a, a.ended, gap_end, "person" if person else "wait",
                "stopped for a person" if person else f"{a.then or 'waiting'}: waiting for the next attempt")
    return segs


def _steps_chart(runs: Sequence[goodput.Attempt], ckpts: Sequence[Mapping[str, Any]], sc: _Scale,
                 end: float, end_step: int | None, height: float) -> tuple[list[Line], list[Segment], int]:
    """Per attempt a line of steps against wall time through its checkpoints, and in red the steps it trained
    that a fault lost (recomputed by the next attempt)."""
    nexts = _trained_next(runs)
    reach = [_reached(a, n, end_step) for a, n in zip(runs, nexts, strict=True)]
    top = max([end_step or 0, *(int(m["step"]) for m in ckpts[-1:]), *(r for r in reach if r is not None)],
              default=1) or 1
    every = max(len(ckpts) // MAX_POINTS, 1)
    times = [float(m["time"]) for m in ckpts]  # sorted: _checkpoints sorts by time

    def y(step: float) -> float:
        return round(height - step / top * height, 2)

    lines: list[Line] = []
    marks: list[Segment] = []
    for i, a in enumerate(runs):
        if a.train_start is None:
            continue
        stop = a.stop(end)
        lo, hi = bisect.bisect_left(times, a.train_start), bisect.bisect_right(times, stop)
        mine = [ckpts[j] for j in range(lo, hi) if j % every == 0 or j == hi - 1]
        pts = [(a.train_start, a.from_step or 0), *((float(m["time"]), int(m["step"])) for m in mine)]
        reached, nxt = reach[i], nexts[i]
        kept_to = nxt.from_step if nxt is not None and nxt.from_step is not None else reached
        if kept_to is not None and (not mine or kept_to > pts[-1][1]):
            pts.append((stop, kept_to))
        lines.append(Line(" ".join(f"{sc.x(t)},{y(s)}" for t, s in pts), "kept",
                          f"attempt {a.number}: steps {a.from_step} to {kept_to}"))
        if nxt is not None and nxt.lost_steps and reached is not None and kept_to is not None:
            last_kept = max((p for p in pts if p[1] <= kept_to), key=lambda p: p[0])
            lines.append(Line(f"{sc.x(last_kept[0])},{y(kept_to)} {sc.x(stop)},{y(reached)}", "lost",
                              f"attempt {a.number}: steps {kept_to} to {reached} lost, recomputed by attempt "
                              f"{nxt.number} ({nxt.lost_steps} steps)"))
        for e in a.nonfinite:
            step = e.get("step")
            if isinstance(step, int):
                what = "skipped" if e["event"] == "nonfinite_skipped" else "stopped training"
                marks.append(Segment(sc.x(float(e["time"])), y(step), 0, "nan",
                                     f"non-finite {e.get('what', 'loss')} at step {step}: {what}"))
        if a.hang is not None and isinstance(a.hang.get("step"), int):
            marks.append(Segment(sc.x(float(a.hang["time"])), y(a.hang["step"]), 0, "hang",
                                 str(a.hang.get("summary") or "hang")))
    return lines, marks, top


def _excluded(root: Path, runs: Sequence[goodput.Attempt], keep_s: float, missing: list[str]) -> dict[int, str]:
    """Per attempt, the nodes its root kept out of its job when it was queued (nodes.jsonl)."""
    try:
        known = nodes.entries(root)
    except RunnerError as e:
        missing.append(str(e))
        return {}
    out: dict[int, str] = {}
    newest: dict[str, Mapping[str, Any]] = {}  # node -> its newest entry up to the attempt's queueing, not cleared
    read = 0
    for a in sorted(runs, key=lambda a: a.queued):  # one walk through the memory (oldest first) for all attempts
        while read < len(known) and known[read]["time"] <= a.queued:
            item = known[read]
            if "clear" in item:
                newest.pop(item["clear"], None)
            else:
                newest[item["node"]] = item
            read += 1
        bad = {n: e for n, e in newest.items() if a.queued - e["time"] <= keep_s}
        out[a.number] = ", ".join(f"{n} ({e.get('cause')})" for n, e in sorted(bad.items()))
    return out


def _alerts(run: RunDir) -> list[dict[str, str]]:
    """The alerts delivered (alerts/sent.jsonl), still queued, and set aside, oldest first."""
    out: list[dict[str, str]] = []
    sent = alerts.delivery.sent_log(run.root)
    try:
        lines = read_regular(sent).decode("utf-8", "replace").splitlines() if sent.is_file() else []
    except (OSError, Unreadable):
        lines = []
    for line in lines:
        try:
            a = json.loads(line)
        except ValueError:
            continue
        if isinstance(a, dict):
            out.append(_alert_row(a, "sent", a.get("time")))
    for folder, state in ((alerts.queue_dir(run.root), "queued, not delivered yet"),
                          (run.alerts / "rejected", "refused by the webhook")):
        for p in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            entry = read_json(p, {})
            a = entry.get("alert") if isinstance(entry, dict) else None
            if isinstance(a, dict):
                out.append(_alert_row(a, state, None, str(entry.get("queued_at", ""))))
    return out


def _alert_row(a: Mapping[str, Any], state: str, when: Any, stamp: str = "") -> dict[str, str]:
    text = f"{a.get('run')} {a.get('event')} (job {a.get('job_id') or '-'}, attempt {a.get('attempt')})"
    return {"time": clock(when) if isinstance(when, (int, float)) else stamp, "state": state,
            "event": str(a.get("event")), "text": text + (f": {a['cause']}" if a.get("cause") else ""),
            "next": str(a.get("next_step") or "")}


def _identity(manifest: RunManifest) -> list[tuple[str, str]]:
    git: GitState = manifest.get("git") or {}
    keys = [("runner version", manifest.get("runner_version")), ("config hash", manifest.get("config_hash")),
            ("config file", manifest.get("config_file")),
            ("overrides", " ".join(manifest.get("overrides") or []) or "none"),
            ("scheduler", manifest.get("scheduler")), ("image", manifest.get("image")),
            ("container runtime", manifest.get("runtime")), ("image spec hash", manifest.get("spec_hash")),
            ("git commit", git.get("commit")), ("uncommitted changes", ", ".join(git.get("diff_files") or [])
                                                 if git.get("dirty") else "none"),
            ("world size", manifest.get("world_size")), ("global batch", manifest.get("global_batch")),
            ("submitted from", manifest.get("host"))]
    return [(k, "-" if v is None else str(v)) for k, v in keys]


def _rows(runs: Sequence[goodput.Attempt], events: Sequence[Mapping[str, Any]], manifest: RunManifest,
          excluded: Mapping[int, str], end: float, end_step: int | None) -> list[AttemptRow]:
    """The attempts table: one row per attempt, in words."""
    sizes = sorted(_world_sizes(events).items())
    times = [t for t, _ in sizes]
    nexts = _trained_next(runs)
    rows = []
    for i, a in enumerate(runs):
        resized = bisect.bisect_right(times, a.queued)  # the resizes recorded by the time it was queued
        world = sizes[resized - 1][1] if resized else manifest.get("world_size")
        stop = a.stop(end) if a.ended is not None or a.finished is not None else None
        notes = [f"non-finite {e.get('what', 'loss')} at step {e.get('step')}: "
                 f"{'skipped' if e['event'] == 'nonfinite_skipped' else 'stopped training'}" for e in a.nonfinite]
        notes += [stragglers.describe(e) for e in a.stragglers]
        if a.hang is not None and a.hang.get("summary") != a.cause:
            notes.append(str(a.hang.get("summary")))
        if a.preflight_status and a.preflight_status != "pass":
            notes.append(f"preflight {a.preflight_status}: {a.preflight_summary}")
        notes += [str(e.get("change")) for e in a.events if e["event"] == "resized"]
        outcome = a.outcome or ("finished" if a.finished else "running" if stop is None else "-")
        trained = "-" if a.train_start is None else "running" if stop is None else duration(stop - a.train_start)
        rows.append(AttemptRow(
            a.number, a.job_id or "-", clock(a.queued),
            duration(a.started - a.queued) if a.started is not None else "-",
            f"{a.preflight_status} {duration(a.preflight_s)}" if a.preflight_status else "-",
            duration(a.train_start - a.began - a.preflight_s) if a.train_start is not None else "-", trained,
            f"{a.from_step} → {_reached(a, nexts[i], end_step)}" if a.from_step is not None else "-",
            outcome, OUTCOME_CLASS.get(outcome, "ok" if outcome in ("finished", "running") else "bad"),
            a.cause or "", a.lost_steps, " ".join(x for x in (a.then, a.then_reason) if x) or "-",
            a.nodes or ", ".join(a.bad_nodes) or "-", excluded.get(a.number) or "-", str(world), notes))
    return rows


def _ranks(run: RunDir) -> tuple[list[dict[str, Any]], int | None]:
    """The newest attempt's ranks against the median (the straggler view), from their heartbeats."""
    beats = [b for p in sorted(run.heartbeats.glob("rank-*.json")) if isinstance(b := read_json(p), dict)]
    newest = max((int(b.get("attempt", 0)) for b in beats), default=None)
    ranks = stragglers.compare([b for b in beats if b.get("attempt", 0) == newest])
    for r in ranks:
        r["compute_ms"], r["data_ms"] = f"{r['compute_s'] * 1000:.1f}", f"{r['data_s'] * 1000:.1f}"
    return ranks, newest


def _bad_nodes(run: RunDir) -> list[dict[str, str]]:
    """The nodes this run named as bad in its root's memory (nodes.jsonl): each node once, how many times, and the
    last time (a run restarted thousands of times names the same few nodes again and again)."""
    try:
        found = nodes.entries(run.root.parent)
    except RunnerError:  # said by _excluded for a Slurm run
        return []
    last: dict[str, Mapping[str, Any]] = {}
    times: Counter[str] = Counter()
    for e in found:
        if e.get("run") == run.name and "node" in e:
            node = str(e["node"])
            last.pop(node, None)  # ordered by its last time
            last[node] = e
            times[node] += 1
    return [{"node": n, "times": str(times[n]), "cause": str(e.get("cause")), "time": clock(e.get("time")),
             "detail": str(e.get("detail", ""))} for n, e in last.items()]


def _loss_bars(acc: goodput.Goodput) -> list[tuple[str, str, float, float, int]]:
    """Each loss worth a bar (0.05% of wall time or more): name, duration, share, where its bar starts, colour."""
    wall = acc.wall_s or 1.0
    bars, x = [], 100 * (acc.productive_s or 0.0) / wall
    for k, v in acc.losses.items():
        if v >= wall / 2000:
            bars.append((k, duration(v), round(100 * v / wall, 2), round(x, 2), list(goodput.LOSSES).index(k) + 1))
            x += 100 * v / wall
    return bars


def _files(run: RunDir, missing: list[str]) -> tuple[RunManifest, list[dict[str, Any]], str, Any, Any]:
    """The manifest, checkpoint manifests, config text, ``finished`` and ``progress.json``; what is missing is
    said in ``missing``."""
    if not run.manifest.is_file():
        missing.append("manifest.json is missing: submission time, config hash and image unknown; goodput not "
                       "computed")
    manifest: RunManifest
    try:
        manifest = observe.manifest_of(run)
    except RunnerError as e:
        missing.append(str(e))
        manifest = {}
    try:
        config = read_regular(run.config, 16 << 20).decode("utf-8", "replace")
    except (OSError, Unreadable):
        config = ""
        missing.append("config.yaml is missing: the config is unknown")
    ckpts = _checkpoints(run)
    if not ckpts:
        missing.append(("no complete checkpoint: no steps were kept" if not status.program_mode(run) else
                        NO_CHECKPOINT) if run.checkpoints.is_dir() else "checkpoints/ is missing")
    done = read_json(run.finished, None)
    if run.finished.exists() and not isinstance(done, dict):
        missing.append("finished is unreadable: the end of training is taken from the ledger")
    progress = read_json(run.progress)
    if progress is None:
        missing.append("progress.json is missing: the last step reached is taken from checkpoints and the ledger")
    if not run.preflight.is_file():
        missing.append("preflight.json is missing: no preflight checks or bandwidth to show")
    return manifest, ckpts, config, done if isinstance(done, dict) else {}, progress


def collect(run: RunDir) -> Report:
    """Everything the page shows, read from the run directory (and Slurm's state, as ``runner status``)."""
    missing: list[str] = []
    manifest, ckpts, config, done, progress = _files(run, missing)
    events = _ledger(run, missing)
    cfg_hash = manifest.get("config_hash")
    ours = [int(m["step"]) for m in ckpts if not cfg_hash or m.get("config_hash") == cfg_hash]
    last = (max(ours), checkpoint.CheckpointDir(run.checkpoints).step(max(ours))) if ours else None  # as latest()
    seen = None
    try:
        seen = observe.observe(run, observe.shown, strict=True, events=events)
        row = status.row_of(seen, last)
    except Exception as e:  # the page still shows what can be read
        row = status.broken_row(run, str(e))
        missing.append(f"status: {e}")
    every = seen.attempts if seen is not None else goodput.attempts(events)
    runs = every[-MAX_ATTEMPTS:]  # drawn and listed; the headline and the goodput count every attempt
    acc = status.accounting(run, every, manifest, last)
    blind = unseen(runs, any(a.train_start is None for a in runs) and status.program_mode(run))
    end = float(done.get("time") or time.time())
    created = float(manifest.get("created", runs[0].queued if runs else end))
    end_step = done.get("step")
    if end_step is None and isinstance(progress, dict):
        end_step = progress.get("step")
    if end_step is None and ckpts:
        end_step = ckpts[-1]["step"]
    end_step = end_step if isinstance(end_step, int) else None
    sc = _Scale(created if len(runs) == len(every) else runs[0].queued, end)  # the drawn attempts' time
    chart_h = 240.0
    lines, marks, top = _steps_chart(runs, ckpts, sc, end, end_step, chart_h)
    try:
        keep_s = float(read_resolved(run.config)["resume"]["exclude_nodes_s"])
    except Exception:  # the config is said missing above; the default then
        keep_s = 21600.0
    excluded = _excluded(run.root.parent, runs, keep_s, missing) if scheduler.of_manifest(manifest).queue \
        else {}
    ranks, rank_attempt = _ranks(run)
    sent = _alerts(run)
    pre = read_json(run.preflight)
    pre = pre if isinstance(pre, dict) else {}
    hang = read_json(run.hang)
    headline = {"state": str(row.get("state")), "goodput": f"{acc.goodput:.1%}" if acc.goodput is not None else "-",
                "wall": duration(acc.wall_s), "productive": duration(acc.productive_s),
                "attempts": str(len(every)), "restarts": str(row.get("restarts")),
                "steps lost": str(sum(a.lost_steps for a in every)),
                "last step": str(end_step if end_step is not None else "-"),
                "last checkpoint": str(row.get("last_checkpoint_step") or "-"),
                "last outcome": str(row.get("last_outcome") or (every[-1].outcome if every else None) or "-")}
    return Report(
        run.name, str(run.root), str(row.get("state")), clock(time.time()), headline, acc, _loss_bars(acc),
        _ran(_rows(runs, events, manifest, excluded, end, end_step), runs, blind, end), _timeline(runs, sc, end, blind),
        max(len(runs), 1) * ROW_H, sc.ticks(), lines, marks, chart_h, step_ticks(top, chart_h) if lines else [], ranks,
        rank_attempt, [c for c in pre.get("checks") or [] if isinstance(c, dict)], str(pre.get("summary", "")),
        hang if isinstance(hang, dict) else None, _bad_nodes(run), sent[-MAX_ATTEMPTS:], _identity(manifest), config,
        missing, [NO_STEPS] if blind else [], _cut(every, runs),
        f"{len(sent)} alerts: the newest {MAX_ATTEMPTS} are listed" if len(sent) > MAX_ATTEMPTS else "")


def _cut(every: Sequence[goodput.Attempt], shown: Sequence[goodput.Attempt]) -> str:
    """What the page says when it draws and lists only the newest attempts: how the others ended."""
    if len(shown) == len(every):
        return ""
    left = every[:len(every) - len(shown)]
    ends = Counter(a.outcome or "-" for a in left)
    return (f"{len(every)} attempts: the timeline, the table and the steps chart show the newest {len(shown)}, from "
            f"attempt {shown[0].number} (queued {clock(shown[0].queued)}); the headline and where the time went "
            f"count them all. Attempts 1 to {left[-1].number} ended: "
            + ", ".join(f"{n} {outcome}" for outcome, n in ends.most_common()))


def _ran(rows: list[AttemptRow], runs: Sequence[goodput.Attempt], blind: Sequence[int], end: float) \
        -> list[AttemptRow]:
    """The attempts table's rows, where runner saw no step of the program: startup until the program started (its
    preflight's end), then "the program ran" instead of a training time."""
    for row, a in zip(rows, runs, strict=True):
        if a.number in blind:
            ended = a.ended is not None or a.finished is not None
            ran = goodput.program_start(a)
            row.startup = duration(max(ran - a.began - a.preflight_s, 0.0))
            row.trained = f"the program ran {duration(max(a.stop(end) - ran, 0.0))}" if ended else "the program runs"
    return rows


def render(report: Report, secrets: Sequence[str] = ()) -> str:
    from runner.host import render as templates

    page = templates.environment().get_template("report.html.j2").render(r=report, losses_defined=goodput.LOSSES)
    return alerts.redact(page, secrets)


def _secrets(run: RunDir) -> list[str]:
    """The webhook URL, where this process can read it: never shown (a Slack URL is found by its shape too)."""
    url = os.environ.get(status.DEFAULT_URL_ENV, "").strip()
    found = [url] if url else []
    try:
        found += alerts.secrets_of(read_resolved(run.config)["alerts"])
    except Exception:
        pass
    return found


def refresh(root: Path) -> int:
    """``runner cron --report``: rewrite each run's page whose records changed since, then the root's index; a run
    that cannot be reported is logged and skipped. Returns how many pages were written."""
    written = 0
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        run = RunDir(p)
        try:
            if not run.config.is_file():
                continue
            page = run.report_page
            newest = max((f.stat().st_mtime for f in (run.ledger, run.progress, run.finished)
                          if f.exists()), default=0.0)
            if not page.is_file() or page.stat().st_mtime < newest:
                write(run)
                written += 1
        except Exception as e:  # one run must never stop the others
            log.error("%s: report not written: %s", p.name, e)
    index(root)
    return written


def write(run: RunDir, out: Path | None = None) -> Path:
    """Write the run's page (default: RUN_DIR/report.html) and return its path."""
    path = out or run.report_page
    with _no_gc():
        page = render(collect(run), _secrets(run))
    atomic_write(path, page)
    return path


@contextmanager
def _no_gc() -> Iterator[None]:
    """A ledger of 50,000 attempts is some 300,000 small objects without a cycle among them: Python's cyclic collector
    would walk them again and again while they are made (a third of the page's time) and free nothing."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def index(root: Path, out: Path | None = None) -> Path:
    """Write ROOT/index.html: every run under root with the same headline numbers as its page."""
    rows = status.collect(None, root)
    for r in rows:
        r["page"] = f"{r['run']}/{PAGE}" if RunDir(Path(str(r["path"]))).report_page.is_file() else ""
        r["goodput_text"] = f"{r['goodput']:.1%}" if r.get("goodput") is not None else "-"
        r["wall"] = duration(r.get("wall_s"))
        r["lost"] = str(sum(r.get("lost_steps") or []))
        r["error"] = r.get("error") or ""
    path = out or root / INDEX
    secrets = [u for u in [os.environ.get(status.DEFAULT_URL_ENV, "").strip()] if u]
    from runner.host import render as templates

    text = templates.environment().get_template("report-index.html.j2").render(
        root=str(root.resolve()), rows=rows, generated=clock(time.time()), losses_defined=goodput.LOSSES)
    atomic_write(path, alerts.redact(text, secrets))
    return path


def open_page(path: Path) -> str | None:
    """Open the page in a browser where there is one; else why not (one line)."""
    try:
        webbrowser.get()
    except webbrowser.Error:
        return "no browser found here; copy the file to a machine with one (it needs no network)"
    webbrowser.open(path.resolve().as_uri())
    return None
