"""The hang watchdog: every rank notices when training stops advancing, and the job names who is stuck where.

Each rank runs one daemon thread (off the training thread; the training thread only stores its step number, and
timestamps with the name of a phase where a long pause is legitimate). The thread rewrites the rank's heartbeat file
every ``interval`` seconds, so a rank that stops beating (SIGSTOP, a dead node, a process holding the GIL in C code)
is seen by the others. It learns what is normal for this run (``allowance``):

- between two steps: ``max(factor x the 99th percentile of the last 1,000 step times, floor)``; a run of 0.1 s
  steps is named within ``floor`` (5 s) and the few seconds the reports take, not after a fixed half minute;
- in a phase the training thread marked (``MARKED``: the first step, a validation, a checkpoint, an epoch's end and
  the next epoch's data loader start): ``factor x`` the longest pause of the same phase earlier in this run, at
  least ``floor``, at most ``phase_s``; a phase's first occurrence gets ``phase_s`` (the first step
  ``first_step_s``). The step clock restarts when the phase ends.

Only the markers make a pause legitimate, never what the stack shows: the peers of a stopped rank wait in a
collective with their steps stopped too, and that must be named. When the limit is passed, the thread

1. writes where this rank's main thread is (its Python stack, and the phase that stack means: in a collective,
   in the data loader, in backward, ...) to ``hangs/attempt-N/rank-XXXXX.json``;
2. asks the other ranks for their reports (``hangs/attempt-N/requested``: each watchdog thread answers it at its
   next beat, whatever its own clock says), waits for them (longer while a rank that has not reported still beats:
   it is alive and will answer), then the lowest rank that reported writes ``hang.json``: the phase most ranks are
   in, and the ranks (with their nodes) that are elsewhere or not beating at all;
3. exits the process with ``EXIT_HANG``: srun's ``--kill-on-bad-exit`` then ends the step, stopped ranks
   included, and the batch script's exit hook records cause ``hang`` with that summary.

The analysis (``phase``, ``summarize``) and the limit (``allowance``) are pure and tested as tables, the training
thread's marks replayed with their times into a real ``Watchdog``; the thread is tested with real processes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from runner import stragglers
from runner.job import jobenv
from runner.rundir import EXIT_HANG, HEARTBEAT_S, RunDir, atomic_write, read_json

log = logging.getLogger(__name__)

# Phases in which a rank may be waiting for its peers: a collective, and backward, where DDP's and FSDP's gradient
# all-reduce and reduce-scatter run in C++ hooks (no torch.distributed frame in the Python stack). A rank in one of
# them is not named beside ranks in the other: both wait for the same missing rank.
WAITING = frozenset({"collective", "backward"})

# "file:function" substrings of torch's private code (tests/test_internals.py checks them against the installed
# torch; renamed in another torch, a stuck rank's phase reads vaguer, nothing fails). Here, not in runner.job.internals
# (which imports torch and Lightning): a plain program's ``runner.progress`` starts this watchdog without Lightning.
# torch.distributed's collectives, and DDP's own broadcasts (torch/nn/parallel/distributed.py): the buffer sync
# before each forward.
COLLECTIVE_FRAMES = ("distributed_c10d.py:", ":_distributed_broadcast_coalesced", ":_sync_buffers",
                     ":_sync_module_buffers")
DATA_FRAMES = ("_next_data",)  # a DataLoader iterator fetching the next batch

# (phase, substrings of "file:function" of any frame in the stack): the first rule that matches names the phase.
# Checked innermost frame first, so a collective inside backward is a collective.
PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("collective", (*COLLECTIVE_FRAMES, "torch/distributed/", "reduce_boolean_decision", ":barrier")),
    ("checkpoint", ("torch/serialization.py:", "save_checkpoint", "runner/checkpoint.py:")),
    ("data", ("torch/utils/data/", ":__getitem__", ":__iter__", ":__next__", *DATA_FRAMES)),
    ("backward", ("torch/autograd/", ":backward")),
    ("optimizer", ("torch/optim/", "optimizer_step")),
    ("forward", (":forward", ":training_step")),
)


# The phases in which a long pause is no hang, as the training thread marks them (``Watchdog.enter``): the Lightning
# callback (runner.job.callback.Pulse) and runner's checkpoint (RunnerCheckpoint.save). A plain program marks none.
FIRST_STEP = "first step"  # from the watchdog's start (a fit's) to the first step: ``first_step_s``
BEFORE_VALIDATION = "before validation"  # after a batch Lightning validates or ends the epoch after (loader start)
VALIDATION = "validation"  # on_validation_start to on_validation_end; each validation batch restarts its clock
CHECKPOINT = "checkpoint"  # runner's or the program's save, until the next batch starts
# runner's save waiting for its previous checkpoint's background write: learned from the writes' own durations
# (``learn``), never from earlier waits (the first save waits for nothing)
CHECKPOINT_WRITE = "checkpoint write"
EPOCH_END = "epoch end"  # on_train_epoch_end (the program's epoch-end work) until the next epoch starts
EPOCH_START = "epoch start"  # on_train_epoch_start until the epoch's first batch (the train loader's restart)
MARKED = (FIRST_STEP, BEFORE_VALIDATION, VALIDATION, CHECKPOINT, CHECKPOINT_WRITE, EPOCH_END, EPOCH_START)
# Never learned: the first step happens once, and what follows "before validation" may be no validation at all.
UNLEARNED = frozenset({FIRST_STEP, BEFORE_VALIDATION})
QUANTILE = 0.99  # of the step times: a rare slow step (a log flush, a GC pause) raises the limit, one outlier not
STEPS_KEPT = 1000
CHECK_S = 0.5  # how often the thread compares the clock with the limit (memory only; files every ``interval``)


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank quantile: the smallest value at least ``q`` of ``values`` are at or below."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def allowance(phase: str | None, steps: Sequence[float], longest: Mapping[str, float], *, factor: float,
              floor_s: float, phase_s: float, first_step_s: float | None) -> float:
    """Seconds without progress that make a hang: between two steps (``phase`` None) from this run's step times
    ``steps``; in a marked phase from ``longest`` (phase -> the longest pause of its earlier occurrences)."""
    if phase == FIRST_STEP:
        return first_step_s if first_step_s is not None else math.inf
    if phase is not None:
        seen = None if phase in UNLEARNED else longest.get(phase)
        return phase_s if seen is None else min(max(factor * seen, floor_s), phase_s)
    return max(factor * quantile(steps, QUANTILE), floor_s) if steps else floor_s


def phase(frames: Sequence[str]) -> str:
    """The phase a stack is in, from its frames as "path:function", outermost first (traceback order)."""
    for frame in reversed(frames):
        for name, marks in PHASES:
            if any(m in frame for m in marks):
                return name
    return "other"


def innermost_user_frame(frames: Sequence[str]) -> str | None:
    """The innermost frame outside the standard library and installed packages: the user's line."""
    for frame in reversed(frames):
        if "site-packages/" not in frame and "/lib/python" not in frame and "runner/job/" not in frame:
            return frame
    return None


def summarize(reports: Mapping[int, Mapping[str, Any]], world: int, hosts: Mapping[int, str]) -> dict[str, Any]:
    """Who is stuck where, from the ranks' reports (rank -> {"phase", "where", "host"}); ranks without a report
    did not respond (stopped, dead, or stuck holding the GIL). ``hosts`` names the node of every rank that ever
    wrote a heartbeat."""
    silent = sorted(set(range(world)) - set(reports))
    counts = Counter(str(r["phase"]) for r in reports.values())

    def group(ph: str) -> str:
        return "waiting" if ph in WAITING else ph

    groups = Counter(group(ph) for ph in counts.elements())
    # The most common group; with a tie (2 in data, 2 in collective) the waiting side: the others are the cause.
    top = max(groups, key=lambda g: (groups[g], g == "waiting")) if groups else None
    majority = (max(WAITING & set(counts), key=lambda ph: (counts[ph], ph == "collective")) if top == "waiting"
                else top)
    odd = sorted(r for r, rep in reports.items() if group(str(rep["phase"])) != top)
    suspects: list[dict[str, Any]] = [{"rank": r, "node": hosts.get(r, "?"), "state": "not responding"}
                                      for r in silent]
    suspects += [{"rank": r, "node": str(reports[r].get("host", hosts.get(r, "?"))),
                  "state": f"in {reports[r]['phase']}", "where": reports[r].get("where")} for r in odd]
    nodes = sorted({str(s["node"]) for s in suspects})
    waiting = Counter(str(rep["phase"]) for r, rep in reports.items() if r not in odd)
    where = " or ".join(f"{ph} ({n})" for ph, n in waiting.most_common()) if len(waiting) > 1 else majority
    if suspects:
        named = ", ".join(f"rank {s['rank']} on {s['node']} ({s['state']})" for s in suspects)
        text = f"hang: {len(reports) - len(odd)} of {world} ranks in {where}; {named}"
    else:
        text = f"hang: all {world} ranks in {where}; no rank stands out (a collective that never completes?)"
    return {"cause": "hang", "majority": majority, "suspects": suspects, "nodes": nodes, "summary": text,
            "phases": dict(counts)}


def _median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 5) if values else None


def _frames(thread_id: int) -> list[str]:
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return []
    return [f"{fs.filename}:{fs.name}" for fs in traceback.extract_stack(frame)]


class Watchdog:
    """One per rank. ``beat(step)`` and the phase markers from the training thread; everything else happens on the
    watchdog thread."""

    def __init__(self, rd: RunDir, rank: int, world: int, attempt: int, *, factor: float, floor_s: float,
                 interval_s: float = HEARTBEAT_S, report_every_s: float = 30.0, first_step_s: float | None = None,
                 phase_s: float = 900.0, exit: Any = os._exit, on_beat: Callable[[], None] | None = None) -> None:
        self.rd, self.rank, self.world, self.attempt = rd, rank, world, attempt
        self.factor, self.floor_s, self.interval_s = factor, floor_s, interval_s
        self.first_step_s = first_step_s  # the longest wait for the first step once armed (None: no limit)
        self.phase_s = phase_s  # a marked phase's allowance at its first occurrence, and at most
        self._exit = exit
        self._on_beat = on_beat  # also run on the thread at every beat (a plain program's peers' non-finite stop)
        self._step = -1
        # (the marked phase the training thread is in, None between steps; when it last progressed): one tuple, so
        # the watchdog thread reads both at once.
        self._at: tuple[str | None, float] = (FIRST_STEP, time.monotonic())
        self._gap = 0.0  # the longest pause so far of the phase occurrence in progress
        self._longest: dict[str, float] = {}  # phase -> the longest pause of its earlier occurrences
        # Appended by the training thread; the watchdog thread reads them whole (sorted(), list() and len() of a
        # deque run under the GIL without yielding it).
        self._steps: deque[float] = deque(maxlen=STEPS_KEPT)  # seconds between two steps, outside marked phases
        self._compute: deque[float] = deque(maxlen=50)  # this rank's own time per step: batch start to backward
        self._data: deque[float] = deque(maxlen=50)  # its wait for data: previous batch end to this batch start
        self._batch_start = self._batch_end = 0.0
        self._busy = 0  # >0 while a pause of its own runs (a plain program waiting for its peers' NaN stop)
        self.report_every_s = report_every_s
        self._flagged: dict[int, int] = {}  # rank -> consecutive reports that found it slow
        self._reported: set[int] = set()
        self._main = threading.main_thread().ident or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(self._stop,), name="runner-watchdog", daemon=True)
        self.host = socket.gethostname()

    @property
    def request(self) -> Path:
        return self.rd.hang_request(self.attempt)

    def start(self) -> Watchdog:
        """Watch from now on; again after ``stop`` (a fit run again from an earlier checkpoint after this one failed
        to load, ``runner.job.fallback``): a fresh thread, the stopped one ends on its own event."""
        if self._thread.ident is not None:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, args=(self._stop,), name="runner-watchdog", daemon=True)
        self._at, self._gap = (FIRST_STEP, time.monotonic()), 0.0  # the first step's clock starts here
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def beat(self, step: int, now: float | None = None) -> None:
        """Called by the training thread at every step: a few assignments, no I/O. A step ends any phase."""
        now = time.monotonic() if now is None else now
        self._batch_end = now
        if step != self._step:
            ph, since = self._at
            if ph is None:
                self._steps.append(now - since)
            else:
                self._close(ph, since, now)
            self._step, self._at = step, (None, now)

    def stepped(self, step: int) -> float:
        """A plain program's one call per step (``runner.progress``): ``beat`` where no hook marks the batch's start
        or its backward, so the whole step is this rank's own time (a data wait cannot be told apart: none is
        counted). Returns the time it read."""
        now = time.monotonic()
        if step != self._step:
            ph, since = self._at
            if ph is None:
                self._steps.append(now - since)
                self._compute.append(now - since)
                self._data.append(0.0)
            else:
                self._close(ph, since, now)
            self._step, self._at = step, (None, now)
        self._batch_end = now
        return now

    def batch_start(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._batch_end:
            self._data.append(now - self._batch_end)
        self._batch_start = now
        ph = self._at[0]
        if ph is not None and ph != FIRST_STEP:  # a checkpoint, an epoch's end or start: over once a batch starts
            self._close(ph, self._at[1], now)
            self._at = (None, now)

    def before_backward(self) -> None:
        if self._batch_start:
            self._compute.append(time.monotonic() - self._batch_start)

    def enter(self, ph: str, now: float | None = None) -> None:
        """The training thread enters a phase in which a long pause is legitimate (``MARKED``); the same phase
        again is progress within it (a validation batch). Before the first step, nothing: ``first_step_s`` holds."""
        now = time.monotonic() if now is None else now
        current, since = self._at
        if current == FIRST_STEP:
            return
        if current == ph:
            self._gap = max(self._gap, now - since)
        elif current is not None:
            self._close(current, since, now)
        self._at = (ph, now)

    def leave(self, now: float | None = None) -> None:
        """The phase is over (a validation's end): the step clock restarts."""
        now = time.monotonic() if now is None else now
        current, since = self._at
        if current is not None and current != FIRST_STEP:
            self._close(current, since, now)
            self._at = (None, now)

    def _close(self, ph: str, since: float, now: float) -> None:
        """End an occurrence of ``ph``: its longest pause is what the next occurrence is measured by."""
        if ph not in UNLEARNED and ph != CHECKPOINT_WRITE:  # a wait says nothing of how long the next one may be
            self._longest[ph] = max(self._longest.get(ph, 0.0), self._gap, now - since)
        self._gap = 0.0

    def learn(self, ph: str, seconds: float) -> None:
        """A pause of ``ph`` measured elsewhere (a checkpoint's background write, which the next save may wait for):
        the next occurrence is measured by it too. From any thread: one dict item, replaced whole."""
        self._longest[ph] = max(self._longest.get(ph, 0.0), seconds)

    def busy(self, on: bool) -> None:
        """Around a long pause that is not a hang (a plain program waiting for its peers to stop); the stall clock
        restarts after it."""
        self._busy += 1 if on else -1
        self._at = (self._at[0], time.monotonic())

    def limit(self) -> float:
        """Seconds without progress that make a hang, in the phase the training thread is in now."""
        return self._allowance(self._at[0])

    def _allowance(self, ph: str | None) -> float:
        return allowance(ph, list(self._steps), self._longest, factor=self.factor, floor_s=self.floor_s,
                         phase_s=self.phase_s, first_step_s=self.first_step_s)

    def overdue(self, now: float) -> tuple[float, float] | None:
        """(seconds without progress, the limit) once they make a hang; None while they do not."""
        ph, since = self._at
        stalled, lim = now - since, self._allowance(ph)
        return (stalled, lim) if stalled > lim and not self._busy else None

    def _heartbeat(self) -> None:
        recent = list(self._steps)[-50:]
        atomic_write(self.rd.heartbeat(self.rank),
                     json.dumps({"rank": self.rank, "host": self.host, "pid": os.getpid(), "step": self._step,
                                 "time": time.time(), "attempt": self.attempt,
                                 "step_s": _median(recent), "compute_s": _median(self._compute),
                                 "data_s": _median(self._data)}))

    def _run(self, stop: threading.Event) -> None:
        next_beat = time.monotonic()
        next_report = next_beat + self.report_every_s
        requested = False
        while not stop.wait(min(self.interval_s, CHECK_S)):
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.interval_s
                try:
                    self._heartbeat()
                    if self.rank == 0 and time.monotonic() >= next_report:
                        next_report = time.monotonic() + self.report_every_s
                        self._report_stragglers()
                except OSError as e:  # a full or flaky shared filesystem must not stop training
                    log.warning("heartbeat not written: %s", e)
                if self._on_beat is not None:
                    self._on_beat()
                # Another rank's hang report asks this one for its own, busy or not: a rank slow to notice on its
                # own clock would otherwise be named as not responding.
                requested = self.request.exists()
            if requested or self.overdue(time.monotonic()):
                self._fire()
                return

    def _report_stragglers(self) -> None:
        """Rank 0: compare every rank's timings; a rank slow in two reports in a row goes to the ledger once (the host
        side alerts it: ``runner.host.notices``)."""
        beats = [b for p in RunDir.by_rank(self.rd.heartbeats).values()
                 if isinstance(b := read_json(p), dict) and b.get("attempt") == self.attempt]
        rows = stragglers.compare(beats)
        atomic_write(self.rd.stragglers, json.dumps({"time": time.time(), "ranks": rows}))
        slow = {r["rank"]: r for r in rows if r["slow"]}
        self._flagged = {rank: self._flagged.get(rank, 0) + 1 for rank in slow}
        for rank, times in self._flagged.items():
            if times >= 2 and rank not in self._reported:
                self._reported.add(rank)
                r = slow[rank]
                self.rd.record("straggler", rank=rank, node=r["node"], slow=r["slow"], step=r["step"],
                               compute_x=r["compute_x"], data_x=r["data_x"], compute_s=r["compute_s"],
                               data_s=r["data_s"], attempt=self.attempt)
                log.warning("rank %d on %s is a straggler: %s %.1fx the median", rank, r["node"], r["slow"],
                            r["compute_x"] if r["slow"] == "forward" else (r["data_x"] or 0.0))

    def _fire(self) -> None:
        frames = _frames(self._main)
        during, since = self._at
        report = {"rank": self.rank, "host": self.host, "step": self._step, "phase": phase(frames),
                  "where": innermost_user_frame(frames) or (frames[-1] if frames else None),
                  "stack": frames[-25:], "stalled_s": round(time.monotonic() - since, 1), "during": during,
                  "limit_s": None if math.isinf(lim := self._allowance(during)) else round(lim, 1)}
        log.error("no progress for %.0f s (limit %.0f s%s) at step %d; this rank is in %s", report["stalled_s"],
                  lim, f", in its {during}" if during else "", self._step, report["phase"])
        try:
            atomic_write(self.rd.hang_report(self.attempt, self.rank), json.dumps(report, indent=1))
            self.request.touch()
            self._conclude()
        except OSError as e:
            log.error("hang report not written: %s", e)
        logging.shutdown()
        self.rd.write_rank_exit(self.rank, self.attempt, EXIT_HANG)
        self._exit(EXIT_HANG)

    def _conclude(self) -> None:
        """Wait for the other ranks' reports; the lowest reporting rank writes the summary.

        Every live rank answers the request within one beat; the wait is ``3 x interval``, longer (up to
        ``10 x interval``) while a rank without a report still beats: a loaded node's thread may answer late, and
        a live rank named "not responding" would send the hunt to the wrong node. A stopped rank stops beating: once
        each rank without a report has been silent for two beats, one beat of waiting is enough, and none where each
        had been silent for two beats when asked (a stopped rank named after the floor's seconds: its heartbeat thread
        beats every interval whatever the training thread does, so one silent that long is stopped, dead, or stuck
        in code that holds the GIL).
        """
        asked = time.time()
        start = time.monotonic()
        reports: dict[int, dict[str, Any]] = {}
        while len(reports) < self.world:
            reports = self._reports()
            waited = time.monotonic() - start
            if waited >= 10 * self.interval_s or (waited >= 3 * self.interval_s
                                                  and not self._beating(set(reports), asked)) \
                    or (waited >= self.interval_s + CHECK_S
                        and not self._beating(set(reports), time.time() - self.interval_s)) \
                    or not self._beating(set(reports), asked - self.interval_s):
                break
            time.sleep(0.2)
        if not reports or (min(reports) != self.rank and self._summary_written()):
            return
        if min(reports) != self.rank:  # the lowest reporter died before its summary (its peers' exits end it)
            reports = self._reports()
        summary = summarize(reports, self.world, self.rd.rank_hosts(self.attempt))
        summary.update(step=max(int(r.get("step", -1)) for r in reports.values()), attempt=self.attempt,
                       time=time.time(), world=self.world)
        atomic_write(self.rd.hang, json.dumps(summary, indent=1))
        self.rd.record("hang", summary=summary["summary"], nodes=summary["nodes"], step=summary["step"])
        # The exit hook reads the agreed exit code from here (rank 0 may be the stuck one).
        env = jobenv.current()
        self.rd.write_last_exit(EXIT_HANG, env.job_id, env.restart_count)
        log.error("%s", summary["summary"])

    def _reports(self) -> dict[int, dict[str, Any]]:
        return {rank: rep for rank, p in RunDir.by_rank(self.rd.hang_reports(self.attempt)).items()
                if isinstance(rep := read_json(p), dict)}

    def _summary_written(self) -> bool:
        """Whether the lowest reporting rank wrote this hang's summary, waiting up to ``10 x interval``: a rank that
        exits at once closes its connections, and a peer still gathering reports dies of that in its collective
        before it can write one (seen under Apptainer: no summary at all)."""
        deadline = time.monotonic() + 10 * self.interval_s
        while time.monotonic() < deadline:
            h = read_json(self.rd.hang)
            if isinstance(h, dict) and h.get("attempt") == self.attempt:
                return True
            time.sleep(0.2)
        return False

    def _beating(self, reported: set[int], since: float) -> bool:
        """Whether a rank that has not reported wrote a heartbeat of this attempt within an interval of ``since``."""
        for p in RunDir.by_rank(self.rd.heartbeats).values():
            b = read_json(p)
            if isinstance(b, dict) and b.get("attempt") == self.attempt and b.get("rank") not in reported \
                    and float(b.get("time", 0)) >= since - self.interval_s:
                return True
        return False
