"""One logging setup for every entry point: the CLI, the batch script's hooks, cron and the launcher.

User-facing output (tables, plans, what a command did) is printed; diagnostics go through ``logging`` under the
``runner`` logger. On a terminal a record reads ``runner: warning: ...``; where output lands in a file (cron, the
exit hook, rank logs) every record carries a timestamp and its module, so a 3 a.m. reader can line logs up.
"""

from __future__ import annotations

import logging
import os
import sys

PLAIN = "runner: %(levelname_lower)s%(message)s"
STAMPED = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        level = record.levelname.lower()
        record.levelname_lower = "" if level == "info" else f"{level}: "
        return super().format(record)


_FACTORY: list[object] = []


def _scrubbing_records() -> None:
    """Every log record of this process, whatever handler writes it (stderr, a driver's log file), without the
    webhook URLs the process knows (``runner.redaction``): installed once."""
    if _FACTORY:
        return
    from runner import redaction

    make = logging.getLogRecordFactory()

    def factory(*args: object, **kwargs: object) -> logging.LogRecord:
        record = make(*args, **kwargs)
        if record.name.startswith("runner"):
            try:
                text = record.getMessage()
            except Exception:  # a bad format string: logging reports it, as it would have
                return record
            clean = redaction.scrub(text)
            if clean != text:
                record.msg, record.args = clean, None
        return record

    logging.setLogRecordFactory(factory)
    _FACTORY.append(factory)


def setup(verbosity: int = 0, stamped: bool | None = None) -> None:
    """Configure the ``runner`` logger once per process.

    ``verbosity``: -1 warnings only (``-q``), 0 info, 1 debug (``-v``, also ``RUNNER_VERBOSE=1``: every command
    runner runs). ``stamped``: timestamps and module names; by default when stderr is not a terminal.
    """
    _scrubbing_records()
    if os.environ.get("RUNNER_VERBOSE"):
        verbosity = max(verbosity, 1)
    level = {-1: logging.WARNING, 0: logging.INFO}.get(verbosity, logging.DEBUG)
    if stamped is None:
        stamped = not sys.stderr.isatty()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(STAMPED if stamped else PLAIN, datefmt="%Y-%m-%dT%H:%M:%S"))
    root = logging.getLogger("runner")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception as one line (``Type: message``), for reports where one bad run is one line."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}" if text else type(e).__name__
