"""How full a rank's memory pool is: a heartbeat field measured on the rank.

A rank runs out of one of two pools: its GPU (on CUDA), or the memory of its host, shared by
the host's ranks and bounded by a container's cgroup limit when there is one. ``used`` counts
other processes too: they exhaust the pool just the same. The controller's report is
:mod:`meshbook.mesh.controller.memory`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import psutil


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
