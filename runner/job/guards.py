"""The non-finite guard: a NaN or inf never reaches the weights, and so never reaches a checkpoint.

Checked just before each optimizer step, on the gradients *after* DDP's all-reduce: they are the same on every
rank, and a non-finite loss on one rank makes them non-finite on all. For a small model every rank reads them all
and decides on its own, without a collective; with runner's DDP the gradients are views into a few buckets, and
the read is one sum per bucket instead of a norm per gradient (less than half of a small model's check). Above
``SHARD_ABOVE`` gradient elements each rank reads a share of them and one all-reduce of one number adds up the
verdicts: every rank decides alike, and the check of a 50M-parameter model reads 1/ranks of its gradients (a full
read is 8 ms on one CPU core, ~0.1 ms on a GPU). With FSDP each rank holds its own shard of the reduced
gradients: it reads it all, and the verdicts are added up the same way, so a NaN in one shard stops (or skips)
every rank, never one rank alone (which would leave the others waiting in their next collective). Then the
update is dropped (the gradients are cleared, so the optimizer leaves the weights as they were) and, by
``nonfinite.action``:

- ``stop`` (default): training stops at this step without writing a checkpoint; the launcher exits
  ``EXIT_NONFINITE``, the exit hook records cause ``nan`` with the step and alerts, and the run waits for a
  person (``runner resume`` restarts it from the newest checkpoint, all of whose weights are finite);
- ``skip``: the batch is skipped, recorded in the ledger (``nonfinite_skipped`` with the step), and training
  goes on; more than ``max_skips`` in a row stop it as above (the data or the model is broken, not one batch).

With fp16 mixed precision, GradScaler skips overflowing steps itself and lowers its scale: the guard lets up to
``SCALER_STREAK`` of them in a row pass unrecorded, and acts as above on a longer streak.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from runner.job import internals
from runner.rundir import RunDir

log = logging.getLogger(__name__)

# Gradient elements above which the ranks of a DDP run split the check and add up their verdicts: a read of 16M
# fp32 elements (~2.5 ms on one CPU core, ~0.02 ms on a GPU) costs about what an all-reduce of one number does.
SHARD_ABOVE = 1 << 24
# Non-finite steps in a row that fp16's GradScaler may skip on its own before the guard acts: 32 halvings take
# its scale from 2^16 to 2^-16, below any useful one, so a longer streak is a broken run, not a settling scale.
SCALER_STREAK = 32
# Tensors up to which the check reads each one's sum (DDP's buckets: a 50M-parameter model has ~9 of 25 MB);
# above it, one fused norm over all of them (separate gradients: a call per tensor would cost more).
FEW = 16


def nonfinite(tensors: list[Any]) -> bool:
    """Whether any of these tensors (gradients, or the buckets they are views into) holds a NaN or an inf.

    One number read from all of them, finite when every element is: the sum of each of a few tensors (DDP's
    buckets: per-call costs dominate a small model's check, and a sum is the cheapest read), else the largest of
    their norms in one fused call (max keeps a NaN). Finite values whose sum or norm is beyond the dtype's range
    (above ~3.4e38 in float32) make it inf too, so a non-finite number (rare) is confirmed element by element
    before it stops a run.
    """
    if not tensors:
        return False
    tensors = [internals.sparse_values(t) if t.is_sparse else t for t in tensors]  # nn.Embedding(sparse=True)
    if len(tensors) <= FEW:  # half precision sums in float32: many small fp16 gradients add up past 65504
        sums = [t.sum(dtype=torch.float32 if t.element_size() < 4 else None) for t in tensors]
        total = (sums[0] if len(sums) == 1 else torch.stack(sums).sum()).item()
    else:
        total = torch.stack(internals.norms(tensors)).max().item()
    return not math.isfinite(total) and not all(bool(torch.isfinite(t).all()) for t in tensors)


def buckets(grads: list[Any]) -> list[Any] | None:
    """The storages that ``grads`` cover exactly, each as one flat tensor, when there are fewer of them than
    gradients (runner's DDP keeps the gradients as views into its few buckets); else None (separate tensors, or
    views that leave gaps, overlap, or are not contiguous: then the gradients themselves are read)."""
    shared: dict[int, tuple[Any, list[Any]]] = {}
    for g in grads:
        storage = g.untyped_storage()
        shared.setdefault(storage.data_ptr(), (storage, []))[1].append(g)
    if len(shared) >= len(grads):
        return None
    flats = []
    for start, (storage, views) in shared.items():
        size, dtype = views[0].element_size(), views[0].dtype
        spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * size) for v in views)
        tiled = spans[0][0] == start and spans[-1][1] == start + storage.nbytes() and \
            all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
        if not tiled or any(v.dtype != dtype or not v.is_contiguous() for v in views):
            return None
        flats.append(torch.empty(0, dtype=dtype, device=views[0].device).set_(storage))
    return flats


class NonFiniteGuard(L.Callback):
    """Checks the reduced gradients before each optimizer step and acts on a non-finite one by ``action``
    (``stop`` or ``skip``, at most ``max_skips`` in a row)."""

    def __init__(self, rd: RunDir, action: str, max_skips: int) -> None:
        self.rd, self.action, self.max_skips = rd, action, max_skips
        self.tripped_at: int | None = None  # the step at which training stopped
        self.in_a_row = 0
        self.loss: Any = None
        self.plan: tuple[Any, list[Any], bool] = (None, [], False)  # see _plan
        self.views: tuple[list[int], list[Any] | None] | None = None  # see _reads
        self.fsdp = False  # each rank holds a shard of the gradients (see _plan)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
        # Kept, not read: the gradients decide, and the loss only names the cause when they are non-finite.
        # Reading it here would cost every step a device sync (and ~10 us on a CPU).
        self.loss = loss.detach()

    def _plan(self, trainer: L.Trainer, optimizer: Any) -> tuple[list[Any], bool]:
        """The parameters whose gradients this rank checks, and whether the ranks add up their verdicts.

        DDP's reduced gradients are the same on every rank, so above ``SHARD_ABOVE`` elements each rank
        checks a share (largest first, each to the least loaded rank: the same split on every rank) and one
        all-reduce adds up the verdicts; a 50M-parameter model's check then reads 1/ranks of its gradients.
        Below it one read is cheaper than the collective, and every rank checks them all on its own. With
        FSDP each rank checks its whole shard, and the verdicts are always added up. Worked out once per
        trainer and optimizer: at every step it would cost more than a small model's check itself.
        """
        key = (id(trainer), id(optimizer), len(optimizer.param_groups))
        if self.plan[0] != key:
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            fsdp = self.fsdp = internals.is_fsdp(trainer.strategy)
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self.views = None
            if fsdp or world == 1 or sum(p.numel() for p in params) <= SHARD_ABOVE:
                self.plan = (key, params, fsdp and world > 1)
            else:
                rank, load, mine = dist.get_rank(), [0] * world, []
                for i in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
                    least = load.index(min(load))
                    load[least] += params[i].numel()
                    if least == rank:
                        mine.append(params[i])
                self.plan = (key, mine, True)
        return self.plan[1], self.plan[2]

    def _reads(self, grads: list[Any]) -> list[Any]:
        """What this rank reads to check ``grads``: the buckets they are views into (a small model's check is
        then one sum instead of a norm per gradient; runner's DDP), or the gradients themselves. The buckets
        are found again whenever a gradient moves; a run whose gradients are separate tensors at its first
        step reads them from then on (they move at every step: Lightning frees them between steps)."""
        if self.views is None:  # the first step of this plan
            sparse = any(g.is_sparse for g in grads)  # no storage of its own: no view into a bucket
            self.views = ([], None) if sparse else ([g.data_ptr() for g in grads], buckets(grads))
        elif self.views[1] is not None:
            where = [g.data_ptr() for g in grads]
            if where != self.views[0]:
                self.views = (where, buckets(grads))
        return self.views[1] or grads

    def _bad(self, trainer: L.Trainer, optimizer: Any, device: Any) -> bool:
        params, collective = self._plan(trainer, optimizer)
        grads = [p.grad for p in params if p.grad is not None]
        # Ranks that add up verdicts read gradients: a share's buckets would hold the other ranks' shares too,
        # and FSDP's gradients are already one flat tensor per unit.
        # FSDP2's gradients are DTensors: each rank reads its local shard (a DTensor's own sum would gather);
        # with one rank too (a resume on fewer ranks), where no verdict is shared.
        bad = nonfinite([internals.local(g) for g in grads] if collective or self.fsdp else self._reads(grads))
        if not collective:
            return bad
        verdicts = torch.tensor([float(bad)], device=device)  # a sum, not a max: NCCL's max may drop a NaN
        dist.all_reduce(verdicts)
        return bool(verdicts.item() > 0)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) \
            -> None:
        if not self._bad(trainer, optimizer, pl_module.device):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        if getattr(trainer.precision_plugin, "scaler", None) is not None and self.in_a_row <= SCALER_STREAK:
            # fp16's GradScaler (unscaled just before this hook) found the overflow too: it skips the step
            # itself and halves its scale. Normal while the scale settles, as in the first steps at 2^16.
            return
        for g in optimizer.param_groups:  # drop the update: the weights stay as they were
            for p in g["params"]:
                p.grad = None
        step = trainer.global_step
        finite_loss = self.loss is None or bool(torch.isfinite(self.loss).all())
        what = "gradients" if finite_loss else f"loss {float(self.loss.float().sum())}"
        if self.action == "skip" and self.in_a_row <= self.max_skips:
            log.warning("non-finite %s at step %d: batch skipped (%d in a row)", what, step, self.in_a_row)
            if trainer.global_rank == 0:
                self.rd.record("nonfinite_skipped", step=step, what=what)
            return
        log.error("non-finite %s at step %d: training stops before any checkpoint of it", what, step)
        self.tripped_at = step
        trainer.should_stop = True
        if trainer.global_rank == 0:
            self.rd.record("nonfinite", step=step, what=what, skipped_in_a_row=self.in_a_row - 1)
