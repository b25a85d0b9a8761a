"""The stop flag: a signal (the time limit's, scancel's SIGTERM) asks training to stop at its next agreed step.

The launcher installs the handlers before anything else (a signal may come seconds after the job starts); the
checkpoint callback reads the flag at step boundaries and never checkpoints inside a handler. Standard library only:
the launcher imports it before torch.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

log = logging.getLogger("runner.job.callback")  # rank logs name this line runner's callback's, as before the split


class StopFlag:
    """Set by a signal handler; read at the next step boundary (never checkpoint inside a handler)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.installed: set[int] = set()

    def install(self, signame: str) -> None:
        sig = getattr(signal, f"SIG{signame}")
        if sig in self.installed:
            return
        self.installed.add(sig)
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: FrameType | None) -> None:
            self.set(signum)
            if callable(previous):
                previous(signum, frame)

        signal.signal(sig, handler)

    def set(self, signum: int, frame: FrameType | None = None) -> None:
        self.signum = signum
        log.info("received %s; checkpointing at the next agreed step", signal.Signals(signum).name)

    def take_over_sigterm(self) -> None:
        """Replace Lightning's SIGTERM handler (it broadcasts inside the handler and stops each rank on its own
        flag): SIGTERM then stops the ranks at an agreed step, with a checkpoint, like the requeue signal.
        Lightning's teardown puts back the handler that was there before ``fit``."""
        signal.signal(signal.SIGTERM, self.set)


_FLAG: list[StopFlag] = []


def stop_flag(signame: str = "USR2") -> StopFlag:
    """This process's one stop flag, its handlers installed on first use: the launcher installs them before
    anything else (a signal may come seconds after the job starts), and a program's callback finds the same flag."""
    if not _FLAG:
        _FLAG.append(StopFlag())
    flag = _FLAG[0]
    flag.install(signame)
    if signame != "TERM":
        flag.install("TERM")  # scancel / preemption: checkpoint at the next step if the grace time allows
    return flag
