"""How much memory each rank uses, and how close its memory pool is to running out.

A rank runs out of one of two pools: its GPU (on CUDA), or the memory of its host, shared by
the host's ranks and bounded by a container's cgroup limit when there is one. On the rank,
:mod:`meshbook.mesh.rank.memory` measures that pool for every heartbeat (``used`` counts other processes
too: they exhaust it just the same). On the controller, :func:`memory_report` turns the last
heartbeats into a :class:`MemoryReport`, one :class:`MemoryRow` per rank: RSS, CPU, CUDA
allocated / reserved / peak and how full the pool is, ``near_limit`` from ``NEAR_LIMIT`` full,
so a rank about to be OOM-killed shows before it is. A rank that has sent no heartbeat yet
(right after ``start()``) is asked for one by :meth:`~meshbook.Mesh.memory`. A dead rank's last numbers are not shown:
they describe a process that no longer exists.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from ...protocol.text import format_bytes, format_percent, status_table


class RankState(Protocol):
    """What a report reads of a rank's state (the controller's book keeps it)."""

    rank: int
    hostname: str
    pid: int | None
    device: str
    state: str
    cause: str  # why it is dead ("" while alive)
    metrics: dict[str, Any]
    last_seen: float

#: A pool this full is about to run out.
NEAR_LIMIT = 0.9
#: How a report names the CPU pools (a GPU pool is named by its device, ``cuda:0``).
_POOL_NAMES = {"host": "host RAM", "container": "container RAM"}


@dataclass(frozen=True)
class MemoryRow:
    """One rank's resources, from its last heartbeat (``None``: not measured or not known)."""

    rank: int
    host: str
    pid: int | None
    device: str
    state: str
    cpu: float | None = None
    rss: int | None = None
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    cuda_peak: int | None = None
    pool: str = ""
    pool_used: int | None = None
    pool_limit: int | None = None
    heartbeat_age: float | None = None

    @property
    def pool_fraction(self) -> float | None:
        if self.pool_used is None or not self.pool_limit:
            return None
        return self.pool_used / self.pool_limit

    @property
    def near_limit(self) -> bool:
        fraction = self.pool_fraction
        return fraction is not None and fraction >= NEAR_LIMIT

    @property
    def dead(self) -> bool:
        return self.state.startswith("dead")

    def pool_text(self) -> str:
        """What the pool is and how full: ``"host RAM 51.2 GiB / 125.8 GiB (41%)"``, with
        ``", near its limit"`` inside the brackets when it is."""
        if self.pool_fraction is None:
            return "-"
        near = ", near its limit" if self.near_limit else ""
        return (f"{_POOL_NAMES.get(self.pool, self.pool)} {format_bytes(self.pool_used)} / "
                f"{format_bytes(self.pool_limit)} ({format_percent(self.pool_fraction)}{near})")


@dataclass(frozen=True)
class MemoryReport:
    """Per-rank memory and CPU; prints as a table (CUDA columns only when a rank has a GPU)."""

    rows: tuple[MemoryRow, ...]

    @property
    def on_gpu(self) -> bool:
        return any(r.cuda_allocated is not None for r in self.rows)

    def near_limit(self) -> list[int]:
        return [r.rank for r in self.rows if r.near_limit]

    def __str__(self) -> str:
        table = []
        for r in self.rows:
            row: dict[str, Any] = {"rank": r.rank, "host": r.host or "-", "pid": r.pid or "-",
                                   "device": r.device or "-", "state": r.state,
                                   "cpu": "-" if r.cpu is None else f"{r.cpu:.0f}%",
                                   "rss": format_bytes(r.rss)}
            if self.on_gpu:
                row.update({"cuda alloc": format_bytes(r.cuda_allocated),
                            "reserved": format_bytes(r.cuda_reserved),
                            "peak": format_bytes(r.cuda_peak)})
            row["memory pool"] = r.pool_text()
            row["heartbeat"] = "-" if r.heartbeat_age is None else f"{r.heartbeat_age:.1f} s ago"
            table.append(row)
        return status_table(table)

    __repr__ = __str__


def memory_report(states: Iterable[RankState], now: float | None = None) -> MemoryReport:
    """A :class:`MemoryReport` from the controller's per-rank states and last heartbeats."""
    now = time.monotonic() if now is None else now
    return MemoryReport(tuple(memory_row(s, now) for s in states))


def memory_row(s: RankState, now: float) -> MemoryRow:
    state = s.state + (f" ({s.cause})" if s.cause else "")
    base = MemoryRow(s.rank, s.hostname, s.pid, s.device, state)
    m = s.metrics
    if base.dead or not m:
        return base
    pool = m.get("memory") or {}
    return MemoryRow(
        s.rank, s.hostname, s.pid, s.device, state, cpu=m.get("cpu"), rss=m.get("rss"),
        cuda_allocated=m.get("cuda_allocated"), cuda_reserved=m.get("cuda_reserved"),
        cuda_peak=m.get("cuda_peak"), pool=pool.get("pool", ""), pool_used=pool.get("used"),
        pool_limit=pool.get("limit"), heartbeat_age=round(now - s.last_seen, 1))


