"""The non-finite guard: a NaN or inf never reaches the weights, and so never reaches a checkpoint.

Each rank checks the gradients it contributes, each one as soon as backward has produced it (a post-accumulate-grad
hook, on the backward that DDP all-reduces): the gradient is still in the CPU's cache or the GPU's queue then, where
reading every gradient again just before the optimizer step costs a pass over all of them from memory (measured on a
50M-parameter MLP, 2 CPU ranks: 44 ms a step that way, 5 ms this way). Just before the optimizer step the ranks
add up their verdicts in one all-reduce of one number, so that every rank takes the same decision. The averaged
gradients are finite when every rank's are (DDP divides before it adds, so the sum cannot overflow). With FSDP each
rank reads its shard of the reduced gradients instead, and the verdicts are added up the same way.

A non-finite gradient drops the update (the gradients are cleared, so the optimizer leaves the weights as they were)
and, by ``nonfinite.action``:

- ``stop`` (default): training stops at this step without writing a checkpoint; the launcher exits
  ``EXIT_NONFINITE``, the exit hook records cause ``nan`` with the step and alerts, and the run waits for a
  person (``runner resume`` restarts it from the newest checkpoint, all of whose weights are finite);
- ``skip``: the batch is skipped, recorded in the ledger (``nonfinite_skipped`` with the step), and training
  goes on; more than ``max_skips`` in a row stop it as above (the data or the model is broken, not one batch).
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from typing import Any

from runner.rundir import RunDir, atomic_write

log = logging.getLogger(__name__)


def make_guard(rd: RunDir, action: str, max_skips: int) -> Any:
    import lightning as L
    import torch
    import torch.distributed as dist

    class NonFiniteGuard(L.Callback):
        def __init__(self) -> None:
            self.tripped_at: int | None = None  # the step at which training stopped
            self.in_a_row = 0
            self.loss: Any = None
            self.norms: list[Any] = []  # this backward's gradient norms, one per parameter, not read yet
            self.collect = False
            self.hooks: list[Any] = []

        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            from lightning.pytorch.strategies import FSDPStrategy

            if isinstance(trainer.strategy, FSDPStrategy):  # gradients live in FSDP's flat shards: read after
                return
            for p in pl_module.parameters():
                if p.requires_grad:
                    self.hooks.append(p.register_post_accumulate_grad_hook(self._gradient_done))  # type: ignore[no-untyped-call]

        def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            for h in self.hooks:
                h.remove()
            self.hooks.clear()

        def _gradient_done(self, p: Any) -> None:
            if self.collect:  # the norm is queued, not read: no sync with a GPU here
                self.norms.append(torch.linalg.vector_norm(p.grad))

        def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
            # Kept, not read: the gradients decide, and the loss only names the cause when they are non-finite.
            # Reading it here would cost every step a device sync (and ~10 us on a CPU).
            self.loss = loss.detach()
            # Only the backward that DDP all-reduces (the last of an accumulation): the gradients then hold the
            # earlier micro-batches' too.
            self.collect = bool(getattr(trainer.strategy.model, "require_backward_grad_sync", True))
            self.norms.clear()

        def _bad(self, optimizer: Any, device: Any) -> bool:
            """Whether any rank's gradients are non-finite: one all-reduce of one number (none with one rank)."""
            if self.hooks:
                norms, self.norms = self.norms, []
            else:
                grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
                norms = list(torch._foreach_norm(grads)) if grads else []
            # The largest norm is finite iff every gradient is (max keeps a NaN).
            bad = (~torch.isfinite(torch.stack(norms).max())).float().reshape(1) if norms \
                else torch.zeros(1, device=device)
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(bad)
            return bool(bad.item() > 0)

        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) \
                -> None:
            if not self._bad(optimizer, pl_module.device):
                self.in_a_row = 0
                return
            for g in optimizer.param_groups:  # drop the update: the weights stay as they were
                for p in g["params"]:
                    p.grad = None
            step = trainer.global_step
            self.in_a_row += 1
            finite_loss = self.loss is None or bool(torch.isfinite(self.loss).all())
            what = "gradients" if finite_loss else f"loss {float(self.loss.float().sum())}"
            if action == "skip" and self.in_a_row <= max_skips:
                log.warning("non-finite %s at step %d: batch skipped (%d in a row)", what, step, self.in_a_row)
                if trainer.global_rank == 0:
                    rd.record("nonfinite_skipped", step=step, what=what)
                return
            log.error("non-finite %s at step %d: training stops before any checkpoint of it", what, step)
            self.tripped_at = step
            trainer.should_stop = True
            if trainer.global_rank == 0:
                rd.record("nonfinite", step=step, what=what, skipped_in_a_row=self.in_a_row - 1)

    return NonFiniteGuard()


def record_crash(rd: RunDir, attempt: int, rank: int, step: int, exc: BaseException) -> dict[str, Any]:
    """Write what this rank raised (type, innermost frame, step): the exit hook compares attempts with it,
    and the same crash at the same step twice is a crash loop (``runner.policy.crash_loop``)."""
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    crash = {"type": type(exc).__name__, "message": str(exc)[:300], "step": step, "rank": rank,
             "frame": f"{last.filename}:{last.lineno} in {last.name}" if last else None, "time": time.time()}
    try:
        atomic_write(rd.crash_file(attempt, rank), json.dumps(crash) + "\n")
    except OSError as e:  # the traceback still reaches the rank log
        log.warning("crash record not written: %s", e)
    return crash
