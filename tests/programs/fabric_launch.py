"""A Fabric program that launches itself, as Fabric's README and "Getting started" write one: ``Fabric(accelerator=...,
devices=..., strategy="ddp")`` then ``fabric.launch()``, ``fabric.setup``/``setup_dataloaders``, ``fabric.backward``,
its devices and nodes from its own arguments; a tiny regression model on synthetic data. Each step prints the rank,
the loss and the sum of the weights. It never imports runner: the tests run it as ``python fabric_launch.py ...``."""

import argparse
import time

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset


def main(args):
    fabric = Fabric(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(42)
    print(f"fabric rank {fabric.global_rank} of {fabric.world_size}", flush=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    dataloader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    dataloader = fabric.setup_dataloaders(dataloader)
    model.train()
    for epoch in range(args.epochs):
        for step, (inputs, targets) in enumerate(dataloader):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            fabric.backward(loss)
            optimizer.step()
            weights = sum(p.double().sum().item() for p in model.parameters())
            print(f"Train Epoch: {epoch} [{step}] rank {fabric.global_rank} Loss: {loss.item():.8f} "
                  f"weights {weights:.12f}", flush=True)
            time.sleep(args.sleep)
    fabric.print("training done")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--sleep", type=float, default=0.0)
    main(parser.parse_args())
