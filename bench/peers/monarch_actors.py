"""Monarch's side of ``bench/workloads/actors.py``: the actors of :mod:`bench.peers.actor_side`,
on Monarch's API (its procs import this module by name)."""

from __future__ import annotations

import time
from typing import Any

from monarch.actor import Actor, endpoint

from . import tolerate_monarch_faults

tolerate_monarch_faults()


class Ping(Actor):
    @endpoint
    def noop(self) -> None:
        return None


class Sink(Actor):
    def __init__(self) -> None:
        self.buffer: Any = None

    @endpoint
    def load(self, tensor: Any) -> int:
        if self.buffer is None or self.buffer.shape != tensor.shape:
            self.buffer = tensor.clone()
        else:
            self.buffer.copy_(tensor)
        return int(tensor.nbytes)


class Source(Actor):
    @endpoint
    async def send(self, sink: Any, nbytes: int, times: int) -> list[float]:
        import torch

        tensor = torch.ones(nbytes // 4)
        await sink.load.call_one(tensor)
        taken = []
        for _ in range(times):
            start = time.perf_counter()
            await sink.load.call_one(tensor)
            taken.append(time.perf_counter() - start)
        return taken
