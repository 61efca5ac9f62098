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
from typing import Any, Iterator, Mapping

from .limits import HTML_CHARS, capped
from .text import format_ranks, group_by_text
from .topology import DimSelector, Topology


class RankValues(Mapping[int, Any]):
    """Mapping rank -> value, in rank order, sliceable by the mesh's named dimensions."""

    __slots__ = ("_values", "_topology")

    def __init__(self, values: Mapping[int, Any], topology: Topology | None = None) -> None:
        self._values = {r: values[r] for r in sorted(values)}
        self._topology = topology

    def __getitem__(self, rank: int) -> Any:
        try:
            return self._values[rank]
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
        print alike but hold other numbers (a tensor prints 4 decimals) are not one group."""
        found = [(part, text) for ranks, text in group_by_text({r: _safe_repr(v) for r, v in self._values.items()})
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
        if isinstance(other, RankValues):
            return self._values == other._values
        if isinstance(other, Mapping):
            return self._values == dict(other)
        return NotImplemented

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
    """``ranks`` (whose values print alike) split by equal contents, where the values are
    tensors or numpy arrays; NaN equals NaN."""
    if len(ranks) == 1:
        return [ranks]
    first = values[ranks[0]]
    torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")
    if torch is not None and isinstance(first, torch.Tensor):
        def same(a: Any, b: Any) -> bool:
            return (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                    and bool(torch.equal(a, b) or (a.is_floating_point() and torch.allclose(
                        a, b, rtol=0.0, atol=0.0, equal_nan=True))))
    elif numpy is not None and isinstance(first, numpy.ndarray):
        def same(a: Any, b: Any) -> bool:
            return bool(isinstance(b, numpy.ndarray) and a.shape == b.shape and a.dtype == b.dtype
                        and numpy.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    else:
        return [ranks]
    parts: list[list[int]] = []
    for rank in ranks:
        try:
            part = next((p for p in parts if same(values[p[0]], values[rank])), None)
        except Exception:  # noqa: BLE001 - tensors torch cannot compare (sparse, a device of their own)
            return [ranks]
        if part is None:
            parts.append([rank])
        else:
            part.append(rank)
    return parts


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception as exc:  # a broken __repr__ must not hide the other ranks' values
        return f"<{type(value).__name__} object; repr failed: {exc}>"
