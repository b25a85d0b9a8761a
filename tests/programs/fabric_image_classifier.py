"""A Fabric program written for ``fabric run``: modeled on Lightning's ``examples/fabric/image_classifier/
train_fabric.py`` (``Fabric()`` with no arguments and no ``fabric.launch()``: the CLI says the world;
``seed_everything``, ``setup_dataloaders``, ``setup``, ``fabric.backward``, ``StepLR``, the test loop's
``fabric.all_gather``, ``fabric.save``), with tiny synthetic 8x8 images in place of MNIST's download and no
torchvision/torchmetrics. Each logged step also prints the rank and the sum of the weights. It never imports runner:
the tests run it as ``fabric run fabric_image_classifier.py ...``."""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from lightning.fabric import Fabric, seed_everything
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import TensorDataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.fc1 = nn.Linear(8 * 2 * 2, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def images(n, seed):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))


def run(hparams):
    # The parameters like accelerator, strategy, devices etc. are provided by the command line (`fabric run --help`)
    fabric = Fabric()
    seed_everything(hparams.seed)
    print(f"fabric rank {fabric.global_rank} of {fabric.world_size}", flush=True)

    train_loader = torch.utils.data.DataLoader(images(256, 0), batch_size=hparams.batch_size)
    test_loader = torch.utils.data.DataLoader(images(64, 1), batch_size=hparams.batch_size)
    train_loader, test_loader = fabric.setup_dataloaders(train_loader, test_loader)

    model = Net()
    optimizer = optim.Adadelta(model.parameters(), lr=hparams.lr)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = StepLR(optimizer, step_size=1, gamma=hparams.gamma)

    for epoch in range(1, hparams.epochs + 1):
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            fabric.backward(loss)
            optimizer.step()
            weights = sum(p.double().sum().item() for p in model.parameters())
            print(f"Train Epoch: {epoch} [{batch_idx}] rank {fabric.global_rank} Loss: {loss.item():.8f} "
                  f"weights {weights:.12f}", flush=True)
            time.sleep(hparams.sleep)
        scheduler.step()

        model.eval()
        test_loss = 0
        correct = 0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                correct += output.argmax(dim=1).eq(target).sum().item()
        test_loss = fabric.all_gather(test_loss).sum() / len(test_loader.dataset)
        print(f"\nTest set: Average loss: {test_loss:.4f}, correct: {correct}\n", flush=True)

    if hparams.save_model:
        fabric.save("fabric_cnn.pt", {"model": model})
    fabric.print("training done")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Fabric image classifier")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--save-model", action="store_true", default=False)
    run(parser.parse_args())
