"""runner as a library: ``import runner``, then ``runner.submit(...)``, ``runner.sweep(...)``, ``runner.find(...)``.

It runs where the CLI runs (a login node, a laptop, a notebook, a pipeline step) and calls the functions the CLI calls:
``submit.plan`` and ``submit.start``, ``sweep.plan`` and ``sweep.drive``, ``status.row``, ``status.cancel``,
``submit.resume_any``, ``report.write``. The difference is where a local run's driver lives: ``runner submit`` drives
it in the foreground until its attempt ends; here it runs in a process of its own (``runner.host.background``) and
``submit`` returns a ``Run`` at once, to ``wait`` on. A config is the unit, never a pickled function.

Every mistake a user can fix raises the ``runner.errors.RunnerError`` (``ConfigError``, ``InputError``,
``SubmitError``, ...) whose text ``runner`` prints as its one-line errors; anything else is a bug and keeps its
traceback. What the CLI would print (``submitted job 12: ...``) goes to the ``runner`` logger at INFO.

Importing this module imports no torch, Lightning or numpy (it is the login node's side: ``lint-imports``); ``import
runner`` imports it only when one of its names is first used.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

from runner import ledger, spec
from runner.errors import RunnerError, refused_by_filesystem
from runner.host import background, report, scheduler, status, sweep_report
from runner.host import submit as submission
from runner.host import sweep as sweeps
from runner.host.background import Driver
from runner.host.submit import Plan
from runner.host.sweep import SweepPlan
from runner.records import SweepMark
from runner.rundir import RunDir
from runner.spec.typed import RunConfig, read_resolved

__all__ = ["Event", "Plan", "Run", "Sweep", "SweepPlan", "execute", "find", "find_sweep", "plan", "plan_sweep", "runs",
           "submit", "sweep", "validate"]

log = logging.getLogger("runner.api")
PathLike = str | os.PathLike[str]
POLL_S = 0.5  # how often ``wait`` looks at a run it did not start (Slurm's, another process's)


@contextlib.contextmanager
def _said() -> Iterator[None]:
    """What the CLI's functions print (``submitted job 12: RUN``), as INFO records of the ``runner.api`` logger; the
    file system's refusal (read-only, not this user's, full) as the one-line error the CLI prints for it."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            yield
    except OSError as e:
        if isinstance(e, RunnerError) or (refused := refused_by_filesystem(e)) is None:
            raise
        raise refused from None
    finally:
        for line in out.getvalue().splitlines():
            if line.strip():
                log.info("%s", line)


@dataclass(frozen=True)
class Event:
    """One line of a run's ledger (``runner.ledger``): its name, when, and its fields (those ``ledger`` names for it;
    a line a newer runner wrote may hold more)."""

    event: ledger.EventName
    time: float
    fields: Mapping[str, Any]


class Run:
    """A run directory: what a submission returns, and what ``find`` looks up.

    Every property reads the run directory (and asks Slurm, for a Slurm run) when it is read: a ``Run`` holds no state
    of its own but the background driver of a local run this process started."""

    def __init__(self, path: PathLike, driver: Driver | None = None) -> None:
        self.dir = RunDir(Path(path).resolve())
        self._driver = driver

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r})"

    @property
    def path(self) -> Path:
        return self.dir.root

    @property
    def name(self) -> str:
        """The run directory's name (``NAME-YYYYmmdd-HHMMSS``), as ``runner status`` lists it."""
        return self.dir.name

    def status(self) -> dict[str, Any]:
        """The run's row of ``runner status --json``: state, job id, last checkpoint, restarts, goodput, ..."""
        return status.row(self.dir)

    @property
    def state(self) -> str:
        """pending, running, completed, failed, cancelled, timeout, preempted or interrupted (``runner status``)."""
        return str(self.status()["state"])

    @property
    def config(self) -> RunConfig:
        """The resolved config the run trains with (its ``config.yaml``: overrides and sweep values applied)."""
        return read_resolved(self.dir.config)

    @property
    def sweep(self) -> SweepMark | None:
        """The sweep this run is a point of (id, index, size, its values), or None."""
        return (self.dir.manifest_record() or {}).get("sweep")

    def ended(self) -> bool:
        """Whether the run has stopped until someone (or ``runner cron``) starts it again: finished, or its attempt
        ended and nothing runs; False while it waits to start (a sweep's point in the queue) or trains."""
        if self._driver is not None and self._driver.process.poll() is None:
            return False
        return status.ended(self.dir) is True and self.state not in ("pending", "running")

    def wait(self, timeout: float | None = None) -> str:
        """Wait until the run ``ended``; returns its state.

        Raises:
            TimeoutError: it has not ended after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._driver is not None:
            try:
                self._driver.wait(timeout)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"run {self.name}: still {self.state} after {timeout:g} s") from None
        while not self.ended():
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {self.name}: still {self.state} after {timeout:g} s")
            time.sleep(POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic())))
        return self.state

    def events(self) -> list[Event]:
        """The run's ledger, oldest first, each line as an ``Event`` (lines of names this runner does not know are
        left out)."""
        return [Event(e["event"], float(e.get("time", 0.0)), {k: v for k, v in e.items() if k not in ("event", "time")})
                for e in self.dir.events() if e.get("event") in ledger.EVENT_NAMES]

    def logs(self, rank: int | None = 0, attempt: int | None = None) -> str:
        """One rank's log of one attempt (default: the latest), or with ``rank=None`` the part of Slurm's batch output
        that attempt wrote, as ``runner logs`` prints it.

        Raises:
            RunnerError: no such log (yet).
        """
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status.logs(self.dir, rank, False, attempt=attempt)
        return out.getvalue()

    def cancel(self, wait_s: float = 30) -> None:
        """``runner cancel``: every rank checkpoints and exits (a local run's are killed after ``wait_s``); it is
        never resubmitted. Returns once it stopped."""
        with _said():
            status.cancel(self.dir, wait_s)
        if self._driver is not None:
            self._driver.wait()

    def resume(self, *overrides: str, force: bool = False) -> Run:
        """``runner resume``: start the stopped run again from its newest complete checkpoint, optionally on other
        capacity (``num_nodes=N``, ``num_device=M``); a local run's driver runs in the background again. Returns
        this run.

        Raises:
            SubmitError: refused (it still runs, its records are damaged, a layout that changes its global batch).
        """
        if scheduler.of_manifest(self.dir.manifest_record() or {}).detached:
            with _said():
                submission.resume_any(self.dir, list(overrides), force=force)
        else:
            with _said():
                self._driver = background.resume(self.dir, list(overrides), force=force)
        return self

    @property
    def report_path(self) -> Path:
        """Where ``report`` writes the run's page (``RUN/report.html``)."""
        return self.dir.report_page

    def report(self, out: PathLike | None = None) -> Path:
        """Write the run's report page (``runner report``) and return its path."""
        with _said():
            return report.write(self.dir, Path(out) if out is not None else None)


class Sweep:
    """A sweep's points, each an ordinary ``Run``: what ``sweep`` returns, and what ``find_sweep`` looks up."""

    def __init__(self, folder: PathLike, driver: Driver | None = None) -> None:
        self.folder = sweeps.SweepDir(Path(folder).resolve())
        self._driver = driver

    def __repr__(self) -> str:
        return f"Sweep({self.id!r})"

    @property
    def id(self) -> str:
        return self.folder.id

    def points(self) -> list[dict[str, str]]:
        """Every point's values, by index (key.path -> value as written)."""
        return self.folder.points()

    def runs(self) -> list[Run]:
        """The runs written so far, by point index."""
        return [Run(r.root) for r in self.folder.runs().values()]

    def states(self) -> dict[int, str]:
        """Each point's state by index; ``missing`` for one whose run directory was never written."""
        written = self.folder.runs()
        return {i: Run(written[i].root).state if i in written else "missing" for i in range(len(self.points()))}

    def running(self) -> bool:
        """Whether a driver runs the sweep now (it holds the sweep's lock); on Slurm, whether any of its runs is still
        queued or running."""
        if self._driver is not None:
            return self._driver.process.poll() is None
        if sweeps.held(self.folder):
            return True
        return self.folder.queued() and any(state in ("pending", "running") for state in self.states().values())

    def wait(self, timeout: float | None = None) -> dict[int, str]:
        """Wait until the sweep's driver ended (every point it could run has ended); returns ``states``.

        Raises:
            TimeoutError: it still runs after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.running():
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"sweep {self.id}: still running after {timeout:g} s")
            if self._driver is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._driver.wait(POLL_S)
            else:
                time.sleep(POLL_S)
        return self.states()

    @property
    def report_path(self) -> Path:
        """Where ``report`` writes the sweep's page (``RUN_ROOT/sweeps/ID/report.html``)."""
        return self.folder.report_page

    def report(self, out: PathLike | None = None) -> Path:
        """Write the page comparing the sweep's runs (``runner report --sweep``), and each run's page it links to
        where missing or stale; returns its path."""
        with _said():
            return sweep_report.write(self.folder, Path(out) if out is not None else None)

    def resume(self, parallel: int | None = None) -> Sweep:
        """``runner sweep --resume``: start or resume every point that is not completed, in the background.

        Raises:
            SubmitError: a driver runs the sweep already.
        """
        with _said():
            self._driver = background.sweep(self.folder.root, self.folder.driver, self.folder.console_log, parallel)
        return self


# ---------------------------------------------------------------------------------------------------------------
# Submit, sweep


def validate(config: PathLike, *overrides: str) -> spec.Config:
    """``runner validate``: the config loaded and checked as ``submit`` would check it here.

    Raises:
        ConfigError: every problem, one line each.
    """
    return spec.load(Path(config), list(overrides))


def plan(config: PathLike, *overrides: str, allow_missing_image: bool = False) -> Plan:
    """``runner submit --dry-run``: everything a submission would write and run, changing nothing; ``str(plan)`` is
    the dry run's text, ``plan.files`` the files, ``plan.argv`` the command. ``execute(plan)`` submits it."""
    return submission.plan(Path(config), list(overrides), allow_missing_image=allow_missing_image)


def plan_sweep(config: PathLike, *axes: str, points: PathLike | None = None, parallel: int | None = None,
               allow_missing_image: bool = False) -> SweepPlan:
    """``runner sweep --dry-run``: every point's plan (``.plans``, ``.points``) and, on Slurm, the job array
    (``.array``), changing nothing. ``axes`` are ``key.path=v1,v2,...``; ``points`` a YAML file of explicit points."""
    return sweeps.plan(Path(config), list(axes), Path(points) if points is not None else None, parallel,
                       allow_missing_image)


@overload
def execute(p: Plan) -> Run: ...
@overload
def execute(p: SweepPlan) -> Sweep: ...


def execute(p: Plan | SweepPlan) -> Run | Sweep:
    """Submit what ``plan`` or ``plan_sweep`` planned; returns once the run (or the sweep's driver) started.

    Raises:
        SubmitError: the scheduler refused it (a Slurm sweep's job array included), or its image is missing.
    """
    if isinstance(p, SweepPlan):
        with _said():
            written = sweeps.prepare(p)
            folder = written.sweep
            if written.array is not None:  # Slurm: one job array, queued; its tasks are the sweep's runs
                sweeps.submit_array(written)
                return Sweep(folder.root)
            driver = background.sweep(folder.root, folder.driver, folder.console_log, written.parallel)
        return Sweep(folder.root, driver)
    submission.warn(p)
    with _said():
        started = submission.start(p, detach=True)
    return Run(started.run.root, started.driver)


def submit(config: PathLike, *overrides: str, allow_missing_image: bool = False) -> Run:
    """``runner submit``: validate, write the run directory and start the run (a local run's driver in the
    background; a Slurm run queued); returns the ``Run`` once it started. ``overrides`` are ``key.path=value``.

    Raises:
        ConfigError: the config (every problem, the text ``runner submit`` prints), exit code 2.
        SubmitError: the scheduler refused it, or its image is missing.
    """
    return execute(plan(config, *overrides, allow_missing_image=allow_missing_image))


def sweep(config: PathLike, *axes: str, points: PathLike | None = None, parallel: int | None = None,
          allow_missing_image: bool = False) -> Sweep:
    """``runner sweep``: plan every point, write them, and run them in the background (locally ``parallel`` at a
    time, default 1); returns the ``Sweep`` once its driver runs."""
    return execute(plan_sweep(config, *axes, points=points, parallel=parallel,
                              allow_missing_image=allow_missing_image))


# ---------------------------------------------------------------------------------------------------------------
# Look up


def find(name: PathLike, root: PathLike = "runs") -> Run:
    """A run by its directory, its directory's name under ``root``, or its run name (or a prefix): the newest.

    Raises:
        InputError: no run matches, or a prefix matches runs of several names.
    """
    return Run(status.find_run(os.fspath(name), Path(root)).root)


def runs(root: PathLike = "runs", sweep: str | None = None) -> list[Run]:
    """The runs under ``root`` (only those of one sweep, by its id, with ``sweep``), as ``runner status`` lists them."""
    rows = status.collect(None, Path(root))
    return [Run(r["path"]) for r in rows
            if sweep is None or (isinstance(r.get("sweep"), dict) and r["sweep"].get("id") == sweep)]


def find_sweep(sweep_id: str, root: PathLike = "runs") -> Sweep:
    """A sweep by its id (``sweep-NAME-YYYYmmdd-HHMMSS``) under ``root``, or by its folder.

    Raises:
        InputError: no such sweep.
    """
    return Sweep(sweeps.find(sweep_id, Path(root)).root)

