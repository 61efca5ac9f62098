"""A plain torchrun training script: DDP on a toy regression task with a DistributedSampler.

    torchrun --nproc-per-node 2 examples/torchrun_train.py

Nothing in it knows about meshbook: pasted into ``%%mesh`` cells (one cell per ``# %%``
section) it runs unmodified and computes the same losses, bit for bit.
"""

# %% set-up: the environment torchrun provides, and the process group
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

rank = int(os.environ["RANK"])
world_size = int(os.environ["WORLD_SIZE"])
local_rank = int(os.environ["LOCAL_RANK"])
dist.init_process_group("gloo")

# %% data and model: the same on every rank (seeded), DDP keeps the replicas in sync
torch.manual_seed(0)
features = torch.randn(256, 16)
targets = features @ torch.randn(16, 1) + 0.1 * torch.randn(256, 1)
dataset = TensorDataset(features, targets)
sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
loader = DataLoader(dataset, batch_size=16, sampler=sampler)
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

# %% train: every rank sees its own shard; losses are averaged across ranks for the log
losses = []
for epoch in range(3):
    sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        losses.append(logged.item() / world_size)
    if rank == 0:
        print(f"epoch {epoch}: loss {losses[-1]:.4f}")

# %% clean up, as every torchrun script does
if rank == 0 and os.environ.get("LOSSES_FILE"):
    with open(os.environ["LOSSES_FILE"], "w") as f:
        json.dump(losses, f)
dist.destroy_process_group()
