"""Actor meshes seen from the notebook: spawn, endpoint calls, futures and supervision.

>>> policy = gens.spawn("policy", Policy, 64)        # one Policy per rank of `gens`
>>> policy.generate.call(x).result()                 # RankValues, every rank
>>> policy.generate.choose(x).result()               # one value, from the least busy rank
>>> policy.slice(rank=0).generate.call_one(x).result()
>>> trainer.sync.call(policy)                         # a handle as an argument: rank to rank

A call is one request on the ranks' main channel (``ACTOR``), in order with cells, so it is
a :class:`~meshbook.mesh.controller.core.run.Run` like a cell's: output, interrupts, stacks and the
grouped :class:`~meshbook.RemoteError` work the same. An :class:`ActorMesh` is a view (a set of
ranks) over an :class:`ActorState` shared by every slice of one actor mesh.

``choose`` picks by what the controller knows: the rank with the fewest requests queued on
its main thread, taking turns among equals. ``broadcast`` keeps its run, and the next call on
the actor mesh raises its failure (and prints its output) before anything new is sent.

**Supervision.** An endpoint that raises fails that call only. A rank that dies fails every
call pending on it (the controller does that for every run) and marks the actor mesh failed:
every call then raises, saying to restart the rank and ``respawn()``. Supervisors given at
spawn (a notebook callable, or an actor mesh with a ``__supervise__`` endpoint) receive a
:class:`~meshbook.mesh.protocol.actors.SupervisionEvent`.

A handle passed to an endpoint pickles to its :class:`~meshbook.mesh.protocol.actors.ActorAddress`
(each rank reported its own at spawn), rebuilt on the receiving rank by
:func:`meshbook.mesh.rank.ops.actor_handle`.
"""

from __future__ import annotations

import itertools
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

from ...protocol import messages as msg
from ...protocol import wire
from ...protocol.actors import (
    Actor,
    ActorAddress,
    ActorFuture,
    ActorView,
    Peer,
    SupervisionEvent,
    endpoints_of,
    methods_of,
)
from ...protocol.cell import code_places
from ...protocol.errors import MeshError, MeshTimeout, RemoteError, SendError
from ...protocol.events import Error, Result
from ...protocol.namespaces import SEEDED
from ...protocol.text import format_ranks, restart_hint
from ...protocol.values import RankValues
from ...rank import ops
from ..core.controller import Controller
from ..core.render import EventRenderer
from .view import MeshView


@dataclass(eq=False)
class ActorState:
    """One actor mesh: what it was spawned from, where its actors are, whether it failed."""

    mesh: MeshView
    name: str
    cls: type
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    peers: dict[int, Peer] = field(default_factory=dict)
    #: Why the actor mesh failed ("" while it works), and the ranks whose actor is gone.
    failed: str = ""
    lost: set[int] = field(default_factory=set)
    broadcasts: list["RunFuture"] = field(default_factory=list)
    supervisors: list[Any] = field(default_factory=list)
    turn: "itertools.count[int]" = field(default_factory=itertools.count)
    #: Found on the ranks when this kernel attached the kept mesh (see :func:`adopt`): its
    #: constructor's arguments stayed with the kernel that spawned it.
    adopted: bool = False

    @property
    def controller(self) -> Controller:
        return self.mesh.controller


#: How long attaching waits for the ranks to list their actors (control threads answer at once).
ADOPT_TIMEOUT_S = 30.0

#: Each running controller's actor meshes by name (a stopped one's are dropped at the next
#: look: the handles a user still holds keep theirs, and say the mesh is stopped).
_actors: dict[Controller, dict[str, ActorState]] = {}


def _registry() -> dict[Controller, dict[str, ActorState]]:
    for controller in [c for c in _actors if c.stopped]:
        del _actors[controller]
    return _actors


def actor_meshes(mesh: MeshView) -> dict[str, "ActorMesh"]:
    """The actor meshes spawned on ``mesh``'s mesh, by name."""
    return {name: ActorMesh(state) for name, state in _registry().get(mesh.controller, {}).items()}


def spawn(mesh: MeshView, name: str, cls: type, *args: Any, supervisor: Any = None, **kwargs: Any) -> "ActorMesh":
    """Build ``cls(*args, **kwargs)`` on every rank of ``mesh`` as actor ``name``."""
    controller = mesh.controller
    controller.check_usable(mesh.ranks)
    _check_spawn(controller, name, cls, supervisor)
    state = ActorState(mesh, name, cls, args, dict(kwargs), supervisors=[supervisor] if supervisor else [])
    _spawn_on(state, mesh.ranks)
    return _register(state)


def adopt(mesh: MeshView) -> list[str]:
    """Handles for the actors living on ``mesh``'s ranks, which a kernel before this one
    spawned (this kernel attached the kept mesh): each becomes one of ``mesh.actors()``,
    its class as the ranks have it. Returns their names."""
    controller = mesh.controller
    living = controller.live(mesh.ranks)
    if not living:
        return []
    found: dict[str, dict[int, tuple[type, Peer, list[int]]]] = {}
    asked = controller.call(ops.actors_living, ranks=living, what="the actors living there")
    try:
        answers = asked.result(timeout=ADOPT_TIMEOUT_S, echo=False)
    except (RemoteError, MeshTimeout) as exc:  # the mesh is attached all the same: say what is missing
        answers = asked.values()
        print(f"meshbook: the actors living on rank(s) {format_ranks(sorted(set(living) - set(answers)))} have no "
              f"handle in this kernel: {exc}".splitlines()[0], file=sys.stderr)
    for rank, actors in answers.items():
        for name, found_here in actors.items():
            found.setdefault(name, {})[rank] = found_here
    for name, where in sorted(found.items()):
        living_here = sorted(where)
        cls = where[living_here[0]][0]
        spawned = sorted(set(living_here).union(*(on for _, _, on in where.values())))
        state = ActorState(mesh.narrow(spawned), name, cls, (), {}, {r: peer for r, (_, peer, _) in where.items()},
                           adopted=True)
        lost = [r for r in spawned if r not in where]  # died or restarted while no kernel was attached
        if lost:
            state.lost.update(lost)
            state.failed = f"rank(s) {format_ranks(lost)} lost it while no kernel was attached"
        _register(state)
    return sorted(found)


def _register(state: ActorState) -> "ActorMesh":
    controller = state.controller
    registry = _registry().setdefault(controller, {})
    if not registry:  # this dict, not a lookup: a stopped controller's entry leaves the registry first
        controller.add_death_listener(lambda rank, cause: _rank_died(controller, registry, rank, cause))
        controller.add_stop_listener(lambda: _mesh_stopped(controller, registry))
    registry[state.name] = state
    return ActorMesh(state)


def _check_spawn(controller: Controller, name: str, cls: type, supervisor: Any) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise MeshError(f"actor name {name!r}: give a Python identifier (the actor is a variable of each "
                        f"rank's namespace under that name)")
    if name in SEEDED:
        raise MeshError(f"actor name {name!r}: meshbook sets it on every rank ({', '.join(sorted(SEEDED))}), "
                        f"and the actor would replace it there; pick another name")
    if name in _registry().get(controller, {}):
        raise MeshError(f"an actor named {name!r} already lives on this mesh: pick another name")
    if not isinstance(cls, type) or not issubclass(cls, Actor):
        raise MeshError(f"spawn() needs a subclass of meshbook.Actor, got {cls!r}")
    if not endpoints_of(cls):
        raise MeshError(f"{cls.__qualname__} has no endpoint: mark the methods others call with "
                        f"@meshbook.endpoint")
    hidden = sorted(set(endpoints_of(cls)) & set(dir(ActorMesh)))
    if hidden:
        raise MeshError(f"{cls.__qualname__}: endpoint(s) {', '.join(hidden)} would hide the handle's own "
                        f"attribute(s) of that name; rename them")
    try:
        wire.dumps(cls)
    except Exception as exc:  # noqa: BLE001 - whatever pickling raises, say what
        raise SendError(f"the actor class {cls.__qualname__} cannot be sent to the ranks: {exc}. Keep "
                        f"unpicklable things (locks, open files, sockets) out of the class body; create "
                        f"them in __init__, which runs on the rank") from None
    if supervisor is not None and not callable(supervisor) and not (
            isinstance(supervisor, ActorMesh) and hasattr(supervisor.state.cls, msg.SUPERVISE)):
        raise MeshError("supervisor= takes a function of the failure event, or an actor mesh whose class "
                        "defines __supervise__(self, event)")


def _spawn_on(state: ActorState, ranks: list[int]) -> None:
    body = {"actor": state.name, "cls": state.cls, "args": state.args, "kwargs": state.kwargs,
            "code": code_places(methods_of(state.cls)), "ranks": state.mesh.ranks}
    run = state.controller.submit(msg.ACTOR, body, ranks, f"spawn {state.name} ({state.cls.__qualname__})",
                                  noun="spawn")
    try:
        peers = run.result()
    except BaseException:  # a failure on some ranks, or an interrupt during a slow __init__
        done = list(run.values())
        if done:  # all or nothing: no rank keeps half an actor mesh
            state.controller.call(ops.drop_actor, state.name, ranks=done, what="drop_actor").wait(10)
        raise
    state.peers.update(peers)


def _rank_died(controller: Controller, registry: dict[str, ActorState], rank: int, cause: str) -> None:
    """A death listener (the receiver thread): fail the actor meshes living on ``rank``."""
    for state in list(registry.values()):
        if rank not in state.peers:
            continue
        state.lost.add(rank)
        state.failed = state.failed or f"rank {rank} died ({cause})"
        _tell(state, SupervisionEvent(controller.name, state.name, rank, f"died ({cause})"))


def _mesh_stopped(controller: Controller, registry: dict[str, ActorState]) -> None:
    """A stop listener: every actor mesh of ``controller`` is gone with it. Its supervisors
    hear it once, except those living on the same mesh (stopped too). A kept mesh this kernel
    let go of (detached) keeps its actors: nothing failed."""
    if controller.detached:
        return
    for state in list(registry.values()):
        _tell(state, SupervisionEvent(controller.name, state.name, None, f"stopped ({controller.stop_reason})"),
              gone=controller)


def _tell(state: ActorState, event: SupervisionEvent, gone: Controller | None = None) -> None:
    """``event`` to each of ``state``'s supervisors, each on a thread of its own (an actor
    supervisor answers through the receiver this may run on); none on mesh ``gone``."""
    for supervisor in state.supervisors:
        if isinstance(supervisor, ActorMesh) and supervisor.state.controller is gone:
            continue
        threading.Thread(target=_supervise, args=(supervisor, event), daemon=True).start()


def _supervise(supervisor: Any, event: SupervisionEvent) -> None:
    try:
        if isinstance(supervisor, ActorMesh):
            supervisor.submit_call(msg.SUPERVISE, supervisor.ranks, (event,), {}, False).result()
        else:
            supervisor(event)
    except Exception as exc:  # noqa: BLE001 - a failing supervisor must not end the receiver
        print(f"meshbook: the supervisor of actor {event.actor!r} failed on {event}: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)


class RunFuture(ActorFuture):
    """The answer to an endpoint call from the notebook: its :class:`Run`."""

    def __init__(self, run: Any, state: ActorState, one: bool) -> None:
        super().__init__(run.what, one)
        self.run = run
        self.state = state

    def collect(self, timeout: float | None) -> RankValues:
        return self.run.result(timeout)

    def arrivals(self) -> Iterator[tuple[int, Any]]:
        renderer = EventRenderer(self.run)
        try:
            for event in self.run.events():
                if isinstance(event, Result):
                    yield event.rank, event.value
                elif isinstance(event, Error):
                    yield event.rank, event.failure
                else:
                    renderer.feed([event])
        except KeyboardInterrupt:  # Ctrl-C while waiting stops the endpoint too, as in result()
            self.interrupt()
            raise
        finally:
            renderer.close()

    def done(self) -> bool:
        return self.run.done()

    def wait(self, timeout: float | None = None) -> bool:
        return bool(self.run.wait(timeout))

    def forget(self) -> None:
        self.state.broadcasts.append(self)

    def interrupt(self) -> None:
        self.run.interrupt()

    def failed_by_deaths(self, ranks: set[int]) -> bool:
        """Whether this call ended, failing only because some of ``ranks`` died."""
        error = self.run.exception() if self.done() else None
        return error is not None and all(f.died and r in ranks for r, f in error.failures.items())


class ActorMesh(ActorView):
    """Actor ``name`` on some ranks of a mesh: ``handle.ENDPOINT.call(...)`` and friends."""

    def __init__(self, state: ActorState, ranks: list[int] | None = None) -> None:
        super().__init__(state.name, state.cls.__qualname__, endpoints_of(state.cls),
                         state.mesh.ranks if ranks is None else ranks, state.mesh.topology)
        self.state = state

    @property
    def mesh(self) -> MeshView:
        return self.state.mesh

    @property
    def failed(self) -> str:
        """Why this actor mesh failed ("" while it works)."""
        return self.state.failed

    def submit_call(self, endpoint: str, ranks: list[int], args: tuple[Any, ...], kwargs: dict[str, Any],
                    one: bool) -> RunFuture:
        self._check_usable()
        body = {"actor": self.name, "endpoint": endpoint, "args": args, "kwargs": kwargs,
                "stdin": self.state.controller.stdin_probe(), "max_bytes": self.state.controller.max_result_bytes}
        run = self.state.controller.submit(msg.ACTOR, body, ranks, f"{self.name}.{endpoint}")
        return RunFuture(run, self.state, one)

    def _check_usable(self) -> None:
        state = self.state
        if state.controller.stopped:
            state.controller.check_usable(self.ranks)  # says the mesh is stopped
        if state.failed and state.adopted:  # respawn() cannot: the arguments stayed with the kernel before
            raise MeshError(f"actor {self.name!r} failed: {state.failed}. Its constructor's arguments stayed with "
                            f"the kernel that spawned it: spawn it again under another name")
        if state.failed:
            dead = state.controller.dead(sorted(state.lost))
            restart = f"Restart the rank(s) with {restart_hint(dead)}, then" if dead else "The rank(s) were restarted:"
            raise MeshError(f"actor {self.name!r} failed: {state.failed}. {restart} {self.name}.respawn() builds "
                            f"it there again")
        finished, state.broadcasts = partition(state.broadcasts)
        for i, future in enumerate(finished):
            try:
                future.run.result()  # prints its output; raises its failure
            except RemoteError as exc:
                exc.hint = "\n".join(filter(None, [exc.hint, f"(from an earlier {future.what}.broadcast(...); "
                                                              f"nothing new was sent)"]))
                state.broadcasts = finished[i + 1:] + state.broadcasts  # the next call says theirs
                raise

    def pick_rank(self) -> int:
        controller = self.state.controller
        turn = next(self.state.turn) % len(self.ranks)
        order = self.ranks[turn:] + self.ranks[:turn]
        return min(order, key=controller.queued)

    def narrow_to(self, ranks: list[int]) -> "ActorMesh":
        return ActorMesh(self.state, ranks)

    def respawn(self) -> "ActorMesh":
        """Build the actor again on the ranks that lost it (restart them first)."""
        state = self.state
        lost = sorted(state.lost)
        if not lost:
            raise MeshError(f"actor {self.name!r} lost no rank: nothing to respawn")
        if state.adopted:
            raise MeshError(f"actor {self.name!r} was spawned by the kernel before this one attached the mesh, "
                            f"and its constructor's arguments stayed there: spawn it again under another name")
        dead = state.controller.dead(lost)
        if dead:
            raise MeshError(f"rank(s) {format_ranks(dead)} of actor {self.name!r} are still dead: restart them "
                            f"first with {restart_hint(dead)}")
        _spawn_on(state, lost)
        # A broadcast that failed only by these deaths was answered with them: the deaths failed
        # the actor mesh, and restart + respawn are the answer. Raised by the next call, it
        # would fail a call to working actors, and send nothing.
        state.broadcasts = [f for f in state.broadcasts if not f.failed_by_deaths(state.lost)]
        state.lost.clear()
        state.failed = ""
        return self

    def address(self) -> ActorAddress:
        """What a rank needs to call these actors directly."""
        controller = self.state.controller
        return ActorAddress(controller.name, self.name, self.cls_name, self.endpoints, tuple(self.ranks),
                            self.topology, controller.wire.key, {r: self.state.peers[r] for r in self.ranks})

    def __reduce__(self) -> tuple[Any, ...]:
        return (ops.actor_handle, (self.address(),))

    def __repr__(self) -> str:
        state = ("its mesh is stopped" if self.state.controller.stopped else
                 f"failed: {self.failed}" if self.failed else "ok")
        return (f"<ActorMesh {self.name!r} ({self.cls_name}) on mesh {self.state.controller.name!r}, "
                f"ranks {format_ranks(self.ranks)}: {state}>")


def partition(broadcasts: list["RunFuture"]) -> tuple[list["RunFuture"], list["RunFuture"]]:
    """(finished, still running), each future asked once: one that finishes in between is in
    exactly one list, so its failure is neither raised twice nor lost."""
    done = [(f, f.done()) for f in broadcasts]
    return [f for f, d in done if d], [f for f, d in done if not d]
