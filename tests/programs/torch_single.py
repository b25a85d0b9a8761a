"""A single-process PyTorch training script, modeled on Lightning's ``examples/fabric/image_classifier/train_torch.py``
(the plain-PyTorch version of its Fabric example: a device, a model, an optimizer and the loop, no process group), on
synthetic data. Run on more than one rank it would train separate copies; runner stops it at its first step. It never
imports runner."""

import torch
import torch.nn.functional as F

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(1)
model = torch.nn.Linear(8, 1).to(device)
optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
for epoch in range(1, 3):
    for _ in range(8):
        data = torch.randn(16, 8, device=device)
        optimizer.zero_grad()
        loss = F.mse_loss(model(data), data.sum(1, keepdim=True))
        loss.backward()
        optimizer.step()
    print(f"Train Epoch: {epoch} Loss: {loss.item():.6f}", flush=True)
