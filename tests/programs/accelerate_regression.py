"""An Accelerate training script as its community writes one, modeled on the quick tour of huggingface/accelerate's
README and its ``examples/nlp_example.py`` loop: ``Accelerator()`` (its launcher, ``accelerate launch`` or torchrun,
says the world), ``accelerator.prepare`` of the model, optimizer and DataLoader, ``accelerator.backward``,
``accelerator.print`` and ``accelerator.wait_for_everyone``. A tiny regression model on synthetic data (no download).
It never imports runner."""

import argparse
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset


def training_function(args):
    accelerator = Accelerator(cpu=args.cpu)
    set_seed(args.seed)
    print(f"accelerate process {accelerator.process_index} of {accelerator.num_processes} "
          f"({accelerator.distributed_type})", flush=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    dataset = TensorDataset(x, x.sum(1, keepdim=True).sin())
    train_dataloader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=args.lr)
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    for epoch in range(args.num_epochs):
        model.train()
        for step, (inputs, targets) in enumerate(train_dataloader):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            weights = sum(p.double().sum().item() for p in model.parameters())
            print(f"epoch {epoch} step {step} process {accelerator.process_index} loss {loss.item():.8f} "
                  f"weights {weights:.12f}", flush=True)
            time.sleep(args.sleep)
    accelerator.wait_for_everyone()
    accelerator.print("training done")


def main():
    parser = argparse.ArgumentParser(description="Simple example of a training script.")
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--num_epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--sleep", type=float, default=0.0)
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()
