"""Lightning's transformer example, as its docs and README give it ("LightningTransformer": the Transformer of
`lightning.pytorch.demos` in a LightningModule, SGD, `Trainer.fit`), with what a real training adds: a validation
loop, the program's own `ModelCheckpoint` on the validation loss, and work at each epoch's end. Random tokens
instead of WikiText2 (no download). No import of runner.

--slow S: seconds each validation batch and each epoch's end take (a large validation set, an evaluation that writes
samples): what `trainer.should_stop` would still run after a stop. --log DIR adds the tests' batch log (batchlog.py,
beside this file: each trained batch, and --pause-at / --kill-at steps).
"""

import argparse
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos import Transformer
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--devices", type=int, default=1)
parser.add_argument("--num_nodes", type=int, default=1)
parser.add_argument("--max_epochs", type=int, default=3)
parser.add_argument("--sleep", type=float, default=0.0, help="seconds per training step")
parser.add_argument("--slow", type=float, default=0.0, help="seconds per validation batch and epoch end")
parser.add_argument("--out", default="checkpoints-own")
parser.add_argument("--samples", type=int, default=512)
parser.add_argument("--log", default=None, help="the tests' batch log into this directory")
parser.add_argument("--pause-at", type=int, nargs="*", default=[])
parser.add_argument("--kill-at", type=int, default=-1)
parser.add_argument("--random-sampler", action="store_true", help="the DataLoader's own RandomSampler, not Lightning's")
args = parser.parse_args()


class LightningTransformer(L.LightningModule):
    def __init__(self, vocab_size: int = 64) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=vocab_size, ninp=16, nhead=2, nhid=16, nlayers=1)

    def forward(self, inputs, target):
        return self.model(inputs, target)

    def training_step(self, batch, batch_idx):
        time.sleep(args.sleep)
        inputs, target = batch
        output = self(inputs, target)
        return torch.nn.functional.nll_loss(output, target.view(-1))

    def validation_step(self, batch, batch_idx):
        time.sleep(args.slow)
        inputs, target = batch
        self.log("val_loss", torch.nn.functional.nll_loss(self(inputs, target), target.view(-1)), sync_dist=True)

    def on_train_epoch_end(self):
        time.sleep(args.slow)
        print(f"epoch {self.current_epoch} ended at step {self.global_step}", flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)


g = torch.Generator().manual_seed(0)
tokens = torch.randint(0, 64, (args.samples, 9), generator=g)
data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
callbacks = [ModelCheckpoint(dirpath=args.out, monitor="val_loss", save_last=True)]
if args.log:
    from batchlog import BatchLog

    callbacks.append(BatchLog(args.log, args.pause_at, args.kill_at))
trainer = L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy="ddp",
                    max_epochs=args.max_epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                    callbacks=callbacks, use_distributed_sampler=not args.random_sampler)
trainer.fit(LightningTransformer(), DataLoader(data, batch_size=4, shuffle=True),
            DataLoader(data, batch_size=4))
print(f"trained to step {trainer.global_step}", flush=True)
