"""How much a result may weigh: what stays on the rank, and how much of a repr is shown.

A cell's last expression travels to the notebook and is printed there. A 600 MB value would
cost the kernel gigabytes and send its whole repr to the browser, so:

* a result whose message is over its limit (by default :data:`DEFAULT_MAX_BYTES`, the same
  as ``pull``'s ``max_bytes``) stays on the rank as ``_``, and the notebook gets a
  :class:`KeptOnRank` saying so and how to fetch it;
* a repr shown in the notebook is cut at :data:`REPR_CHARS` characters, with a note; an
  HTML form over :data:`HTML_CHARS` (markup cannot be cut) gives way to the text, cut so.
"""

from __future__ import annotations

from dataclasses import dataclass

from .text import format_bytes

#: The most a pull, or a result, moves unless told otherwise (a pull sums over its ranks).
DEFAULT_MAX_BYTES = 2 ** 31
#: The most of one value's repr the notebook shows.
REPR_CHARS = 20_000
#: The most of one value's HTML form the notebook shows (a DataFrame's own, cut by pandas at
#: 60 rows, stays well under it).
HTML_CHARS = 5 * REPR_CHARS


@dataclass(frozen=True)
class KeptOnRank:
    """What a rank sends instead of a result over the limit; the result stays there as ``_``."""

    type: str
    nbytes: int
    limit: int

    def __repr__(self) -> str:
        return (f"<{self.type} of {format_bytes(self.nbytes)} or more kept on the rank as `_` (over the "
                f"{format_bytes(self.limit)} result limit). Keep it with `name = _` in the next "
                f"cell, fetch it with mesh.pull('_', max_bytes=...) (%mesh pull _ --max-bytes 8G), "
                f"or raise the limit: %%mesh --max-bytes 8G, mesh.run(..., max_bytes=...), "
                f"meshbook.start(..., max_result_bytes=...)>")


def capped(text: str, limit: int = REPR_CHARS) -> str:
    """``text``, cut at ``limit`` characters with a note saying how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… [cut: the repr is {len(text):,} characters, the first {limit:,} are shown]"
