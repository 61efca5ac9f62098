"""Per-rank results: a read-only mapping rank -> value that prints identical values once.

``RankValues`` is what every call on the mesh returns. It behaves like a ``dict`` in rank
order, can be narrowed by mesh dimension (``vals.where(dp=0)``), and its repr groups ranks
whose values print the same way::

    >>> vals
    [0-3] 12.0

In a notebook, values that render as HTML (a DataFrame, ``IPython.display.HTML``) render so,
each group of ranks under its label, as the text groups them.
"""

from __future__ import annotations

import html
import sys
from typing import Any, Callable, Iterator, Mapping, overload

from .limits import HTML_CHARS, capped
from .text import format_ranks, group_by_text
from .topology import DimSelector, Topology


class RankValues(Mapping[int, Any]):
    """Mapping rank -> value, in rank order, sliceable by the mesh's named dimensions."""

    __slots__ = ("_values", "_topology")

    def __init__(self, values: Mapping[int, Any], topology: Topology | None = None) -> None:
        self._values = {r: values[r] for r in sorted(values)}
        self._topology = topology

    @overload
    def __getitem__(self, rank: int) -> Any: ...

    @overload
    def __getitem__(self, rank: slice) -> "RankValues": ...

    def __getitem__(self, rank: int | slice) -> Any:
        if isinstance(rank, slice):  # ranks by number, as range() counts them: vals[1:3] is ranks 1 and 2
            chosen = range(*rank.indices(max(self._values, default=-1) + 1))
            return RankValues({r: v for r, v in self._values.items() if r in chosen}, self._topology)
        try:
            return self._values[rank]
        except TypeError:  # a list of ranks, say: unhashable
            raise TypeError(f"values are looked up by one rank (vals[2]) or a slice of rank numbers "
                            f"(vals[0:4]), not a {type(rank).__name__}; vals.where(dp=0) selects by "
                            f"dimension") from None
        except KeyError:
            raise KeyError(f"no value for rank {rank}; ranks here: {format_ranks(self._values)}") from None

    def __iter__(self) -> Iterator[int]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    @property
    def ranks(self) -> list[int]:
        return list(self._values)

    def replaced(self, values: Mapping[int, Any]) -> "RankValues":
        """Other values for the same ranks, on the same mesh dimensions."""
        return RankValues(values, self._topology)

    def where(self, **selectors: DimSelector) -> "RankValues":
        """The values of the ranks matching ``selectors``, e.g. ``vals.where(dp=0)``."""
        if self._topology is None:
            raise TypeError("these values carry no mesh dimensions to select on")
        keep = set(self._topology.where(**selectors))
        return RankValues({r: v for r, v in self._values.items() if r in keep}, self._topology)

    def unique(self) -> Any:
        """The single value every rank returned; ``ValueError`` if they differ."""
        groups = self.groups()
        if len(groups) != 1:
            raise ValueError(f"ranks returned {len(groups)} different values: {self!r}")
        return self._values[groups[0][0][0]]

    def groups(self) -> list[tuple[list[int], str]]:
        """Ranks grouped by identical repr, ordered by their lowest rank; ranks whose arrays
        print alike but hold other numbers (a tensor prints 4 decimals) are not one group, and
        ranks whose dicts hold the same items in another order are (shown as the lowest rank's
        prints)."""
        texts = {r: _safe_repr(v) for r, v in self._values.items()}
        found = [(part, texts[part[0]]) for ranks, _ in group_by_text(
                     {r: _order_free_text(v, texts[r]) for r, v in self._values.items()})
                 for part in _equal_parts(ranks, self._values)]
        return sorted(found, key=lambda group: group[0][0])

    def __repr__(self) -> str:
        if not self._values:
            return "RankValues {}"
        lines = []
        groups = self.groups()
        for ranks, text in groups:
            label = f"[{format_ranks(ranks)}] "
            lines.append(label + capped(text).replace("\n", "\n" + " " * len(label)))
        if len({text for _, text in groups}) < len(groups):
            lines.append("(ranks shown apart with the same text hold different numbers, beyond the digits shown)")
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def _repr_html_(self) -> str | None:
        """The values' HTML, grouped by rank (values without any show their text); None, for
        text alone, when no value has an HTML form."""
        shown = {r: _html_of(v) for r, v in self._values.items()}
        if not any(shown.values()):
            return None
        texts = {r: text if text is not None else f"<pre>{html.escape(capped(_safe_repr(self._values[r])))}</pre>"
                 for r, text in shown.items()}
        return "".join(f"<div><b>[{format_ranks(ranks)}]</b>{text}</div>" for ranks, text in group_by_text(texts))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        theirs = other._values if isinstance(other, RankValues) else dict(other)
        return self._values.keys() == theirs.keys() and all(
            _alike(value, theirs[rank], _equal) for rank, value in self._values.items())

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (RankValues, (self._values, self._topology))


def _html_of(value: Any) -> str | None:
    """``value._repr_html_()`` where its type has one and it gives text (IPython's rule too),
    and no more than :data:`HTML_CHARS` of it (else the text, which can be cut)."""
    method = getattr(type(value), "_repr_html_", None)
    if not callable(method) or isinstance(value, type):
        return None
    try:
        text = method(value)
    except Exception:  # noqa: BLE001 - a broken one falls back to the text, as in IPython
        return None
    return text if isinstance(text, str) and 0 < len(text) <= HTML_CHARS else None


def _equal_parts(ranks: list[int], values: Mapping[int, Any]) -> list[list[int]]:
    """``ranks`` (whose values print alike) split by equal contents, where the values are or
    hold tensors or numpy arrays (in lists, tuples and dicts): a tensor prints 4 decimals."""
    if len(ranks) == 1 or not _holds_arrays(values[ranks[0]]):
        return [ranks]
    parts: list[list[int]] = []
    for rank in ranks:
        try:
            part = next((p for p in parts if _alike(values[p[0]], values[rank])), None)
        except Exception:  # noqa: BLE001 - tensors torch cannot compare (sparse, a device of their own)
            return [ranks]
        if part is None:
            parts.append([rank])
        else:
            part.append(rank)
    return parts


#: How many items of a list, tuple or dict are looked into for an array: a result of a
#: million numbers is not walked to find none.
LOOKED_INTO = 64


def _holds_arrays(value: Any, depth: int = 4) -> bool:
    """Is ``value`` a tensor or numpy array, or does it hold one (looking a few levels and
    items deep)?"""
    if _array_kind(value) is not None:
        return True
    items = value.values() if type(value) is dict else value if type(value) in (list, tuple) else ()
    return depth > 0 and any(_holds_arrays(item, depth - 1) for item, _ in zip(items, range(LOOKED_INTO)))


def _order_free_text(value: Any, text: str) -> str:
    """What ranks are grouped by: ``text`` (the value's repr), or where the value is or holds a
    dict, the repr with its items sorted: equal dicts built in another order print apart (a
    set needs nothing: it arrives rebuilt in this process's order)."""
    ordered = _order_free(value)
    return text if ordered is value else _safe_repr(ordered)


def _order_free(value: Any, depth: int = 4) -> Any:
    """``value`` itself, or, where it is or holds (a few levels and items deep) a dict, a
    stand-in with the dicts' items in sorted order, where they sort."""
    kind = type(value)
    if depth == 0 or kind not in (dict, list, tuple) or len(value) > LOOKED_INTO:
        return value
    if kind is dict:
        items = [(k, _order_free(v, depth - 1)) for k, v in value.items()]
        try:
            return (dict, sorted(items, key=lambda item: item[0]))
        except TypeError:  # keys of kinds that do not compare: as they are
            return (dict, items)
    items = [_order_free(item, depth - 1) for item in value]
    return value if all(a is b for a, b in zip(items, value)) else (kind, items)


def _array_kind(value: Any) -> str | None:
    torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")
    if torch is not None and isinstance(value, torch.Tensor):
        return "tensor"
    if numpy is not None and isinstance(value, numpy.ndarray):
        return "ndarray"
    return None


def _alike(a: Any, b: Any, leaf: Callable[[Any, Any], bool] = lambda a, b: True) -> bool:
    """Equal numbers in their tensors and arrays (NaN equal to NaN), the same shape around
    them, and ``leaf`` true of what is neither (by default: values that print alike went by
    their print already)."""
    kind = _array_kind(a)
    if kind is not None:
        return kind == _array_kind(b) and _same_numbers(kind, a, b)
    if type(a) in (list, tuple):
        return type(b) is type(a) and len(a) == len(b) and all(_alike(x, y, leaf) for x, y in zip(a, b))
    if type(a) is dict:
        return type(b) is dict and a.keys() == b.keys() and all(_alike(a[k], b[k], leaf) for k in a)
    return leaf(a, b)


def _equal(a: Any, b: Any) -> bool:
    """``a == b``, where tensors and arrays compare as a whole (their ``==`` is elementwise)."""
    return bool(a == b)


def _same_numbers(kind: str, a: Any, b: Any) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if kind == "tensor":
        import torch

        return bool(torch.equal(a, b) or (a.is_floating_point() and torch.allclose(
            a, b, rtol=0.0, atol=0.0, equal_nan=True)))
    import numpy

    return bool(numpy.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception as exc:  # a broken __repr__ must not hide the other ranks' values
        return f"<{type(value).__name__} object; repr failed: {exc}>"
