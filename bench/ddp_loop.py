"""The training loop of the training-overhead workload, run as is by torchrun and by meshbook.

One importable function, so both runs execute the very same code: torchrun's workers call it
from ``bench/ddp_torchrun.py``, meshbook's ranks through ``Mesh.apply``. It expects a
process group to exist, seeds everything it draws from, and times only the steps (between
two barriers), not process start or group creation, and each step on its own: the median
step is what a burst of other work on a shared machine disturbs least.
"""

from __future__ import annotations

import time
from typing import Any


def train(steps: int = 200, seed: int = 0, threads: int = 1, log_every: int = 50) -> dict[str, Any]:
    """Train a small MLP with DDP for ``steps``; this rank's losses and seconds."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(threads)  # the same on both sides, whatever each launcher would pick
    rank = dist.get_rank()
    torch.manual_seed(seed)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(seed + rank)  # each rank its own shard
    losses, step_seconds = [], []
    dist.barrier()
    started, cpu = time.perf_counter(), time.process_time()
    for step in range(1, steps + 1):
        began = time.perf_counter()
        x = torch.randn(64, 64, generator=data)
        loss = ((model(x) - x.sum(1, keepdim=True).sin()) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % log_every == 0:
            print(f"step {step}: loss {losses[-1]:.5f}", flush=True)
        step_seconds.append(time.perf_counter() - began)
    dist.barrier()
    # CPU of the whole process (the runtime's own threads included), over the same span.
    return {"rank": rank, "seconds": time.perf_counter() - started, "losses": losses,
            "step_seconds": step_seconds, "cpu_seconds": time.process_time() - cpu}
