"""``runner.progress(step, loss=...)``: one line in a plain program's training loop gives it what runner's Lightning
callback gives a Trainer, where a program allows it.

A program that trains no Lightning ``Trainer`` (a torchrun-style script, its own loop) shows runner no steps. One call
per optimizer step, ``runner.progress(step, loss=loss.item())``, gives it:

- the hang watchdog and step timings: the same ``runner.job.watchdog.Watchdog`` as a Trainer's, started at the
  first call and fed at each (heartbeats with the step; a hang names who is stuck where and exits 79);
- the non-finite guard on the loss: a NaN or inf stops every rank at that step, with the ledger's ``nonfinite``
  event and exit 80, as ``runner.job.guards`` stops a Trainer (for a Trainer the reduced gradients decide; a plain
  program gives its loss, and a rank that saw a non-finite one tells the others through the run directory: their
  watchdog threads stop them, also in the middle of a collective that waits for this rank);
- ``progress.json`` (rank 0, every few seconds: the terminal's progress line), the ledger's ``train_start`` at the
  first step (goodput tells startup from training) and so the report's steps chart.

Outside a run of runner's (no ``RUNNER_PROGRAM_RUN_DIR`` in the environment: a laptop, a test, a login node) every
call is a no-op. Standard library only at import: ``import runner`` stays cheap and torch-free; runner's job modules
are imported at the first call in a run. ``automatic(step)`` is the same without a loss, for a hook that sees every
optimizer step of a program that never calls ``progress``: once ``progress`` is called, ``automatic`` does nothing
for the rest of the process.

Each call is a few attribute reads, one clock read and a float comparison (BENCHMARKS.md: ns per call).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

log = logging.getLogger("runner.job.callback")  # rank logs name runner's in-process lines this way

PROGRESS_S = 2.0  # progress.json at most this often (runner.job.ckpt_callback.PROGRESS_S)


class _Run:
    """runner's side of one rank of a program, built at the first call in a run."""

    def __init__(self, run_dir: str, step: int) -> None:
        from pathlib import Path

        from runner.job import jobenv, watchdog
        from runner.job.resume import current_attempt
        from runner.rundir import RunDir, read_json
        from runner.spec.typed import read_resolved

        self.rd = rd = RunDir(Path(run_dir))
        cfg = read_resolved(rd.config)
        env = jobenv.current()
        self.rank, self.world, self.attempt = env.rank, env.world_size, current_attempt(rd)
        self.stopping = False
        self.next_progress = 0.0
        self.last: tuple[int, float | None] = (step, None)
        self.first_at = self.last_at = time.monotonic()  # rank 0: the first and the last step's ends (``seen``)
        self.first = step
        w = cfg["watchdog"]
        self.wd: Any = watchdog.Watchdog(rd, self.rank, self.world, self.attempt, factor=w["factor"],
                                         floor_s=w["plain_floor_s"], report_every_s=w["straggler_report_s"],
                                         on_beat=self._peer_stopped).start() if w["enabled"] else None
        if self.rank == 0:
            import atexit

            atexit.register(self.write_progress)  # the last step, whenever the program ends
            before = read_json(rd.progress, {})
            earlier = before.get("step") if isinstance(before, dict) else None
            lost = max(earlier - step, 0) if isinstance(earlier, int) and before.get("attempt") != self.attempt else 0
            rd.record("train_start", step=step, lost_steps=lost, attempt=self.attempt, resumed_from=None)
        log.info("runner.progress: the program's steps feed runner's %s from step %d",
                 "watchdog, non-finite guard and progress" if self.wd else "non-finite guard and progress "
                 "(watchdog.enabled: false)", step)

    def step(self, step: int, loss: float | None) -> None:
        now = self.wd.stepped(step) if self.wd is not None else time.monotonic()
        if loss is not None and loss - loss != 0:  # NaN or inf (inf - inf is NaN): one float operation
            self.nonfinite(step, loss)
        if self.rank == 0:
            self.last, self.last_at = (step, loss), now
            if now >= self.next_progress:
                self.write_progress()

    def write_progress(self) -> None:
        import json

        from runner.rundir import atomic_write

        self.next_progress = time.monotonic() + PROGRESS_S
        step, loss = self.last
        shown = {"loss": float(loss)} if loss is not None and loss - loss == 0 else {}
        try:
            atomic_write(self.rd.progress, json.dumps({"step": step, "time": time.time(), "attempt": self.attempt,
                                                       **shown}) + "\n",
                         durable=False)
        except OSError as e:  # advisory: a full disk must not stop training
            log.warning("progress.json not written: %s", e)

    def nonfinite(self, step: int, loss: float) -> None:
        """Stop every rank at this step: say so once (the ledger's ``nonfinite``, the launcher's exit code for the
        exit hook), tell the other ranks, wait until they stopped (a peer in a collective with this rank would
        otherwise die of its closed connection, a failure instead of a NaN), then exit ``EXIT_NONFINITE``."""
        from runner.job import jobenv
        from runner.rundir import EXIT_NONFINITE

        rd, what = self.rd, f"loss {float(loss)}"
        log.error("non-finite %s at step %d: training stops (runner.progress)", what, step)
        self.stopping = True
        stop = rd.nonfinite_stop(self.attempt)
        stop.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(stop, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            first = True
        except FileExistsError:
            first = False  # another rank saw one at the same step and said so
        if first:
            rd.record("nonfinite", step=step, what=what, skipped_in_a_row=0)
            env = jobenv.current()
            rd.write_last_exit(EXIT_NONFINITE, env.job_id, env.restart_count)
        self._seen()
        deadline = time.monotonic() + (5 * self.wd.interval_s + 2 if self.wd is not None else 2.0)
        seen = rd.nonfinite_seen(self.attempt, 0).parent
        if self.wd is not None:
            self.wd.busy(True)  # waiting for the others is no hang
        while time.monotonic() < deadline and sum(1 for _ in seen.iterdir()) < self.world:
            time.sleep(0.05)
        if self.wd is not None:
            self.wd.stop()
        _exit(EXIT_NONFINITE)

    def _seen(self) -> None:
        seen = self.rd.nonfinite_seen(self.attempt, self.rank)
        seen.parent.mkdir(parents=True, exist_ok=True)
        seen.touch()

    def _peer_stopped(self) -> None:
        """On the watchdog thread, at every beat: another rank saw a non-finite loss; stop here too, wherever the
        training thread is (most likely in a collective that waits for that rank)."""
        if self.stopping or not self.rd.nonfinite_stop(self.attempt).exists():
            return
        from runner.rundir import EXIT_NONFINITE

        self.stopping = True
        log.error("another rank saw a non-finite loss: training stops (runner.progress)")
        self._seen()
        logging.shutdown()
        os._exit(EXIT_NONFINITE)


def _exit(code: int) -> None:
    """End the rank with ``code``: as ``SystemExit`` where runner's launcher runs the program in its own process (it
    turns it into the rank's exit code, and its own exit avoids the interpreter's teardown, where a live gloo group
    may abort), else at once (a program in a child process)."""
    if "runner.job.program" in sys.modules:
        raise SystemExit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


_run: Any = None  # None: not looked at yet; False: not in a run of runner's; else this rank's _Run
_manual = False  # progress() was called: automatic() steps aside


def _start(step: int) -> Any:
    global _run
    run_dir = os.environ.get("RUNNER_PROGRAM_RUN_DIR")  # runner.job.jobenv.PROGRAM_ENV (not imported: stays cheap)
    if not run_dir:
        _run = False
        return False
    _run = _Run(run_dir, step)
    return _run


def seen() -> tuple[int | None, float | None] | None:
    """What this process showed runner of its training, for the end of a program (``runner.job.program``): None when
    no step (neither ``progress`` nor ``automatic`` in a run); else rank 0's last step and its productive seconds,
    ``(None, None)`` on the other ranks.

    The productive seconds price every step up to the last (from step 0 of the program's numbering) at this
    process's mean step time: a program that resumed from its own snapshot and numbers its steps on (``progress``) is
    credited with the steps it kept, one whose steps are counted here (``automatic``, from 1 in each process) with
    this process's. None with fewer than two steps (no mean to price them at)."""
    if not _run:
        return None
    run = _run
    if run.rank != 0:
        return None, None
    last = run.last[0]
    if last <= run.first:
        return last, None
    return last, (run.last_at - run.first_at) * last / (last - run.first)


def progress(step: int, loss: float | None = None) -> None:
    """Tell runner that this rank finished optimizer step ``step`` (any numbering that grows), with its loss as a
    Python number (``loss.item()``; None: no non-finite check). A no-op outside a run of runner's."""
    global _manual
    run = _run if _run is not None else _start(step)
    if run is not False:
        _manual = True
        run.step(step, loss)


def automatic(step: int) -> None:
    """``progress`` without a loss, from a hook that sees every optimizer step; ignored once ``progress`` was
    called in this process."""
    if _manual:
        return
    run = _run if _run is not None else _start(step)
    if run is not False:
        run.step(step, None)
