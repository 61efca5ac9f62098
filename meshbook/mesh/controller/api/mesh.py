"""The Python API: start a mesh, run code on its ranks, get per-rank values back.

>>> import meshbook
>>> mesh = meshbook.start(4, dims={"dp": 2, "tp": 2})
>>> mesh.run("x = torch.full((2,), float(rank)); dist.all_reduce(x); x.sum().item()").result()
[0-3] 12.0
>>> mesh.run("x * 2", ranks=[0, 2]).result()          # namespaces persist across calls
>>> mesh.apply(lambda a: rank + a, 10).result()       # a notebook function, per-rank results
>>> mesh.slice(dp=0)                                  # a view over the ranks with dp == 0
>>> mesh.stop()

A :class:`Mesh` is a *view*: a set of ranks of one running mesh. :meth:`Mesh.slice` returns
another view of the same ranks' processes, so ``mesh.slice(dp=0).run(...)`` runs on half the
mesh and the namespaces it touches are the same ones the full mesh sees.

A notebook may run several meshes, each under a name (``start(4, name="trainers")``; an
unnamed one is ``mesh``, then ``mesh2``...). :func:`current` is the one ``%%mesh`` cells use:
the last started, or the one picked with :func:`use` (``%mesh use NAME``); :func:`meshes` lists
the running ones. Actors (:meth:`Mesh.spawn`) are in :mod:`.actors`.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from types import FunctionType
from typing import Any, Callable, Mapping, Sequence

from ...protocol import messages as msg
from ...protocol.backends import Backend, check_requested
from ...protocol.cell import cell_filename, code_places, compile_cell, module_functions
from ...protocol.errors import MeshError, MeshStoppedError, check_bytes, check_seconds
from ...protocol.limits import DEFAULT_MAX_BYTES
from ...protocol.topology import DimSelector, Topology, resolve
from ...protocol.values import RankValues
from ...protocol.versions import versions
from ...rank import ops
from .. import recovery
from ..core.book import RankState
from ..core.controller import REPLACED, USER_STOP, Controller
from ..core.render import EventRenderer
from ..core.run import Run
from ..insight.memory import MemoryReport, memory_report
from ..insight.metrics import MetricsHistory
from ..insight.stragglers import DURATION_FACTOR, StragglerReport, straggler_report, stuck_in_collectives
from ..launch import get_launcher, launchers
from ..launch.base import Launcher
from ..launch.kept import Lease, find, new_mesh_file, next_epoch, parse_duration
from ..launch.kept import list_meshes as kept_meshes
from ..launch.network import HostLink
from ..launch.record import MeshRecord
from .actors import ActorMesh, actor_meshes, adopt, spawn
from .data import DataOps
from .debug import DebugOps
from .follow import FollowOptions, follow
from .plan import PlanOps

#: How long a memory report waits for ranks that have sent no heartbeat yet.
MEASURE_TIMEOUT_S = 2.0


def start(n: int | None = None, *, dims: Mapping[str, int] | None = None, backend: str = "auto",
          launcher: str | Launcher = "local", timeout: float = 120.0,
          collective_timeout: float = 300.0, max_result_bytes: int | str = DEFAULT_MAX_BYTES,
          name: str | None = None, keep: str | float | None = None,
          env: Mapping[str, str | None] | Sequence[str] | None = None) -> "Mesh":
    """Start a mesh of ranks and return it once torch.distributed is ready on every rank.

    ``n`` ranks, or named ``dims`` whose product is the world size (``{"dp": 2, "tp": 2}``);
    each rank's namespace then holds ``device_mesh``, a torch ``DeviceMesh`` with those names.
    Without either, a launcher that knows its hosts and ranks per host (``SSH(hosts,
    per_host=2)``, Slurm's nodes and GPUs per node) gives hosts x ranks per host.
    ``backend="auto"`` is NCCL (plus gloo for CPU tensors) when every host has a GPU per rank,
    else gloo, with a note on stderr saying why when there are GPUs; ``"nccl"`` refuses to start
    without a GPU per rank. The ranks start with this process's environment as it is now
    (``CUDA_VISIBLE_DEVICES``, ``NCCL_*``... set in a cell before ``start`` count); ranks on
    other hosts keep their host's, plus the variables named in ``env``: ``["NCCL_DEBUG",
    "FOO=bar"]`` or ``{"NCCL_DEBUG": None, "FOO": "bar"}`` (a bare name or None: its value
    here). ``collective_timeout`` bounds how long a collective may hang before it fails on its
    own. A result bigger than ``max_result_bytes`` (2 GiB, like
    ``pull``'s ``max_bytes``) stays on its rank as ``_``; ``run(max_bytes=...)`` overrides it.
    ``name`` names the mesh among this notebook's meshes (default ``mesh``, then ``mesh2``...);
    the new mesh becomes the current one. ``keep="8h"`` (a duration, or seconds) makes the
    mesh outlive this process by up to that long after it was last heard from: reattach it
    from another kernel with :func:`meshbook.attach` (see :mod:`..launch.kept`).
    """
    timeout = check_seconds(timeout, "timeout")
    collective_timeout = check_seconds(collective_timeout, "collective_timeout")
    max_result_bytes = check_bytes(max_result_bytes, "max_result_bytes")
    name = new_name(name)
    chosen = get_launcher(launcher)
    if n is None and dims is None:
        n = chosen.default_ranks()  # hosts x ranks per host, when the launcher knows both
    topology = Topology.create(n, dims)
    check_requested(backend)
    variables = parse_env(env)
    mesh_id = ""
    if keep is not None:
        lease_s = parse_duration(keep)
        mesh_id, mesh_file = new_mesh_file()  # its directory is checked before any agent starts
        chosen.keep(lease_s, mesh_file)
    controller = Controller(topology, chosen, backend, collective_timeout, name, env=variables)
    controller.max_result_bytes = max_result_bytes
    recovery.install(controller)
    controller.launch(timeout)
    try:
        for note in controller.notes:
            print(note, file=sys.stderr, flush=True)
        if mesh_id:
            controller.lease = Lease(_record(controller, mesh_id))
        return register(controller)
    except BaseException:  # a mesh file that cannot be written, a Ctrl-C: no mesh nobody holds
        controller.stop()
        raise


def _record(controller: Controller, mesh_id: str) -> MeshRecord:
    """Write the mesh file of a kept mesh now that it runs: how to reach each host's agent
    (what it said when it listened), the keys, and what its launcher needs to find it again."""
    network, launcher = controller.network, controller.launcher
    assert network is not None and launcher.lease_s is not None
    hosts = [{"name": link.name, "addr": link.address, "port": link.port, "pid": link.agent_pid,
              "hostname": link.hostname, "store_port": link.store_port, "gpus": link.gpus, "ranks": link.ranks}
             for link in (network.links[h] for h in sorted(network.links))]
    record = MeshRecord(
        id=mesh_id, name=controller.name, launcher=launcher.name, hosts=hosts, key=controller.wire.key.hex(),
        server=network.server.to_json(), controller=network.me.to_json(),
        dims=[list(d) for d in controller.topology.dims], backend=controller.chosen.torch,
        collective_timeout=controller.collective_timeout, generation=controller.generation,
        epoch=network.epoch, started=time.time(), lease_s=launcher.lease_s,
        launcher_state=launcher.to_record(), versions=versions())
    record.save()
    return record


def parse_env(env: Mapping[str, str | None] | Sequence[str] | None) -> dict[str, str]:
    """``start(env=...)`` as name -> value: ``"NAME"`` (or ``NAME: None``) takes its value in
    this process now, ``"NAME=VALUE"`` sets it."""
    if env is None:
        return {}
    items = env.items() if isinstance(env, Mapping) else \
        [tuple(e.split("=", 1)) if "=" in e else (e, None) for e in ([env] if isinstance(env, str) else env)]
    out = {}
    for name, value in items:
        if not isinstance(name, str) or not name or "=" in name:
            raise MeshError(f"env: {name!r} is not a variable name; give NAME or NAME=VALUE")
        if value is None:
            if name not in os.environ:
                raise MeshError(f"env: {name} is not set in this notebook; give {name}=VALUE")
            value = os.environ[name]
        out[name] = str(value)
    return out


def attach(mesh_id: str, name: str | None = None, timeout: float = 60.0) -> "Mesh":
    """Take over the kept mesh ``mesh_id`` (``start(keep=...)``, see :func:`list_meshes`) after
    a kernel restart: same ranks, same variables. It becomes the current mesh, under ``name``
    (default: its name when started). Any other kernel that drove it is fenced off: its next
    cell fails and says this one attached it."""
    timeout = check_seconds(timeout, "timeout")
    record, known = find(mesh_id), launchers()
    if record.launcher not in known:  # before taking the next epoch: a refused attach fences nobody
        raise MeshError(f"kept mesh {mesh_id} was started with the {record.launcher!r} launcher, which this "
                        f"kernel does not have (available: {', '.join(known)}): install the package that "
                        f"registers it")
    chosen = name or record.name
    # This kernel drives it already: that handle lets go (its name too), once the new one is made.
    driving = next((m for m in meshes().values()
                    if m.controller.lease is not None and m.controller.lease.id == record.id), None)
    chosen = new_name(chosen, replacing=driving.name if driving is not None else None)
    record = next_epoch(record)
    controller = Controller(Topology(tuple((k, v) for k, v in record.dims)),
                            known[record.launcher].from_record(record), record.backend, record.collective_timeout,
                            chosen, key=bytes.fromhex(record.key))
    if driving is not None:
        driving.controller.stop(f"it was attached again in this kernel, as {chosen!r}: "
                                f"meshbook.mesh_named({chosen!r}) drives it", detach=True)
    controller.agents.chosen = Backend.of(record.backend)
    controller.lease = Lease(record)
    recovery.install(controller)
    controller.attach(timeout)
    mesh = register(controller)
    adopt(mesh)  # the actors the kernel before spawned: mesh.actors() has their handles
    return mesh


def list_meshes() -> list[MeshRecord]:
    """The kept meshes this user can attach (``%mesh list``), oldest first; ``.row()`` of
    each: id, name, launcher, hosts, ranks, Slurm job and state, age, lease left, attached here."""
    return kept_meshes()


def register(controller: Controller) -> "Mesh":
    """A started (or attached) mesh becomes the current one, under its name."""
    mesh = Mesh(controller, list(range(controller.topology.world_size)))
    global _current
    _current = _meshes[controller.name] = mesh
    _ended.pop(controller.name, None)

    def follow_run(run: Run, renderer: EventRenderer, timeout: float | None) -> RankValues:
        return follow(run, mesh, renderer, FollowOptions(timeout=timeout))

    controller.follow = follow_run  # run.result() follows as a cell does (hang hints, interrupts)
    controller.launcher.watch(mesh)  # a launcher that keeps an eye on its hosts (Slurm: the time limit)
    for listener in list(_start_listeners):
        listener(mesh)
    return mesh


#: Called with every newly started mesh (the kernel layer hooks in here).
_start_listeners: list[Callable[["Mesh"], None]] = []


def add_start_listener(listener: Callable[["Mesh"], None]) -> None:
    """Call ``listener(mesh)`` with every mesh started from now on (the kernel bridge)."""
    if listener not in _start_listeners:
        _start_listeners.append(listener)


def remove_start_listener(listener: Callable[["Mesh"], None]) -> None:
    if listener in _start_listeners:
        _start_listeners.remove(listener)
_current: "Mesh | None" = None
#: This process's meshes by name, in start order (stopped ones are dropped when next looked at).
_meshes: dict[str, "Mesh"] = {}
#: Meshes that ended on their own (their Slurm job ended, every host was lost...), by name: how.
_ended: dict[str, str] = {}


def meshes() -> dict[str, "Mesh"]:
    """The running meshes of this process by name, in the order they started."""
    for name in [n for n, m in _meshes.items() if m.stopped]:
        reason = _meshes.pop(name).controller.stop_reason
        if reason != USER_STOP:
            _ended[name] = reason
    return dict(_meshes)


def ended_meshes() -> dict[str, str]:
    """Meshes that ended on their own since they were started, by name: how each ended."""
    meshes()
    return dict(_ended)


def current() -> "Mesh":
    """The mesh ``%%mesh`` cells run on: the last started, or the one picked with :func:`use`."""
    if _current is not None and _current.controller.fenced:
        raise MeshStoppedError(_current.controller.fence_said())  # until another mesh is started or attached
    if _current is None or _current.stopped:
        running = meshes()
        if _current is not None and _current.name in _ended and _current.controller.stop_reason != USER_STOP:
            raise MeshError(f"the mesh {_current.name!r} ended ({_current.controller.stop_reason}); start a "
                            f"new one with meshbook.start(...) (%mesh start ...)")
        if _current is not None and running:
            raise MeshError(f"the current mesh {_current.name!r} is stopped; running: {', '.join(running)}. "
                            f"Pick one with meshbook.use(NAME) (%mesh use NAME)")
        raise MeshError("no mesh is running: start one with meshbook.start(4) "
                        "(or %mesh start -n 4 in a notebook)")
    return _current


def use(name: str) -> "Mesh":
    """Make the running mesh ``name`` the current one (``%mesh use NAME``) and return it."""
    global _current
    _current = mesh_named(name)
    return _current


def mesh_named(name: str) -> "Mesh":
    """The running mesh called ``name``."""
    running = meshes()
    if name not in running:
        names = ", ".join(running) or "none"
        raise MeshError(f"no mesh named {name!r} is running (running: {names})")
    return running[name]


def new_name(name: str | None, replacing: str | None = None) -> str:
    """``name`` if no running mesh has it (else a MeshError); unnamed: mesh, mesh2...
    ``replacing``: the name of a mesh about to let go of it (attached again)."""
    running = {n: m for n, m in meshes().items() if n != replacing}
    if name is None:
        candidates = itertools.chain(["mesh"], (f"mesh{i}" for i in itertools.count(2)))
        return next(n for n in candidates if n not in running)
    if not isinstance(name, str) or not name.replace("-", "_").isidentifier():
        raise MeshError(f"mesh name {name!r}: use letters, digits, '_' or '-', starting with a letter, "
                        f"e.g. name='trainers'")
    if name in running:
        raise MeshError(f"a mesh named {name!r} is already running: stop it first "
                        f"(meshbook.mesh_named({name!r}).stop()), or pick another name")
    return name


class Mesh(DebugOps, DataOps, PlanOps):
    """A set of ranks of a running mesh; run code on them and collect per-rank results."""

    def __init__(self, controller: Controller, ranks: list[int]) -> None:
        self.controller = controller
        self._ranks = ranks

    # -- shape -------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The mesh's name in this notebook (``start(name=...)``)."""
        return self.controller.name

    @property
    def kept_id(self) -> str | None:
        """The id a kept mesh (``start(..., keep=...)``) is attached by after a kernel restart
        (``meshbook.attach(id)``, ``%mesh attach ID``); None for a mesh that is not kept."""
        lease = self.controller.lease
        return lease.id if lease is not None else None

    @property
    def ranks(self) -> list[int]:
        return list(self._ranks)

    @property
    def topology(self) -> Topology:
        return self.controller.topology

    @property
    def dims(self) -> dict[str, int]:
        return dict(self.topology.dims)

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def stopped(self) -> bool:
        return self.controller.stopped

    def select(self, ranks: Sequence[int] | str | int | None = None,
               where: Mapping[str, DimSelector] | None = None) -> list[int]:
        """Resolve a selection (explicit ranks and/or dimension filters) within this view."""
        return resolve(self.topology, ranks, where, self._ranks)

    def slice(self, **where: DimSelector) -> "Mesh":
        """A view over the ranks matching ``where``, e.g. ``mesh.slice(dp=0)``."""
        return self.narrow(where=where)

    def narrow(self, ranks: Sequence[int] | str | int | None = None,
               where: Mapping[str, DimSelector] | None = None) -> "Mesh":
        """A view over the selected ranks, e.g. ``mesh.narrow([0, 2])`` or ``mesh.narrow("0-3")``."""
        return Mesh(self.controller, self.select(ranks, where))

    # -- running code ------------------------------------------------------------------------

    def run(self, code: str, ranks: Sequence[int] | str | int | None = None, *,
            where: Mapping[str, DimSelector] | None = None, first_line: int = 1,
            name: str | int | None = None, max_bytes: int | str | None = None) -> Run:
        """Run ``code`` in each selected rank's namespace; the value of a final expression is
        that rank's result. A ``SyntaxError`` is raised here, before anything is sent.

        ``first_line`` numbers the code's first line (tracebacks then use the numbers a user
        sees in a notebook cell); ``name`` names the code in tracebacks and stacks. A result
        bigger than ``max_bytes`` (by default the mesh's ``max_result_bytes``) stays on its rank
        as ``_``, and the rank's value says so.
        """
        if not isinstance(code, str):
            raise MeshError(f"run() takes code as a string, not {type(code).__name__}; "
                            f"use apply() to call a function")
        chosen = self.select(ranks, where)
        cell_name = name if name is not None else "run"
        compile_cell(code, cell_filename(cell_name), first_line)
        body = {"code": code, "first_line": first_line, "name": cell_name,
                "stdin": self.controller.stdin_probe(),
                "max_bytes": (self.controller.max_result_bytes if max_bytes is None
                              else check_bytes(max_bytes, "max_bytes"))}
        what = f"cell [{name}]" if isinstance(name, int) else _describe_code(code)  # a notebook cell's number
        return self.controller.submit(msg.EXEC, body, chosen, what)

    def apply(self, fn: Callable[..., Any], *args: Any,
              ranks: Sequence[int] | str | int | None = None,
              where: Mapping[str, DimSelector] | None = None, **kwargs: Any) -> Run:
        """Call ``fn(*args, **kwargs)`` on each selected rank; its return value is the result.

        A function defined in the notebook (or a script) sees the rank's namespace (``rank``,
        ``torch``, ``dist``, your variables) before the notebook names it carried along, and so
        do the functions of yours it calls; assigning a global inside it does not persist (use
        :meth:`run` for state). Its tracebacks show its own file and lines.
        """
        if not callable(fn):
            raise MeshError(f"apply() needs a function, got a {type(fn).__name__}")
        chosen = self.select(ranks, where)
        body = {"fn": fn, "args": args, "kwargs": kwargs, "stdin": self.controller.stdin_probe(),
                "max_bytes": self.controller.max_result_bytes,
                "code": code_places(module_functions(fn)) if isinstance(fn, FunctionType) else {}}
        return self.controller.submit(msg.APPLY, body, chosen, f"apply({_name_of(fn)})")

    def call(self, fn: Callable[..., Any], *args: Any, ranks: Sequence[int] | None = None,
             control: bool | None = None, what: str = "", **kwargs: Any) -> Run:
        """Run one of meshbook's own rank operations: ``fn(worker, *args, **kwargs)``.

        It runs on the channel the operation declares (``@rank_op(channel=CONTROL)``: the rank's
        control thread, which answers even while the rank is busy); ``control`` overrides that.
        For extensions of meshbook, not for user code.
        """
        channel = None if control is None else msg.CONTROL if control else msg.MAIN
        return self.controller.call(fn, *args, ranks=self.select(ranks), what=what or _name_of(fn),
                                    channel=channel, **kwargs)

    # -- actors ------------------------------------------------------------------------------

    def spawn(self, name: str, cls: type, *args: Any, supervisor: Any = None, **kwargs: Any) -> ActorMesh:
        """Build ``cls(*args, **kwargs)`` (a :class:`meshbook.Actor`) on every rank of this view,
        as actor ``name``; each rank's namespace sees it under that name. ``supervisor`` (a
        function, or an actor mesh with ``__supervise__``) receives its failure events."""
        return spawn(self, name, cls, *args, supervisor=supervisor, **kwargs)

    def actors(self) -> dict[str, ActorMesh]:
        """The actor meshes spawned on this mesh, by name."""
        return actor_meshes(self)

    # -- observing ---------------------------------------------------------------------------

    def memory(self) -> MemoryReport:
        """Each rank's RSS, CPU, CUDA allocated/reserved/peak and how full its memory pool is.

        From the last heartbeats; ranks that have sent none yet (right after ``start()``) are
        asked on their control threads, so the report never shows a live rank as unmeasured.
        """
        unmeasured = [s.rank for s in self.status() if not s.metrics and s.state != "dead"]
        if unmeasured:
            asked = self.controller.call(ops.heartbeat, ranks=unmeasured, what="memory")
            asked.wait(MEASURE_TIMEOUT_S)
            for rank, metrics in asked.values().items():
                self.controller.record_metrics(rank, metrics)
        return memory_report(self.status())

    def stragglers(self, run: Run | None = None, factor: float = DURATION_FACTOR) -> StragglerReport:
        """Which rank the others wait for: the rank that arrives last at the collectives (of
        ``run``, or of the last seconds of the latest cell), else from where each rank spent
        the last seconds (sampled inside collectives or not); with ``run``, also the ranks
        whose duration exceeds ``factor`` times the median of the others'."""
        if run is not None:
            arrivals = self.controller.clock.lateness(run.id)
        else:
            recent = self.controller.clock.recent()
            arrivals = recent[1] if recent is not None else None
        return straggler_report(self._sampled(), run.durations if run is not None else None, factor, arrivals)

    def waiting(self, run: Run) -> dict[int, float] | None:
        """Seconds each rank of ``run`` spent waiting in torch.distributed's collectives,
        exactly (None when it called none: collectives issued from C++, DDP's, are not timed)."""
        return self.controller.clock.waiting(run.id)

    def queued(self, run: Run) -> dict[int, str]:
        """The ranks where ``run`` has not started yet because they still run earlier work
        (a cell that outlived its wait, a ``mesh.run`` nobody waited for), and what that is."""
        return self.controller.queued_behind(run)

    @property
    def collective_timeout(self) -> float:
        """Seconds a collective may wait before it fails (``start(collective_timeout=)``; a
        script's own ``init_process_group(timeout=)`` sets its groups' own)."""
        return self.controller.collective_timeout

    def stuck(self, run: Run) -> dict[int, float]:
        """Seconds each rank of ``run`` has waited inside its current collective call, from
        its last heartbeat (ranks not in a collective are left out)."""
        return stuck_in_collectives(self._sampled(), run.id)

    def _sampled(self) -> dict[int, dict[str, Any]]:
        """Each live rank's sampling report (where its main thread spent the last seconds)."""
        return {s.rank: s.metrics.get("sampling", {}) for s in self.status() if s.state != "dead"}

    @property
    def history(self) -> MetricsHistory:
        """The last few minutes of each rank's memory (the dashboard's sparklines)."""
        return self.controller.history

    # -- managing ----------------------------------------------------------------------------

    def status(self) -> list[RankState]:
        """Each rank's state: pid, host, device, idle/busy/dead, last heartbeat."""
        return [self.controller.ranks[r] for r in self._ranks]

    def hosts(self) -> list[HostLink]:
        """The hosts of a mesh across hosts (empty on one host): address, agent pid, ranks,
        round trip, last heartbeat and state (ok, suspect, lost)."""
        network = self.controller.network
        return [network.links[h] for h in sorted(network.links)] if network is not None else []

    def job(self) -> Any:
        """The Slurm job the mesh runs in (``JobInfo``: id, state, nodes, time left, e.g.
        ``"1:52:10"``; ``str()`` of it reads "Slurm job 123: RUNNING on h[1-2], 1:52:10 left"),
        or None for a mesh started otherwise."""
        return self.controller.launcher.job()

    def interrupt(self, ranks: Sequence[int] | str | int | None = None) -> None:
        """SIGINT to the selected ranks: running user code raises ``KeyboardInterrupt``. The
        dead among them are skipped; a :class:`MeshError` if every one is dead."""
        self.controller.interrupt(self.living(ranks, "interrupt"))

    def stop(self, *, replaced: bool = False) -> None:
        """Stop the whole mesh (every rank and agent), not only this view's ranks. ``replaced``:
        a new mesh takes its place (``%mesh restart``), and its handles say to take that one."""
        self.controller.stop(REPLACED if replaced else USER_STOP)

    def __enter__(self) -> "Mesh":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self.stopped else "running"
        view = "" if len(self._ranks) == self.world_size else f", ranks {self._ranks}"
        named = "" if self.name == "mesh" else f"{self.name!r} "
        kept = f", kept as {self.kept_id}" if self.kept_id is not None else ""
        return f"<Mesh {named}{self.topology.describe()}{view}{kept}: {state}>"


def _describe_code(code: str) -> str:
    first = next((line.strip() for line in code.splitlines() if line.strip()), "")
    return f"run({first[:40] + ('...' if len(first) > 40 else '')!r})"


def _name_of(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__

