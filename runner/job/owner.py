"""At most one job trains a run directory: the ranks check, while training, that their job still owns it.

The run's ``job_id`` file names the job that owns it; ``runner resume`` and ``runner cron`` write it when they
submit a new job, and never while the old one may be alive (``runner.policy``). Should two jobs still meet on
one run (a resubmission that raced a requeue, a user who sbatch'ed the script by hand), the older one must not
keep training, and above all must not write a checkpoint next to the owner's. The batch script checks once
before the ranks start; this callback checks while they train: every ``resume.owner_check_every_n_steps``
steps, before every checkpoint (``on_save_checkpoint`` runs on every rank before anything is written) and
before the final weights. Each rank reads the file itself; one all-reduce of the 0/1 "still the owner" flags
(all must agree, i.e. the minimum) lets every rank stop at the same step, so no rank waits in a collective for
one that left. A superseded job exits ``EXIT_SUPERSEDED`` (78) without writing anything more; the exit hook
records it as superseded and neither requeues nor alerts.

A local run has no job id and no check: it is started in the foreground and its directory is new.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from runner.rundir import EXIT_SUPERSEDED, RunDir

log = logging.getLogger(__name__)


def still_owner(rd: RunDir, job_id: str) -> bool:
    """The run's ``job_id`` names this job (or cannot be read: a filesystem blip is no reason to stop training)."""
    return rd.job_id() in (None, job_id)


def make_callback(rd: RunDir, every_n_steps: int) -> Any:
    """A Lightning callback that ends a superseded job (``SystemExit(78)``) at the same step on every rank."""
    import lightning as L

    job = os.environ.get("SLURM_JOB_ID")

    class OwnerCheck(L.Callback):
        def __init__(self) -> None:
            self.checked_step = -1

        def check(self, trainer: L.Trainer) -> None:
            if not job:
                return
            self.checked_step = trainer.global_step
            if trainer.strategy.reduce_boolean_decision(still_owner(rd, job), all=True):
                return
            log.warning("job %s no longer owns %s (its job_id is %s): stopping at step %d without a checkpoint; "
                        "exit %d", job, rd.root, rd.job_id(), trainer.global_step, EXIT_SUPERSEDED)
            raise SystemExit(EXIT_SUPERSEDED)

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            step = trainer.global_step  # the same on every rank; unchanged over accumulated batches: check once
            if step % every_n_steps == 0 and step != self.checked_step:
                self.check(trainer)

        def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                               checkpoint: dict[str, Any]) -> None:
            self.check(trainer)  # every rank builds the checkpoint before any writes it

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.check(trainer)  # before the final weights and the `finished` marker

    return OwnerCheck()
