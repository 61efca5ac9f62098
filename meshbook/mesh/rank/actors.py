"""Actors inside a rank: the registry, endpoint calls, and calls to other ranks' actors.

**Hosting.** :class:`ActorHost` (``worker.actors``) keeps this rank's actors by name and serves
``ACTOR`` requests from the controller (spawn, call) and ``PEER`` requests from other ranks, on
the main thread, in order with cells: a stuck endpoint shows in ``%mesh stacks`` and stops on
an interrupt like a stuck cell. An actor is also a variable of the rank's namespace under its
name, so a ``%%mesh`` cell on that mesh sees it and ``%mesh who`` lists it. The answer to a
``PEER`` call goes straight back to the calling rank (:meth:`ActorHost.reply`), never through
the notebook.

**Calling.** A handle on an actor mesh that reached this rank as an argument (or a push) is a
:class:`RemoteActor`. Its calls leave from this process, signed with the target mesh's key,
straight to each target rank's request socket (its ``Peer.address``): the target mesh's
private runtime directory is open to this user only, and a message without the key is dropped
there. Arguments are pickled once; when every target is on this host their tensors go into one
memfd the targets map through ``/proc/<pid>/fd`` (:mod:`meshbook.mesh.protocol.payload`): one
copy, however many targets. Answers come back on a reply socket this process binds in its own
mesh's runtime directory, one per target mesh (each verified with that mesh's key). A target
that dies fails the call within a quarter of a second (its pid is checked while waiting).

Both addresses are ``ipc://`` paths and liveness is a pid: a call from one host to an actor on
another is refused with a clear error (call it from the notebook, which reaches every host),
never queued where nothing listens.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
import secrets
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import zmq

from ..protocol import messages as msg
from ..protocol import wire
from ..protocol.actors import (
    ENDPOINT_MARK,
    Actor,
    ActorAddress,
    ActorFuture,
    ActorView,
    Peer,
    methods_of,
    set_place,
    timeout_error,
)
from ..protocol.cell import place_code
from ..protocol.errors import MeshError, RankFailure, RemoteError
from ..protocol.payload import Payload, Segments, pickled, worth_sharing
from ..protocol.proc import pid_alive
from ..protocol.text import format_ranks
from ..protocol.values import RankValues
from .devices import on_device

if TYPE_CHECKING:
    from .context import RankContext

#: How often a caller waiting for answers checks that its targets are still alive.
LIVENESS_S = 0.25

_host: "ActorHost | None" = None


class ActorHost:
    """This rank's actors, and its end of rank-to-rank calls."""

    def __init__(self, worker: "RankContext") -> None:
        global _host
        self.worker = worker
        self.actors: dict[str, Actor] = {}
        #: The ranks each actor's mesh was spawned on (by name): told to a kernel that attaches.
        self.spawned_on: dict[str, list[int]] = {}
        self._replies: dict[str, zmq.Socket] = {}  # a caller's reply address -> our PUSH to it
        #: PEER request -> the note that its arguments' shared memory is unmapped again.
        self._released: dict[int, list[Any]] = {}
        self._ctx: zmq.Context | None = None
        self.client: PeerClient | None = None
        _host = self

    def context(self) -> zmq.Context:
        if self._ctx is None:
            self._ctx = zmq.Context()
        return self._ctx

    # -- serving (main thread) ------------------------------------------------------------

    def serve(self, body: dict[str, Any], request: int) -> Any:
        """An ``ACTOR`` or ``PEER`` request: spawn an actor, or call one of its endpoints."""
        if "cls" in body:
            return self.spawn(body)
        name, endpoint = body["actor"], body["endpoint"]
        actor = self.actors.get(name)
        if actor is None:
            raise LookupError(f"no actor {name!r} lives on rank {self.worker.rank}: the rank was restarted "
                              f"since it was spawned (respawn() it), or it was never spawned here")
        method = getattr(type(actor), endpoint, None)
        if not getattr(method, ENDPOINT_MARK, False) and endpoint != msg.SUPERVISE:
            raise AttributeError(f"{type(actor).__qualname__} has no endpoint {endpoint!r}")
        if "payload" not in body:
            return self._run(getattr(actor, endpoint), body["args"], body["kwargs"])
        values, release = body["payload"].open()
        args, kwargs = values["args"], values["kwargs"]
        del values
        try:
            return self._run(getattr(actor, endpoint), args, kwargs)
        finally:
            # The last references to the mapped tensors, unless the actor kept one: without
            # them the mapping goes, and the caller writes its next call into the same memory.
            del args, kwargs
            if release():  # signed now, so it is numbered before the answer it precedes
                note = {msg.KIND: msg.RELEASED, msg.ID: request, msg.RANK: self.worker.rank}
                self._released[request] = self.worker.wire.pack(note)

    def _run(self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``function(*args, **kwargs)`` as user code, its tensors moved to this rank's device;
        an ``async def`` endpoint's coroutine is run to its end on the rank's event loop, as a
        cell's top-level ``await`` is."""
        args, kwargs = on_device((args, kwargs), self.worker.device)
        with self.worker.user_code():
            value = function(*args, **kwargs)
            return self.worker.run_awaitable(value) if inspect.iscoroutine(value) else value

    def spawn(self, body: dict[str, Any]) -> Peer:
        """Build this rank's instance of an actor; answer how other ranks reach it."""
        name, cls = body["actor"], body["cls"]
        if name in self.actors:
            raise ValueError(f"an actor named {name!r} already lives on this rank: mesh.actors()[{name!r}] is its "
                             f"handle, or pick another name")
        if name in self.worker.namespace:
            held = type(self.worker.namespace[name])
            raise ValueError(f"this rank has a variable {name!r} (a {held.__module__}.{held.__qualname__}), which "
                             f"the actor would replace: pick another actor name, or `del {name}` on the ranks "
                             f"(%%mesh) first")
        place_code(methods_of(cls), body["code"])
        cfg = self.worker.cfg
        set_place(self.worker.rank, cfg.topology.world_size, cfg.topology.coords(self.worker.rank))
        instance = self._run(cls, body["args"], body["kwargs"])
        self.actors[name] = instance
        self.spawned_on[name] = list(body.get("ranks", [self.worker.rank]))
        self.worker.namespace[name] = instance
        return self._peer()

    def _peer(self) -> Peer:
        cfg = self.worker.cfg
        return Peer(cfg.request_addr, os.getpid(), socket.gethostname(), cfg.control_addr)

    def living(self) -> dict[str, tuple[type, Peer, list[int]]]:
        """Each actor living here: its class, how to reach it and the ranks its actor mesh was
        spawned on (a kernel that attached this kept mesh rebuilds its handles from them, and
        tells which ranks lost theirs meanwhile)."""
        peer = self._peer()  # every actor of this rank is reached the same way
        return {name: (type(actor), peer, self.spawned_on.get(name, [self.worker.rank]))
                for name, actor in list(self.actors.items())}

    def drop(self, name: str) -> bool:
        """Forget actor ``name`` (and its namespace variable, if still the actor)."""
        self.spawned_on.pop(name, None)
        actor = self.actors.pop(name, None)
        if actor is not None and self.worker.namespace.get(name) is actor:
            del self.worker.namespace[name]
        return actor is not None

    def reply(self, message: wire.Message, frames: list[Any]) -> None:
        """Send the answer of a ``PEER`` call to the rank that made it (main thread), after
        saying whether the call's shared memory may be reused."""
        address, pid = message.header[msg.REPLY_TO]
        sock = self._replies.get(address)
        if sock is None:
            sock = self._replies[address] = self.context().socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(address)
        note = self._released.pop(message.header[msg.ID], None)
        if note is not None:
            sock.send_multipart(note)
        tracker = wire.send_tracked(sock, frames)
        # The caller may change the tensors it gets: wait until ZeroMQ let go of ours, unless
        # the caller died meanwhile (then nothing will ever take them).
        while not tracker.done and pid_alive(pid):
            with contextlib.suppress(zmq.NotDone):
                tracker.wait(LIVENESS_S)


class PeerClient:
    """This process's calls to other ranks' actors, one :class:`_Link` per target mesh."""

    def __init__(self, host: ActorHost) -> None:
        self.host = host
        self._links: dict[bytes, _Link] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def link(self, key: bytes) -> "_Link":
        with self._lock:
            link = self._links.get(key)
            if link is None:
                link = self._links[key] = _Link(self.host, key)
            return link

    def send(self, address: ActorAddress, endpoint: str, ranks: list[int], args: tuple[Any, ...],
             kwargs: dict[str, Any], one: bool) -> "PeerFuture":
        own = self.host.worker.cfg.request_addr
        if any(address.peers[r].address == own for r in ranks):
            raise MeshError(f"{address.name}.{endpoint}: an actor cannot call an actor on its own rank and wait: "
                            f"both run on the rank's one main thread. Call it from the notebook, or from an "
                            f"actor on another rank")
        # Negative: never one of the controller's; with our pid: never another caller's (a call
        # stopped by its number must be this one; callers share a host, see _Link.send).
        request = -((os.getpid() << 32) + next(self._ids))
        return self.link(address.key).send(request, address, endpoint, ranks, args, kwargs, one)


class _Link:
    """Calls to the ranks of one target mesh: a wire with its key, and our reply socket."""

    def __init__(self, host: ActorHost, key: bytes) -> None:
        ctx = host.context()
        self.wire = wire.Wire(key)
        self.rank = host.worker.rank
        self.replies = ctx.socket(zmq.PULL)
        self.replies.setsockopt(zmq.RCVHWM, 0)
        self.address = f"ipc://{host.worker.cfg.rundir}/p{os.getpid()}-{secrets.token_hex(4)}"
        self.replies.bind(self.address)
        self._ctx = ctx
        self._socks: dict[str, zmq.Socket] = {}
        self._send_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self.pending: dict[int, PeerFuture] = {}
        self.segments = Segments()
        self.host = host
        self._handlers: dict[str, Callable[[PeerFuture, wire.Message], None]] = {
            msg.RESULT: self._on_answer, msg.ERROR: self._on_answer, msg.RELEASED: self._on_released}

    def send(self, request: int, address: ActorAddress, endpoint: str, ranks: list[int],
             args: tuple[Any, ...], kwargs: dict[str, Any], one: bool) -> "PeerFuture":
        here = socket.gethostname()
        peers = {r: address.peers[r] for r in ranks}
        what = f"{address.name}.{endpoint}"
        away = sorted(r for r, p in peers.items() if p.host != here)
        if away:
            raise MeshError(f"{what}: rank(s) {format_ranks(away)} of {address.name!r} live on another host "
                            f"than this rank ({here}); actors call each other on one host only, so far: "
                            f"call it from the notebook, which reaches every host")
        body, views, buffers = pickled({"args": args, "kwargs": kwargs}, what)
        segment = None
        if all(p.host == here for p in peers.values()) and worth_sharing(views):
            payload, segment = self.segments.share(body, views)
        else:
            payload = Payload(body, buffers)
        future = PeerFuture(self, request, peers, address, what, one, segment)
        self.pending[request] = future
        header = {msg.KIND: msg.PEER, msg.ID: request, msg.RANK: self.rank,
                  msg.REPLY_TO: (self.address, os.getpid())}
        frames = self.wire.pack(header, {"actor": address.name, "endpoint": endpoint, "payload": payload})
        with self._send_lock:
            for peer in peers.values():
                self._sock(peer.address).send_multipart(frames, copy=True)
        return future

    def stop(self, request: int, peers: list[Peer]) -> None:
        """Ask ``peers``' control threads to interrupt ``request`` (a caller that gave up)."""
        frames = self.wire.pack({msg.KIND: msg.PEER_STOP, msg.ID: request, msg.RANK: self.rank})
        with self._send_lock:
            for peer in peers:
                self._sock(peer.control).send_multipart(frames, copy=True)

    def _sock(self, address: str) -> zmq.Socket:
        sock = self._socks.get(address)
        if sock is None:
            sock = self._socks[address] = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        return sock

    def _on_answer(self, future: "PeerFuture", message: wire.Message) -> None:
        """A target's result or error. One this process cannot unpickle (a class of a module
        only the target imports) is that target's error: its part of the call ends, saying so."""
        header, rank = message.header, message.header[msg.RANK]
        try:
            body = message.body()
        except Exception as exc:  # noqa: BLE001 - whatever the answer's unpickling raises
            future.arrive(rank, _unreadable(rank, self.rank, header.get(msg.TYPE), exc), True)
            return
        future.arrive(rank, body, message.kind == msg.ERROR)

    @staticmethod
    def _on_released(future: "PeerFuture", message: wire.Message) -> None:
        future.released.add(message.header[msg.RANK])

    def pump(self, timeout: float) -> None:
        """Take the answers that arrive within ``timeout`` s (one reader at a time), then fail
        the calls whose target died."""
        if not self._read_lock.acquire(timeout=timeout):
            return
        try:
            if self.replies.poll(int(timeout * 1000)):
                while True:
                    try:
                        frames = wire.recv(self.replies, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        message = self.wire.unpack(frames)
                    except wire.BadMessage:
                        continue
                    handler = self._handlers.get(message.kind)
                    if handler is None:
                        self.host.worker.note_unknown(message.kind, "actor reply")
                        continue
                    future = self.pending.get(message.header[msg.ID])
                    if future is not None:  # else: a call that already failed (its target died)
                        handler(future, message)
            for future in list(self.pending.values()):
                future.check_alive()
        finally:
            self._read_lock.release()


class PeerFuture(ActorFuture):
    """The answer to a rank-to-rank call (see :class:`~meshbook.mesh.protocol.actors.ActorFuture`)."""

    def __init__(self, link: _Link, request: int, peers: dict[int, Peer], address: ActorAddress,
                 what: str, one: bool, segment: int | None) -> None:
        super().__init__(what, one)
        self.link, self.request, self.peers, self.address = link, request, peers, address
        #: The shared memory of the arguments (held until every target answered), and the
        #: targets that unmapped it again.
        self.segment = segment
        self.released: set[int] = set()
        self._arrived: list[tuple[int, Any]] = []
        self._failures: dict[int, RankFailure] = {}
        self._values: dict[int, Any] = {}
        self._forgotten = False
        self._next_check = time.monotonic() + LIVENESS_S

    def arrive(self, rank: int, value: Any, failed: bool) -> None:
        if rank not in self.peers or rank in self._values or rank in self._failures:
            return
        (self._failures if failed else self._values)[rank] = value
        self._arrived.append((rank, value))
        if self.done():
            self.link.pending.pop(self.request, None)
            if self.segment is not None:
                self.link.segments.give_back(self.segment, self.released == set(self.peers))
            if self._forgotten and self._failures:
                print(f"meshbook: {self.what}.broadcast(...) failed:\n{self._error().render()}", file=sys.stderr)

    def check_alive(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + LIVENESS_S
        for rank, peer in self.peers.items():
            if rank not in self._values and rank not in self._failures and not pid_alive(peer.pid):
                self.arrive(rank, RankFailure(rank, "RankDied", f"rank {rank} of mesh {self.address.mesh!r} "
                                              f"died (its process {peer.pid} is gone)", died="gone"), True)

    def done(self) -> bool:
        return len(self._values) + len(self._failures) == len(self.peers)

    def _wait(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            left = LIVENESS_S if deadline is None else min(LIVENESS_S, deadline - time.monotonic())
            if left <= 0:
                return False
            self.link.pump(left)
        return True

    def forget(self) -> None:
        self._forgotten = True
        threading.Thread(target=self.wait, name="meshbook-broadcast", daemon=True).start()

    def wait(self, timeout: float | None = None) -> bool:
        try:
            return self._wait(timeout)
        except KeyboardInterrupt:  # the endpoint waiting was interrupted (a Ctrl-C of its cell)
            self.interrupt()
            raise

    def interrupt(self) -> None:
        """Stop the call on the ranks still running it (or drop it where it still waits): a
        nested call must not run on after the one that made it was interrupted. Their answers
        (``KeyboardInterrupt``) are taken by this link's next wait."""
        self.link.stop(self.request, [p for r, p in self.peers.items()
                                      if r not in self._values and r not in self._failures])

    def _error(self) -> RemoteError:
        return RemoteError(dict(self._failures), partial=RankValues(self._values, self.address.topology))

    def collect(self, timeout: float | None) -> RankValues:
        if not self.wait(timeout):
            raise timeout_error(self.what, [r for r in self.peers if r not in self._values
                                            and r not in self._failures], timeout or 0.0)
        if self._failures:
            raise self._error()
        return RankValues(self._values, self.address.topology)

    def arrivals(self) -> Iterator[tuple[int, Any]]:
        index = 0
        while True:
            while index < len(self._arrived):
                yield self._arrived[index]
                index += 1
            if self.done():
                return
            try:
                self.link.pump(LIVENESS_S)
            except KeyboardInterrupt:  # as in wait: a caller that gives up stops the call
                self.interrupt()
                raise


class RemoteActor(ActorView):
    """A handle on an actor mesh, on a rank: calls go from this rank straight to the targets."""

    def __init__(self, address: ActorAddress, ranks: list[int] | None = None) -> None:
        super().__init__(address.name, address.cls_name, address.endpoints,
                         address.ranks if ranks is None else ranks, address.topology)
        self.address = address
        self._turn = itertools.count()

    def submit_call(self, endpoint: str, ranks: list[int], args: tuple[Any, ...], kwargs: dict[str, Any],
                    one: bool) -> ActorFuture:
        return _client().send(self.address, endpoint, ranks, args, kwargs, one)

    def pick_rank(self) -> int:
        """The target with the fewest calls of this process still unanswered (ties in turn)."""
        busy = dict.fromkeys(self.ranks, 0)
        for future in _client().link(self.address.key).pending.values():
            for rank in future.peers:
                if rank in busy and not future.done():
                    busy[rank] += 1
        turn = next(self._turn)
        order = self.ranks[turn % len(self.ranks):] + self.ranks[:turn % len(self.ranks)]
        return min(order, key=lambda r: busy[r])

    def narrow_to(self, ranks: list[int]) -> "RemoteActor":
        return RemoteActor(self.address, ranks)

    def __repr__(self) -> str:
        return f"<actor {self.name!r} ({self.cls_name}) of mesh {self.address.mesh!r}, ranks {self.ranks}>"


def _unreadable(rank: int, caller: int, type_name: str | None, exc: Exception) -> RankFailure:
    """An answer the calling rank cannot unpickle, as the target's error, saying what to do
    instead (worded as the notebook's, for a result it cannot read)."""
    what = f"a {type_name}" if type_name else "it"
    return RankFailure(rank, "UnreadableResult", (
        f"the result ({what}) cannot be unpickled on rank {caller}, which called it: "
        f"{type(exc).__name__}: {exc}. Return plain data instead (tensors, numbers, lists and "
        f"dicts of them), or make what it needs importable on the calling rank too"))


def _client() -> PeerClient:
    if _host is None:
        raise MeshError("this actor handle came back from a rank: call actors from the notebook with the "
                        "handle spawn() returned, or pass it to an endpoint to call it from a rank")
    if _host.client is None:
        _host.client = PeerClient(_host)
    return _host.client
