"""The ``%mesh`` line magic and the ``%%mesh`` cell magic: a thin face over the Python API.

``%%mesh [options]`` runs the cell on the mesh; ``%mesh COMMAND [options]`` manages it.
Every command is a method declared with IPython's ``magic_arguments``, so ``%mesh?`` lists
them all and ``%mesh help COMMAND`` shows one in full. Errors the user can fix (a bad option,
a bad selection, no mesh running) are shown as one line; the mesh is left untouched.
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any, Callable

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..mesh import (
    CellSyntaxError,
    Mesh,
    MeshError,
    MeshTimeout,
    RankValues,
    RemoteError,
    add_start_arguments,
    attach,
    ended_meshes,
    launcher_from_args,
    list_meshes,
    meshes,
    parse_dims,
    start,
    status_table,
    use,
)
from .base import (
    cell_number,
    command,
    describe,
    out_name,
    parse_argstring,
    require_mesh,
    running_mesh,
    seconds_arg,
    selected,
    selection,
)
from .data_commands import DataCommands, parse_size
from .debug_commands import DebugCommands
from .plan_commands import PlanCommands
from .render import RenderOptions, show_run
from .widget_commands import WidgetCommands

#: What asks a command for its help, as in a shell (``%%mesh --help``, ``%mesh start -h``).
_HELP = frozenset({"--help", "-h"})


@magics_class
class MeshMagics(DebugCommands, WidgetCommands, DataCommands, PlanCommands, Magics):
    """``%mesh`` / ``%%mesh``; the current mesh is :func:`meshbook.current`."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        #: How each mesh was started with %mesh start, by name (what %mesh restart repeats).
        self._start_args: dict[str, dict[str, Any]] = {}
        self._auto = False

    # -- the magic ---------------------------------------------------------------------------

    @magic_arguments(name="%mesh")
    @argument("--mesh", "-m", dest="mesh_name", help="run on the mesh of this name (default: the current "
                                                     "one, see %%mesh use)")
    @selection("to run on")
    @argument("--timeout", "-t", type=seconds_arg,
              help="stop waiting after this many seconds (time spent answering the ranks' "
                   "input() or pdb prompts not counted); the ranks keep running")
    @argument("--out", "-o", help="also store the per-rank results (RankValues) in this variable "
                                  "(those of the ranks that succeeded, when some fail)")
    @argument("--ordered", action="store_true",
              help="print each rank's output in rank order when the cell ends (deterministic)")
    @argument("--quiet", "-q", action="store_true", help="do not display the results")
    @argument("--max-bytes", help="a result bigger than this (e.g. 512M, 8G) stays on its rank as `_` "
                                  "(default: the mesh's, 2 GiB unless started otherwise)")
    @argument("--no-status", action="store_true",
              help="no live per-rank status for this cell (shown when a cell runs over 1 s)")
    @argument("--first-line", type=int, default=2, help=argparse.SUPPRESS)
    @line_cell_magic
    def mesh(self, line: str, cell: str | None = None) -> Any:
        """Run a cell on every rank of the mesh, or on a slice of them.

        %%mesh [options]   runs the cell's code in each selected rank's persistent
        namespace (rank, world_size, local_rank, coords, device, torch, dist and
        device_mesh are predefined). Output streams in as the ranks print it, with
        identical lines from several ranks merged ("[0-3] epoch 1"). The value of a
        final expression is shown per rank; errors are grouped by traceback and the
        cell fails like a local exception would.

        %mesh COMMAND [options]   manages the mesh; %mesh help COMMAND shows one command.
        """
        try:
            if cell is None:
                return self._line(line)
            return self._cell(line, cell)
        except (RemoteError, CellSyntaxError):
            raise  # shown with their own tracebacks (remote frames, the bad line)
        except MeshError as exc:
            raise UsageError(str(exc)) from None

    # -- %%mesh ------------------------------------------------------------------------------

    def _cell(self, line: str, cell: str) -> Any:
        if _HELP.intersection(line.split()):  # the options, and nothing run
            return self.help_("")
        args = parse_argstring(self.mesh, line)
        out, (ranks, where) = out_name(args), selected(args)
        try:
            mesh = require_mesh(args.mesh_name)
        except UsageError as exc:
            if not self._auto:
                raise
            raise UsageError(f"{exc} (every cell runs on the mesh since %mesh on: %mesh off runs them "
                             f"locally)") from None
        run = mesh.run(cell, ranks, where=where, first_line=args.first_line,
                       name=cell_number(self.shell),
                       max_bytes=parse_size(args.max_bytes) if args.max_bytes else None)
        options = RenderOptions(ordered=args.ordered, timeout=args.timeout,
                                late_values=partial(self._store_late, out) if out else None)
        try:
            values = show_run(run, options, mesh, view=self.cell_view(mesh, run, enabled=not args.no_status))
        except RemoteError as exc:
            if out:  # the ranks that succeeded: their values are the user's as well
                self.shell.user_ns[out] = exc.partial
            else:
                exc.keeps = "%%mesh --out NAME keeps them"
            raise
        except MeshTimeout as exc:
            if out:
                raise MeshTimeout(f"{exc}\nThe values of the ranks that finish go to `{out}` when the cell "
                                  f"ends.") from None
            raise
        if out:
            self.shell.user_ns[out] = values
        if args.quiet or all(v is None for v in values.values()):
            return None
        return values

    def _store_late(self, out: str, values: RankValues) -> str:
        """``--out`` of a cell that ended after its timeout (the receiver thread): stored then."""
        if not values:
            return f"; no rank finished: `{out}` is as it was"
        self.shell.user_ns[out] = values
        return f"; the values of the ranks that finished are in `{out}`"

    # -- %mesh COMMAND -----------------------------------------------------------------------

    def _line(self, line: str) -> Any:
        name, _, rest = line.strip().partition(" ")
        if not name or name in _HELP:
            return self.help_("")
        if _HELP.intersection(rest.split()):  # %mesh start --help, as a shell command takes it
            return self.help_(name)
        handler = self._commands().get(name)
        if handler is None:
            raise UsageError(f"unknown command %mesh {name}; commands: "
                             f"{', '.join(sorted(self._commands()))} (see %mesh?)")
        return handler(rest)

    def _commands(self) -> dict[str, Callable[[str], Any]]:
        return {getattr(type(self), attr).mesh_command: getattr(self, attr)
                for attr in dir(type(self)) if hasattr(getattr(type(self), attr), "mesh_command")}

    @magic_arguments(name="mesh help")
    @argument("command", nargs="?", help="the command to explain")
    @command
    def help_(self, line: str) -> None:
        """Show the help of one command, or the list of commands."""
        args = parse_argstring(self.help_, line)
        if args.command:
            handler = self._commands().get(args.command)
            if handler is None:
                raise UsageError(f"unknown command {args.command!r}; commands: {', '.join(sorted(self._commands()))}")
            print(_readable(handler.__doc__))
        else:
            print(_readable(type(self).mesh.__doc__))

    @magic_arguments(name="mesh start")
    @argument("count", nargs="?", type=int, help="number of ranks, as -n gives it (%%mesh start 4)")
    @argument("-n", type=int, help="number of ranks (or give --dims)")
    @argument("--dims", "-d", help="named mesh dimensions, e.g. dp=2,tp=2 (product = ranks)")
    @argument("--backend", default="auto", help="auto (gloo on CPU, NCCL on GPUs), gloo, nccl")
    @argument("--timeout", type=seconds_arg, default=120.0, help="seconds to wait for the ranks to start")
    @argument("--collective-timeout", type=seconds_arg, default=300.0,
              help="seconds before a hung collective fails on its own (default 300)")
    @argument("--name", help="name the mesh, to run several (%%%%mesh --mesh NAME, "
                                   "%%mesh use NAME)")
    @argument("--force", action="store_true", help="stop a running mesh (of that name) and start a new one")
    @argument("--env", action="append", metavar="NAME[=VALUE]",
              help="a variable for the ranks on other hosts (repeat it): NCCL_DEBUG takes its value "
                   "here, NCCL_DEBUG=INFO sets it. Ranks on this machine start with this kernel's "
                   "environment as it is at %%mesh start")
    @argument("--keep", metavar="DURATION",
              help="keep the mesh (ranks and variables) after this kernel dies or restarts, for up to "
                   "DURATION (8h, 30m, 1h30m) after it was last heard; %%mesh attach ID takes it back")
    @command
    def start(self, line: str) -> None:
        """Start a mesh: %mesh start -n 4 --dims dp=2,tp=2 (this machine),
        %mesh start --hosts gpu1,gpu2 --per-host 8 (ssh), %mesh start --join -n 16 --per-host 8,
        %mesh start -n 4 --keep 8h (outlives the kernel),
        %mesh start --slurm nodes=2,gpus-per-node=8,time=2:00:00 (a Slurm job; job=ID: your allocation)"""
        args = parse_argstring(self.start, line)
        launcher = launcher_from_args(args)  # the launchers' own options (add_start_arguments)
        if args.count is not None and args.n is not None and args.count != args.n:
            raise UsageError(f"%mesh start {args.count} -n {args.n}: give the number of ranks once")
        n = args.n if args.n is not None else args.count
        if n is None and not args.dims:
            n = launcher.default_ranks()  # hosts x --per-host, Slurm's nodes x GPUs per node
        if n is None and not args.dims:
            raise UsageError("say how many ranks: %mesh start -n 4 (or --dims dp=2,tp=2, or "
                             "--hosts gpu1,gpu2 --per-host 2)")
        options = {"n": n, "dims": parse_dims(args.dims) if args.dims else None,
                   "backend": args.backend, "timeout": args.timeout,
                   "collective_timeout": args.collective_timeout, "name": args.name,
                   "launcher": launcher, "keep": args.keep, "env": args.env}
        # Unnamed: one mesh at a time, as ever (the current one, or, where it stopped, the
        # unnamed one still running). Named: another mesh beside the running ones.
        running = meshes().get(args.name) if args.name else running_mesh() or meshes().get("mesh")
        if running is not None:
            if not args.force:
                raise UsageError(f"a mesh is already running ({running!r}); %mesh stop it first, "
                                 f"use %mesh start --force to replace it, or --name another one")
            running.stop()
            print(f"stopped {describe(running)} (--force)")  # it may be another name's: say which
        mesh = start(**options)
        self._start_args[mesh.name] = dict(options, name=mesh.name)
        lease = mesh.controller.lease
        threads = mesh.status()[0].threads
        print(f"started {describe(mesh)}" + (f"; {threads}" if threads else "") + (
            f"; kept as {lease.id} for {args.keep} after this kernel was last heard: after a restart, "
            f"%mesh attach {lease.id}" if lease is not None else ""))

    @magic_arguments(name="mesh list")
    @command
    def list_(self, line: str) -> None:
        """List the kept meshes you can attach: id, launcher, hosts, ranks, Slurm job, age, lease left."""
        parse_argstring(self.list_, line)
        here = {m.controller.lease.id: name for name, m in meshes().items() if m.controller.lease is not None}
        rows = [record.row(here.get(record.id, "")) for record in list_meshes()]
        print(status_table(rows) if rows else "no kept mesh (start one with %mesh start -n 4 --keep 8h)")

    @magic_arguments(name="mesh attach")
    @argument("id", help="the mesh's id, from %%mesh list")
    @argument("--name", help="its name in this notebook (default: the one it was started with)")
    @argument("--timeout", type=seconds_arg, default=60.0, help="seconds to wait for its agents to answer")
    @command
    def attach(self, line: str) -> None:
        """Take back a kept mesh after a kernel restart: %mesh attach ID (same ranks, same variables)"""
        args = parse_argstring(self.attach, line)
        mesh = attach(args.id, name=args.name, timeout=args.timeout)
        print(f"attached {describe(mesh)}: kept mesh {args.id}; any other kernel attached to it is "
              f"fenced off")

    @magic_arguments(name="mesh stop")
    @argument("name", nargs="?", help="the mesh to stop (default: the current one)")
    @argument("--all", action="store_true", dest="every", help="stop every running mesh")
    @command
    def stop(self, line: str) -> None:
        """Stop the mesh: every rank and its host agent exit; namespaces are lost."""
        args = parse_argstring(self.stop, line)
        chosen = list(meshes().values()) if args.every else \
            [_running_or_kept(args.name)] if args.name else [m for m in [running_mesh()] if m is not None]
        if not chosen:
            left = meshes()
            print(f"the current mesh is stopped; running: {', '.join(left)} (%mesh stop NAME, or --all)"
                  if left else "no mesh is running")
            return
        for mesh in chosen:
            mesh.stop()
        left = meshes()
        print("mesh stopped" if len(chosen) == 1 and chosen[0].name == "mesh" and not left else
              f"stopped {', '.join(m.name for m in chosen)}" +
              (f"; still running: {', '.join(left)} (%mesh use NAME picks one)" if left else ""))
        if self._auto and not left:  # %mesh on ends with the last mesh: cells are not left failing
            self.off("")

    @magic_arguments(name="mesh use")
    @argument("name", help="the mesh %%%%mesh cells and %%mesh commands use from now on")
    @command
    def use(self, line: str) -> None:
        """Pick the mesh that cells and commands use: %mesh use trainers"""
        args = parse_argstring(self.use, line)
        print(f"now using {describe(use(args.name), named=True)}")

    @magic_arguments(name="mesh restart")
    @argument("ranks", nargs="?",
              help="restart only these ranks (0,2): the others keep their variables")
    @argument("--on", help="the ranks of a lost host: start their agent on this host instead (ssh)")
    @command
    def restart(self, line: str) -> None:
        """Restart the mesh (fresh namespaces), or only some ranks: %mesh restart 1;
        the ranks of a lost host elsewhere: %mesh restart 8-15 --on gpu3"""
        args = parse_argstring(self.restart, line)
        if args.ranks:
            self.restart_ranks(args.ranks, args.on)
            return
        if args.on:
            raise UsageError("--on goes with the ranks of a lost host: %mesh restart 8-15 --on gpu3")
        mesh = running_mesh()
        options = self._start_args.get(mesh.name) if mesh is not None else \
            next(reversed(self._start_args.values()), None)
        if options is None and mesh is not None:
            every = f"0-{mesh.world_size - 1}" if mesh.world_size > 1 else "0"
            raise UsageError(f"%mesh restart repeats the %mesh start of the current mesh, and {describe(mesh)} was "
                             f"not started by %mesh start in this kernel (but from Python, or attached): restart "
                             f"its ranks instead (fresh namespaces), %mesh restart {every}")
        if options is None:
            raise UsageError("nothing to restart: start a mesh with %mesh start first")
        old = mesh.controller.lease if mesh is not None else None
        if mesh is not None:
            mesh.stop(replaced=True)
        mesh = start(**options)
        lease = mesh.controller.lease
        kept = f"; kept as {lease.id}" + (f" (not {old.id} any more)" if old is not None else "") + \
            f": after a kernel restart, %mesh attach {lease.id}" if lease is not None else ""
        print(f"restarted {describe(mesh)}{kept}. Handles to the old mesh stopped with it: "
              f"mesh = meshbook.current() takes the new one")

    @magic_arguments(name="mesh status")
    @command
    def status(self, line: str) -> None:
        """Show each mesh's ranks: host, pid, device, coordinates and state; its actors; and
        for a mesh across hosts, each host: address, agent pid, ranks, round trip, last heartbeat."""
        parse_argstring(self.status, line)
        ended = ended_meshes()
        if not meshes() and ended:  # say how they ended: a new %mesh start needs no --force
            print("\n".join(f"{'mesh' if name == 'mesh' else f'mesh {name!r}'} ended: {reason}. Start a new "
                            f"one with %mesh start" for name, reason in ended.items()))
            return
        running = meshes()
        current = require_mesh() if not running else running_mesh()
        if current is None:
            print(f"the current mesh is stopped; running: {', '.join(running)} (%mesh use NAME picks one)")
        for mesh in running.values():
            rows = [{"rank": s.rank, "host": s.hostname, "pid": s.pid or "-", "device": s.device,
                     **{k: v for k, v in mesh.topology.coords(s.rank).items()},
                     "state": s.state + (f" ({s.cause})" if s.cause else "")} for s in mesh.status()]
            hosts = mesh.hosts()
            job = mesh.job()
            if job is not None:
                print(job)
            if hosts:
                print(status_table([h.row() for h in hosts]))
            mark = " (current)" if current is not None and mesh.controller is current.controller \
                and len(running) > 1 else ""
            actors = [f"{a.name} ({a.cls_name}{', failed: ' + a.failed if a.failed else ''})"
                      for a in mesh.actors().values()]
            lease = mesh.controller.lease
            print(f"{describe(mesh)}{mark}\n{status_table(rows)}" +
                  (f"\nactors: {', '.join(actors)}" if actors else "") +
                  (f"\nkept as {lease.id}: outlives this kernel (%mesh list shows its lease)" if lease else ""))

    @magic_arguments(name="mesh on")
    @command
    def on(self, line: str) -> None:
        """Run every following cell on the mesh (as if it started with %%mesh) until %mesh off."""
        parse_argstring(self.on, line)
        require_mesh()
        if not self._auto:
            self.shell.input_transformers_cleanup.append(_auto_mesh)
            self._auto = True
        print("every cell now runs on the mesh; %mesh off to stop")

    @magic_arguments(name="mesh off")
    @command
    def off(self, line: str) -> None:
        """Cells run locally again."""
        parse_argstring(self.off, line)
        if self._auto:
            self.shell.input_transformers_cleanup.remove(_auto_mesh)
            self._auto = False
        print("cells run locally again")

    def unload(self) -> None:
        if self._auto:
            self.off("")


def _running_or_kept(name: str) -> Mesh:
    """The running mesh ``name``; for the id of a kept mesh this kernel has not attached, a
    UsageError saying how to stop it (it said that no mesh of that name ran)."""
    try:
        return require_mesh(name)
    except UsageError:
        if any(record.id == name and not record.problem for record in list_meshes()):
            raise UsageError(f"{name} is a kept mesh this kernel has not attached: %mesh attach {name}, "
                             f"then %mesh stop") from None
        raise


def _auto_mesh(lines: list[str]) -> list[str]:
    """Input transformer of %mesh on: prefix plain cells with %%mesh."""
    first = next((line for line in lines if line.strip()), None)
    if first is None or first.lstrip().startswith(("%", "!", "?")):
        return lines
    return ["%%mesh --first-line 1\n", *lines]


def _command_help(magics: type) -> str:
    commands = [getattr(magics, a) for a in sorted(dir(magics))
                if hasattr(getattr(magics, a), "mesh_command")]
    lines = [f"  {fn.mesh_command:<12} {fn.mesh_summary}" for fn in commands]
    return "\nCommands (%mesh help COMMAND for details):\n" + "\n".join(lines) + "\n"


MeshMagics.mesh.__doc__ = (MeshMagics.mesh.__doc__ or "") + _command_help(MeshMagics)
# %mesh start's launcher options come from the launchers (a plug-in's too), declared once each.
add_start_arguments(MeshMagics.start.parser)
MeshMagics.start.__doc__ = MeshMagics.start.parser.format_help()


def _readable(doc: str | None) -> str:
    """A magic's help as a reader wants it: IPython's ``magic_arguments`` opens it with reST's
    literal-block marker ``::``, which its own ``%mesh?`` page shows and a printed help need not."""
    return (doc or "").removeprefix("::\n\n")
