"""What in a rank's namespace still holds process groups that are gone: after meshbook
re-creates the groups (a step check, a recovery, a restart), a DDP or FSDP module built before
calls the old, destroyed ones, and fails with gloo's "Connection closed by peer" (NCCL: an
aborted communicator) or torch's "Process group ... is not initialized in the world group map",
neither of which says why. A DeviceMesh finds its groups by name, so a DTensor or a tensor
parallel module on ``device_mesh`` works on the new groups and is not named.

The step report names what is stale once the new groups are joined, and a later failure that
comes from such an object says so in its own headline (both through :func:`stale_objects`).
"""

from __future__ import annotations

import itertools
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from .torch_compat import fsdp2_groups, pipeline_groups, process_groups

#: How many elements of a tensor are summed at once for its print (32 MiB in float64).
PRINT_SLICE = 1 << 22

#: The kind of ``step`` as parallelize binds it (its model and optimizer are told with it).
PARALLELIZED = "parallelize step"
#: What torch says when a collective is called on a group that was destroyed (FSDP2 kept it; a
#: pipeline stage looks its peers up in it).
DESTROYED_GROUP = re.compile(r"Process group .* is not initialized in the world group map|Group .* is not registered")


def stale_objects(namespace: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Variables bound to process groups that no longer exist (destroyed when meshbook
    re-created the groups), as (name, kind): what must be re-created before they work again."""
    return [(name, kind) for name, kind, _ in _stale(namespace)]


def _stale(namespace: Mapping[str, Any]) -> list[tuple[str, str, list[Any]]]:
    """:func:`stale_objects`, each with the groups it holds."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return []
    current = {id(pg) for _, pg in process_groups()}
    bound = [(name, kind, list(_groups(holds))) for name, kind, holds in _bound(namespace)]
    stale = [entry for entry in bound if any(id(pg) not in current for pg in entry[2])]
    values = {name: namespace.get(name) for name, _, _ in stale}
    # A module inside another one named here (``layer`` of ``for layer in model: fully_shard(layer)``)
    # is rebuilt with it: naming it too told the user to rebuild a loop variable.
    inside = {id(part) for value in values.values() if isinstance(value, torch.nn.Module)
              for part in itertools.islice(value.modules(), 1, None)}
    # What parallelize made with a step named here is made again with it, by parallelize.
    inside |= {id(made) for name, kind, _ in stale if kind == PARALLELIZED
               for made in (getattr(values[name], "built").model, getattr(values[name], "built").optimizer)}
    return sorted((entry for entry in stale if id(values[entry[0]]) not in inside), key=lambda e: e[:2])


#: A collective that waited its timeout out waited on a live group: one meshbook closed fails at once.
_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
#: The locals in torch's frames that name the group a collective runs on.
_GROUP_LOCALS = ("group", "pg", "process_group")
#: What of the stale can fail without a frame naming its group: a module, in its backward().
_MODULES = ("DDP module", "FSDP module", "FSDP2 module")


def stale_in_failure(exc: BaseException, message: str, namespace: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The stale variables (:func:`stale_objects`) a failed collective came from, as far as its
    frames tell: the group a frame of the failure ran on (a collective's ``group``, a DDP
    module's ``process_group``) picks those holding it, and a current one clears them all.
    Where no frame names one (DDP's backward runs in C++), only the stale modules are named.
    A timeout, or an error that says nothing of a closed or destroyed group, names none: it
    came from a live group (a deadlock, a rank that died), whatever else the namespace holds."""
    if _TIMED_OUT.search(message):
        return []
    stale = _stale(namespace)
    if not stale:
        return []
    named = [(name, kind) for name, kind, _ in stale]
    used = _groups_in(sys.modules["torch"].distributed.ProcessGroup, exc.__traceback__)
    if not used:
        return [(name, kind) for name, kind in named if kind in _MODULES] or \
            (named if DESTROYED_GROUP.search(message) else [])
    current = {id(pg) for _, pg in process_groups()}
    if all(id(pg) in current for pg in used):
        return []
    return [(name, kind) for name, kind, groups in stale if any(pg in used for pg in groups)] or named


def _groups_in(group_type: type, tb: Any) -> list[Any]:
    """The process groups the frames of a traceback ran on, by the names torch gives them."""
    found: list[Any] = []
    while tb is not None:
        values = tb.tb_frame.f_locals
        candidates = [values.get(name) for name in _GROUP_LOCALS]
        candidates.append(getattr(values.get("self"), "process_group", None))
        found += [c for c in candidates if isinstance(c, group_type) and all(c is not f for f in found)]
        tb = tb.tb_next
    return found


def replica_prints(namespace: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], tuple[float | None, ...]]]:
    """Each DDP module of the namespace, and each optimizer over one's parameters: the ranks
    that keep a replica of it (its group's) and a print of its numbers (each tensor's sum, in
    float64). Replicas in step print alike; an optimizer step that ran on some ranks only (an
    interrupt between backward and step, a rank failing there) leaves them apart for good,
    with no error: DDP syncs gradients, never weights nor optimizer state."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return {}
    found: dict[str, tuple[tuple[int, ...], tuple[float | None, ...]]] = {}
    owners: dict[int, tuple[int, ...]] = {}  # id(parameter) -> the ranks keeping it
    variables = [(n, v) for n, v in list(namespace.items()) if not n.startswith("_")]
    for name, value in variables:
        if isinstance(value, torch.nn.parallel.DistributedDataParallel):
            try:
                members = tuple(torch.distributed.get_process_group_ranks(value.process_group))
            except Exception:  # noqa: BLE001 - its group is gone: a stale object, named as such
                continue
            found[name] = members, _prints(torch, [*value.parameters(), *value.buffers()])
            owners.update((id(p), members) for p in value.parameters())
    for name, value in variables:
        if isinstance(value, torch.optim.Optimizer):
            params = [p for group in value.param_groups for p in group["params"]]
            keepers = {owners.get(id(p)) for p in params}
            if len(keepers) == 1 and None not in keepers:
                state = [v for p in params for v in value.state.get(p, {}).values()]
                found[name] = keepers.pop(), _prints(torch, state)  # type: ignore[assignment]
    return found


def _prints(torch: Any, values: Iterable[Any]) -> tuple[float | None, ...]:
    """Each value's sum in float64 (a number as it is; None where there is none, or a NaN),
    a slice at a time: a float64 copy of a whole weight (4x a bf16 embedding) could run a full
    GPU out of memory in the middle of a step check."""
    out: list[float | None] = []
    with torch.no_grad():
        for value in values:
            try:
                if torch.is_tensor(value):
                    flat = value.detach().reshape(-1)
                    total = float(sum((part.sum(dtype=torch.float64) for part in flat.split(PRINT_SLICE)),
                                      torch.zeros((), dtype=torch.float64, device=flat.device)))
                else:
                    total = float(value)
            except (TypeError, ValueError, RuntimeError):
                total = None
            out.append(None if total is None or total != total else total)
    return tuple(out)


class _Absent:
    """What no value is an instance of: the class of a module nobody imported."""


def _loaded(module: str, name: str) -> Any:
    """``module.name`` if some code imported ``module`` (no value can be one otherwise). Asked
    as a failing cell is reported: importing ``torch.distributed.tensor`` there would take
    the rank most of a second, while its peers' recovery waits on it."""
    return getattr(sys.modules.get(module), name, _Absent)


def _bound(namespace: Mapping[str, Any]) -> Iterator[tuple[str, str, list[Any]]]:
    """``(name, kind, what it holds)`` of each variable bound to process groups (what it holds:
    the groups and device meshes it calls). A value that cannot be asked is left out: this
    runs as a failure is reported and after new groups were joined, where raising would cost
    the rank its answer."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    for name, value in list(namespace.items()):
        if name.startswith("_") or name == "device_mesh":
            continue
        try:
            kind, holds = _binding(torch, value)
        except Exception:  # noqa: BLE001 - a user's object with a property that raises, say
            continue
        if kind:
            yield name, kind, holds


def _binding(torch: Any, value: Any) -> tuple[str, list[Any]]:
    """What kind of bound object ``value`` is ("" for none), and the groups and meshes it holds."""
    DeviceMesh = _loaded("torch.distributed.device_mesh", "DeviceMesh")  # noqa: N806 - a class
    DTensor = _loaded("torch.distributed.tensor", "DTensor")  # noqa: N806

    if isinstance(value, DeviceMesh):
        return "DeviceMesh", [value]
    if isinstance(value, torch.distributed.ProcessGroup):
        return "process group", [value]
    if isinstance(value, DTensor):
        return "DTensor", [value.device_mesh]
    if isinstance(value, torch.nn.parallel.DistributedDataParallel):
        return "DDP module", [value.process_group]
    if isinstance(value, _loaded("torch.distributed.fsdp", "FullyShardedDataParallel")):
        group = getattr(value, "process_group", None)
        return "FSDP module", [group] if group is not None else []
    if isinstance(value, torch.nn.Module):
        meshes = _meshes(DTensor, value.parameters())
        kept = fsdp2_groups(value)
        if kept:
            return "FSDP2 module", kept + meshes
        return ("module with DTensor parameters" if meshes else ""), meshes
    if isinstance(value, torch.optim.Optimizer):
        meshes = _meshes(DTensor, (p for g in value.param_groups for p in g["params"]))
        return ("optimizer over DTensor parameters" if meshes else ""), meshes
    if isinstance(value, _loaded("meshbook.mesh.rank.parallel", "Reporting")):
        # A pipeline's stage keeps its group, taken when it was built, and sends on it each step.
        return PARALLELIZED, _binding(torch, value.built.model)[1] + pipeline_groups(value.built.schedule)
    return "", []


def _meshes(dtensor: Any, params: Iterable[Any]) -> list[Any]:
    """The distinct device meshes of the DTensors among ``params``."""
    found: dict[int, Any] = {}
    for p in params:
        if isinstance(p, dtensor):
            found.setdefault(id(p.device_mesh), p.device_mesh)
    return list(found.values())


def _groups(holds: list[Any]) -> Iterator[Any]:
    """The process groups behind what a variable holds; a mesh finds its groups by name, so
    one whose groups are gone gives a placeholder that is no current group."""
    for held in holds:
        if not hasattr(held, "get_all_groups"):  # a process group itself
            yield held
            continue
        try:
            yield from held.get_all_groups()
        except Exception:  # noqa: BLE001 - looked up by name: gone with them
            yield _Absent
