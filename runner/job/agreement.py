"""The step agreement: every rank stops training at the same step, without a blocking collective per step."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from runner.job.stopflag import StopFlag

AGREE_S = 0.1  # aim: ranks compare stop flags about this often (or every step, when slower)
STOP, SUPERSEDED = "stop", "superseded"  # what the ranks agree on (Agreement.check)


def _verdict(stop: bool, superseded: bool) -> str | None:
    return SUPERSEDED if superseded else STOP if stop else None  # a superseded job writes nothing, not even on a signal


class Agreement:
    """Decides, identically on every rank, at which step training stops, without a blocking collective per step.

    At a check step every rank waits for the reduction it started at the previous check (long done by now), reads
    the verdict, and starts the next one, non-blocking: ``[stop flag, superseded, steps until the next check]``,
    reduced with MAX (rank 0 proposes the interval from its step time, so every rank agrees on the next check
    step). A signal is acted on within two intervals (0.2 s, or two steps); the stop step is the same on every
    rank, and the checkpoint is written there, so a preemption loses no step. ``superseded(step)`` is this rank's
    reading of the run's owner (``owner.Reader``): when any rank finds another job owns the run, every rank
    leaves at the same step, without a checkpoint.
    """

    def __init__(self, flag: StopFlag, superseded: Callable[[int], bool] = lambda step: False) -> None:
        self.flag = flag
        self.superseded = superseded
        self.next_check = -1
        self.every = 1
        self.work: dist.Work | None = None
        self.buf = torch.zeros(3, dtype=torch.int64)
        self.mark: tuple[float, int] | None = None

    def check(self, trainer: Any, step: int) -> str | None:
        """Called at every optimizer step boundary with the global step: STOP or SUPERSEDED when all ranks stop
        here (for that reason), else None. ``trainer``: Lightning's, or anything with its ``world_size``,
        ``global_rank`` and ``strategy.root_device``."""
        if step < self.next_check:  # most steps: nothing more to do
            return None
        if not (dist.is_available() and dist.is_initialized()) or trainer.world_size == 1:
            return _verdict(self.flag.signum is not None, self.superseded(step))  # next_check stays -1
        verdict = None
        if self.work is not None:
            self.work.wait()
            verdict = _verdict(bool(self.buf[0].item()), bool(self.buf[1].item()))
            self.every = max(int(self.buf[2].item()), 1)
            self.work = None
        self.next_check = step + self.every
        if verdict:
            return verdict
        mine = [int(self.flag.signum is not None), int(self.superseded(step))]
        self.buf = torch.tensor([*mine, self.propose(step) if trainer.global_rank == 0 else 0], dtype=torch.int64,
                                device=trainer.strategy.root_device)
        self.work = dist.all_reduce(self.buf, op=dist.ReduceOp.MAX, async_op=True)
        return None

    def propose(self, step: int) -> int:
        now = time.monotonic()
        every = self.every
        if self.mark is not None and step > self.mark[1]:
            step_s = (now - self.mark[0]) / (step - self.mark[1])
            every = int(min(max(AGREE_S / max(step_s, 1e-6), 1), 100))
        self.mark = (now, step)
        return every

    def finish(self) -> None:
        """At the end of training (every rank): complete the reduction still in flight."""
        if self.work is not None:
            self.work.wait()
            self.work = None
