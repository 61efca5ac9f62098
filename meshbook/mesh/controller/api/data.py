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
  refused before anything moves. What metadata cannot size (an object of your own, a deep
  container, a string, a value a cell changed since) each rank weighs as it pickles it, against
  its share of the limit, and a rank answers that it is over, or that the name went, instead of
  sending it. Then local ranks write their big buffers into shared memory, which the notebook
  maps as each rank answers (one copy, on the rank): into the file of a value pulled before that
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
import keyword
import math
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from ...protocol.errors import (
    MeshError,
    MissingNameError,
    RemoteError,
    SelectionError,
    ShapeError,
    TooLargeError,
    check_bytes,
)
from ...protocol.limits import DEFAULT_MAX_BYTES
from ...protocol.namespaces import SEEDED, Layout, Namespaces
from ...protocol.payload import PIECE, Landing, Overweight, Payload, Slot, WriterExited, pack, pieces
from ...protocol.text import format_bytes, format_ranks, group_by_text, restart_hint
from ...protocol.values import RankValues
from ...rank import ops
from ..core.render import write_stream
from ..core.run import Run, interrupted_run
from .follow import QUEUED_HINT_S, still_running
from .view import MeshView, Ranks, Where

if TYPE_CHECKING:
    import torch

    from ..core.controller import Controller

#: What a rank may send of a limited pull beyond its share of the limit: the pickle's own bytes
#: around the data (types, shapes, names: about a hundred bytes a tensor).
_FRAMING = 64 << 10
#: How often a pull looks for answers that arrived (the last one wakes it at once).
_LAND_EVERY_S = 1.0
#: How long an interrupted push waits for its ranks to say whether they stored it.
INTERRUPTED_WAIT_S = 5.0


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
        if values is not None and not isinstance(values, Mapping):
            raise MeshError(f"push() takes a dict of names to values, or keywords: mesh.push(x=t) or "
                            f"mesh.push({{'x': t}}), not a {type(values).__name__}")
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
        get the same piece). The size along ``dim`` must divide evenly. A numpy array is sent
        as a tensor (over its memory, uncopied). ``mesh.ref(name).gather(dim, mesh_dim=...)``
        is the inverse.
        """
        import torch

        _check_names({name: tensor})
        tensor = _from_numpy(tensor, f"scatter({name!r})")
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
        pieces = tensor.tensor_split(parts, dim=axis)  # exactly one per group, empty ones too
        _deliver(self, [(group, {name: piece}) for group, piece in zip(groups, pieces)], "scatter")

    def pull(self: MeshView, name: str, ranks: Ranks = None, *, where: Where = None,
             max_bytes: int | str | None = DEFAULT_MAX_BYTES) -> RankValues:
        """The value of ``name`` on each selected rank, as a :class:`RankValues`.

        Tensors arrive on the CPU; a DTensor arrives as each rank's local shard. Refused,
        before anything moves, if ``name`` is missing on some rank or if the tensors would
        add up to more than ``max_bytes`` (bytes, or a size such as ``"512M"``; 2 GiB by default;
        None: no limit). What its metadata
        cannot size (objects of your own, bytes, deep containers, a value changed since) is
        weighed on each rank as it is pickled, against that rank's share of the limit.
        """
        values, shards = _pull(self, name, self.select(ranks, where), max_bytes)
        if shards:
            warnings.warn(f"{name!r} is a DTensor: each rank's value is its local shard, not the whole tensor; "
                          f"mesh.ref({name!r}).full_tensor() gives the whole", stacklevel=2)
        return values


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
              max_bytes: int | None = DEFAULT_MAX_BYTES) -> RankValues:
        """The values, rank -> value (see :meth:`Mesh.pull`; a DTensor's local shards, unsaid)."""
        return _pull(self.mesh, self.name, self.mesh.select(ranks, where), max_bytes)[0]

    def full_tensor(self, max_bytes: int | None = DEFAULT_MAX_BYTES) -> torch.Tensor:
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
        return _assemble(*_left_to_right(layout, {coord: shards[rank] for coord, rank in needed.items()}), ())

    def gather(self, dim: int = 0, *, mesh_dim: str | None = None,
               max_bytes: int | None = DEFAULT_MAX_BYTES) -> torch.Tensor:
        """Concatenate a plain tensor sharded by convention: each rank's piece, in rank order.

        With ``mesh_dim`` one piece per coordinate of that dimension (from the lowest rank
        that has it): the inverse of ``mesh.scatter(name, t, dim, mesh_dim=...)``. Numpy arrays
        are concatenated as tensors.
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
        _check_joinable(self.name, {rank: infos[rank].shape or () for rank in sources}, dim)
        values = self.fetch(sources, max_bytes=max_bytes)
        pieces = [_from_numpy(values[rank], f"gather() of {self.name!r}") for rank in sources]
        return torch.cat(pieces, dim=dim)  # the shapes were checked: they join

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


def _pull(mesh: MeshView, name: str, ranks: list[int], max_bytes: int | str | None) -> tuple[RankValues, bool]:
    """``name``'s value on each of ``ranks`` (see :meth:`DataOps.pull`), and whether it is a
    DTensor's local shards."""
    if max_bytes is not None:
        max_bytes = check_bytes(max_bytes, "max_bytes")
    infos = _infos(mesh, name, ranks)
    sizes = {rank: info.nbytes or 0 for rank, info in infos.items()}
    if max_bytes is not None and sum(sizes.values()) > max_bytes:
        raise TooLargeError(_too_large(name, sizes, max_bytes))
    return _fetch(mesh, name, sizes, max_bytes), any(info.layout for info in infos.values())


def _infos(mesh: MeshView, name: str, ranks: list[int], timeout: float | None = None) -> RankValues:
    """Every rank's metadata for ``name``; :class:`MissingNameError` naming the ranks without it."""
    if not isinstance(name, str):
        raise MeshError(f"variable names are strings, not {type(name).__name__}")
    if not name.isidentifier():  # never a variable: not "not defined on rank(s) 0,1"
        raise MeshError(f"{name!r} is not a valid variable name (letters, digits and _, e.g. 'loss')")
    found = mesh.call(ops.info, name, ranks=ranks, what=f"info({name!r})")
    infos = found.result(timeout=timeout, echo=False)
    missing = [r for r, info in infos.items() if info is None]
    if missing:
        raise MissingNameError(_missing(name, missing, [r for r in infos if r not in missing]))
    return infos


def _missing(name: str, missing: list[int], have: list[int]) -> str:
    """Why a pull is refused when ``name`` is missing on some ranks, and what to do."""
    where = (f" (it is on rank(s) {format_ranks(have)}: select those, ranks={format_ranks(have)!r} in Python, "
             f"--ranks {format_ranks(have)} in %mesh)" if have else
             "; define it there in a %%mesh cell or send it with mesh.push()")
    return f"{name!r} is not defined on rank(s) {format_ranks(missing)}{where}; nothing was moved"


def _fetch(mesh: MeshView, name: str, sizes: Mapping[int, int], max_bytes: int | None) -> RankValues:
    """Each rank's value of ``name`` (``sizes``: its bytes by metadata, rank -> bytes), shared
    memory mapped where the ranks run on this machine; refused as the checks before it refuse
    when a rank answers that the name is gone or the value weighs too much (a cell ran since)."""
    controller = mesh.controller
    share, landing = controller.agents.same_host, controller.landing
    slots = landing.offer(sizes) if share else {}
    what = f"pull({name!r})"
    run, clean = None, False
    try:
        run = mesh.call(ops.fetch, name, _limits(sizes, max_bytes), share, slots, ranks=list(sizes), what=what)
        values = _land(run, landing)
        answers = run.result(echo=False)
        clean = True
    finally:  # mapped, or never to be: the ranks close the files they lent either way
        landing.settle(slots, clean)
        if run is not None:
            _release(mesh, run, slots)
    missing = [rank for rank, answer in answers.items() if answer is None]
    if missing:
        raise MissingNameError(_missing(name, missing, [r for r in answers.ranks if r not in missing]))
    over = {rank: answer.nbytes for rank, answer in answers.items() if isinstance(answer, Overweight)}
    if over:
        assert max_bytes is not None  # no rank weighs against no limit
        # Each rank may send what its metadata said and an equal share of the rest (_limits):
        # the limit that lets the heaviest through gives every rank that much more.
        needed = sum(sizes.values()) + len(sizes) * max(nbytes - sizes[rank] for rank, nbytes in over.items())
        raise TooLargeError(_too_large(name, {**sizes, **over}, max_bytes, over, needed))
    return answers.replaced(values)


def _limits(sizes: Mapping[int, int], max_bytes: int | None) -> dict[int, int] | None:
    """What each rank may send of a pull limited to ``max_bytes`` in all: the bytes its
    metadata said and an equal share of what the limit leaves, so the ranks together never send
    more (but for :data:`_FRAMING` each, the pickle's own bytes)."""
    if max_bytes is None:
        return None
    share = (max_bytes - sum(sizes.values())) // len(sizes)
    return {rank: size + share + _FRAMING for rank, size in sizes.items()}


def _land(run: Run, landing: Landing) -> dict[int, Any]:
    """Each rank's value, mapped as its answer arrives rather than once every rank answered:
    a rank closes a file it lent a minute on (:class:`~meshbook.mesh.protocol.payload.Lent`)
    and may even die meanwhile, while another rank may answer much later (busy with a cell)."""
    values: dict[int, Any] = {}
    seen = 0
    try:
        while True:
            _, seen = run.events_since(seen, _LAND_EVERY_S)
            done = run.done()
            for rank, answer in run.values().items():
                if rank not in values and isinstance(answer, Payload):
                    values[rank] = _load(landing, rank, answer, run.what)
            if done:
                return values
    except BaseException:  # Ctrl-C, or a value that cannot be read: stop the ranks still at it
        run.interrupt()
        raise


def _load(landing: Landing, rank: int, payload: Payload, what: str) -> Any:
    """The value of rank ``rank``'s answer; an error naming the rank where it cannot be read."""
    try:
        return landing.load(payload, "pull")["value"]
    except WriterExited:
        raise MeshError(f"{what}: rank {rank} died after it answered, before the notebook read its "
                        f"value; restart it with {restart_hint([rank])} and pull again") from None
    except MeshError:
        raise  # out of descriptors: it says what to do
    except RuntimeError as exc:
        raise MeshError(f"{what}: the value of rank {rank} cannot be read: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - whatever unpickling raises (a class only the ranks import)
        raise MeshError(f"{what}: the value of rank {rank} cannot be unpickled in the notebook "
                        f"({type(exc).__name__}: {exc}); pull a part of it that is plain data (tensors, "
                        f"numbers, lists and dicts of them), or make what it needs importable here "
                        f"too") from None


def _release(mesh: MeshView, run: Run, slots: Mapping[int, Slot]) -> None:
    """Tell the ranks that lent files for ``run`` (not written into the notebook's ``slots``)
    to close them: the notebook mapped them, or never will."""
    offered = {slot.token for slot in slots.values()}
    lent = {rank: answer.shared.token for rank, answer in run.values().items()
            if isinstance(answer, Payload) and answer.shared and answer.shared.token not in offered}
    lent = {rank: lent[rank] for rank in mesh.controller.live(list(lent))}
    if lent:  # a dead rank's files went with it; one dead must not keep the others' pinned
        with contextlib.suppress(MeshError):  # a stopped mesh's ranks are gone, files and all
            mesh.call(ops.unshare, lent, ranks=sorted(lent), what=f"{run.what}: release")


def _deliver(mesh: MeshView, parts: list[tuple[list[int], dict[str, Any]]], what: str) -> None:
    """Store each part's values on its ranks; all-or-nothing per rank, and said when partial."""
    controller = mesh.controller
    everyone = sorted({r for ranks, _ in parts for r in ranks})
    controller.check_usable(everyone)
    with contextlib.ExitStack() as stack:
        payloads = [stack.enter_context(pack(values, controller.agents.same_host, what))
                    for ranks, values in parts]  # every value pickled before anything is sent
        runs: list[Run] = []
        try:  # a Ctrl-C as a later part is sent stops the parts sent before it too
            for (ranks, _), payload in zip(parts, payloads):
                if controller.remote and sum(memoryview(b).nbytes for b in payload.buffers) >= 2 * PIECE:
                    payload, sent_ahead = pieces(payload)  # pipelined across the network
                    assert payload.staged is not None  # pieces() names where the pieces go
                    for piece in sent_ahead:
                        runs.append(mesh.call(ops.stage, payload.staged.token, *piece, ranks=ranks, what=what))
                runs.append(mesh.call(ops.store, payload, ranks=ranks, what=what))
            _wait_saying_what_is_ahead(controller, runs, what)
        except KeyboardInterrupt as exc:  # waited for before the files the ranks map are closed
            sent = interrupted_run(exc)  # interrupted as it was sent
            raise _interrupted([*runs, *([sent] if sent is not None else [])], parts, everyone, what) from None
    failures = {r: f for run in runs for r, f in getattr(run.exception(), "failures", {}).items()}
    for ranks, values in parts:
        for rank in ranks:
            if rank not in failures:
                state = controller.ranks[rank]
                state.known_names = state.known_names | set(values)
    if failures:
        raise RemoteError(failures, hint=f"{what}: {_landed(parts, everyone, set(failures))} "
                                         f"(a rank stores all or none)")


def _wait_saying_what_is_ahead(controller: Controller, runs: list[Run], what: str) -> None:
    """Wait for ``runs``; where they still wait behind earlier work after
    :data:`~.follow.QUEUED_HINT_S` (a cell that outlived its timeout), say so once: nothing
    else would tell why the push does not return."""
    deadline = time.monotonic() + QUEUED_HINT_S
    if all(run.wait(max(0.0, deadline - time.monotonic())) for run in runs):
        return
    behind = {rank: earlier for run in runs for rank, earlier in controller.queued_behind(run).items()}
    if behind:
        write_stream("stderr", f"{still_running(behind)}: the {what} is stored there once that ends "
                               f"(mesh.interrupt('{format_ranks(behind)}') stops it; Ctrl-C drops the {what} "
                               f"instead)\n")
    for run in runs:
        run.wait()


def _interrupted(runs: list[Run], parts: list[tuple[list[int], dict[str, Any]]], everyone: list[int],
                 what: str) -> KeyboardInterrupt:
    """Ctrl-C during a push: the ranks stop storing (or drop the request unstarted), and the
    interrupt says which ranks stored the values all the same (a rank stores all or none)."""
    for run in runs:
        run.interrupt()
    deadline = time.monotonic() + INTERRUPTED_WAIT_S
    for run in runs:
        run.wait(max(0.0, deadline - time.monotonic()))
    unsure = {r for run in runs for r in run.pending}
    unsent = set(everyone) - {r for run in runs for r in run.ranks}  # the parts the Ctrl-C came before
    failed = {r for run in runs for r in run.failed_ranks()} | unsent
    said = f"{what} interrupted: {_landed(parts, everyone, failed, unsure)}"
    return KeyboardInterrupt(said + (f"; rank(s) {format_ranks(unsure)} still busy: look with mesh.who()"
                                     if unsure else ""))


def _landed(parts: list[tuple[list[int], dict[str, Any]]], everyone: list[int], failed: AbstractSet[int],
            unsure: AbstractSet[int] = frozenset()) -> str:
    """Where a push's values are: the ranks that stored them, and those that kept their
    previous values (``unsure``: neither said yet)."""
    names = ", ".join(sorted({n for _, values in parts for n in values}))
    stored = [r for r in everyone if r not in failed and r not in unsure]
    kept = failed - unsure
    return (f"{names} stored on rank(s) {format_ranks(stored) or 'none'}"
            + (f"; rank(s) {format_ranks(kept)} kept their previous values" if kept else ""))


def _check_names(values: Mapping[str, Any]) -> None:
    """Refuse names a rank's code could not use, or that would break the rank: Python's own
    (``__builtins__`` replaced, every cell fails) and meshbook's."""
    for name in values:
        if not isinstance(name, str) or not name.isidentifier():
            raise MeshError(f"{name!r} is not a valid variable name")
        if keyword.iskeyword(name):
            raise MeshError(f"{name!r} is a Python keyword: no code could use a variable of that "
                            f"name; send your value under another name")
        if name.startswith("__") and name.endswith("__"):
            raise MeshError(f"{name!r} is a special name, Python's own on every rank (__builtins__, "
                            f"__name__...); send your value under another name")
        if name in SEEDED:
            raise MeshError(f"{name!r} is set by meshbook on every rank ({', '.join(sorted(SEEDED))}); "
                            f"send your value under another name")


def _from_numpy(value: Any, what: str) -> Any:
    """A numpy array as a tensor over its memory (scatter and gather move tensors); anything
    else as it is. A read-only array (one that arrived in a frame) too: the tensor is only
    pickled or concatenated, never written."""
    numpy = sys.modules.get("numpy")
    if numpy is None or not isinstance(value, numpy.ndarray):
        return value
    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "the given NumPy array is not writable"
            return torch.from_numpy(value)
    except (TypeError, ValueError) as exc:  # an object dtype; negative strides
        raise ShapeError(f"{what}: a numpy array of dtype {value.dtype} with strides {value.strides} "
                         f"has no tensor view ({exc}); make it a tensor first (torch.tensor(array) "
                         f"copies it)") from None


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


def _check_joinable(name: str, shapes: Mapping[int, tuple[int, ...]], dim: int) -> None:
    """``gather()``'s pieces, by their shapes: alike in every dimension but ``dim``, or a
    :class:`ShapeError` naming each rank's shape, before anything moves."""
    ndim = len(next(iter(shapes.values())))
    if ndim and not -ndim <= dim < ndim:
        raise ShapeError(f"dim {dim} is out of range for {name!r}, which has {ndim} dimensions")
    rest = {(len(shape), shape[:dim % ndim] + shape[dim % ndim + 1:]) if ndim else (len(shape), shape)
            for shape in shapes.values()}
    if ndim == 0 or len(rest) > 1:  # a 0-d piece joins nothing either
        listed = group_by_text({rank: str(tuple(shape)) for rank, shape in shapes.items()})
        raise ShapeError(f"gather() of {name!r} along dim {dim} joins pieces alike in every other dimension, and "
                         f"they are " + ", ".join(f"[{format_ranks(ranks)}] {shape}" for ranks, shape in listed) +
                         "; nothing was moved")


def _axis(tensor: torch.Tensor, dim: int) -> int:
    if not -tensor.dim() <= dim < tensor.dim():
        raise ShapeError(f"dim {dim} is out of range for a tensor of shape {tuple(tensor.shape)}")
    return dim % tensor.dim()


def _too_large(name: str, sizes: Mapping[int, int], limit: int, weighed: Mapping[int, int] | None = None,
               needed: int | None = None) -> str:
    """Why a pull of ``sizes`` (rank -> bytes) is refused, and the limit that would let it
    through (``needed``, where it is not their sum). ``weighed``: the ranks that refused it as
    they pickled it (at least that much)."""
    total = sum(sizes.values())
    per_rank = "; ".join(f"[{format_ranks(r)}] {format_bytes(int(b))}"
                         for r, b in group_by_text({r: str(b) for r, b in sizes.items()}))
    needed = total if needed is None else needed
    power, unit = (30, "G") if needed >= 2 ** 30 else (20, "M")
    enough = math.ceil(needed / 2 ** power)
    how = (f"at least {format_bytes(total)} ({per_rank}; weighed on rank(s) {format_ranks(weighed)} "
           f"as they pickled it, which its metadata could not tell), over the {format_bytes(limit)} "
           f"limit; nothing was kept" if weighed else
           f"{format_bytes(total)} ({per_rank}), over the {format_bytes(limit)} limit; nothing was moved")
    return (f"pulling {name!r} would move {how}. Pull from fewer ranks, or raise the limit: "
            f"mesh.pull({name!r}, max_bytes={enough} * 2**{power}) (%mesh pull {name} --max-bytes "
            f"{enough}{unit}; max_bytes=None: no limit)")


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
    for i, (kind, arg) in enumerate(layout.placements):
        known = kind in ("Shard", "Replicate") or (kind == "Partial" and arg in _REDUCE) \
            or (kind == "_StridedShard" and _partner(layout, i) is not None)
        if not known:
            placement = f"{kind} {arg}" if arg not in (None, "") else kind
            raise ShapeError(f"cannot assemble {name!r} in the notebook: placement {placement} is not "
                             f"supported; run `{name}.full_tensor()` on the ranks and pull the result")
    return layout


def _partner(layout: Layout, level: int) -> int | None:
    """The later mesh dimension a ``_StridedShard`` at ``level`` was split after: the one that
    shards the same tensor dimension as many ways as its split factor (FSDP2 over tensor
    parallel: ``dp:_StridedShard(dim=0, sf=2) tp:Shard(0)``), or None where there is not
    exactly one."""
    dim, factor = layout.placements[level][1]
    later = [j for j in range(level + 1, len(layout.placements)) if layout.placements[j] == ("Shard", dim)]
    return later[0] if len(later) == 1 and layout.mesh_shape[later[0]] == factor else None


def _left_to_right(layout: Layout, shards: dict[tuple[int, ...], Any]) -> tuple[Layout, dict[tuple[int, ...], Any]]:
    """``layout`` with each ``_StridedShard`` as the plain shards it amounts to: its mesh
    dimension and its partner's swapped, both ``Shard``, the shards' coordinates swapped with
    them (the partner split the tensor first, so it is the outer one when assembling)."""
    order = list(range(len(layout.placements)))
    placements = list(layout.placements)
    for level, (kind, arg) in enumerate(layout.placements):
        if kind == "_StridedShard":
            partner = cast(int, _partner(layout, level))
            placements[level] = ("Shard", arg[0])
            order[level], order[partner] = order[partner], order[level]
    if order == sorted(order):
        return layout, shards
    swapped = replace(layout, mesh_shape=tuple(layout.mesh_shape[k] for k in order),
                      placements=tuple(placements[k] for k in order))
    return swapped, {tuple(coord[k] for k in order): shard for coord, shard in shards.items()}


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
