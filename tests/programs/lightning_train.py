"""A plain Lightning training script, written as users write them: its own argparse, model, DataLoaders and
Trainer, no import of runner. The tests run it unchanged under runner (program mode) and on its own.

--stateful uses torchdata's StatefulDataLoader with its StatefulDistributedSampler (resumable mid-epoch); --nan-at,
--stall-at and --sleep are the faults the tests inject, the way a real program would misbehave.
"""

import argparse
import time

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--devices", type=int, default=1)
parser.add_argument("--num_nodes", type=int, default=1)
parser.add_argument("--max_steps", type=int, default=60)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--samples", type=int, default=2048)
parser.add_argument("--stateful", action="store_true")
parser.add_argument("--nan-at", type=int, default=-1, help="return a NaN loss at this step")
parser.add_argument("--stall-at", type=int, default=-1, help="hang forever in this step (a stuck collective)")
parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
parser.add_argument("--ckpt_path", default=None, help="trainer.fit's own ckpt_path (e.g. last)")
parser.add_argument("--fsdp", action="store_true", help="FSDP2: ModelParallelStrategy, fully_shard in configure_model")
args = parser.parse_args()


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Dropout(0.1), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        if self.global_step == args.stall_at:
            while True:
                time.sleep(1)
        time.sleep(args.sleep)
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        return loss * float("nan") if self.global_step == args.nan_at else loss

    def configure_model(self):
        if args.fsdp:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def on_train_start(self):
        print(f"train starts at step {self.trainer.global_step}", flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=args.lr, momentum=0.9)


g = torch.Generator().manual_seed(0)
x = torch.randn(args.samples, 16, generator=g)
data = TensorDataset(x, x.sum(1, keepdim=True).sin())
strategy = "ddp"
if args.fsdp:
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(data_parallel_size=args.devices * args.num_nodes, tensor_parallel_size=1)
trainer = L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=strategy,
                    max_steps=args.max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, use_distributed_sampler=not args.stateful)
if args.stateful:
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    sampler = StatefulDistributedSampler(data, trainer.world_size, trainer.global_rank, shuffle=True, seed=0)
    loader = StatefulDataLoader(data, batch_size=16, sampler=sampler)
else:
    loader = DataLoader(data, batch_size=16, shuffle=True)
trainer.fit(Regressor(), loader, ckpt_path=args.ckpt_path)
print(f"trained to step {trainer.global_step}", flush=True)
