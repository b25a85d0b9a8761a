"""A torchrun-style DDP script, written the way PyTorch's own tutorial writes one: modeled on pytorch/examples
``distributed/ddp-tutorial-series/multinode.py`` (its ``ddp_setup``, ``Trainer`` with ``_run_batch``/``_run_epoch``,
``_save_snapshot``/``_load_snapshot`` and the epoch-level ``snapshot.pt``), with synthetic data in place of its
``datautils`` and, as users add to it for preemptible clusters, its own SIGTERM handler that saves a snapshot and
exits. It never imports runner: the tests run it unchanged as ``python ddp_multinode.py EPOCHS SAVE_EVERY``."""

import argparse
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, sleep):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.epoch = 0
        self.snapshot_path = snapshot_path
        self.sleep = sleep
        if os.path.exists(snapshot_path):
            print("Loading snapshot", flush=True)
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        print(f"[RANK{self.global_rank}] SIGTERM at epoch {self.epoch}", flush=True)
        if self.global_rank == 0:
            self._save_snapshot(self.epoch)
        sys.exit(0)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}", flush=True)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for i, (source, targets) in enumerate(self.train_data):
            loss = self._run_batch(source, targets)
            weights = sum(p.double().sum().item() for p in self.model.parameters())
            print(f"[RANK{self.global_rank}] epoch {epoch} batch {i} loss {loss:.8f} weights {weights:.12f}",
                  flush=True)
            time.sleep(self.sleep)

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self.epoch = epoch
            self._run_epoch(epoch)
            if self.global_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch + 1)


def main(save_every, total_epochs, batch_size, snapshot_path, sleep):
    ddp_setup()
    print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} (local {os.environ['LOCAL_RANK']}, "
          f"group {os.environ['GROUP_RANK']}, run {os.environ.get('TORCHELASTIC_RUN_ID')})", flush=True)
    torch.manual_seed(0)
    dataset, model = MyTrainDataset(256), torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    train_data = DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset))
    Trainer(model, train_data, optimizer, save_every, snapshot_path, sleep).train(total_epochs)
    print(f"[RANK{os.environ['RANK']}] done", flush=True)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)")
    parser.add_argument("--snapshot_path", default="snapshot.pt")
    parser.add_argument("--sleep", default=0.0, type=float, help="seconds after each batch (slow enough to stop)")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path, args.sleep)
