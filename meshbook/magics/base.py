"""What every ``%mesh`` command shares: the ``command`` marker and finding the mesh."""

from __future__ import annotations

import argparse
import contextlib
import keyword
import shlex
import sys
import warnings
from collections.abc import Iterator
from typing import Any, Callable

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument

from ..mesh import (
    Mesh,
    MeshError,
    MeshStoppedError,
    check_seconds,
    current,
    ended_meshes,
    mesh_named,
    meshes,
    parse_where,
)

Command = Callable[[Any, str], Any]


def command(fn: Command) -> Command:
    """Mark a method as a ``%mesh`` subcommand named after it (``help_`` -> ``help``).

    Applied first (innermost), so it still sees the one-line summary that ``%mesh?`` lists.
    """
    fn.mesh_command = fn.__name__.rstrip("_")  # type: ignore[attr-defined]
    fn.mesh_summary = summary(fn.__doc__)  # type: ignore[attr-defined]
    return fn


def summary(doc: str | None) -> str:
    """A docstring's first sentence, its wrapped lines joined: what ``%mesh?`` lists (a first
    line alone stopped mid-sentence: "restart ... or only some ranks: %mesh restart 1;")."""
    paragraph = " ".join(line.strip() for line in (doc or "").strip().split("\n\n")[0].splitlines())
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[:end + 1]


def selection(what: str) -> Callable[[Command], Command]:
    """``--ranks`` and ``--where``, for every command that picks ranks by option (``what``:
    "to run on"), read with :func:`selected`. Each may come more
    than once, as a user adds a condition to a line: ranks add up, and every condition holds
    (``--where dp=0 --where tp=1`` is ``--where dp=0,tp=1``), where the last alone would
    silently pick other ranks."""

    def declare(fn: Command) -> Command:
        fn = argument("--where", "-w", action="append",
                      help="select ranks by mesh coordinates: dp=0 or dp=0,tp=0-1")(fn)
        return argument("--ranks", "-r", action="append", help=f"ranks {what}: 0,2 or 0-3 (default: all)")(fn)

    return declare


def parse_argstring(magic: Any, line: str) -> argparse.Namespace:
    """``line`` read by ``magic``'s options as a shell splits it: quotes group words and go
    (``--ranks '0,2'``, ``--name "my run"``). IPython's own parse keeps them on POSIX, and
    ``'0,2'`` with its quotes was refused as a selection."""
    try:
        argv = shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"{line.strip()!r}: {exc} (close the quote, or escape it with a backslash)") from None
    return magic.parser.parse_args(argv)


def cell_number(shell: Any) -> int:
    """The number the frontend shows the running cell under (``In [N]``), as meshbook names it
    in tracebacks and messages ("cell [N]"). IPython counts a cell before running it from 9.x
    on, after it before (``execution_count`` is N+1 or N meanwhile); both store the cell in
    the input history first, at index N, which says which."""
    count = shell.execution_count
    history = getattr(shell, "history_manager", None)
    stored = len(history.input_hist_raw) - 1 if history is not None else -1
    return stored if stored in (count, count - 1) else count


def selected(args: argparse.Namespace) -> tuple[str | None, dict[str, list[int]] | None]:
    """The ranks and the conditions :func:`selection` declared, as the API takes them."""
    try:
        where = parse_where(",".join(args.where)) if args.where else None
    except MeshError as exc:
        raise UsageError(str(exc)) from None
    return (",".join(args.ranks) if args.ranks else None), where


def out_name(args: argparse.Namespace) -> str | None:
    """``--out``'s variable, checked before anything runs: a name no cell can write (``1x``,
    ``a.b``) would store the values where nothing can reach them."""
    name = args.out
    if name is not None and (not name.isidentifier() or keyword.iskeyword(name)):
        raise UsageError(f"--out takes a variable name (letters, digits and _), not {name!r}")
    return name


def seconds_arg(text: str) -> float:
    """An option's seconds (``type=`` of every ``--timeout``): above 0, or argparse's usage
    error saying so."""
    try:
        return check_seconds(text, "")
    except MeshError:
        raise argparse.ArgumentTypeError(f"give a number of seconds above 0, e.g. 30 (got {text!r})") from None


def notebook_values(shell: Any, names: list[str], retry: str) -> dict[str, Any]:
    """The notebook's variables ``names``, or a UsageError naming the missing ones and the
    command (``retry``) to run once they are defined."""
    missing = [n for n in names if n not in shell.user_ns]
    if missing:
        raise UsageError(f"no variable {', '.join(map(repr, missing))} in the notebook; "
                         f"define it first, then {retry}")
    return {n: shell.user_ns[n] for n in names}


@contextlib.contextmanager
def warnings_as_notes() -> Iterator[None]:
    """What the API warns of, as ``note:`` lines of the cell (not a line of meshbook's source)."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        yield
    for warning in said:
        print(f"note: {warning.message}", file=sys.stderr)


def running_mesh() -> Mesh | None:
    try:
        return current()
    except MeshError:
        return None


def require_mesh(name: str | None = None) -> Mesh:
    """The current mesh, or the running mesh ``name`` (``--mesh NAME``)."""
    if name is not None:
        try:
            return mesh_named(name)
        except MeshError as exc:
            raise UsageError(str(exc)) from None
    try:
        return current()
    except MeshStoppedError as exc:  # another kernel attached the current (kept) mesh
        raise UsageError(str(exc)) from None
    except MeshError as exc:
        if meshes() or ended_meshes():  # the current one stopped or ended: which, and what runs
            raise UsageError(str(exc)) from None
        raise UsageError("no mesh is running: start one with %mesh start -n 4 "
                         "(or %mesh start --dims dp=2,tp=2)") from None


def describe(mesh: Mesh, named: bool = False) -> str:
    """``mesh 'trainers': 4 ranks (dp=2 x tp=2, cpu)``; the default name only if ``named``."""
    prefix = f"mesh {mesh.name!r}: " if named or mesh.name != "mesh" else ""
    return f"{prefix}{mesh.world_size} ranks ({mesh.topology.describe()}, {mesh.status()[0].device or 'cpu'})"
