"""The shape of a mesh: world size, named dimensions, and rank selections.

Ranks are laid out row-major over the named dimensions, exactly as
``torch.distributed.device_mesh.init_device_mesh`` lays them out, so ``coords`` on the
controller and a rank's position in its ``device_mesh`` always agree: with
``dims={"dp": 2, "tp": 2}`` rank 3 is ``{"dp": 1, "tp": 1}``.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence, Union

from .errors import MeshError, SelectionError
from .text import format_ranks

#: What a selection on one dimension may be: one index, several, or a range.
DimSelector = Union[int, Iterable[int]]

DEFAULT_DIM = "world"


@dataclass(frozen=True)
class Topology:
    """World size and named dimensions (their product is the world size)."""

    dims: tuple[tuple[str, int], ...]

    @classmethod
    def create(cls, n: int | None = None, dims: Mapping[str, int] | None = None) -> "Topology":
        """Validate ``n``/``dims`` as given to :func:`meshbook.start`."""
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise MeshError(f"n={n!r}: the number of ranks is a positive integer")
        if dims is None:
            if n is None:
                raise MeshError("give the number of ranks (n=4) or named dims (dims={'dp': 2, 'tp': 2})")
            dims = {DEFAULT_DIM: n}
        dims = dict(dims)
        if not dims:
            raise MeshError("dims is empty: name at least one dimension, e.g. dims={'dp': 4}")
        for name, size in dims.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise MeshError(f"dimension name {name!r} must be a Python identifier, e.g. 'dp'")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise MeshError(f"dimension {name!r} has size {size!r}; sizes are positive integers")
        world = math.prod(dims.values())
        if n is not None:
            if n != world:
                shape = " x ".join(f"{k}={v}" for k, v in dims.items())
                raise MeshError(f"n={n} but dims {shape} make {world} ranks; drop n or make them agree")
        return cls(tuple(dims.items()))

    @property
    def world_size(self) -> int:
        return math.prod(size for _, size in self.dims)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.dims)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.dims)

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> {dim: index}, row-major (the last dimension varies fastest)."""
        out: dict[str, int] = {}
        for name, size in reversed(self.dims):
            out[name] = rank % size
            rank //= size
        return dict(reversed(list(out.items())))

    def where(self, **selectors: DimSelector) -> list[int]:
        """Ranks whose coordinates match every selector, e.g. ``where(dp=0)`` or ``tp=[0, 1]``."""
        sizes = dict(self.dims)
        wanted: dict[str, set[int]] = {}
        for name, sel in selectors.items():
            if name not in sizes:
                by_number = (" (ranks by number: mesh.narrow([0]), or ranks=[0])"
                             if name in ("rank", "ranks") else "")
                raise SelectionError(
                    f"the mesh has no dimension {name!r}; its dimensions are {self.describe()}{by_number}")
            values = set(_rank_list(sel, name, "an index (0)", "a list of them ([0, 1])"))
            bad = sorted(v for v in values if not 0 <= v < sizes[name])
            if bad:
                raise SelectionError(
                    f"{name}={bad[0]} is out of range: {name} has size {sizes[name]} "
                    f"(valid: 0-{sizes[name] - 1})")
            wanted[name] = values
        return [r for r in range(self.world_size)
                if all(self.coords(r)[k] in v for k, v in wanted.items())]

    def check_ranks(self, ranks: Iterable[int]) -> list[int]:
        """Validate explicit ranks; returns them sorted and without duplicates."""
        out = sorted(set(ranks))
        for r in out:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.world_size:
                raise SelectionError(
                    f"rank {r!r} does not exist: this mesh has ranks 0-{self.world_size - 1}")
        if not out:
            raise SelectionError("the selection is empty: name at least one rank")
        return out

    def describe(self) -> str:
        return ", ".join(f"{name}={size}" for name, size in self.dims)


_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_index_list(text: str, what: str = "ranks") -> list[int]:
    """``"0,2,4-6"`` -> ``[0, 2, 4, 5, 6]``; a clear error for anything else."""
    out: list[int] = []
    for part in text.split(","):
        match = _RANGE.match(part)
        if not match:
            raise SelectionError(
                f"cannot read {what} {text!r}: use numbers and ranges, e.g. 0,2 or 0-3")
        lo = int(match.group(1))
        hi = int(match.group(2)) if match.group(2) is not None else lo
        if hi < lo:
            raise SelectionError(f"range {part.strip()!r} in {what} runs backwards")
        out.extend(range(lo, hi + 1))
    return out


def parse_assignments(text: str, what: str) -> dict[str, str]:
    """``"dp=2,tp=2"`` -> ``{"dp": "2", "tp": "2"}`` (a value may be a range, ``0-1``)."""
    out: dict[str, str] = {}
    for part in text.split(","):
        name, eq, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not name.isidentifier() or not value:
            raise SelectionError(f"cannot read {what} {text!r}: write name=value pairs, e.g. dp=2,tp=2")
        if name in out:
            raise SelectionError(f"{what} {text!r} names {name!r} twice")
        out[name] = value
    return out


def parse_dims(text: str) -> dict[str, int]:
    """``"dp=2,tp=2"`` -> ``{"dp": 2, "tp": 2}``, as written after ``--dims``."""
    dims = {}
    for name, value in parse_assignments(text, "--dims").items():
        if not value.isdigit() or int(value) < 1:
            raise SelectionError(f"--dims {text!r}: size of {name!r} must be a positive integer")
        dims[name] = int(value)
    return dims


def parse_where(text: str) -> dict[str, list[int]]:
    """``"dp=0,tp=0-1"`` -> ``{"dp": [0], "tp": [0, 1]}``, as written after ``--where``."""
    return {name: parse_index_list(value, f"--where {name}")
            for name, value in parse_assignments(text, "--where").items()}


def _rank_list(ranks: Any, what: str = "ranks", one: str = "a rank (2)",
               many: str = "a list of ranks ([0, 2])") -> list[int]:
    """A rank, or ranks (any iterable of whole numbers, numpy's too), as a list; else a
    :class:`SelectionError` saying what to give (``ranks=1.5`` raised a bare ``TypeError``).
    ``what``, ``one`` and ``many`` name them otherwise (a dimension's indices)."""
    if type(ranks) is int:  # the common cases first: Iterable's isinstance costs a microsecond
        return [ranks]
    if isinstance(ranks, str):
        return parse_index_list(ranks, what)
    items = ranks if isinstance(ranks, (list, tuple)) else list(ranks) if isinstance(ranks, Iterable) else [ranks]
    try:
        if any(isinstance(r, bool) for r in items):
            raise TypeError("a bool is not an index")
        return [operator.index(r) for r in items]
    except TypeError:
        raise SelectionError(f"{what}={ranks!r}: give {one}, {many} or a string such as '0,2' or "
                             f"'0-3'") from None


def resolve(topology: Topology, ranks: Sequence[int] | str | int | None,
            where: Mapping[str, DimSelector] | None, within: Sequence[int]) -> list[int]:
    """Turn a user's selection into ranks, intersected with the view's own ranks ``within``."""
    chosen = list(within)
    if ranks is not None:
        explicit = topology.check_ranks(_rank_list(ranks))
        outside = [r for r in explicit if r not in within]
        if outside:
            raise SelectionError(
                f"rank {outside[0]} is not in this view (its ranks are {list(within)})")
        chosen = explicit
    if where is not None and not isinstance(where, Mapping):
        raise SelectionError(f"where={where!r}: give a mapping of dimension names to indices, e.g. "
                             f"where={{'dp': 0}} or where={{'tp': '0-1'}}")
    if where:
        matching = set(topology.where(**where))
        among, chosen = chosen, [r for r in chosen if r in matching]
        if not chosen:
            raise SelectionError(_none_match(topology, where, among))
    return chosen


def _none_match(topology: Topology, where: Mapping[str, DimSelector], among: list[int]) -> str:
    """Why a selection came out empty, in the words a user writes it (``dp=0``, not a dict),
    with where the ranks it was asked among are."""
    asked = ",".join(f"{name}={format_ranks(_rank_list(sel, name))}" for name, sel in where.items())
    shown = among[:4]
    places = "; ".join(f"rank {r} is at {','.join(f'{k}={v}' for k, v in topology.coords(r).items())}"
                       for r in shown)
    more = f"; and {len(among) - len(shown)} more" if len(among) > len(shown) else ""
    return f"no rank matches {asked} among rank(s) {format_ranks(among)} ({places}{more})"
