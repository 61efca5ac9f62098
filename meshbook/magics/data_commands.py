"""``%mesh who``, ``%mesh push`` and ``%mesh pull``: the ranks' variables, from the notebook.

A mixin of :class:`~meshbook.magics.mesh_magic.MeshMagics`; each command is a thin face over
:meth:`Mesh.who <meshbook.Mesh.who>`, :meth:`Mesh.push <meshbook.Mesh.push>` and
:meth:`Mesh.pull <meshbook.Mesh.pull>`::

    %mesh who --where dp=0            # the table of variables, no data moved
    %mesh push lr batch --ranks 0,1   # the notebook's lr and batch, into those ranks
    %mesh pull loss --out losses      # RankValues of every rank's loss, stored as losses
"""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from ..mesh import DEFAULT_MAX_BYTES, RankValues, format_bytes, format_ranks
from ..mesh import parse_size as size_in_bytes
from .base import (
    command,
    notebook_values,
    out_name,
    parse_argstring,
    require_mesh,
    selected,
    selection,
    warnings_as_notes,
)


class DataCommands:
    """The ``%mesh`` commands that look at and move the ranks' variables."""

    shell: Any

    @magic_arguments(name="mesh who")
    @selection("to look at")
    @command
    def who(self, line: str) -> None:
        """List the ranks' variables: type, shape, dtype, device, bytes, DTensor placements."""
        args = parse_argstring(self.who, line)
        ranks, where = selected(args)
        print(repr(require_mesh().who(ranks, where=where)))

    @magic_arguments(name="mesh push")
    @argument("names", nargs="+", help="notebook variables to send, e.g. lr batch")
    @selection("to send to")
    @command
    def push(self, line: str) -> None:
        """Send notebook variables to the ranks' namespaces, under the same names."""
        args = parse_argstring(self.push, line)
        values = notebook_values(self.shell, args.names, f"%mesh push {' '.join(args.names)}")
        (ranks, where), mesh = selected(args), require_mesh()
        mesh.push(values, ranks=ranks, where=where)
        print(f"pushed {', '.join(args.names)} to ranks {format_ranks(mesh.select(ranks, where))}")

    @magic_arguments(name="mesh pull")
    @argument("name", help="the ranks' variable to bring back")
    @selection("to bring it from")
    @argument("--max-bytes", default=str(DEFAULT_MAX_BYTES),
              help=f"refuse to move more than this in total, e.g. 512M or 8G "
                   f"(default {format_bytes(DEFAULT_MAX_BYTES)})")
    @argument("--out", "-o", help="store the values (RankValues) in this variable instead of showing them")
    @command
    def pull(self, line: str) -> RankValues | None:
        """Bring a variable back from the ranks, as per-rank values (tensors on the CPU)."""
        args = parse_argstring(self.pull, line)
        out, (ranks, where) = out_name(args), selected(args)
        with warnings_as_notes():
            values = require_mesh().pull(args.name, ranks, where=where, max_bytes=parse_size(args.max_bytes))
        if out is None:
            return values
        # Not returned as well: IPython's Out[n] and _ would hold the values (and their
        # memory) after `del` of the name they were stored under.
        self.shell.user_ns[out] = values
        print(f"pulled {args.name} from ranks {format_ranks(values.ranks)} into {out}")
        return None


def parse_size(text: str, what: str = "--max-bytes") -> int:
    """``"8G"`` -> ``8 * 2**30``, or a UsageError saying how to write a size."""
    try:
        return size_in_bytes(text, what)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


