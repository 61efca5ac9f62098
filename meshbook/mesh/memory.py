"""How much memory each rank uses, and how close its memory pool is to running out.

A rank runs out of one of two pools: its GPU (on CUDA), or the memory of its host, shared by
the host's ranks and bounded by a container's cgroup limit when there is one. On the rank,
:func:`memory_probe` measures that pool for every heartbeat (``used`` counts other processes
too: they exhaust it just the same). On the controller, :func:`memory_report` turns the last
heartbeats into a :class:`MemoryReport`, one :class:`MemoryRow` per rank: RSS, CPU, CUDA
allocated / reserved / peak and how full the pool is, ``near_limit`` from ``NEAR_LIMIT`` full,
so a rank about to be OOM-killed shows before it is. A dead rank's last numbers are not shown:
they describe a process that no longer exists.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psutil

from .table import format_bytes, format_percent, status_table

if TYPE_CHECKING:
    from .controller import RankState

#: A pool this full is about to run out.
NEAR_LIMIT = 0.9
#: How a report names the CPU pools (a GPU pool is named by its device, ``cuda:0``).
_POOL_NAMES = {"host": "host RAM", "container": "container RAM"}


def memory_probe(cuda_device: int | None) -> Callable[[], dict[str, Any]]:
    """A heartbeat field: ``{"pool", "limit", "used"}`` of the GPU ``cuda_device`` or the host."""
    if cuda_device is not None:
        import torch

        def gpu() -> dict[str, Any]:
            try:
                free, total = torch.cuda.mem_get_info(cuda_device)
            except RuntimeError as exc:  # a broken CUDA context must not end the control thread
                return {"pool": f"cuda:{cuda_device}", "limit": None, "used": None, "error": str(exc)}
            return {"pool": f"cuda:{cuda_device}", "limit": total, "used": total - free}

        return gpu
    cgroup = _cgroup_files()
    limit = _read_int(cgroup[0]) if cgroup else None

    def host() -> dict[str, Any]:
        vm = psutil.virtual_memory()
        if cgroup and limit is not None and limit < vm.total:
            return {"pool": "container", "limit": limit, "used": _read_int(cgroup[1])}
        return {"pool": "host", "limit": vm.total, "used": vm.total - vm.available}

    return host


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


def _cgroup_files() -> tuple[str, str] | None:
    """This process's cgroup memory limit and usage files (v2, else v1), if it has them."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            names, root = ("memory.max", "memory.current"), "/sys/fs/cgroup"
        elif "memory" in controllers.split(","):
            names, root = ("memory.limit_in_bytes", "memory.usage_in_bytes"), "/sys/fs/cgroup/memory"
        else:
            continue
        # Inside a container the cgroup path is often not visible: its root is the cgroup.
        for directory in (os.path.join(root, path.lstrip("/")), root):
            if os.path.exists(os.path.join(directory, names[0])):
                return os.path.join(directory, names[0]), os.path.join(directory, names[1])
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit
