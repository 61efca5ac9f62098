"""``%mesh who``, ``%mesh push`` and ``%mesh pull``: the ranks' variables, from the notebook.

A mixin of :class:`~meshbook.magics.mesh_magic.MeshMagics`; each command is a thin face over
:meth:`Mesh.who <meshbook.Mesh.who>`, :meth:`Mesh.push <meshbook.Mesh.push>` and
:meth:`Mesh.pull <meshbook.Mesh.pull>`::

    %mesh who --where dp=0            # the table of variables, no data moved
    %mesh push lr batch --ranks 0,1   # the notebook's lr and batch, into those ranks
    %mesh pull loss --out losses      # RankValues of every rank's loss, stored as losses
"""

from __future__ import annotations

import keyword
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ..mesh import DEFAULT_MAX_BYTES, RankValues, format_bytes, format_ranks, parse_where
from ..mesh import parse_size as size_in_bytes
from .base import command, notebook_values, require_mesh

_RANKS_HELP = "ranks: 0,2 or 0-3 (default: all)"
_WHERE_HELP = "select ranks by mesh coordinates: dp=0 or dp=0,tp=0-1"


class DataCommands:
    """The ``%mesh`` commands that look at and move the ranks' variables."""

    shell: Any

    @magic_arguments(name="mesh who")
    @argument("--ranks", "-r", help=_RANKS_HELP)
    @argument("--where", "-w", help=_WHERE_HELP)
    @command
    def who(self, line: str) -> None:
        """List the ranks' variables: type, shape, dtype, device, bytes, DTensor placements."""
        args = parse_argstring(self.who, line)
        print(repr(require_mesh().who(args.ranks, where=_where(args.where))))

    @magic_arguments(name="mesh push")
    @argument("names", nargs="+", help="notebook variables to send, e.g. lr batch")
    @argument("--ranks", "-r", help=_RANKS_HELP)
    @argument("--where", "-w", help=_WHERE_HELP)
    @command
    def push(self, line: str) -> None:
        """Send notebook variables to the ranks' namespaces, under the same names."""
        args = parse_argstring(self.push, line)
        values = notebook_values(self.shell, args.names, f"%mesh push {' '.join(args.names)}")
        mesh, where = require_mesh(), _where(args.where)
        mesh.push(values, ranks=args.ranks, where=where)
        print(f"pushed {', '.join(args.names)} to ranks "
              f"{format_ranks(mesh.select(args.ranks, where))}")

    @magic_arguments(name="mesh pull")
    @argument("name", help="the ranks' variable to bring back")
    @argument("--ranks", "-r", help=_RANKS_HELP)
    @argument("--where", "-w", help=_WHERE_HELP)
    @argument("--max-bytes", default=str(DEFAULT_MAX_BYTES),
              help=f"refuse to move more than this in total, e.g. 512M or 8G "
                   f"(default {format_bytes(DEFAULT_MAX_BYTES)})")
    @argument("--out", "-o", help="store the values (RankValues) in this variable instead of showing them")
    @command
    def pull(self, line: str) -> RankValues | None:
        """Bring a variable back from the ranks, as per-rank values (tensors on the CPU)."""
        args = parse_argstring(self.pull, line)
        if args.out is not None and (not args.out.isidentifier() or keyword.iskeyword(args.out)):
            raise UsageError(f"--out takes a variable name (letters, digits and _), not {args.out!r}")
        values = require_mesh().pull(args.name, args.ranks, where=_where(args.where),
                                     max_bytes=parse_size(args.max_bytes))
        if args.out is None:
            return values
        # Not returned as well: IPython's Out[n] and _ would hold the values (and their
        # memory) after `del` of the name they were stored under.
        self.shell.user_ns[args.out] = values
        print(f"pulled {args.name} from ranks {format_ranks(values.ranks)} into {args.out}")
        return None


def parse_size(text: str, what: str = "--max-bytes") -> int:
    """``"8G"`` -> ``8 * 2**30``, or a UsageError saying how to write a size."""
    try:
        return size_in_bytes(text, what)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _where(text: str | None) -> dict[str, list[int]] | None:
    return parse_where(text) if text else None
