"""The plain-Lightning side of bench/train_overhead: what a user writes without runner.

Same model, data, Trainer arguments and checkpoint interval as runner's side; checkpoints by Lightning's
ModelCheckpoint; DDP with Lightning's defaults. Started by Lightning's own launcher (local) or by srun.
Usage: python bench/overhead/plain.py MODEL DIM DEVICES NODES MAX_STEPS EVERY OUT_DIR
(or ``main(argv)`` in a process that srun started: bench/overhead/via_submitit.py)
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import Tiny, Wide  # noqa: E402

from runner.dev.example import ShardedDataModule  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    model_name, dim, devices, nodes, max_steps, every, out = (sys.argv[1:] if argv is None else argv)[:7]
    torch.set_num_threads(1)
    L.seed_everything(1234)
    model = Tiny(dim=int(dim), hidden=32, lr=0.01) if model_name == "tiny" else Wide(dim=int(dim))
    loader = {"train": {"total_shards": 4, "batch_size": 8}, "valid": {"total_shards": 4, "batch_size": 16}}
    data = ShardedDataModule(num_samples=1024, dim=int(dim), dataloader=loader, seed=1234)
    trainer = L.Trainer(accelerator="cpu", devices=int(devices), num_nodes=int(nodes), strategy="ddp",
                        precision="32-true", max_steps=int(max_steps), log_every_n_steps=10, num_sanity_val_steps=0,
                        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False, logger=False,
                        use_distributed_sampler=False, default_root_dir=out,
                        callbacks=[ModelCheckpoint(dirpath=out, every_n_train_steps=int(every), save_top_k=-1)])
    trainer.fit(model, datamodule=data)


if __name__ == "__main__":
    main()
