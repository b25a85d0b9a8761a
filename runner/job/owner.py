"""At most one job trains a run directory: the ranks check, while training, that their job still owns it.

The run's ``job_id`` file names the job that owns it; ``runner resume`` and ``runner cron`` write it when they
submit a new job, and never while the old one may be alive (``runner.policy``). Should two jobs still meet on
one run (a resubmission that raced a requeue, a user who sbatch'ed the script by hand), the older one must not
keep training, and above all must not write a checkpoint next to the owner's. The batch script checks once
before the ranks start; the ranks check while they train:

- every ``resume.owner_check_every_n_steps`` steps each rank reads the file, and its verdict rides on the
  launcher's stop agreement (``launch.Agreement``, a non-blocking reduction): every rank stops at the same
  step, a fraction of a second later, without a blocking collective of its own;
- before every checkpoint (``on_save_checkpoint`` runs on every rank before anything is written) and before
  the final weights, with one blocking all-reduce of the 0/1 "still the owner" flags (all must agree).

Either way every rank stops at the same step, so no rank waits in a collective for one that left. A superseded
job exits ``EXIT_SUPERSEDED`` (78) without writing anything more; the exit hook records it as superseded and
neither requeues nor alerts.

A local run has no job id and no check: it is started in the foreground and its directory is new.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

import lightning as L

from runner.rundir import EXIT_SUPERSEDED, RunDir

log = logging.getLogger(__name__)


def still_owner(rd: RunDir, job_id: str) -> bool:
    """The run's ``job_id`` names this job (or cannot be read: a filesystem blip is no reason to stop training)."""
    return rd.job_id() in (None, job_id)


def step_aside(rd: RunDir, job: str | None, step: int) -> NoReturn:
    """End this rank of a superseded job: nothing more is written."""
    log.warning("job %s no longer owns %s (its job_id is %s): stopping at step %d without a checkpoint; exit %d",
                job, rd.root, rd.job_id(), step, EXIT_SUPERSEDED)
    raise SystemExit(EXIT_SUPERSEDED)


class Reader:
    """``reader(step)``: whether the run's ``job_id`` names another job than ``job`` (this one), read at most every
    ``every_n_steps`` steps (the last reading in between; once superseded, always; never without a Slurm job)."""

    def __init__(self, rd: RunDir, every_n_steps: int, job: str | None) -> None:
        self.rd, self.every, self.job = rd, every_n_steps, job
        self.read_at = -every_n_steps
        self.superseded = False

    def __call__(self, step: int) -> bool:
        if self.job and not self.superseded and step - self.read_at >= self.every:
            self.read_at, self.superseded = step, not still_owner(self.rd, self.job)
        return self.superseded

    def step_aside(self, step: int) -> NoReturn:
        step_aside(self.rd, self.job, step)


class OwnerCheck(L.Callback):
    """Ends a superseded job (``SystemExit(78)``) before it writes a checkpoint or the final weights, at the same
    step on every rank (the periodic check rides on the stop agreement instead). ``job``: this one (None: a local
    run, never superseded)."""

    def __init__(self, rd: RunDir, job: str | None) -> None:
        self.rd, self.job = rd, job

    def check(self, trainer: L.Trainer) -> None:
        if self.job and not trainer.strategy.reduce_boolean_decision(still_owner(self.rd, self.job), all=True):
            step_aside(self.rd, self.job, trainer.global_step)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        self.check(trainer)  # every rank builds the checkpoint before any writes it

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.check(trainer)  # before the final weights and the `finished` marker
