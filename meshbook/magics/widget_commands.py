"""``%mesh dashboard``, ``%mesh memory``, ``%mesh stragglers``, and the live status of cells.

A mixin of :class:`~meshbook.magics.mesh_magic.MeshMagics`: each ``@command`` method is a
``%mesh`` subcommand, listed by ``%mesh?``. The text commands print what the Python API
returns (:meth:`meshbook.Mesh.memory`, :meth:`meshbook.Mesh.stragglers`), for terminals and
logs; the dashboard is :class:`meshbook.widgets.Dashboard`.

:meth:`WidgetCommands.cell_view` gives a ``%%mesh`` cell its live per-rank status, but only
when a person is watching: nbconvert, papermill and nbval execute with ``allow_stdin=False``
(no one there to answer ``input()``), and such a batch run gets no live status, so the outputs
it stores stay deterministic.
"""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from ..kernel import cell_allows_stdin
from ..mesh import DURATION_FACTOR, Mesh, Run, View, meshes
from ..widgets import CellStatusView, Dashboard
from ..widgets.dashboard import REFRESH_S
from .base import command, parse_argstring, require_mesh


class WidgetCommands:
    """Per-rank views: live cell status, dashboard, memory and straggler reports."""

    shell: Any
    #: The live status of the last ``%%mesh`` cell that showed one.
    cell_status: CellStatusView | None = None
    #: The last ``%%mesh`` cell's mesh and run: ``%mesh stragglers`` reports its durations.
    _last_cell: tuple[Mesh, Run] | None = None

    def cell_view(self, mesh: Mesh, run: Run, enabled: bool = True) -> View | None:
        """The live status of a ``%%mesh`` cell's ``run``, if someone is watching it."""
        self._last_cell = (mesh, run)
        if not enabled or not _watched(self.shell):
            return None
        self.cell_status = CellStatusView(mesh)
        return self.cell_status

    @magic_arguments(name="mesh dashboard")
    @argument("--refresh", type=float, default=REFRESH_S,
              help=f"seconds between updates (default {REFRESH_S:g})")
    @argument("--mesh", "-m", dest="mesh_name", help="only the mesh of this name (default: every running mesh)")
    @command
    def dashboard(self, line: str) -> Dashboard | None:
        """Show a live panel of the ranks: state, CPU, memory with sparklines, stragglers."""
        args = parse_argstring(self.dashboard, line)
        if args.refresh <= 0:
            raise UsageError(f"--refresh {args.refresh:g}: give seconds between updates, e.g. 0.5")
        current = require_mesh(args.mesh_name)
        running = meshes()
        if args.mesh_name or len(running) < 2:
            return Dashboard(current, refresh=args.refresh)
        for mesh in running.values():  # a section per mesh, each its own live panel
            display(Dashboard(mesh, refresh=args.refresh))
        return None

    @magic_arguments(name="mesh memory")
    @command
    def memory(self, line: str) -> None:
        """Print each rank's RSS, CPU, CUDA memory and how full its memory pool is."""
        parse_argstring(self.memory, line)
        print(require_mesh().memory())

    @magic_arguments(name="mesh stragglers")
    @argument("--factor", type=float, default=DURATION_FACTOR,
              help="also flag a rank whose last %%%%mesh cell took this many times the median "
                   f"of the others (default {DURATION_FACTOR:g})")
    @command
    def stragglers(self, line: str) -> None:
        """Print straggler scores per rank and where the slow rank spends its time."""
        args = parse_argstring(self.stragglers, line)
        if args.factor <= 1:
            raise UsageError(f"--factor {args.factor:g}: a rank is slow when it takes more than "
                             f"the others, so give a factor above 1, e.g. 2")
        mesh = require_mesh()
        last = self._last_cell
        run = last[1] if last is not None and last[0] is mesh and last[1].done() else None
        print(mesh.stragglers(run, factor=args.factor))


def _watched(shell: Any) -> bool:
    """Is a person watching the running cell? Batch runners execute with allow_stdin=False."""
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        return False  # a terminal IPython: widgets do not render there
    return cell_allows_stdin(kernel)
