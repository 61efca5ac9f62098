"""Actors: what the notebook, the ranks and their handles share.

An **actor** is an instance of an :class:`Actor` subclass living on each rank of a mesh (one
per rank), next to the ``%%mesh`` namespace; its ``@endpoint`` methods are what others call.
The class is usually defined in a notebook cell and travels by value (cloudpickle); this
module is what it inherits from, so it must load on a rank without the controller.

A handle on an actor mesh has one face wherever it is used, in the notebook (the
controller's ``ActorMesh``) or on a rank that received it as an argument (the rank's
``RemoteActor``): ``handle.endpoint.call/call_one/choose/broadcast/stream(...)`` and
``handle.slice(...)``. That face is :class:`ActorView` and :class:`EndpointRef` here; each side
supplies how a call is sent (through the controller, or rank to rank) and a
:class:`ActorFuture` for its answer.

A handle travels as an :class:`ActorAddress`: the target mesh's key and, per rank, a
:class:`Peer` (the address of the rank's request socket, its pid and host), which the rank
itself reported when the actor was spawned. An address is whatever the rank binds, so a mesh
over several hosts only has to report a network address there.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterator, Sequence

from .errors import MeshError, MeshTimeout, RankFailure, RemoteError
from .text import format_ranks
from .topology import DimSelector, Topology, resolve
from .values import RankValues

#: Marks a method as an endpoint (``@endpoint``).
ENDPOINT_MARK = "__meshbook_endpoint__"


def endpoint(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Make an actor method callable from the notebook and from other actors. An ``async def``
    one is awaited on its rank's event loop; a generator cannot be one (a call answers once)."""
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(f"@endpoint {getattr(fn, '__qualname__', fn)!r} is a generator: a call answers with "
                        f"one value, so return them all (a list), or call it once per item")
    setattr(fn, ENDPOINT_MARK, True)
    return fn


#: Where this process sits in its mesh, once it hosts actors (set by the rank).
_place: dict[str, Any] = {}


def set_place(rank: int, world_size: int, coords: dict[str, int]) -> None:
    """Tell the actors of this process which rank they live on (the rank calls it)."""
    _place.update(rank=rank, world_size=world_size, coords=dict(coords))


class Actor:
    """Base class of actors: subclass it, mark methods with ``@meshbook.endpoint``, and
    ``mesh.spawn("name", MyActor, *args)`` builds one instance per rank of ``mesh``.

    Endpoints run on the rank's main thread, in order with ``%%mesh`` cells, so a stuck
    endpoint shows in ``%mesh stacks`` and an interrupt stops it like a cell. An optional
    ``__supervise__(self, event)`` endpoint receives :class:`SupervisionEvent` s of the actor
    meshes this one supervises (``spawn(..., supervisor=handle)``).
    """

    @property
    def rank(self) -> int:
        """The rank this actor lives on."""
        return int(_place["rank"])

    @property
    def world_size(self) -> int:
        return int(_place["world_size"])

    @property
    def coords(self) -> dict[str, int]:
        """This rank's coordinates in its mesh's named dimensions."""
        return dict(_place["coords"])


def methods_of(cls: type) -> Iterator[tuple[str, Any]]:
    """(``Class.method``, function) for the functions ``cls`` defines or inherits, up to
    :class:`Actor`: what a spawn renames back to the file it came from (cloudpickle sends
    code as ``<dynamic-code>``)."""
    for klass in cls.__mro__:
        if klass in (Actor, object):
            continue
        for name, value in vars(klass).items():
            if hasattr(value, "__code__"):
                yield f"{klass.__qualname__}.{name}", value


def endpoints_of(cls: type) -> tuple[str, ...]:
    """The names of ``cls``'s endpoints (its own and inherited), sorted."""
    return tuple(sorted(name for name in dir(cls)
                        if callable(getattr(cls, name, None)) and getattr(getattr(cls, name), ENDPOINT_MARK, False)))


@dataclass(frozen=True)
class Peer:
    """How to reach the actors of one rank: the address of its request socket (its main
    thread, in order with cells), its pid (liveness, and its shared memory), its host, and
    its control socket (to stop a call the caller gave up on)."""

    address: str
    pid: int
    host: str
    control: str


@dataclass(frozen=True)
class ActorAddress:
    """A handle as it travels: everything a rank needs to call the actor mesh directly."""

    mesh: str
    name: str
    cls_name: str
    endpoints: tuple[str, ...]
    ranks: tuple[int, ...]
    topology: Topology
    key: bytes = field(repr=False)
    peers: dict[int, Peer] = field(repr=False)


@dataclass(frozen=True)
class SupervisionEvent:
    """An actor mesh failed: a rank it lives on died (``rank``), or its whole mesh stopped
    (``rank`` None: every actor of it is gone)."""

    mesh: str
    actor: str
    rank: int | None
    cause: str

    def __str__(self) -> str:
        where = f"rank {self.rank}" if self.rank is not None else "its mesh"
        return f"actor {self.actor!r} on mesh {self.mesh!r} failed: {where} {self.cause}"


class NoEndpointError(MeshError, AttributeError):
    """The actor has no endpoint of that name (an ``AttributeError`` too, for ``hasattr``)."""


class ActorFuture:
    """The answer to an endpoint call: ``result(timeout)``, or ``await`` it in an async cell.

    ``call`` answers a :class:`~meshbook.RankValues`; ``call_one`` and ``choose`` answer the
    one rank's value. A failure raises the same grouped :class:`~meshbook.RemoteError` as a
    cell. Subclasses say how to wait (``collect``) and what arrived (``arrivals``).
    """

    def __init__(self, what: str, one: bool) -> None:
        self.what = what
        self.one = one

    def collect(self, timeout: float | None) -> RankValues:
        """Every rank's value, waiting ``timeout`` s at most; a failure raises RemoteError."""
        raise NotImplementedError

    def arrivals(self) -> Iterator[tuple[int, Any]]:
        """(rank, value or RankFailure) in arrival order, blocking until all arrived."""
        raise NotImplementedError

    def done(self) -> bool:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> bool:
        raise NotImplementedError

    def forget(self) -> None:
        """Nobody waits for this call (``broadcast``): say how its failure is reported."""
        raise NotImplementedError

    def interrupt(self) -> None:
        """Stop the call on the ranks still running it: a wait the user gives up on (Ctrl-C,
        a cancelled ``await``) must not leave the endpoint running there."""
        raise NotImplementedError

    def result(self, timeout: float | None = None) -> Any:
        """Wait (``timeout`` seconds at most: :class:`~meshbook.MeshTimeout`, the call goes on)."""
        values = self.collect(timeout)
        return next(iter(values.values())) if self.one else values

    def exception(self, timeout: float | None = None) -> RemoteError | None:
        try:
            self.result(timeout)
        except RemoteError as exc:
            return exc
        return None

    def stream(self) -> Iterator[tuple[int, Any]]:
        """(rank, value) as each rank answers; failures raise at the end, grouped."""
        failures: dict[int, RankFailure] = {}
        values: dict[int, Any] = {}
        for rank, value in self.arrivals():
            if isinstance(value, RankFailure):
                failures[rank] = value
            else:
                values[rank] = value
                yield rank, value
        if failures:
            raise RemoteError(failures, partial=RankValues(values))

    def __await__(self) -> Generator[Any, None, Any]:
        import asyncio  # only in an async cell

        loop = asyncio.get_running_loop()
        arrived = loop.create_future()

        def settle() -> None:
            if not arrived.done():
                arrived.set_result(None)

        def waiter() -> None:
            self.wait()
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits any more
                loop.call_soon_threadsafe(settle)

        threading.Thread(target=waiter, name="meshbook-await", daemon=True).start()
        try:
            yield from arrived.__await__()
        except (asyncio.CancelledError, KeyboardInterrupt):  # e.g. Ctrl-C: asyncio.run cancels the task
            self.interrupt()  # nobody waits any more: stop the endpoint too, as result() does
            raise
        return self.result()

    def __repr__(self) -> str:
        return f"<ActorFuture {self.what}: {'done' if self.done() else 'running'}>"


class ActorView:
    """A set of ranks of one actor mesh; ``view.ENDPOINT`` is an :class:`EndpointRef`.

    Subclasses send the calls (:meth:`submit_call`) and build narrower views (:meth:`narrow_to`).
    """

    def __init__(self, name: str, cls_name: str, endpoints: Sequence[str], ranks: Sequence[int],
                 topology: Topology) -> None:
        self.name = name
        self.cls_name = cls_name
        self.endpoints = tuple(endpoints)
        self.ranks = list(ranks)
        self.topology = topology

    def submit_call(self, endpoint: str, ranks: list[int], args: tuple[Any, ...], kwargs: dict[str, Any],
                    one: bool) -> ActorFuture:
        """Call ``endpoint`` on ``ranks``; ``one``: the future answers one value."""
        raise NotImplementedError

    def pick_rank(self) -> int:
        """The rank ``choose`` sends to."""
        raise NotImplementedError

    def narrow_to(self, ranks: list[int]) -> "ActorView":
        raise NotImplementedError

    def slice(self, rank: int | Sequence[int] | None = None, **where: DimSelector) -> "ActorView":
        """The actors on some ranks: ``slice(rank=0)``, ``slice(rank=[0, 2])`` or by mesh
        dimension, ``slice(dp=0)``."""
        if rank is None and not where:
            raise MeshError("slice() needs rank= or a mesh dimension, e.g. slice(rank=0) or slice(dp=0)")
        return self.narrow_to(resolve(self.topology, rank, where or None, self.ranks))

    def __getattr__(self, name: str) -> "EndpointRef":
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self.endpoints:
            known = ", ".join(self.endpoints) or "none"
            raise NoEndpointError(f"actor {self.name!r} ({self.cls_name}) has no endpoint {name!r}; its "
                                  f"endpoints: {known}. Mark a method with @meshbook.endpoint to call it")
        return EndpointRef(self, name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self.endpoints))


class EndpointRef:
    """One endpoint of an actor view: the ways to call it."""

    def __init__(self, view: ActorView, name: str) -> None:
        self.view = view
        self.name = name

    def call(self, *args: Any, **kwargs: Any) -> ActorFuture:
        """Every actor of the view; ``.result()`` is a :class:`~meshbook.RankValues`."""
        return self.view.submit_call(self.name, self.view.ranks, args, kwargs, False)

    def call_one(self, *args: Any, **kwargs: Any) -> ActorFuture:
        """The one actor of a singleton view (``slice(rank=0)``); ``.result()`` is its value."""
        if len(self.view.ranks) != 1:
            raise MeshError(f"call_one() needs a single actor, and {self.view.name!r} here spans ranks "
                            f"{format_ranks(self.view.ranks)}: narrow it with .slice(rank=...), or use "
                            f"call() or choose()")
        return self.view.submit_call(self.name, self.view.ranks, args, kwargs, True)

    def choose(self, *args: Any, **kwargs: Any) -> ActorFuture:
        """One actor, the least busy; ``.result()`` is its value."""
        return self.view.submit_call(self.name, [self.view.pick_rank()], args, kwargs, True)

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Every actor, without waiting; a failure is raised by the next call on this actor
        mesh (in the notebook), or printed by the rank (between actors)."""
        self.view.submit_call(self.name, self.view.ranks, args, kwargs, False).forget()

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[tuple[int, Any]]:
        """Every actor; yields (rank, value) as each answers, failures raised at the end."""
        return self.view.submit_call(self.name, self.view.ranks, args, kwargs, False).stream()

    def __repr__(self) -> str:
        return f"<endpoint {self.view.name}.{self.name} on ranks {format_ranks(self.view.ranks)}>"


def timeout_error(what: str, pending: Sequence[int], timeout: float) -> MeshTimeout:
    return MeshTimeout(f"{what} still running on rank(s) {format_ranks(pending)} after {timeout:g} s; it "
                       f"keeps running: wait again with .result()")
