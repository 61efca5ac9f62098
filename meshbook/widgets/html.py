"""The HTML the widgets show: tables, sparklines, bar charts and the colours of rank states.

A widget renders by setting the value of an ``ipywidgets.HTML``, and its ``_repr_mimebundle_``
falls back to the very same HTML where widgets do not render (nbconvert, GitHub), so one
renderer serves both. Styles are inline: notebook frontends and GitHub drop ``<style>``
blocks. Every value is escaped here; callers pass plain text.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

#: Colour of each rank state (the controller's states and a cell's per-rank outcomes).
STATE_COLOURS = {
    "starting": "#757575", "idle": "#2e7d32", "busy": "#1565c0", "running": "#1565c0", "queued": "#757575",
    "done": "#2e7d32", "error": "#c62828", "interrupted": "#ef6c00", "dead": "#b71c1c",
    "failed": "#b71c1c",
}
#: Row backgrounds, strongest first: a dead rank, a straggler, a rank near its memory limit.
DEAD_BG, STRAGGLER_BG, NEAR_LIMIT_BG = "#ffcdd2", "#fff59d", "#ffe0b2"
#: Marks a straggler wherever a rank is shown.
FLAG = "\u2691"
#: The part of a duration bar spent waiting in collectives, and how a legend names it.
WAITING_COLOUR, WAITING_NAME = "#bdbdbd", "grey"

_FONT = "font-family:monospace;font-size:12px"


def esc(value: object) -> str:
    return html.escape(str(value))


def state_colour(state: str) -> str:
    return STATE_COLOURS.get(state.split(" ")[0], "#424242")


def badge(state: str) -> str:
    """A rank state in its colour."""
    return f'<span style="color:{state_colour(state)};font-weight:bold">{esc(state)}</span>'


def panel(title: str, body: str, notes: Sequence[str] = ()) -> str:
    """A titled block: the frame of every widget."""
    lines = "".join(note(text) for text in notes)
    return (f'<div style="{_FONT}"><div style="font-weight:bold;margin-bottom:4px">{esc(title)}</div>'
            f"{body}{lines}</div>")


def note(text: str) -> str:
    """A line of text under a panel."""
    return f'<div style="white-space:pre">{esc(text)}</div>'


def table(headers: Sequence[str], rows: Sequence[tuple[Sequence[str], str]]) -> str:
    """A table of ready-made HTML cells; each row comes with its background colour ('' none)."""
    cell = "padding:1px 8px;text-align:left;white-space:nowrap"
    head = "".join(f'<th style="{cell}">{esc(h)}</th>' for h in headers)
    body = "".join(
        (f'<tr style="background:{bg}">' if bg else "<tr>")
        + "".join(f'<td style="{cell}">{c}</td>' for c in cells) + "</tr>"
        for cells, bg in rows)
    return f'<table style="border-collapse:collapse"><tr>{head}</tr>{body}</table>'


def sparkline(values: Sequence[float], width: int = 120, height: int = 18) -> str:
    """An inline SVG line of ``values`` scaled to its own range (empty below two points)."""
    if len(values) < 2:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    step = width / (len(values) - 1)
    points = " ".join(f"{i * step:.1f},{height - 1 - (v - low) / span * (height - 2):.1f}"
                      for i, v in enumerate(values))
    return (f'<svg width="{width}" height="{height}" style="vertical-align:middle">'
            f'<polyline points="{points}" fill="none" stroke="#1565c0" stroke-width="1"/></svg>')


def bars(items: Sequence[tuple[str, Sequence[tuple[float, str]], str]], width: int = 240) -> str:
    """A horizontal stacked bar chart: one ``(label, [(value, colour), ...], text)`` per bar,
    scaled so the longest bar is ``width`` pixels."""
    top = max((sum(v for v, _ in segments) for _, segments, _ in items), default=0.0) or 1.0
    rows = []
    for label, segments, text in items:
        parts = "".join(f'<span style="display:inline-block;width:{max(1, round(value / top * width))}px;'
                        f'height:10px;background:{colour}"></span>'
                        for value, colour in segments if value > 0 or len(segments) == 1)
        rows.append(f'<div style="display:flex;align-items:center;gap:6px">'
                    f'<span style="width:3em;text-align:right">{esc(label)}</span>'
                    f'<span style="display:inline-flex">{parts}</span><span>{esc(text)}</span></div>')
    return "".join(rows)


def tiles(items: Sequence[tuple[str, str, str]]) -> str:
    """Compact tiles in a row: ``(text, border colour, background)``, wrapping as needed."""
    tile = "padding:2px 6px;border-left:4px solid {};background:{}"
    return ('<div style="display:flex;flex-wrap:wrap;gap:4px">'
            + "".join(f'<div style="{tile.format(border, bg or "#f5f5f5")}">{esc(text)}</div>'
                      for text, border, bg in items)
            + "</div>")
