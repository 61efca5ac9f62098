"""What in a rank's namespace holds on to process groups, and which of it holds groups that are
gone: after meshbook re-creates the groups (a step check, a recovery, a restart), a DDP module
or a DTensor built before still calls the old, closed ones, and the collective fails with
gloo's "Connection closed by peer" (NCCL: an aborted communicator), which says nothing of why.
The step report names what was bound when the groups were re-created (:func:`bound_objects`);
a later failure that comes from one of them says so in its own headline (:func:`stale_objects`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from .torch_compat import process_groups


def bound_objects(namespace: Mapping[str, Any]) -> list[str]:
    """Variables that hold on to process groups: they must be re-created after new groups.

    ``device_mesh`` is meshbook's own and is rebuilt with the groups, so it is not listed.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    found = []
    for name, value in namespace.items():
        if name.startswith("_") or name == "device_mesh":
            continue
        kind = _bound_kind(torch, value)
        if kind:
            found.append(f"{name} ({kind})")
    return sorted(found)


class _Absent:
    """What no value is an instance of: the class of a module nobody imported."""


def _loaded(module: str, name: str) -> Any:
    """``module.name`` if some code imported ``module`` (no value can be one otherwise). Asked
    as a failing cell is reported: importing ``torch.distributed.tensor`` there would take
    the rank most of a second, while its peers' recovery waits on it."""
    return getattr(sys.modules.get(module), name, _Absent)


def _bound_kind(torch: Any, value: Any) -> str:
    DeviceMesh = _loaded("torch.distributed.device_mesh", "DeviceMesh")  # noqa: N806 - a class
    DTensor = _loaded("torch.distributed.tensor", "DTensor")  # noqa: N806

    if isinstance(value, DeviceMesh):
        return "DeviceMesh"
    if isinstance(value, torch.distributed.ProcessGroup):
        return "process group"
    if isinstance(value, DTensor):
        return "DTensor"
    if isinstance(value, torch.nn.parallel.DistributedDataParallel):
        return "DDP module"
    if isinstance(value, torch.nn.Module):
        if type(value).__name__.startswith("FSDP"):
            return "FSDP module"
        if any(isinstance(p, DTensor) for p in value.parameters()):
            return "module with DTensor parameters (FSDP2 / tensor parallel)"
    if isinstance(value, torch.optim.Optimizer):
        if any(isinstance(p, DTensor) for g in value.param_groups for p in g["params"]):
            return "optimizer over DTensor parameters"
    return ""


def stale_objects(namespace: Mapping[str, Any]) -> list[str]:
    """Variables bound to process groups that no longer exist (destroyed when meshbook
    re-created the groups): what must be re-created before they work again."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return []
    current = {id(pg) for _, pg in process_groups()}
    found = []
    for name, value in namespace.items():
        if name.startswith("_") or name == "device_mesh":
            continue
        kind = _bound_kind(torch, value)
        if kind and any(pg is None or id(pg) not in current for pg in _groups_of(torch, value)):
            found.append(f"{name} ({kind})")
    return sorted(found)


def _groups_of(torch: Any, value: Any) -> list[Any]:
    """The process groups ``value`` calls (None for one whose group is gone by name)."""
    DeviceMesh = _loaded("torch.distributed.device_mesh", "DeviceMesh")  # noqa: N806 - a class
    DTensor = _loaded("torch.distributed.tensor", "DTensor")  # noqa: N806

    if isinstance(value, torch.distributed.ProcessGroup):
        return [value]
    if isinstance(value, torch.nn.parallel.DistributedDataParallel):
        return [value.process_group]
    meshes: dict[int, Any] = {}
    if isinstance(value, DeviceMesh):
        meshes[id(value)] = value
    elif isinstance(value, DTensor):
        meshes[id(value.device_mesh)] = value.device_mesh
    else:
        params = value.parameters() if isinstance(value, torch.nn.Module) else (
            p for g in getattr(value, "param_groups", ()) for p in g["params"])
        for p in params:
            if isinstance(p, DTensor):
                meshes.setdefault(id(p.device_mesh), p.device_mesh)
    groups: list[Any] = []
    for mesh in meshes.values():
        try:
            groups += mesh.get_all_groups()
        except Exception:  # its groups are looked up by name: gone with them
            groups.append(None)
    return groups
