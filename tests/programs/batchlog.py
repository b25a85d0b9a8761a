"""A Lightning callback for tests that count what a program trained: each trained batch as one line of
``OUT/rank-R.jsonl`` (its epoch, index in the epoch, the global step after it, what it held: ESPnet's utterance ids,
or the first tensor's values, and its loss), a pause before chosen global steps until ``OUT/go-S`` exists
(``OUT/paused-S`` says it waits), so that a test lands a stop signal on exactly that step, and a rank that dies
(SIGKILL) before a chosen step (after its pause, where it has one), as a node that fails does. An ESPnet3 recipe
adds it from its config (``trainer.callbacks: [{_target_: batchlog.BatchLog, out: ...}]``, this file beside its
run.py); a plain Lightning script passes it to its Trainer. No import of runner.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import lightning as L


def held(batch: Any) -> list[Any]:
    """What a batch held: ESPnet's ``(utterance ids, tensors)``, else the first tensor's values (an index column)."""
    if isinstance(batch, (list, tuple)) and batch:
        first = batch[0]
        if isinstance(first, (list, tuple)) and all(isinstance(x, str) for x in first):
            return list(first)
        if hasattr(first, "tolist"):
            return list(first.tolist())
    return [repr(batch)]


class BatchLog(L.Callback):
    def __init__(self, out: str, pause_at: list[int] | None = None, kill_at: int = -1) -> None:
        self.out = out
        self.pause_at = set(pause_at or [])
        self.kill_at = kill_at
        os.makedirs(out, exist_ok=True)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step = trainer.global_step + 1  # the step this batch makes
        if step in self.pause_at and trainer.global_rank == 0:
            with open(os.path.join(self.out, f"paused-{step}"), "w"):
                pass
            while not os.path.exists(os.path.join(self.out, f"go-{step}")):
                time.sleep(0.02)
        killed = os.path.join(self.out, f"killed-{step}")
        if step == self.kill_at and not os.path.exists(killed):  # once: the resumed attempt trains it
            with open(killed, "w"):
                pass
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        line = {"epoch": trainer.current_epoch, "batch": batch_idx, "step": trainer.global_step, "held": held(batch),
                "loss": float(loss) if loss is not None else None}
        with open(os.path.join(self.out, f"rank-{trainer.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")
