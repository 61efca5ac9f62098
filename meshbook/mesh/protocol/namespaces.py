"""What lives in the ranks' namespaces, described without moving any data.

:func:`describe` runs on a rank and turns one value into a :class:`VarInfo`: its type; for a
tensor its shape, dtype, device and bytes; for a DTensor also its global shape, its placements
on the DeviceMesh dimensions and this rank's local shard (a :class:`Layout`); for an
``nn.Module`` its parameter count and bytes; for ``bytes`` their length. :func:`inventory` does
it for a whole namespace.

:class:`Namespaces` is what ``mesh.who()`` returns: those records for every rank, printed as one
table in which a variable that looks the same on several ranks is one row, with the bytes each
rank holds in total underneath::

    >>> mesh.who()
    name  type     shape   dtype    device  bytes  placements               local   ranks
    w     DTensor  (8, 4)  float32  cpu     64 B   dp:Shard(0) tp:Replicate()  (4, 4)  0-3
    step  int                                                                        0-3
    total per rank: [0-3] 64 B

Memory is counted once per rank: a second name for the same object (``b = a``; a model held
as ``model`` and ``sharded_model``) says ``same as a`` in the bytes column, a value whose
memory an earlier name already holds (a view, a wrapper around the same parameters) says
``memory of a``, and neither adds to the total. Variables a rank had before it was restarted
are listed as ``lost`` rather than silently missing. Private names (``_x``), modules,
classes, imported functions and the names meshbook seeds (``rank``, ``torch``,
``device_mesh``...) are left out.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import BuiltinFunctionType, FunctionType, ModuleType
from typing import Any

from .text import format_bytes, format_ranks, group_by_text, status_table
from .topology import Topology
from .values import RankValues

#: Names every rank's namespace starts with (``Worker.init_distributed``): meshbook's, not yours.
SEEDED = frozenset({"rank", "world_size", "local_rank", "coords", "device", "torch", "dist",
                    "device_mesh", "display"})

#: How deep lists, tuples and dicts are searched for tensors when sizing them.
_CONTAINER_DEPTH = 4
_SCALARS = (int, float, complex, str, bool, type(None))  # not sized (bytes are: they may be big)

#: Columns of the ``who`` table, in order; empty ones are dropped from the printout.
COLUMNS = ("name", "type", "shape", "dtype", "device", "bytes", "params", "placements", "local",
           "ranks")


@dataclass(frozen=True)
class Layout:
    """How a DTensor is spread over its DeviceMesh, as one rank sees it."""

    mesh_dims: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    #: The DeviceMesh's global ranks, row-major: which rank holds which shard.
    mesh_ranks: tuple[int, ...]
    #: One per mesh dimension: ``("Shard", dim)``, ``("Replicate", None)``, ``("Partial", op)``,
    #: ``("_StridedShard", (dim, split_factor))`` (FSDP2 over tensor parallel), or ``(repr,
    #: None)`` for placements meshbook does not know.
    placements: tuple[tuple[str, Any], ...]
    local_shape: tuple[int, ...]

    def describe(self) -> str:
        """``"dp:Shard(0) tp:Replicate()"``."""
        return " ".join(f"{dim}:{_placement_text(p)}" for dim, p in zip(self.mesh_dims, self.placements))


@dataclass(frozen=True)
class VarInfo:
    """One variable on one rank: what it is and how much memory it holds there."""

    name: str
    type: str
    shape: tuple[int, ...] | None = None  # the global shape for a DTensor
    dtype: str | None = None
    device: str | None = None
    nbytes: int | None = None  # bytes held on this rank (a DTensor's local shard)
    params: int | None = None  # an nn.Module's parameter count
    layout: Layout | None = None  # DTensors only
    #: ``"same as a"`` / ``"memory of a"``: what an earlier name of this rank already holds.
    shared: str | None = None
    #: Bytes this variable adds to its rank's total: memory no earlier name holds (``None``:
    #: not measured, ``nbytes`` counts).
    held: int | None = None

    @property
    def adds(self) -> int:
        """Bytes this variable adds to its rank's total (0 where nothing was measured)."""
        return (self.nbytes if self.held is None else self.held) or 0

    @property
    def is_tensor(self) -> bool:
        return self.shape is not None and self.params is None

    def cells(self) -> dict[str, str]:
        """This variable's row in the ``who`` table (without its ranks)."""
        return {
            "name": self.name, "type": self.type,
            "shape": _shape_text(self.shape) if self.shape is not None else "",
            "dtype": self.dtype or "", "device": self.device or "",
            "bytes": self.shared or (format_bytes(self.nbytes) if self.nbytes is not None else ""),
            "params": f"{self.params:,}" if self.params is not None else "",
            "placements": self.layout.describe() if self.layout else "",
            "local": _shape_text(self.layout.local_shape) if self.layout else "",
        }

    def summary(self) -> str:
        """One line: ``"DTensor (8, 4) float32 cpu, 64 B, dp:Shard(0) tp:Replicate(), local (4, 4)"``."""
        cells = self.cells()
        head = " ".join(filter(None, (cells["type"], cells["shape"], cells["dtype"], cells["device"])))
        extra = [cells["bytes"], cells["params"] and f"{cells['params']} params",
                 cells["placements"], cells["local"] and f"local {cells['local']}"]
        return ", ".join(filter(None, [head, *extra]))


def describe(name: str, value: Any) -> VarInfo:
    """Metadata of ``value``; reads attributes only, never the data."""
    kind = type(value).__name__
    torch = sys.modules.get("torch")
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(value, dtensor):
        local = value.to_local()
        return VarInfo(name, kind, tuple(value.shape), _dtype_text(value.dtype), str(local.device),
                       _tensor_bytes(local), layout=_layout(value, local))
    if torch is not None and isinstance(value, torch.Tensor):
        return VarInfo(name, kind, tuple(value.shape), _dtype_text(value.dtype), str(value.device),
                       _tensor_bytes(value))
    if torch is not None and isinstance(value, torch.nn.Module):
        params = list(value.parameters())
        held = [local_shard(t) for t in [*params, *value.buffers()]]
        return VarInfo(name, kind, dtype=_common(_dtype_text(t.dtype) for t in held),
                       device=_common(str(t.device) for t in held),
                       nbytes=sum(_tensor_bytes(t) for t in held),
                       params=sum(p.numel() for p in params))
    if torch is not None and isinstance(value, torch.optim.Optimizer):
        state = [local_shard(t) for t in _optimizer_state(value)]  # its moments: often twice the model
        moments = [t for t in state if t.dim()]  # not Adam's step count, a CPU scalar beside GPU moments
        return VarInfo(name, kind, dtype=_common(_dtype_text(t.dtype) for t in moments),
                       device=_common(str(t.device) for t in moments), nbytes=sum(_tensor_bytes(t) for t in state))
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        return VarInfo(name, kind, tuple(value.shape), str(value.dtype), "cpu", int(value.nbytes))
    if isinstance(value, (list, tuple, dict)):
        return VarInfo(name, kind, nbytes=_contained_bytes(value, _CONTAINER_DEPTH))
    if isinstance(value, (bytes, bytearray)):
        return VarInfo(name, kind, nbytes=len(value))
    return VarInfo(name, kind)


def _optimizer_state(optimizer: Any) -> list[Any]:
    """The tensors an optimizer keeps per parameter (Adam's two moments, its step count...)."""
    torch = sys.modules["torch"]
    return [t for per_param in list(optimizer.state.values()) for t in list(per_param.values())
            if isinstance(t, torch.Tensor)]


def inventory(namespace: Mapping[str, Any]) -> dict[str, VarInfo]:
    """:func:`describe` every user variable of a rank's namespace, by name."""
    # A snapshot: this may run on the control thread while the main thread runs a cell. In
    # the order names were first assigned, so the name a value got first owns its memory.
    items = list(namespace.items())
    out = {}
    owners = _Owners()
    for name, value in items:
        if _shown(name, value):
            try:
                out[name] = owners.attribute(describe(name, value), value)
            except Exception:  # noqa: BLE001 - a broken object must not hide the others
                out[name] = VarInfo(name, type(value).__name__)
    return dict(sorted(out.items()))


class _Owners:
    """Which name first held each object and each storage, so a rank's memory counts once."""

    def __init__(self) -> None:
        self.objects: dict[int, str] = {}
        self.storages: dict[tuple[str, int], str] = {}

    def attribute(self, info: VarInfo, value: Any) -> VarInfo:
        if info.nbytes is None:
            return info  # not measured (a number, a string): small, and ints are shared anyway
        first = self.objects.setdefault(id(value), info.name)
        if first != info.name:
            return replace(info, shared=f"same as {first}", held=0)
        held = _storages(value, _CONTAINER_DEPTH)
        new = {key: size for key, size in held.items() if key not in self.storages}
        self.storages.update(dict.fromkeys(new, info.name))
        if held and not new:
            return replace(info, shared=f"memory of {self.storages[next(iter(held))]}", held=0)
        return replace(info, held=sum(new.values()) if held else info.nbytes)


def _storages(value: Any, depth: int) -> dict[tuple[str, int], int]:
    """The memory blocks ``value`` holds, (device, address) -> bytes: a tensor's storage
    (a DTensor's local one), a module's parameters' and buffers', an array's base buffer,
    and those of tensors inside lists, tuples and dicts."""
    torch = sys.modules.get("torch")
    numpy = sys.modules.get("numpy")
    if torch is not None and isinstance(value, torch.Tensor):
        storage = local_shard(value).untyped_storage()
        return {(str(value.device), storage.data_ptr()): storage.nbytes()} if storage.nbytes() else {}
    if torch is not None and isinstance(value, torch.nn.Module):
        return _merged(_storages(t, depth) for t in itertools.chain(value.parameters(), value.buffers()))
    if torch is not None and isinstance(value, torch.optim.Optimizer):
        return _merged(_storages(t, depth) for t in _optimizer_state(value))
    if numpy is not None and isinstance(value, numpy.ndarray):
        while isinstance(value.base, numpy.ndarray):
            value = value.base
        return {("cpu", value.__array_interface__["data"][0]): int(value.nbytes)} if value.nbytes else {}
    if isinstance(value, (list, tuple, dict)) and depth > 0:
        items = value.values() if isinstance(value, dict) else value
        return _merged(_storages(item, depth - 1) for item in items if not isinstance(item, _SCALARS))
    return {}


def _merged(parts: Any) -> dict[tuple[str, int], int]:
    out: dict[tuple[str, int], int] = {}
    for part in parts:
        out.update(part)
    return out


class Namespaces:
    """The variables of a set of ranks (what :meth:`Mesh.who` returns).

    ``ns["w"]`` is a :class:`RankValues` of that variable's :class:`VarInfo` on the ranks that
    have it; ``ns.lost`` maps a restarted rank to the names it lost.
    """

    def __init__(self, variables: Mapping[int, Mapping[str, VarInfo]],
                 lost: Mapping[int, tuple[str, ...]], topology: Topology | None = None) -> None:
        self.variables = {r: dict(variables[r]) for r in sorted(variables)}
        self.lost = {r: tuple(names) for r, names in sorted(lost.items()) if names}
        self._topology = topology

    @property
    def ranks(self) -> list[int]:
        return list(self.variables)

    def names(self) -> list[str]:
        """Every variable name present on at least one rank, sorted."""
        return sorted({n for infos in self.variables.values() for n in infos})

    def __getitem__(self, name: str) -> RankValues:
        found = {r: infos[name] for r, infos in self.variables.items() if name in infos}
        if not found:
            raise KeyError(f"{name!r} is on none of ranks {format_ranks(self.variables)}")
        return RankValues(found, self._topology)

    def __contains__(self, name: object) -> bool:
        return any(name in infos for infos in self.variables.values())

    def totals(self) -> RankValues:
        """Bytes of tensors, arrays and modules each rank holds."""
        return RankValues({r: sum(i.adds for i in infos.values()) for r, infos in self.variables.items()},
                          self._topology)

    def rows(self) -> list[dict[str, str]]:
        """The table's rows: one per variable and distinct description, with its ranks."""
        rows = []
        for name in sorted({*self.names(), *(n for names in self.lost.values() for n in names)}):
            cells = {r: infos[name].cells() for r, infos in self.variables.items() if name in infos}
            for ranks, _ in group_by_text({r: repr(c) for r, c in cells.items()}):
                rows.append({**cells[ranks[0]], "ranks": format_ranks(ranks)})
            gone = [r for r, names in self.lost.items() if name in names]
            if gone:
                rows.append({**dict.fromkeys(COLUMNS, ""), "name": name,
                             "type": "lost (rank restarted)", "ranks": format_ranks(gone)})
        return rows

    def __repr__(self) -> str:
        rows = self.rows()
        if not rows:
            return f"(no variables on ranks {format_ranks(self.variables)})"
        shown = [c for c in COLUMNS if c in ("name", "type", "ranks") or any(r[c] for r in rows)]
        table = status_table([{c: row[c] for c in shown} for row in rows])
        totals = "  ".join(f"[{format_ranks(ranks)}] {format_bytes(int(text))}"
                           for ranks, text in self.totals().groups())
        lines = [table, f"total per rank: {totals}"]
        if self.lost:
            lines.append(f"rank(s) {format_ranks(self.lost)} were restarted: their variables marked "
                         f"lost are gone; run the cells that made them again, or push them")
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


def _shown(name: str, value: Any) -> bool:
    if name.startswith("_") or name in SEEDED or isinstance(value, (ModuleType, type)):
        return False
    if isinstance(value, (FunctionType, BuiltinFunctionType)):
        return getattr(value, "__module__", None) == "__main__"  # defined in a cell, not imported
    return True


def dtensor_type() -> type[Any] | None:
    """torch's DTensor class, if the user's code imported it (no DTensor exists otherwise)."""
    for module in ("torch.distributed.tensor", "torch.distributed._tensor"):
        found = getattr(sys.modules.get(module), "DTensor", None)
        if found is not None:
            return found
    return None


def _layout(value: Any, local: Any) -> Layout:
    mesh = value.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return Layout(tuple(names), tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()),
                  tuple(_placement(p) for p in value.placements), tuple(local.shape))


def _placement(p: Any) -> tuple[str, Any]:
    kind = type(p).__name__
    if kind == "Shard":
        return ("Shard", int(p.dim))
    if kind == "Replicate":
        return ("Replicate", None)
    if kind == "Partial":
        return ("Partial", str(p.reduce_op))
    if kind == "_StridedShard":
        return ("_StridedShard", (int(p.dim), int(p.split_factor)))
    return (repr(p), None)


def _placement_text(placement: tuple[str, Any]) -> str:
    kind, arg = placement
    if kind in ("Shard", "Replicate", "Partial"):
        return f"{kind}({'' if arg is None else arg})"
    if kind == "_StridedShard":
        return f"_StridedShard(dim={arg[0]}, sf={arg[1]})"  # as torch writes it
    return kind


def local_shard(tensor: Any) -> Any:
    """A DTensor's local shard; any other value unchanged."""
    dtensor = dtensor_type()
    return tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor) else tensor


def _contained_bytes(value: Any, depth: int) -> int | None:
    """Bytes of the tensors, arrays and bytes inside lists, tuples and dicts (a state_dict, a
    batch); ``None`` when there are none (the size of other objects is not measured)."""
    items = value.values() if isinstance(value, dict) else value
    found = None
    for item in items:
        if isinstance(item, _SCALARS):
            continue  # the common case (a list of losses): skip it cheaply
        if isinstance(item, (list, tuple, dict)):
            inner = _contained_bytes(item, depth - 1) if depth > 1 else None
        else:
            inner = describe("", item).nbytes
        if inner is not None:
            found = (found or 0) + inner
    return found


def _tensor_bytes(tensor: Any) -> int:
    return int(tensor.numel() * tensor.element_size())


def _dtype_text(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _shape_text(shape: tuple[int, ...]) -> str:
    return f"({shape[0]},)" if len(shape) == 1 else f"({', '.join(map(str, shape))})"


def _common(texts: Any) -> str | None:
    distinct = set(texts)
    if not distinct:
        return None
    return distinct.pop() if len(distinct) == 1 else "mixed"
