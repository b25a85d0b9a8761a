"""The models both sides of bench/train_overhead train: runner's example model and a ~50M-parameter MLP, each
writing rank 0's step times (wall clock, and its training thread's CPU time) to ``$BENCH_TIMES`` at the end of
training."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from torch import nn

from runner.dev.example import TinyRegressor


class _Clock:
    """Records time.time(), the training thread's CPU time and the process's at every optimizer step; rank 0 writes
    them at the end.

    The thread's CPU time counts what the rank itself spends on a step (its own work and any framework's around it),
    apart from waiting for the other ranks or for a core that other ranks share; the process's adds its other
    threads (gloo's, a checkpoint writer, a watchdog), which compete for the same cores."""

    times: list[float]
    cpu_times: list[float]
    proc_times: list[float]  # not `cpu`: that would hide nn.Module.cpu(), which a strategy's teardown calls

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.times.append(time.time())
        self.cpu_times.append(time.thread_time())
        self.proc_times.append(time.process_time())

    def on_train_end(self) -> None:
        path = os.environ.get("BENCH_TIMES")
        if path:  # every rank: its peak resident memory (bench/sharded)
            import resource

            rank = self.trainer.global_rank  # type: ignore[attr-defined]
            with open(f"{path}.rss{rank}", "w") as f:
                json.dump({"maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}, f)
        if path and self.trainer.global_rank == 0:  # type: ignore[attr-defined]
            start = self.trainer.global_step - len(self.times)  # type: ignore[attr-defined]
            with open(path + ".part", "w") as f:  # renamed whole: the bench waits for the name, then reads it
                json.dump({"times": self.times, "cpu": self.cpu_times, "proc": self.proc_times, "start_step": start}, f)
            os.replace(path + ".part", path)


class Tiny(_Clock, TinyRegressor):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.times, self.cpu_times, self.proc_times = [], [], []


class Wide(_Clock, TinyRegressor):
    """dim -> hidden x layers -> 1 with ReLU and dropout: 12 layers of 2048 are 50.4M parameters."""

    def __init__(self, dim: int = 2048, hidden: int = 2048, layers: int = 12, lr: float = 0.001, **kwargs: Any):
        super().__init__(dim=dim, hidden=hidden, lr=lr, **kwargs)
        blocks: list[nn.Module] = []
        for i in range(layers):
            blocks += [nn.Linear(dim if i == 0 else hidden, hidden), nn.ReLU()]
        self.net = nn.Sequential(*blocks, nn.Dropout(0.1), nn.Linear(hidden, 1))
        self.times, self.cpu_times, self.proc_times = [], [], []

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
