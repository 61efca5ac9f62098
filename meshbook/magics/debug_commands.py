"""``%mesh stacks / diagnose / interrupt / kill / restart RANKS / debug``: stuck ranks, live.

A mixin of :class:`~meshbook.magics.mesh_magic.MeshMagics`; each command is a thin call to
the :class:`~meshbook.Mesh` debugging API (:mod:`meshbook.mesh.controller.api.debug`).
"""

from __future__ import annotations

from argparse import ArgumentTypeError
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from ..mesh import Mesh, format_ranks
from .base import command, parse_argstring, require_mesh, selected, selection
from .render import RenderOptions, show_run


def _one_rank(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ArgumentTypeError(f"{text!r}: give one rank, e.g. %mesh debug 1 (pdb runs on one rank at a time)") \
            from None


class DebugCommands:
    shell: Any

    @magic_arguments(name="mesh stacks")
    @selection("to show")
    @command
    def stacks(self, line: str) -> None:
        """Show every rank's Python stack, merged into one call tree (taken while busy)."""
        ranks, where = selected(parse_argstring(self.stacks, line))
        print(require_mesh().stacks(ranks, where=where).render())

    @magic_arguments(name="mesh diagnose")
    @selection("to look at")
    @command
    def diagnose(self, line: str) -> None:
        """Explain a hang: which ranks wait in which collective, and for whom."""
        ranks, where = selected(parse_argstring(self.diagnose, line))
        print(require_mesh().diagnose(ranks, where=where).render())

    @magic_arguments(name="mesh interrupt")
    @argument("ranks", nargs="?", help="ranks to interrupt: 0,2 or 0-3 (default: all)")
    @command
    def interrupt(self, line: str) -> None:
        """Send SIGINT to ranks: code running in Python raises KeyboardInterrupt."""
        args = parse_argstring(self.interrupt, line)
        mesh = require_mesh()
        mesh.interrupt(args.ranks)
        print(f"interrupted {f'rank(s) {args.ranks}' if args.ranks else 'every rank'}{_dead_skipped(mesh, args.ranks)}")

    @magic_arguments(name="mesh kill")
    @argument("ranks", help="ranks to kill: 1 or 0,2")
    @command
    def kill(self, line: str) -> None:
        """SIGKILL ranks (their variables are lost); %mesh restart RANKS brings them back."""
        args = parse_argstring(self.kill, line)
        mesh = require_mesh()
        skipped = _dead_skipped(mesh, args.ranks)  # before: these die now
        mesh.kill(args.ranks)
        print(f"killed rank(s) {args.ranks}{skipped}; %mesh restart {args.ranks} brings them back")

    def restart_ranks(self, ranks: str, on: str | None = None) -> None:
        """%mesh restart RANKS [--on HOST]: re-fork those ranks, keep every other rank's
        variables (ranks of a lost host: on a new agent there, or on HOST)."""
        print(require_mesh().restart(ranks, on=on).render())

    @magic_arguments(name="mesh debug")
    @argument("rank", type=_one_rank, nargs="?",
              help="the rank whose last exception to debug (default: the first whose last code failed)")
    @command
    def debug(self, line: str) -> Any:
        """Post-mortem pdb on a rank's last exception, answered in the notebook (like %debug)."""
        args = parse_argstring(self.debug, line)
        mesh = require_mesh()
        rank = args.rank if args.rank is not None else _first_failed(mesh)
        values = show_run(mesh.debug(rank), RenderOptions(), mesh)
        print(values[rank])


def _first_failed(mesh: Mesh) -> int:
    """The lowest rank whose last code (a cell, a function, an endpoint) ended in an exception
    of its own, else the lowest whose code failed from another rank's doing (a collective
    aborted, a peer gone: see ``knock_on``). A rank's snapshot says only that much of how its
    code ended, not the finer ``errors.blame_order`` a run's failures are sorted by."""
    snapshots = mesh.snapshots()
    failed = [r for r, s in snapshots.items() if s.last.startswith("stopped with")]
    if not failed:
        raise UsageError("no rank's last code ended in an exception: %mesh debug RANK opens pdb on one that did")
    return min(failed, key=lambda r: (snapshots[r].knock_on, r))


def _dead_skipped(mesh: Mesh, ranks: str | None) -> str:
    """What a signal to ``ranks`` skips: `` (rank(s) 1 dead already)``, or nothing."""
    dead = mesh.controller.dead(mesh.select(ranks))
    return f" (rank(s) {format_ranks(dead)} dead already)" if dead else ""
