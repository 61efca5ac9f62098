"""The actors both actor systems run in ``bench/workloads/actors.py``, written once per API.

meshbook's are here; Monarch's are in :mod:`bench.peers.monarch_actors` (importing monarch
where meshbook's ranks only need meshbook). Each does the same: ``noop`` answers nothing;
``Sink.load`` copies the tensor it gets into a resident buffer, as ``load_state_dict`` does
with weights; ``Source.send`` calls a sink it was handed, rank to rank, and times each call.
"""

from __future__ import annotations

import time
from typing import Any

import meshbook


class Ping(meshbook.Actor):
    @meshbook.endpoint
    def noop(self) -> None:
        return None


class Sink(meshbook.Actor):
    def __init__(self) -> None:
        self.buffer: Any = None

    @meshbook.endpoint
    def load(self, tensor: Any) -> int:
        if self.buffer is None or self.buffer.shape != tensor.shape:
            self.buffer = tensor.clone()
        else:
            self.buffer.copy_(tensor)
        return int(tensor.nbytes)


class Source(meshbook.Actor):
    @meshbook.endpoint
    def send(self, sink: Any, nbytes: int, times: int) -> list[float]:
        """``times`` calls of ``sink.load`` with ``nbytes`` of float32 (after one to warm up)."""
        import torch

        tensor = torch.ones(nbytes // 4)
        sink.load.call_one(tensor).result()
        taken = []
        for _ in range(times):
            start = time.perf_counter()
            sink.load.call_one(tensor).result()
            taken.append(time.perf_counter() - start)
        return taken
