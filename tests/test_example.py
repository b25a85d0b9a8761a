"""The example model every conf uses converges: a user's first longer run must not look like a runner failure."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml

from runner.dev.example import ShardedDataModule, TinyRegressor

REPO = Path(__file__).resolve().parents[1]

# Lightning 2.6 itself trips a FutureWarning of torch's pytree when it trains in-process.
pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")]


class Losses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.values.append(float(outputs["loss"]))


def test_example_model_trains_5000_steps_without_a_non_finite_loss() -> None:
    """One process, the quickstart's model and data at its per-rank batch of 8 (the noisiest gradient any conf
    gives it): 5,000 steps, every loss finite, and the loss falls to a tenth of where it started."""
    conf = yaml.safe_load((REPO / "conf" / "quickstart.yaml").read_text())
    model_args = {k: v for k, v in conf["model"].items() if k != "_target_"}
    assert model_args["lr"] == TinyRegressor().lr, "the conf and the model's default agree"
    torch.set_num_threads(1)
    L.seed_everything(conf["seed"], verbose=False)
    losses = Losses()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=5000, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[losses])
    data = ShardedDataModule(num_samples=conf["data"]["num_samples"], dim=conf["data"]["dim"], seed=conf["seed"],
                             dataloader={"train": {"total_shards": 4, "batch_size": 8}})
    trainer.fit(TinyRegressor(**model_args), data)
    assert len(losses.values) == 5000
    bad = next((i for i, v in enumerate(losses.values) if not math.isfinite(v)), None)
    assert bad is None, f"non-finite loss at step {bad}"
    first, last = sum(losses.values[:50]) / 50, sum(losses.values[-500:]) / 500
    assert last < first / 10, (first, last)
