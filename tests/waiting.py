"""Waiting on something a test can see (a file, a record, a process state) instead of sleeping a guessed time."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def until(what: str, pred: Callable[[], T], timeout: float, every: float = 0.05,
          detail: Callable[[], object] | None = None) -> T:
    """pred()'s first truthy value, polled every `every` seconds; an AssertionError naming `what` after `timeout`,
    followed by `detail()` when given (what a person needs to see why: the last state, the run's logs).

    The one polling loop of the tests: a helper that waits for something of its own (a file, a job state) supplies
    only the predicate and the words. A predicate may raise itself to give up early (the process it waits on died).
    """
    deadline = time.monotonic() + timeout
    while not (got := pred()):
        if time.monotonic() > deadline:
            more = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{more}")
        time.sleep(every)
    return got


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (an orphan nobody reaped yet has ended)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def ended(pids: list[int], timeout: float = 60) -> None:
    """Every one of these processes has ended (a zombie counts as ended)."""
    until(f"process(es) {pids} to end", lambda: not any(alive(p) for p in pids), timeout)


def alerts_all_sent(run: Path) -> bool:
    """RUN/alerts/queue/ holds no alert: an entry leaves it only once delivered (runner.alerts.delivery), so every
    alert queued so far has reached the webhook and no sender is still on its way with one."""
    from runner.alerts.delivery import queue_dir

    q = queue_dir(run)
    return not q.is_dir() or not any(p.suffix == ".json" and not p.name.startswith(".") for p in q.iterdir())


def standby_warm(run: Path, tasks: int) -> bool:
    """The job's newest warm standby step (resume.in_job, runner.job.standby): every one of its ``tasks`` imported torch
    and Lightning and waits."""
    from runner.rundir import Standby

    folders = sorted((run / "standby").glob("*-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
    return bool(folders) and len(Standby(folders[-1]).present(warm=True)) == tasks
