"""A plain torch DDP program, torchrun style (no Lightning): the process group from the environment (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), a few steps of an MLP in DistributedDataParallel, an all_reduce. The tests
run it unchanged under runner (program mode)."""

import os

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
print(f"rank {rank} of {world}, {os.environ['LOCAL_WORLD_SIZE']} on this node", flush=True)
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(20):
    x = torch.randn(8, 16)
    loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
total = torch.tensor([loss.item()])
dist.all_reduce(total)
print(f"trained 20 steps, mean loss {total.item() / world:.4f}", flush=True)
dist.destroy_process_group()
