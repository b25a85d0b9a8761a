"""A plain PyTorch training script with runner's one line: PyTorch's own MNIST example (pytorch/examples,
mnist/main.py: its ``Net``, its ``train`` loop with ``F.nll_loss`` and its Adadelta/StepLR) made distributed the
torchrun way (``init_process_group`` from the environment, ``DistributedDataParallel``, a ``DistributedSampler``), on
tiny synthetic 28x28 images instead of the download. The one line is ``runner.progress(step, loss=loss.item())``
after each optimizer step; the rest knows nothing of runner.

Test knobs, from the environment (the tests set them): NAN_AT_STEP (the loss becomes NaN at that step), NAN_RANK (on
that rank only; default every rank), STEP_SLEEP (seconds per step; changes no number), EPOCHS.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn, optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import runner


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(1152, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def train(args, model, device, train_loader, optimizer, epoch, step):
    model.train()
    nan_at, nan_rank = int(os.environ.get("NAN_AT_STEP", -1)), os.environ.get("NAN_RANK")
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        if step + 1 == nan_at and nan_rank in (None, str(dist.get_rank())):
            loss = loss * float("nan")
        loss.backward()
        optimizer.step()
        step += 1
        runner.progress(step, loss=loss.item())
        if batch_idx % args.log_interval == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.sampler)}]\tLoss: "
                  f"{loss.item():.6f}", flush=True)
        time.sleep(float(os.environ.get("STEP_SLEEP", 0)))
    return step


def main():
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example (tiny synthetic data, DDP)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=int(os.environ.get("EPOCHS", 2)))
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(args.seed)
    device = torch.device("cpu")
    images = torch.randn(480, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 10, (480,), generator=torch.Generator().manual_seed(1))
    dataset = TensorDataset(images, labels)
    sampler = DistributedSampler(dataset)
    train_loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    model = nn.parallel.DistributedDataParallel(Net().to(device))
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    step = 0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        step = train(args, model, device, train_loader, optimizer, epoch, step)
        scheduler.step()
    print(f"trained {step} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
