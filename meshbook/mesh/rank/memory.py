"""What a rank's memory looks like: heartbeat fields measured on the rank.

A rank runs out of one of two pools: its GPU (on an NCCL mesh), or the memory of its host,
shared by the host's ranks and bounded by a container's cgroup limit when there is one.
``used`` counts other processes too (they exhaust the pool just the same), but not this
rank's own cached, free CUDA blocks: its allocator hands those out again before it asks the
GPU for more, so they are no step towards an OOM. The controller's report is
:mod:`meshbook.mesh.controller.insight.memory`.

CUDA's numbers come from :class:`CudaStats`, a thread of their own: torch's allocator calls
take the allocator's lock, which an allocation stuck behind a hung kernel can hold for good,
and the control thread (interrupts, stacks, heartbeats) must never wait on it. A heartbeat
carries the last numbers read, and how stale they are when the allocator stops answering.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from ..protocol.config import HEARTBEAT_S

#: CUDA numbers older than this are marked stale in heartbeats.
STALE_S = 3 * HEARTBEAT_S


class CudaStats:
    """A rank's CUDA memory, read every heartbeat period on a thread of its own once the rank
    uses CUDA (an NCCL rank from the start; a gloo rank once its code puts a tensor on a GPU).

    ``device``: an NCCL rank's GPU, whose memory is also its pool; None: every GPU this
    process uses, summed (the pool stays the host's)."""

    def __init__(self, device: int | None) -> None:
        self.device = device
        self._latest: dict[str, Any] = {}
        self._read_at = 0.0
        self._thread: threading.Thread | None = None

    def latest(self) -> dict[str, Any]:
        """Heartbeat fields: ``cuda_allocated``/``_reserved``/``_peak`` (and ``memory`` for an
        NCCL rank), ``cuda_stale_s`` when the allocator has not answered for a while."""
        torch = sys.modules.get("torch")
        if self._thread is None:
            if torch is None or not torch.cuda.is_initialized():
                return {}
            self._thread = threading.Thread(target=self._loop, name="meshbook-cuda-stats", daemon=True)
            self._thread.start()
        out = dict(self._latest)
        age = time.monotonic() - self._read_at
        if self._read_at and age > STALE_S:
            out["cuda_stale_s"] = round(age, 1)
        return out

    def _loop(self) -> None:
        while True:
            try:
                self._latest = self._read()
            except Exception as exc:  # a broken CUDA context: say so in every heartbeat
                self._latest = {"cuda_error": f"{type(exc).__name__}: {exc}"}
            self._read_at = time.monotonic()
            time.sleep(HEARTBEAT_S)

    def _read(self) -> dict[str, Any]:
        import torch

        cuda = torch.cuda
        devices = [self.device] if self.device is not None else \
            [d for d in range(cuda.device_count()) if cuda.memory_reserved(d)]
        allocated = sum(cuda.memory_allocated(d) for d in devices)
        reserved = sum(cuda.memory_reserved(d) for d in devices)
        out: dict[str, Any] = {"cuda_allocated": allocated, "cuda_reserved": reserved,
                               "cuda_peak": sum(cuda.max_memory_allocated(d) for d in devices)}
        if self.device is not None:
            free, total = cuda.mem_get_info(self.device)
            out["memory"] = {"pool": f"cuda:{self.device}", "limit": total,
                             "used": total - free - (reserved - allocated)}
        return out


def host_memory_probe() -> Callable[[], dict[str, Any]]:
    """A heartbeat field: ``{"pool", "limit", "used"}`` of the host (or its container)."""
    cgroup = _cgroup_files()
    limit = _read_int(cgroup[0]) if cgroup else None

    def host() -> dict[str, Any]:
        vm = psutil.virtual_memory()
        if cgroup and limit is not None and limit < vm.total:
            return {"pool": "container", "limit": limit, "used": _read_int(cgroup[1])}
        return {"pool": "host", "limit": vm.total, "used": vm.total - vm.available}

    return host


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
