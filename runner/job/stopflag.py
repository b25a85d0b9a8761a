"""The stop flag: a signal (the time limit's, scancel's SIGTERM) asks training to stop at its next agreed step.

The launcher installs the handlers before anything else (a signal may come seconds after the job starts); the
checkpoint callback reads the flag at step boundaries and never checkpoints inside a handler. Standard library only:
the launcher imports it before torch.

In program mode (``for_program``) only a Lightning fit that runner's callback drives waits for a step boundary;
anywhere else in the program a signal means what it means without runner, as under torchrun: SIGINT raises
KeyboardInterrupt, and the stop notice and SIGTERM are the program's SIGTERM (torchrun's agent stops its workers with
it): its own handler runs, or the default action (the program ends, seen by the launcher as exit 143). A program that
installs a handler of its own for a signal gets that signal itself. The flag remembers that a stop came.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType
from typing import Any

log = logging.getLogger("runner.job.callback")  # rank logs name this line runner's callback's, as before the split


class StopFlag:
    """Set by a signal handler; read at the next step boundary (never checkpoint inside a handler)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.installed: set[int] = set()
        self.handlers: dict[int, Any] = {}
        self.program = False  # program mode: outside a fit runner drives, a signal gets its program meaning
        self.driving = False  # runner's callback drives a Lightning fit: a stop waits for an agreed step
        self.interrupted = False  # a SIGINT came (program mode)

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
            if self.program and not self.driving:
                self.terminate(frame)

        self.handlers[sig] = handler
        signal.signal(sig, handler)

    @property
    def stopped(self) -> bool:
        """Whether a stop signal (or a Ctrl-C) came to this process."""
        return self.signum is not None or self.interrupted

    def for_program(self) -> None:
        """Program mode, before the program starts: signals get their program meaning outside runner's fits."""
        self.program = True

        def interrupt(signum: int, frame: FrameType | None) -> None:
            self.interrupted = True
            log.info("received SIGINT")
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, interrupt)

    def terminate(self, frame: FrameType | None) -> None:
        """SIGTERM's meaning for the program: its own handler, or the default action (the process ends: here a
        SystemExit with the code a shell reports for it, so that the launcher records the stop)."""
        own = signal.getsignal(signal.SIGTERM)
        if own == signal.SIG_IGN:
            return
        if callable(own) and own != self.handlers.get(signal.SIGTERM) and own != self.set:
            own(signal.SIGTERM, frame)
            return
        raise SystemExit(128 + signal.SIGTERM)

    def set(self, signum: int, frame: FrameType | None = None) -> None:
        self.signum = signum
        if self.program and not self.driving:
            log.info("received %s: the program's SIGTERM", signal.Signals(signum).name)
        else:
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
