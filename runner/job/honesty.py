"""Say what the user's data module really does, measured in the job.

The config promises a global batch (``batch_size`` x ranks x accumulation) and bitwise-exact resumes, but both
depend on the data module: one that does not take ``dataloader`` builds its own loaders, and a plain
``DataLoader`` cannot resume in the middle of an epoch. This callback measures the real global batch at the
first step and checks whether the train loader can save its position (``state_dict``/``load_state_dict``, as
torchdata's ``StatefulDataLoader`` and runner's example loader do); rank 0 logs both and records them in one
ledger event (``data``: ``exactness`` is "exact" or "epoch boundaries only"), where ``runner status`` and a
reader of the run directory find them.
"""

from __future__ import annotations

import logging
from typing import Any

from runner.rundir import RunDir

log = logging.getLogger(__name__)
EXACT = "exact"
EPOCH_ONLY = "epoch boundaries only"


def batch_len(batch: Any) -> int | None:
    """The leading dimension of the first tensor-like object in a batch (tuple, list, dict or tensor)."""
    if hasattr(batch, "shape") and len(batch.shape) >= 1:
        return int(batch.shape[0])
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        n = batch_len(item)
        if n is not None:
            return n
    return None


def resumable(loader: Any) -> bool:
    """Whether Lightning can save and restore this loader's position mid-epoch (its ``_Stateful`` protocol)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def callback(rd: RunDir, configured: int | None, rank: int, world: int) -> Any:
    """A Lightning callback that measures and records; it changes nothing in training. ``configured``: the global
    batch the config asks for (None: a program's own, not known to runner)."""
    import lightning as L

    class Honesty(L.Callback):
        exactness = ""
        measured = False

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            loader = trainer.train_dataloader
            self.exactness = EXACT if resumable(loader) else EPOCH_ONLY
            if self.exactness != EXACT and rank == 0:
                log.warning("the train loader (%s) cannot save its position mid-epoch: a resume is exact only at "
                            "epoch boundaries. hint: torchdata's StatefulDataLoader can", type(loader).__name__)

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if self.measured or rank != 0:
                return
            self.measured = True
            local = batch_len(batch)
            acc = trainer.accumulate_grad_batches
            real = None if local is None else local * world * acc
            log.log(logging.INFO if real == configured or configured is None else logging.WARNING,
                    "global batch measured at the first step: %s = %s x %d ranks x %d accumulation%s", real, local,
                    world, acc, f" (the config says {configured})" if configured is not None else "")
            rd.record("data", exactness=self.exactness, global_batch=real, configured_global_batch=configured,
                      local_batch=local)

    return Honesty()
