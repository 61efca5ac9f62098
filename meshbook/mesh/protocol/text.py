"""Plain text: rank ranges, tables and the units in them, for reports that read well anywhere.

Every text report meshbook prints (``%mesh status``, ``%mesh memory``, ``%mesh stragglers``,
the text fallbacks of the widgets) is built from these few helpers, so the columns, byte sizes
and percentages look the same everywhere::

    >>> print(status_table([{"rank": 0, "rss": format_bytes(3 << 30)}]))
    rank  rss
    0     3.0 GiB
"""

from __future__ import annotations

import re
from typing import Any, Iterable

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def status_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table with a header, columns padded to their widest cell."""
    if not rows:
        return "(no ranks)"
    headers = list(rows[0])
    cells = [[str(row[h]) for h in headers] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def format_bytes(n: float | None) -> str:
    """``3221225472`` -> ``"3.0 GiB"``; ``None`` (not measured) -> ``"-"``."""
    if n is None:
        return "-"
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{value:.0f} B" if unit == 0 else f"{value:.1f} {_UNITS[unit]}"


def format_percent(fraction: float | None) -> str:
    """``0.934`` -> ``"93%"``; ``None`` -> ``"-"``."""
    return "-" if fraction is None else f"{fraction * 100:.0f}%"


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``"0-3,5"``: compact, sorted, ranges of three or more collapsed."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    start = prev = None
    for r in ordered + [None]:
        if start is not None and r is not None and r == prev + 1:  # type: ignore[operator]
            prev = r
            continue
        if start is not None:
            if prev == start:
                parts.append(str(start))
            elif prev == start + 1:
                parts.append(f"{start},{prev}")
            else:
                parts.append(f"{start}-{prev}")
        start = prev = r
    return ",".join(parts)


def restart_hint(ranks: Iterable[int]) -> str:
    """``mesh.restart([1, 3]) (%mesh restart 1,3)``: how to bring dead ranks back, both ways."""
    ordered = sorted(set(ranks))
    return f"mesh.restart({ordered}) (%mesh restart {format_ranks(ordered)})"


def why_dead(deaths: dict[int, str]) -> str:
    """Why ``deaths``' ranks died (rank -> cause): ``SIGKILL`` for one, ``rank 1: SIGKILL;
    rank 3: exit code 1`` for several."""
    dead = sorted(deaths)
    return deaths[dead[0]] if len(dead) == 1 else "; ".join(f"rank {r}: {deaths[r]}" for r in dead)


def ranks_text(ranks: Iterable[int]) -> str:
    """``[2]`` -> ``"rank 2"``, ``[0, 1, 2]`` -> ``"ranks 0-2"``: a rank list in a sentence."""
    ordered = sorted(set(ranks))
    return f"rank{'s' if len(ordered) > 1 else ''} {format_ranks(ordered)}"


#: A verb as it goes with one rank, and with several.
_PLURALS = {"waits": "wait", "is": "are", "has": "have"}


def agree(verb: str, ranks: Iterable[int]) -> str:
    """``verb`` (as with one rank: "waits", "is", "has") as it goes with ``ranks``."""
    return _PLURALS.get(verb, verb) if len(set(ranks)) > 1 else verb


def agreed(text: str, ranks: Iterable[int]) -> str:
    """``text`` whose first word is such a verb, said of ``ranks`` ("waits in ... instead")."""
    verb, _, rest = text.partition(" ")
    return f"{agree(verb, ranks)} {rest}" if rest else agree(verb, ranks)


def group_by_text(texts: dict[int, str]) -> list[tuple[list[int], str]]:
    """Group ranks whose text is identical, groups ordered by their lowest rank."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(texts):
        groups.setdefault(texts[rank], []).append(rank)
    return [(ranks, text) for text, ranks in groups.items()]


def parse_size(text: str, what: str = "size") -> int:
    """``"8G"`` -> ``8 * 2**30``; plain numbers are bytes; K, M, G, T are powers of 1024."""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"{what} {text!r}: write a size like 2147483648, 512M or 8G")
    number, unit = match.groups()
    return int(float(number) * 1024 ** "bkmgt".index((unit or "b").lower()))
