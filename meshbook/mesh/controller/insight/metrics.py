"""A few minutes of each rank's memory, for the dashboard's sparklines.

The controller records every heartbeat here on its receiver thread, from the moment the mesh
starts, so a dashboard opened later still shows how memory got where it is. Only what a
sparkline needs is kept: the time, RSS and CUDA allocated bytes, for ``KEEP_S`` seconds per
rank (600 points at two heartbeats a second), so the cost stays constant however long the
mesh runs. Readers on other threads get copies.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: How much history each rank keeps.
KEEP_S = 300.0


@dataclass(frozen=True)
class MemoryPoint:
    t: float
    rss: int
    cuda: int | None  # CUDA allocated bytes, on a GPU rank

    @property
    def used(self) -> int:
        """The memory that matters for this rank: CUDA allocated on a GPU, else RSS."""
        return self.cuda if self.cuda is not None else self.rss


class MetricsHistory:
    """Per-rank memory over the last ``keep`` seconds, fed by heartbeats."""

    def __init__(self, keep: float = KEEP_S) -> None:
        self.keep = keep
        self._points: dict[int, deque[MemoryPoint]] = {}
        self._lock = threading.Lock()

    def record(self, rank: int, metrics: Mapping[str, Any]) -> None:
        """A heartbeat listener: ``(rank, metrics)``."""
        now = time.monotonic()
        point = MemoryPoint(now, int(metrics.get("rss", 0)), metrics.get("cuda_allocated"))
        with self._lock:
            points = self._points.setdefault(rank, deque())
            points.append(point)
            while points[0].t < now - self.keep:
                points.popleft()

    def memory(self, rank: int, last: float | None = None) -> list[MemoryPoint]:
        """The rank's points, oldest first; only those of the ``last`` seconds if given."""
        with self._lock:
            points = list(self._points.get(rank, ()))
        if last is not None:
            since = time.monotonic() - last
            points = [p for p in points if p.t >= since]
        return points
