"""Resident variables seen from the notebook, and data moved between the notebook and the ranks.

Models and tensors live on the ranks across cells. :class:`DataOps` (a base of
:class:`~meshbook.Mesh`) looks at them without moving them, and moves data when asked::

    >>> mesh.who()                          # every rank's variables, one table, no data moved
    >>> w = mesh.ref("w")                   # a RemoteRef: its repr shows shape, dtype, placements
    >>> w.full_tensor()                     # a DTensor assembled in the notebook from its shards
    >>> mesh.push(lr=0.1, batch=x)          # notebook values into the ranks' namespaces
    >>> mesh.scatter("x", x, mesh_dim="dp") # x split along dim 0, one piece per dp coordinate
    >>> mesh.pull("loss")                   # RankValues, rank -> value

How the data travels:

* **push / scatter** pickle each value once in the notebook
  (:mod:`meshbook.mesh.protocol.payload`): local ranks map its buffers from shared memory, so
  eight ranks cost about what one costs; otherwise each rank gets the buffers as zero-copy
  frames. Tensors land on the rank's
  device (CUDA tensors are copied there). Each rank stores all the pushed values or none of
  them; a rank that failed is named, with the ranks that did store them.
* **pull / fetch** first ask every rank for the value's metadata (on the control thread: a
  busy rank answers), so a name missing on some ranks, or a pull larger than ``max_bytes``, is
  refused before anything moves. Then local ranks write their big buffers into shared memory,
  which the notebook maps (one copy, on the rank): into the file of a value pulled before that
  nothing maps any more, where there is one (written over, its pages are not allocated again),
  else into a new file of the rank's (the notebook keeps it for later pulls); ranks on other hosts send
  their value straight to the notebook as zero-copy frames. CUDA tensors arrive on the CPU; a
  DTensor arrives as the rank's local shard (``ref.full_tensor()`` assembles the global one).

Metadata comes from :mod:`meshbook.mesh.protocol.namespaces`; what each rank runs is in
:mod:`meshbook.mesh.rank.ops` (``who``, ``info``, ``store``, ``fetch``). The controller
remembers the names each rank had at the last ``who()`` or push, so after a rank is restarted ``who()`` lists what it
lost instead of silently showing less.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ...protocol.errors import (
    MeshError,
    MissingNameError,
    RemoteError,
    SelectionError,
    ShapeError,
    TooLargeError,
)
from ...protocol.limits import DEFAULT_MAX_BYTES
from ...protocol.namespaces import SEEDED, Layout, Namespaces
from ...protocol.payload import PIECE, SHARE_MIN, pack, pieces
from ...protocol.text import format_bytes, format_ranks, group_by_text
from ...protocol.values import RankValues
from ...rank import ops
from .view import MeshView, Ranks, Where

if TYPE_CHECKING:
    import torch


class DataOps:
    """What :class:`~meshbook.Mesh` can do with the ranks' variables: who, ref, push, scatter, pull."""

    def who(self: MeshView, ranks: Ranks = None, *, where: Where = None) -> Namespaces:
        """The selected ranks' variables as a table (a :class:`Namespaces`); no data moves.

        Answered on each rank's control thread, so it works while a rank is busy, and shows
        the namespace as it is at that moment.
        """
        chosen = self.select(ranks, where)
        found = dict(self.call(ops.who, ranks=chosen, what="who").result(echo=False))
        lost = {}
        for rank, infos in found.items():
            state = self.controller.ranks[rank]
            names = frozenset(infos)
            if state.lost_namespace:
                lost[rank] = tuple(sorted(state.known_names - names))
                names |= state.known_names  # what it lost stays known until it is back
            state.known_names = names
        return Namespaces(found, lost, self.topology)

    def ref(self: MeshView, name: str, ranks: Ranks = None, *, where: Where = None) -> RemoteRef:
        """A :class:`RemoteRef` to ``name`` on the selected ranks (it must exist on all of them)."""
        chosen = self.select(ranks, where)
        _infos(self, name, chosen)
        return RemoteRef(self.narrow(chosen), name)

    def push(self: MeshView, values: Mapping[str, Any] | None = None, /, *, ranks: Ranks = None,
             where: Where = None, **named: Any) -> None:
        """Store notebook values in the selected ranks' namespaces: ``mesh.push(x=t, lr=0.1)``.

        ``values`` (a dict) can name what keywords cannot (``mesh.push({"ranks": r})``).
        Each value is serialized once, whatever the number of ranks; tensors are placed on
        each rank's device.
        """
        items = {**(values or {}), **named}
        if not items:
            raise MeshError("push() needs values to send: mesh.push(x=tensor, lr=0.1)")
        _check_names(items)
        _deliver(self, [(self.select(ranks, where), items)], "push")

    def scatter(self: MeshView, name: str, tensor: torch.Tensor, dim: int = 0, *,
                mesh_dim: str | None = None, ranks: Ranks = None, where: Where = None) -> None:
        """Split ``tensor`` along ``dim`` and store one piece per rank as ``name``.

        With ``mesh_dim="dp"`` there is one piece per coordinate of that mesh dimension and
        every rank gets the piece of its coordinate (ranks differing only in other dimensions
        get the same piece). The size along ``dim`` must divide evenly.
        ``mesh.ref(name).gather(dim, mesh_dim=...)`` is the inverse.
        """
        import torch

        _check_names({name: tensor})
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            what = "a 0-d tensor" if isinstance(tensor, torch.Tensor) else f"a {type(tensor).__name__}"
            raise ShapeError(f"scatter() splits a tensor with at least one dimension, not {what}; "
                             f"use push() to send the same value to every rank")
        groups = _groups(self, self.select(ranks, where), mesh_dim)
        axis = _axis(tensor, dim)
        size, parts = tensor.shape[axis], len(groups)
        if size % parts:
            over = "rank" if mesh_dim is None else f"{mesh_dim} coordinate"
            raise ShapeError(
                f"cannot scatter {name!r}: its size {size} along dim {dim} does not divide into "
                f"{parts} equal pieces (one per {over}); pad or trim it to a multiple of {parts} "
                f"(e.g. {size - size % parts} or {size + parts - size % parts}), or select other ranks")
        pieces = tensor.split(size // parts, dim=axis)
        _deliver(self, [(group, {name: piece}) for group, piece in zip(groups, pieces)], "scatter")

    def pull(self: MeshView, name: str, ranks: Ranks = None, *, where: Where = None,
             max_bytes: int = DEFAULT_MAX_BYTES) -> RankValues:
        """The value of ``name`` on each selected rank, as a :class:`RankValues`.

        Tensors arrive on the CPU; a DTensor arrives as each rank's local shard. Refused,
        before anything moves, if ``name`` is missing on some rank or if the tensors would
        add up to more than ``max_bytes`` (2 GiB by default).
        """
        chosen = self.select(ranks, where)
        infos = _infos(self, name, chosen)
        total = sum(info.nbytes or 0 for info in infos.values())
        if total > max_bytes:
            raise TooLargeError(_too_large(name, infos, total, max_bytes))
        share = self.controller.agents.same_host and total >= SHARE_MIN
        if not share:
            return self.call(ops.fetch, name, False, ranks=chosen, what=f"pull({name!r})").result(echo=False)
        landing = self.controller.landing
        slots = landing.offer({rank: info.nbytes or 0 for rank, info in infos.items()})
        run, answered = None, False
        try:
            run = self.call(ops.fetch, name, True, slots, ranks=chosen, what=f"pull({name!r})")
            answers = run.result(echo=False)
            answered = True
            return answers.replaced({rank: landing.load(payload, "pull")["value"]
                                     for rank, payload in answers.items()})
        finally:  # mapped, or never to be: the ranks close the files they lent either way
            landing.settle(slots, answered)
            offered = {slot.token for slot in slots.values()}
            lent = {rank: payload.shared.token for rank, payload in (run.values() if run else {}).items()
                    if payload.shared and payload.shared.token not in offered}
            if lent:
                with contextlib.suppress(MeshError):  # a stopped mesh's ranks are gone, files and all
                    self.call(ops.unshare, lent, ranks=sorted(lent), what=f"pull({name!r}): release")


class RemoteRef:
    """A variable on the ranks, held by name from the notebook; its data moves only when asked.

    The repr shows its metadata on every rank (shape, dtype, device, bytes; placements and
    local shards for a DTensor), read fresh each time, without fetching the data.
    """

    def __init__(self, mesh: MeshView, name: str) -> None:
        self.mesh = mesh
        self.name = name

    @property
    def ranks(self) -> list[int]:
        return self.mesh.ranks

    def info(self, timeout: float | None = None) -> RankValues:
        """Each rank's :class:`~meshbook.mesh.protocol.namespaces.VarInfo` for this name, read now."""
        return _infos(self.mesh, self.name, self.mesh.ranks, timeout)

    def fetch(self, ranks: Ranks = None, *, where: Where = None,
              max_bytes: int = DEFAULT_MAX_BYTES) -> RankValues:
        """The values, rank -> value (see :meth:`Mesh.pull`)."""
        return self.mesh.pull(self.name, ranks, where=where, max_bytes=max_bytes)

    def full_tensor(self, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
        """The global tensor of a DTensor, assembled on the notebook's CPU from its shards.

        Only one replica of each shard moves (a ``Replicate()`` dimension is read from its
        first coordinate); ``Partial`` placements are reduced here.
        """
        layout = _one_layout(self.name, self.info())
        needed = _needed(layout)
        outside = sorted(set(needed.values()) - set(self.ranks))
        if outside:
            raise SelectionError(
                f"assembling {self.name!r} needs rank(s) {format_ranks(outside)} of its DeviceMesh, "
                f"outside this ref (ranks {format_ranks(self.ranks)}); take a ref over them: "
                f"mesh.ref({self.name!r}, ranks={format_ranks(layout.mesh_ranks)!r})")
        shards = self.fetch(sorted(set(needed.values())), max_bytes=max_bytes)
        return _assemble(layout, {coord: shards[rank] for coord, rank in needed.items()}, ())

    def gather(self, dim: int = 0, *, mesh_dim: str | None = None,
               max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
        """Concatenate a plain tensor sharded by convention: each rank's piece, in rank order.

        With ``mesh_dim`` one piece per coordinate of that dimension (from the lowest rank
        that has it): the inverse of ``mesh.scatter(name, t, dim, mesh_dim=...)``.
        """
        import torch

        infos = self.info()
        kinds = {info.type for info in infos.values() if not info.is_tensor or info.layout}
        if kinds:
            hint = "; use .full_tensor() for a DTensor" if "DTensor" in kinds else ""
            raise ShapeError(f"gather() concatenates plain tensors; {self.name!r} is a "
                             f"{'/'.join(sorted(kinds))} on some ranks{hint}")
        groups = _groups(self.mesh, self.ranks, mesh_dim)
        sources = [group[0] for group in groups]
        values = self.fetch(sources, max_bytes=max_bytes)
        pieces = [values[rank] for rank in sources]
        return torch.cat(pieces, dim=_axis(pieces[0], dim))

    def __repr__(self) -> str:
        try:
            infos = self.info(timeout=10.0)
        except MeshError as exc:
            return f"<RemoteRef {self.name!r}: {exc}>"
        groups = group_by_text({r: info.summary() for r, info in infos.items()})
        if len(groups) == 1:
            return f"<RemoteRef {self.name!r} on ranks {format_ranks(groups[0][0])}: {groups[0][1]}>"
        lines = [f"  [{format_ranks(ranks)}] {text}" for ranks, text in groups]
        return "\n".join([f"<RemoteRef {self.name!r}:", *lines, ">"])

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


# -- helpers -----------------------------------------------------------------------------------


def _infos(mesh: MeshView, name: str, ranks: list[int], timeout: float | None = None) -> RankValues:
    """Every rank's metadata for ``name``; :class:`MissingNameError` naming the ranks without it."""
    if not isinstance(name, str):
        raise MeshError(f"variable names are strings, not {type(name).__name__}")
    found = mesh.call(ops.info, name, ranks=ranks, what=f"info({name!r})")
    infos = found.result(timeout=timeout, echo=False)
    missing = [r for r, info in infos.items() if info is None]
    if missing:
        have = [r for r in infos if r not in missing]
        where = (f" (it is on rank(s) {format_ranks(have)}: select those, e.g. "
                 f"ranks={format_ranks(have)!r})" if have else
                 "; define it there in a %%mesh cell or send it with mesh.push()")
        raise MissingNameError(f"{name!r} is not defined on rank(s) {format_ranks(missing)}{where}; "
                               f"nothing was moved")
    return infos


def _deliver(mesh: MeshView, parts: list[tuple[list[int], dict[str, Any]]], what: str) -> None:
    """Store each part's values on its ranks; all-or-nothing per rank, and said when partial."""
    controller = mesh.controller
    everyone = sorted({r for ranks, _ in parts for r in ranks})
    controller.check_usable(everyone)
    with contextlib.ExitStack() as stack:
        payloads = [stack.enter_context(pack(values, controller.agents.same_host, what))
                    for ranks, values in parts]  # every value pickled before anything is sent
        runs = []
        for (ranks, _), payload in zip(parts, payloads):
            if controller.remote and sum(memoryview(b).nbytes for b in payload.buffers) >= 2 * PIECE:
                payload, sent_ahead = pieces(payload)  # pipelined across the network
                assert payload.staged is not None  # pieces() names where the pieces go
                runs += [mesh.call(ops.stage, payload.staged.token, *piece, ranks=ranks, what=what)
                         for piece in sent_ahead]
            runs.append(mesh.call(ops.store, payload, ranks=ranks, what=what))
        try:
            for run in runs:
                run.wait()
        except KeyboardInterrupt:
            for run in runs:
                run.interrupt()
            raise
    failures = {r: f for run in runs for r, f in getattr(run.exception(), "failures", {}).items()}
    for ranks, values in parts:
        for rank in ranks:
            if rank not in failures:
                state = controller.ranks[rank]
                state.known_names = state.known_names | set(values)
    if failures:
        names = ", ".join(sorted({n for _, values in parts for n in values}))
        stored = [r for r in everyone if r not in failures]
        raise RemoteError(failures, hint=(
            f"{what}: {names} stored on rank(s) {format_ranks(stored) or 'none'}; rank(s) "
            f"{format_ranks(failures)} kept their previous values (a rank stores all or none)"))


def _check_names(values: Mapping[str, Any]) -> None:
    for name in values:
        if not isinstance(name, str) or not name.isidentifier():
            raise MeshError(f"{name!r} is not a valid variable name")
        if name in SEEDED:
            raise MeshError(f"{name!r} is set by meshbook on every rank ({', '.join(sorted(SEEDED))}); "
                            f"send your value under another name")


def _groups(mesh: MeshView, ranks: list[int], mesh_dim: str | None) -> list[list[int]]:
    """One group per piece: each rank alone, or the ranks sharing a coordinate of ``mesh_dim``."""
    if mesh_dim is None:
        return [[r] for r in ranks]
    topology = mesh.topology
    if mesh_dim not in topology.names:
        raise SelectionError(f"the mesh has no dimension {mesh_dim!r}; its dimensions are "
                             f"{topology.describe()}")
    by_coord: dict[int, list[int]] = {}
    for rank in ranks:
        by_coord.setdefault(topology.coords(rank)[mesh_dim], []).append(rank)
    return [by_coord[c] for c in sorted(by_coord)]


def _axis(tensor: torch.Tensor, dim: int) -> int:
    if not -tensor.dim() <= dim < tensor.dim():
        raise ShapeError(f"dim {dim} is out of range for a tensor of shape {tuple(tensor.shape)}")
    return dim % tensor.dim()


def _too_large(name: str, infos: RankValues, total: int, limit: int) -> str:
    per_rank = "; ".join(f"[{format_ranks(r)}] {format_bytes(int(b))}"
                         for r, b in group_by_text({r: str(i.nbytes or 0) for r, i in infos.items()}))
    power, unit = (30, "G") if total >= 2 ** 30 else (20, "M")
    enough = math.ceil(total / 2 ** power)
    return (f"pulling {name!r} would move {format_bytes(total)} ({per_rank}), over the "
            f"{format_bytes(limit)} limit; nothing was moved. Pull from fewer ranks, or raise the "
            f"limit: mesh.pull({name!r}, max_bytes={enough} * 2**{power}) (%mesh pull {name} "
            f"--max-bytes {enough}{unit})")


def _one_layout(name: str, infos: RankValues) -> Layout:
    """The DTensor layout all ``infos`` share, or a :class:`ShapeError` saying why not."""
    if any(info.layout is None for info in infos.values()):
        kinds = sorted({info.type for info in infos.values() if info.layout is None})
        raise ShapeError(f"full_tensor() assembles DTensors; {name!r} is a {'/'.join(kinds)} on "
                         f"some ranks (use .gather(dim) for a plain tensor split by convention)")
    layouts: dict[int, Layout] = {r: i.layout for r, i in infos.items()}
    meshes = group_by_text({r: repr(layout.mesh_ranks) for r, layout in layouts.items()})
    if len(meshes) > 1:
        options = " or ".join(repr(format_ranks(ranks)) for ranks, _ in meshes)
        raise ShapeError(f"{name!r} lives on {len(meshes)} different DeviceMeshes; assemble one at "
                         f"a time: mesh.ref({name!r}, ranks=...) with ranks {options}")
    layout = layouts[infos.ranks[0]]
    for kind, arg in layout.placements:
        if kind not in ("Shard", "Replicate", "Partial") or (kind == "Partial" and arg not in _REDUCE):
            raise ShapeError(f"cannot assemble {name!r} in the notebook: placement {kind} "
                             f"{arg or ''} is not supported; run `{name}.full_tensor()` on the "
                             f"ranks and pull the result")
    return layout


def _needed(layout: Layout) -> dict[tuple[int, ...], int]:
    """Mesh coordinate -> rank, for the shards needed (one replica of each)."""
    axes = [range(1) if kind == "Replicate" else range(size)
            for (kind, _), size in zip(layout.placements, layout.mesh_shape)]
    strides = [math.prod(layout.mesh_shape[i + 1:]) for i in range(len(layout.mesh_shape))]
    return {coord: layout.mesh_ranks[sum(c * s for c, s in zip(coord, strides))]
            for coord in itertools.product(*axes)}


def _assemble(layout: Layout, shards: dict[tuple[int, ...], Any], prefix: tuple[int, ...]) -> Any:
    """The tensor the mesh dimensions from ``len(prefix)`` on spread out (mesh dim 0 outermost,
    as DTensor shards: a later dimension splits each piece of an earlier one further)."""
    import torch

    level = len(prefix)
    if level == len(layout.mesh_shape):
        return shards[prefix]
    kind, arg = layout.placements[level]
    if kind == "Replicate":
        return _assemble(layout, shards, prefix + (0,))
    parts = [_assemble(layout, shards, prefix + (i,)) for i in range(layout.mesh_shape[level])]
    if kind == "Shard":
        return torch.cat(parts, dim=arg)
    return _REDUCE[arg](torch.stack(parts))


_REDUCE: dict[str, Callable[[Any], Any]] = {
    "sum": lambda stacked: stacked.sum(0), "avg": lambda stacked: stacked.mean(0),
    "max": lambda stacked: stacked.amax(0), "min": lambda stacked: stacked.amin(0),
}
