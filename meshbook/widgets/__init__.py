"""ipywidgets views of a mesh, each with a plain-text and HTML fallback.

* :class:`Dashboard`: a live per-rank panel (state, CPU, memory with a sparkline, heartbeat
  age, stragglers); ``%mesh dashboard`` shows one.
* :class:`CellStatus` / :class:`CellStatusView`: the live per-rank status of a ``%%mesh`` cell
  that runs longer than a second, ending as a bar chart of per-rank durations.

This room depends on :mod:`meshbook.mesh` only; nothing in ``mesh/`` or ``kernel/`` imports it.
"""

from .cell_status import CellStatus, CellStatusView
from .dashboard import Dashboard

__all__ = ["CellStatus", "CellStatusView", "Dashboard"]
