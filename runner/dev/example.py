"""A tiny model and data module that make the quickstart run anywhere in seconds.

The data is generated from a fixed seed (no downloads) and split into shards that rotate over epochs the
ESPnet3 way: ``shard_idx = (epoch * world_size + rank) % total_shards``. The train loader is resumable
mid-epoch (``state_dict``/``load_state_dict``), which is what makes a resumed run bitwise identical to an
uninterrupted one.

With ``order="global"`` an epoch is one seeded order of every sample, the same on any world size, cut into batches
that the ranks take in turn (rank r takes batches r, r + world, ...): its position is a global one (``global_batches``
taken by all ranks, with the ``world_size`` that took them), which a resume on another world size continues exactly
(see ``runner.job.honesty``). The shard rotation cannot: its epoch is world-size shards.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn


def shard_index(epoch: int, rank: int, world_size: int, total_shards: int) -> int:
    """ESPnet3's shard rotation: every shard is visited once per total_shards / world_size epochs."""
    return (epoch * world_size + rank) % total_shards


class _Epoch:
    """Receives Lightning's ``set_epoch`` calls (Lightning looks for ``loader.sampler.set_epoch``)."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class ShardLoader:
    """Yields this rank's shard for the current epoch in a seeded order; resumable mid-epoch.

    Lightning does not prefetch from loaders that have a length, so the batches produced so far in this epoch
    are the batches trained on; the bitwise-resume test guards that assumption.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, *, rank: int, world_size: int, total_shards: int,
                 batch_size: int, seed: int, shuffle: bool = True, order: str = "shards",
                 trace: Path | None = None):
        self.x, self.y = x, y
        self.rank, self.world_size, self.total_shards = rank, world_size, total_shards
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.order, self.trace = order, trace
        self.shard_len = len(x) // total_shards
        self.sampler = _Epoch()
        self.batch_sampler = None  # Lightning inspects it; batching is done here
        self._resume: tuple[int, int] | None = None
        self._epoch, self._yielded = 0, 0

    def __len__(self) -> int:
        if self.order == "global":
            return len(self.x) // self.batch_size // self.world_size
        return self.shard_len // self.batch_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch = self.sampler.epoch
        start = 0
        if self._resume is not None and self._resume[0] == epoch:
            start = self._resume[1]
        self._resume = None
        self._epoch, self._yielded = epoch, start
        if self.order == "global":
            yield from self._global(epoch, start)
            return
        shard = shard_index(epoch, self.rank, self.world_size, self.total_shards)
        idx = torch.arange(shard * self.shard_len, (shard + 1) * self.shard_len)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * 1009 + shard)
            idx = idx[torch.randperm(len(idx), generator=g)]
        for i in range(start, len(self)):
            self._yielded = i + 1
            sel = idx[i * self.batch_size:(i + 1) * self.batch_size]
            yield self.x[sel], self.y[sel]

    def _global(self, epoch: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``order="global"``: this rank's batches of the epoch's one order of all samples, from its ``start``-th."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * 1009)
        idx = torch.randperm(len(self.x), generator=g) if self.shuffle else torch.arange(len(self.x))
        trace = open(self.trace / f"rank-{self.rank:05d}.txt", "a") if self.trace else None  # noqa: SIM115
        try:
            for i in range(start, len(self)):
                self._yielded = i + 1
                b = i * self.world_size + self.rank  # the epoch's global batch number
                if trace:
                    trace.write(f"{epoch} {b}\n")
                    trace.flush()
                sel = idx[b * self.batch_size:(b + 1) * self.batch_size]
                yield self.x[sel], self.y[sel]
        finally:
            if trace:
                trace.close()

    def state_dict(self) -> dict[str, int]:
        state = {"epoch": self._epoch, "consumed": self._yielded}
        if self.order == "global":  # a global position, which a resume on another world size continues
            state.update(global_batches=self._yielded * self.world_size, world_size=self.world_size)
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        consumed = int(state["consumed"])
        done = int(state.get("global_batches", -1))
        if self.order == "global" and done >= 0 and done % self.world_size == 0:
            consumed = done // self.world_size  # as runner moves Lightning's count (internals.move_epoch_position)
        self._resume = (int(state["epoch"]), consumed)


class ShardedDataModule(L.LightningDataModule):
    """Synthetic regression data: y = x @ w + noise, identical on every node."""

    def __init__(self, num_samples: int = 1024, dim: int = 16, data_seed: int = 0,
                 dataloader: dict[str, Any] | None = None, seed: int = 0, order: str = "shards",
                 trace_dir: str | None = None):
        """``order``: "shards" (ESPnet3's rotation) or "global" (see the module); ``trace_dir``: each rank appends
        the epoch and global batch number of every train batch it yields to a file there (``order="global"``)."""
        super().__init__()
        self.num_samples, self.dim, self.data_seed, self.seed = num_samples, dim, data_seed, seed
        self.loader_cfg = dataloader or {"train": {}, "valid": {}}
        if order not in ("shards", "global"):
            raise ValueError(f"order: found {order!r}; expected 'shards' or 'global'")
        self.order, self.trace_dir = order, trace_dir

    def _make(self, n: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.data_seed + offset)
        w = torch.randn(self.dim, 1, generator=g)
        x = torch.randn(n, self.dim, generator=g)
        return x, x @ w + 0.1 * torch.randn(n, 1, generator=g)

    def _loader(self, split: str, n: int, offset: int, shuffle: bool) -> ShardLoader:
        cfg = self.loader_cfg.get(split, {})
        x, y = self._make(n, offset)
        assert self.trainer is not None, "loaders are built by a Trainer"
        return ShardLoader(x, y, rank=self.trainer.global_rank, world_size=self.trainer.world_size,
                           total_shards=int(cfg.get("total_shards", 1)), batch_size=int(cfg.get("batch_size", 8)),
                           seed=self.seed, shuffle=shuffle)

    def train_dataloader(self) -> ShardLoader:
        loader = self._loader("train", self.num_samples, 0, True)
        loader.order = self.order
        if self.trace_dir:
            loader.trace = Path(self.trace_dir)
            loader.trace.mkdir(parents=True, exist_ok=True)
        return loader

    def val_dataloader(self) -> ShardLoader:
        return self._loader("valid", max(self.num_samples // 4, 64), 1, False)


class TinyRegressor(L.LightningModule):
    """A two-layer MLP with dropout, so that resuming without the RNG state would change the result.

    SGD with momentum 0.9 at lr 0.01: at 0.05 it diverged (a non-finite loss within tens of steps on one rank,
    around step 470 on the dev cluster); tests/test_example.py trains it 5,000 steps without one.
    """

    def __init__(self, dim: int = 16, hidden: int = 32, lr: float = 0.01, dropout: float = 0.1,
                 step_time_s: float = 0.0, faults: dict[str, int | float] | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 1))
        self.lr = lr
        self.step_time_s = step_time_s  # stands in for a real model's step time (fault-injection tests, demos)
        # Fault injection for the recovery tests and demos, on rank `rank` (default 0): nan_at_step (one NaN
        # loss at that step), raise_at_step (a deterministic exception), slow_s (a straggler: that much longer
        # per step).
        self.faults = dict(faults or {})

    def _inject(self) -> float:
        """The factor for this step's loss (NaN at nan_at_step, so the gradients are NaN too), after the
        injected delay or exception."""
        f, step = self.faults, self.global_step
        if not f or self.global_rank != int(f.get("rank", 0)):
            return 1.0
        if step == f.get("raise_at_step"):
            raise RuntimeError(f"injected fault at step {step}")
        if f.get("slow_s"):
            time.sleep(float(f["slow_s"]))
        return float("nan") if step == f.get("nan_at_step") else 1.0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.step_time_s:
            time.sleep(self.step_time_s)
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.faults:
            loss = loss * self._inject()
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
