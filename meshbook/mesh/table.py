"""Plain-text tables and the units in them, for reports that must read well in a terminal.

Every text report meshbook prints (``%mesh status``, ``%mesh memory``, ``%mesh stragglers``,
the text fallbacks of the widgets) is built from these few helpers, so the columns, byte sizes
and percentages look the same everywhere::

    >>> print(status_table([{"rank": 0, "rss": format_bytes(3 << 30)}]))
    rank  rss
    0     3.0 GiB
"""

from __future__ import annotations

from typing import Any

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


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
