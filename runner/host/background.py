"""A local run's driver in a process of its own, for callers that do not wait in the foreground: the Python API's
``submit`` and ``resume``, and a sweep's points run N at a time.

The process runs what ``runner submit`` and ``runner resume`` run (``Local.start``, ``submit.resume_any``), with its
output in the run's ``console.log``, in a session of its own (a Ctrl-C at the caller's terminal is the caller's to
pass on; ``runner cancel`` finds it in the run's ``owner.json``, as it finds a foreground driver). The caller gets it
back once the run recorded its start (``submitted``/``resubmitted`` in its ledger), or, when it ended before that, the
error it ended with, raised here as the same typed one-line error the CLI prints.

A sweep's driver (``runner.host.sweep.drive``) runs the same way for the Python API. The process's own side is
``runner.host.detached``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runner import errors
from runner.errors import ConfigError, RunnerError
from runner.rundir import RunDir, read_json

ERROR_FD_ENV = "RUNNER_ERROR_FD"  # where the driver writes the RunnerError it ended with (one JSON object)
STARTED = ("submitted", "resubmitted")  # what Local.start and Local.restart record just before the ranks start
START_WAIT_S = 120.0  # how long a caller waits for the driver to say it started (a resize writes files first)


@dataclass
class Driver:
    """The process driving one local run (or a sweep) in the background."""

    process: subprocess.Popen[bytes]

    def wait(self, timeout: float | None = None) -> int:
        """The driver's exit code (the run's, as ``runner submit`` returns it) once it ended.

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
        """
        return self.process.wait(timeout)


def start(run: RunDir, world_size: int) -> Driver:
    """Start a written run's first attempt in the background (``Local.start``)."""
    before = len(run.events())
    return _spawn(["start", str(run.root), str(world_size)], run.console_log, lambda pid: _started(run, before))


def resume(run: RunDir, overrides: list[str], force: bool = False) -> Driver:
    """Start a stopped local run's next attempt in the background (``submit.resume_any``): refusals raise here."""
    before = len(run.events())
    return _spawn(["resume", str(run.root), *(["--force"] if force else []), *overrides], run.console_log,
                  lambda pid: _started(run, before))


def sweep(folder: Path, driver_record: Path, console_log: Path, parallel: int | None = None) -> Driver:
    """Drive a written sweep in the background (``runner.host.sweep.drive``); back once it holds the sweep (its
    ``driver_record`` names the process)."""
    def holds(pid: int) -> bool:
        who = read_json(driver_record)
        return isinstance(who, dict) and who.get("pid") == pid

    return _spawn(["sweep", str(folder), *([str(parallel)] if parallel else [])], console_log, holds)


def _spawn(args: list[str], console_log: Path, ready: Callable[[int], bool]) -> Driver:
    """Start ``args`` as a driver process (its output appended to ``console_log``) and wait until ``ready(pid)`` or
    until it ended; a RunnerError it ended with is raised here."""
    read_end, write_end = os.pipe()
    try:
        with open(console_log, "ab") as out:
            process = subprocess.Popen([sys.executable, "-m", "runner.host.detached", *args],
                                       stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True, pass_fds=(write_end,),
                                       env={**os.environ, ERROR_FD_ENV: str(write_end)})
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    with os.fdopen(read_end, "rb") as said:
        deadline = time.monotonic() + START_WAIT_S
        while process.poll() is None and not ready(process.pid):
            if time.monotonic() > deadline:
                break  # still working before its start (a slow disk): the caller's wait() goes on from here
            time.sleep(0.02)
        if process.poll() is not None and (error := _error(said.read())) is not None:
            raise error
    return Driver(process)


def _started(run: RunDir, before: int) -> bool:
    return any(e["event"] in STARTED for e in run.events()[before:])


def _error(said: bytes) -> RunnerError | None:
    """The driver's RunnerError, rebuilt as its class in ``runner.errors`` (a class of another module as a
    RunnerError) with its text and exit code; None where it wrote none."""
    try:
        record = json.loads(said)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("message"), str):
        return None
    cls = getattr(errors, str(record.get("kind")), RunnerError)
    if not (isinstance(cls, type) and issubclass(cls, RunnerError)):
        cls = RunnerError
    error = cls(record["message"].splitlines()) if issubclass(cls, ConfigError) else cls(record["message"])
    if isinstance(record.get("exit_code"), int):
        error.exit_code = record["exit_code"]
    return error
