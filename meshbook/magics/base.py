"""What every ``%mesh`` command shares: the ``command`` marker and finding the mesh."""

from __future__ import annotations

from typing import Any, Callable

from IPython.core.error import UsageError

from ..mesh import Mesh, MeshError, MeshStoppedError, current, mesh_named

Command = Callable[[Any, str], Any]


def command(fn: Command) -> Command:
    """Mark a method as a ``%mesh`` subcommand named after it (``help_`` -> ``help``).

    Applied first (innermost), so it still sees the one-line summary that ``%mesh?`` lists.
    """
    fn.mesh_command = fn.__name__.rstrip("_")  # type: ignore[attr-defined]
    fn.mesh_summary = (fn.__doc__ or "").strip().splitlines()[0]  # type: ignore[attr-defined]
    return fn


def notebook_values(shell: Any, names: list[str], retry: str) -> dict[str, Any]:
    """The notebook's variables ``names``, or a UsageError naming the missing ones and the
    command (``retry``) to run once they are defined."""
    missing = [n for n in names if n not in shell.user_ns]
    if missing:
        raise UsageError(f"no variable {', '.join(map(repr, missing))} in the notebook; "
                         f"define it first, then {retry}")
    return {n: shell.user_ns[n] for n in names}


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
    except MeshError:
        raise UsageError("no mesh is running: start one with %mesh start -n 4 "
                         "(or %mesh start --dims dp=2,tp=2)") from None


def describe(mesh: Mesh) -> str:
    named = "" if mesh.name == "mesh" else f"mesh {mesh.name!r}: "
    return f"{named}{mesh.world_size} ranks ({mesh.topology.describe()}, {mesh.status()[0].device or 'cpu'})"
