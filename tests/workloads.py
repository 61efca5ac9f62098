"""Cell code the straggler tests run on the ranks: a training-like loop with a slow rank."""

from __future__ import annotations


def slow_rank_loop(stop_file: str, slow_rank: int = 2, sleep: float = 0.05,
                   max_seconds: float = 60.0) -> str:
    """A loop of tiny steps, each ending in an all_reduce; ``slow_rank`` sleeps before it, so
    every other rank waits for it in the collective. The all_reduce also carries rank 0's
    "stop" (``stop_file`` exists, or ``max_seconds`` passed), so every rank leaves the loop
    after the same step. The cell's value is the number of steps."""
    return f"""\
import os, time
end = time.monotonic() + {max_seconds!r}
x = torch.ones(1000)
steps = 0
while True:
    y = (x * 2).sum()
    if rank == {slow_rank}:
        time.sleep({sleep!r})
    stop = torch.tensor([float(rank == 0 and (os.path.exists({stop_file!r}) or time.monotonic() > end))])
    dist.all_reduce(stop)
    steps += 1
    if stop.item():
        break
steps
"""
