"""The controller's side of a mesh across hosts: one Curve connection per remote host agent.

Requests for the ranks of a remote host travel once per host, with a route naming the
channel and ranks; the agent fans them out (:mod:`meshbook.mesh.agent.link`). What the ranks
send comes back up the same connection, signed by the ranks, and goes through the
controller's one handler table like local traffic.

A ZeroMQ socket belongs to one thread at a time, and a connection both sends and receives, so
every link socket is owned by the controller's receiver thread: other threads hand what they
send to an in-process *outbox* that the receiver drains (one hop inside the process, a few
microseconds, and big buffers still by reference).

Liveness: the receiver pings every remote agent each second (:data:`~meshbook.mesh.protocol.config.HOST_PING_S`)
and times the answer; a host not heard from for 5 s is *suspect*, for 15 s *lost*
(configurable): its ranks are dead and the runs that waited on them fail with
"host NAME lost: ranks ...". The agent, hearing nothing for as long, stops its ranks.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import zmq

from ...protocol import config, fragments, net, wire
from ...protocol import messages as msg
from ...protocol.bodies import Bootstrap
from ...protocol.errors import MeshError
from ...protocol.ordering import Incoming, Outgoing
from ...protocol.remote import decode_seq, encode_head
from ...protocol.text import format_ranks
from ...protocol.versions import mismatch, versions


@dataclass
class HostLink:
    """A remote host agent as the controller sees it."""

    host: int
    name: str  # what the user called it (the ssh host, or the joined host's name)
    address: str  # the address the agent advertised: its interface that routes to us
    ranks: list[int]
    port: int = 0  # the port we dialled (0: it joined our ROUTER)
    #: The socket that reaches it (the ROUTER we dial every listening agent from, or the one
    #: joining agents dial into), and its routing id there ("": a socket that does not route).
    sock: zmq.Socket | None = None
    identity: bytes = b""
    agent_pid: int | None = None
    hostname: str = ""
    store_port: int = 0
    gpus: int = 0  # the GPUs its ranks see (the agent counted them)
    last_heard: float = field(default_factory=time.monotonic)
    last_ping: float = 0.0
    rtt: float | None = None
    state: str = "ok"  # ok | suspect | lost | stopped (it confirmed a stop)
    #: How far the host's wall clock runs ahead of ours (its ranks' collective times are
    #: stamped with it), from the quickest of the recent pings.
    clock_offset_ns: int = 0
    _best_ping_ns: int = 0
    #: What this side sent and the agent has not acknowledged; what it sent, in order.
    outgoing: Outgoing = field(default_factory=Outgoing)
    incoming: Incoming = field(default_factory=Incoming)
    #: What came up in fragments (a big pull), put together again.
    assembly: fragments.Assembly = field(default_factory=fragments.Assembly)
    #: The newest of our numbers the agent was told are lost (the runs on its ranks failed then).
    told_lost: int = 0

    def clocked(self, sent_ns: int, agent_ns: int, back_ns: int) -> None:
        """A ping's answer: the agent read its clock ``agent_ns`` between our ``sent_ns`` and
        ``back_ns``. The quicker the round trip, the better the estimate; older bests fade."""
        trip = back_ns - sent_ns
        if self._best_ping_ns == 0 or trip <= self._best_ping_ns:
            self._best_ping_ns = max(1, trip)
            self.clock_offset_ns = agent_ns - (sent_ns + back_ns) // 2
        else:
            self._best_ping_ns += self._best_ping_ns // 16  # a better estimate may come along

    def end(self, state: str) -> None:
        """The link is ``lost`` or ``stopped``: it keeps nothing from now on (what was kept for
        sending again, what waited behind a gap, a message half put together: a big pull from
        a host lost halfway would hold its memory until the mesh stops)."""
        self.state = state
        self.outgoing, self.incoming, self.assembly = Outgoing(), Incoming(), fragments.Assembly()

    def wholes(self, messages: list[list[Any]]) -> Iterator[list[Any]]:
        """Messages the link delivered in order, with fragments put together: what can be
        handled now."""
        for message in messages:
            whole = self.assembly.take(message)
            if whole is not None:
                yield whole

    def describe(self) -> str:
        return f"host {self.name} ({self.address}): ranks {format_ranks(self.ranks)}"

    def row(self) -> dict[str, Any]:
        """This host as a row of ``%mesh status``."""
        heard = time.monotonic() - self.last_heard
        return {"host": self.name, "address": self.address, "agent pid": self.agent_pid or "-",
                "ranks": format_ranks(self.ranks),
                "round trip": f"{self.rtt * 1000:.1f} ms" if self.rtt is not None else "-",
                "last heartbeat": f"{heard:.1f} s ago", "state": self.state}


@dataclass(frozen=True)
class Joined:
    """An agent that joined, before the controller gave it a place in the mesh."""

    identity: bytes
    address: str
    hostname: str
    pid: int
    store_port: int
    gpus: int
    versions: dict[str, str]


def refuse_other_versions(theirs: dict[str, str] | None, who: str) -> None:
    """A ``MeshError`` naming both sides and what to install when ``who`` runs other versions
    than this kernel (see :mod:`~meshbook.mesh.protocol.versions`)."""
    problem = mismatch(versions(), theirs, "this kernel", who)
    if problem:
        raise MeshError(problem)


class Network:
    """Curve keys, the allowlist, the links, and the outbox through which any thread sends."""

    def __init__(self, ctx: zmq.Context, key: bytes, suspect_s: float = config.HOST_SUSPECT_S,
                 lost_s: float = config.HOST_LOST_S, keys: tuple[net.Keys, net.Keys] | None = None,
                 epoch: int = 0, env: dict[str, str] | None = None) -> None:
        self.ctx = ctx
        self.key = key
        #: The variables the user named for the ranks (the hosts' own environment is kept).
        self.env = dict(env or {})
        self.suspect_s, self.lost_s = suspect_s, lost_s
        #: The mesh's server key (agents listen with it) and the controller's own key, the only
        #: one a listening agent admits: new, or a kept mesh's (attach) from its mesh file.
        self.server, self.me = keys or (net.Keys.new(), net.Keys.new())
        #: Sent with every message to an agent: a kept mesh's agents refuse older epochs.
        self.epoch = epoch
        self.links: dict[int, HostLink] = {}
        #: The links by the socket that reaches them and their routing id on it.
        self._routed: dict[zmq.Socket, dict[bytes, HostLink]] = {}
        #: One ROUTER dials every listening agent: the receiver then waits on one socket, not one
        #: per host, and drains every host's answers in one go. Its connections are made (and
        #: a replaced one dropped) by the receiver thread, which owns it (see ``settle``).
        self._dialler: zmq.Socket | None = None
        self._connects: list[tuple[bytes, str]] = []
        self._retired: list[str] = []
        self.router: zmq.Socket | None = None  # where joining agents dial in
        self.joined: list[Joined] = []
        self.joined_changed = threading.Condition()
        self.allowlist = net.Allowlist(set())
        self._join_key: bytes | None = None
        self._zap: net.ZapHandler | None = None
        self._outbox_in = ctx.socket(zmq.PULL)
        self._outbox_in.bind(f"inproc://outbox-{id(self)}")
        self._outbox = ctx.socket(zmq.PUSH)
        self._outbox.setsockopt(zmq.SNDHWM, 0)
        self._outbox.connect(f"inproc://outbox-{id(self)}")
        #: The link sockets the receiver thread sent on since it last looked (a send may take the
        #: signal that a message arrived: the receiver asks them before it sleeps).
        self.sent_on: set[zmq.Socket] = set()
        #: Bumped when a socket is added, so the receiver polls it too; ``wake`` tells it now.
        self.version = 0
        self.wake: Callable[[], None] = lambda: None

    # -- making links ----------------------------------------------------------------------------

    def bootstrap(self, tunnel: bool = False, **more: Any) -> Bootstrap:
        """What a listening agent is told on its ssh session's stdin (never on a command line),
        with ``more`` (a hint of our address, a kept mesh's lease and file)."""
        return Bootstrap(self.key.hex(), self.server.public.decode(), self.server.secret.decode(),
                         self.me.public.decode(), self.lost_s, tunnel, dict(self.env), **more)

    def dial(self, host: int, name: str, ranks: list[int], info: dict[str, Any], address: str,
             port: int) -> HostLink:
        """Connect to a listening agent (Curve client with the controller's key), once what it
        said of itself (``info``: its LISTENING line, or a mesh file's record) shows it runs
        what we run."""
        refuse_other_versions(info.get("versions"), f"the host agent on {name}")
        if self._dialler is None:
            self._dialler = self._new_dialler()
        endpoint, identity = net.tcp_address(address, port), os.urandom(8)
        link = HostLink(host, name, info["addr"], ranks, port=port, sock=self._dialler, identity=identity,
                        agent_pid=info.get("pid"), hostname=info.get("hostname", ""),
                        store_port=int(info.get("store_port", 0)), gpus=int(info.get("gpus", 0)))
        self._add(link)  # a link it replaces is dropped first: it may have the same address
        self._connects.append((identity, endpoint))
        self.version += 1  # the receiver makes the connection at its next turn (or send)
        self.wake()
        return link

    def _new_dialler(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        for option, value in ((zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.LINGER, 1000),
                              (zmq.RECONNECT_IVL, 100), (zmq.RECONNECT_IVL_MAX, 1000),
                              (zmq.ROUTING_ID, os.urandom(8)),  # how agents know us: kept across reconnections
                              (zmq.ROUTER_MANDATORY, 1)):
            sock.setsockopt(option, value)
        net.curve_client(sock, self.me, self.server.public)
        return sock

    def open_join(self, address: str, hosts: int, timeout: float) -> Bootstrap:
        """Listen for ``hosts`` joining agents; returns the token's content."""
        join = net.Keys.new()
        self._join_key = join.public
        self.allowlist.allow(join.public)
        self._zap = self.allowlist.serve(self.ctx)
        router = self.ctx.socket(zmq.ROUTER)
        # HANDOVER: a joined agent's connection with its own key takes over its routing id.
        for option, value in ((zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.LINGER, 1000), (zmq.ROUTER_MANDATORY, 1),
                              (zmq.ROUTER_HANDOVER, 1)):
            router.setsockopt(option, value)
        net.curve_server(router, self.server)
        port = net.bind_in_range(router, address)
        self.router = router
        self.version += 1
        self.wake()
        return Bootstrap(self.key.hex(), self.server.public.decode(), lost_s=self.lost_s, env=dict(self.env),
                         controller=[address, port], join=join.to_json(), timeout=timeout)

    def on_join(self, identity: bytes, body: dict[str, Any], welcome: list[Any]) -> None:
        """A joining agent (receiver thread). First it comes with the join key, and brings a key
        of its own: that key is admitted from now on, and the agent is told so (``welcome``)
        and comes back with it, on a new connection that takes over its routing id. Only then
        has it joined: the join key is revoked once the hosts have joined, and a link that
        resets later reconnects with the agent's own key."""
        if not body.get("switched"):
            key = body.get("key")
            if key:
                self.allowlist.allow(key.encode())
            if self.router is not None:
                self.sent_on.add(self.router)
                self.router.send_multipart([identity, encode_head(self.epoch, 0, b""), *welcome],
                                           copy=False)
            return
        with self.joined_changed:
            if any(j.identity == identity for j in self.joined):
                return
            self.joined.append(Joined(identity, body["addr"], body["hostname"], int(body["pid"]),
                                      int(body.get("store_port", 0)), int(body.get("gpus", 0)),
                                      body.get("versions") or {}))
            self.joined_changed.notify_all()

    def spend_token(self) -> None:
        """The hosts have joined: a copy of the token opens nothing from now on."""
        if self._join_key is not None:
            self.allowlist.revoke(self._join_key)

    def adopt(self, host: int, joined: Joined, ranks: list[int]) -> HostLink:
        link = HostLink(host, joined.hostname, joined.address, ranks, sock=self.router, identity=joined.identity,
                        agent_pid=joined.pid, hostname=joined.hostname, store_port=joined.store_port,
                        gpus=joined.gpus)
        self._add(link)
        return link

    def _add(self, link: HostLink) -> None:
        old = self.links.get(link.host)
        if old is not None and old.port:
            self._retired.append(net.tcp_address(old.address, old.port))  # the receiver drops it
        # New dicts, not changed ones: the receiver may be going through the old ones.
        self.links = {**self.links, link.host: link}
        routed: dict[zmq.Socket, dict[bytes, HostLink]] = {}
        for candidate in self.links.values():
            if candidate.sock is not None:
                routed.setdefault(candidate.sock, {})[candidate.identity] = candidate
        self._routed = routed
        self.version += 1
        self.wake()

    def settle(self) -> None:
        """Make the connections dialled since, and drop those of replaced links (receiver
        thread: it owns the dialling socket)."""
        dialler = self._dialler
        while dialler is not None and self._retired:
            try:
                dialler.disconnect(self._retired.pop(0))
            except zmq.ZMQError:
                pass  # never connected (the receiver had not yet made the connection)
        while dialler is not None and self._connects:
            identity, endpoint = self._connects.pop(0)
            dialler.setsockopt(zmq.CONNECT_ROUTING_ID, identity)
            dialler.connect(endpoint)

    # -- sending (any thread, under the controller's send lock) ----------------------------------

    def send(self, routes: dict[int, bytes], frames: list[Any]) -> zmq.MessageTracker | None:
        """Queue a message for the agents of ``routes``' hosts, each with its route: the
        receiver thread sends it, one outbox message for all of them (a request to 128 hosts
        crosses the outbox once). With big buffers, returns a tracker, done once the receiver
        copied them (see ``_forward``; wait for it outside the send lock: the receiver may need
        that lock before it gets to them)."""
        parts = [struct.pack(f"<{len(routes)}I", *routes), *routes.values(), *frames]
        if wire.is_big(frames):
            return wire.send_tracked(self._outbox, parts)
        wire.send(self._outbox, parts, big=False)  # known: not asked again of every host's route
        return None

    # -- the receiver thread's side ------------------------------------------------------------

    def sockets(self) -> list[zmq.Socket]:
        """Everything the receiver polls for the network."""
        return [self._outbox_in, *(sock for sock in (self._dialler, self.router) if sock is not None)]

    def drain(self, sock: zmq.Socket, handle: Callable[[HostLink | None, bytes, list[Any]], None]) -> None:
        """Handle what ``sock`` has ready: forward the outbox, or pass received messages on
        with the link they came up (None: an agent that is joining, known by its routing id)."""
        if sock is self._outbox_in:
            for frames in wire.ready(sock):
                self._forward(frames)
            return
        joining = sock is self.router  # there, a routing id not known yet is an agent joining
        for frames in wire.ready(sock):
            identity = frames[0].bytes
            link = self._routed.get(sock, {}).get(identity)
            if link is not None or joining:
                self._in_order(link, identity, frames[1:], handle)

    def _in_order(self, link: HostLink | None, identity: bytes, frames: list[Any],
                  handle: Callable[[HostLink | None, bytes, list[Any]], None]) -> None:
        """Pass a link's messages on in the order the agent sent them; hold what comes after a
        gap until it is sent again (see ``tick``)."""
        seq = decode_seq(frames[0].bytes if isinstance(frames[0], zmq.Frame) else frames[0])
        # Heard, whether or not it can be passed on yet: an agent whose answers wait behind a
        # gap (a resend queued behind a big transfer) is alive all the same.
        self._heard(link)
        if link is None or seq == 0:  # an agent not placed yet (joining), or outside the order
            handle(link, identity, frames[1:])
            return
        for message in link.wholes(link.incoming.take(seq, frames[1:], time.monotonic())):
            handle(link, identity, message)

    @staticmethod
    def _heard(link: HostLink | None) -> None:
        if link is not None:
            link.last_heard = time.monotonic()
            link.state = "ok" if link.state == "suspect" else link.state

    def _forward(self, parts: list[Any]) -> None:
        head = parts[0]
        head = head.bytes if isinstance(head, zmq.Frame) else head
        hosts = struct.unpack(f"<{len(head) // 4}I", head)
        routes, frames = parts[1:1 + len(hosts)], parts[1 + len(hosts):]
        # Big buffers are copied once, here, and the copy is what every link sends and keeps
        # (for sending again): whoever sent them may change its tensor as soon as this thread
        # let go of them, whatever the hosts do, and a push to 16 hosts is one copy, not 16.
        kept = [bytes(f.buffer) if isinstance(f, zmq.Frame) and len(f) >= wire.ZERO_COPY_MIN else f
                for f in frames]
        # A big message goes in fragments, cut once for every link (its agent hears us as they
        # come). Measured once too: a request to 128 hosts is one message, sent 128 times.
        cut = fragments.split(kept, at=1)
        nbytes = wire.size(cut.last()) if cut.fragments else cut.nbytes
        big = wire.is_big([b"", *cut.rest])  # behind a route: the envelope too
        for host, route in zip(hosts, routes):
            link = self.links.get(host)
            if link is None or link.state in ("lost", "stopped"):
                continue  # the host is gone: what waited for it has failed
            for fragment in cut.fragments:
                self._send(link, link.outgoing.number(fragment, of=cut.nbytes), fragment, True)
            route = route.bytes if isinstance(route, zmq.Frame) else route
            message = cut.last([route])
            self._send(link, link.outgoing.number(message, nbytes + len(route)), message, big)

    def _send(self, link: HostLink, seq: int, parts: list[Any], big: bool | None = None) -> None:
        """``parts`` (route and message) to ``link``'s agent, as message ``seq`` of the link
        (``big``: whether they carry big buffers, where the caller knows)."""
        route = parts[0].bytes if isinstance(parts[0], zmq.Frame) else bytes(parts[0])
        frames = [encode_head(self.epoch, seq, route), *parts[1:]]
        big = wire.is_big(parts) if big is None else big
        if self._connects:
            self.settle()  # dialled since the receiver last looked: connected before it is sent to
        if link.sock is None:
            return
        try:
            self.sent_on.add(link.sock)
            wire.send(link.sock, frames, prefix=[link.identity] if link.identity else (), big=big)
        except zmq.ZMQError:
            pass  # EHOSTUNREACH: a joined agent reconnecting; its liveness check decides

    def tick(self, op: Callable[[dict[str, Any]], list[Any]], lost: Callable[[HostLink], None]) -> None:
        """Ping every link that is due, mark the silent ones, and ask again for what a link is
        missing (receiver thread). ``op`` signs an operation for an agent."""
        now = time.monotonic()
        for link in list(self.links.values()):
            if link.state in ("lost", "stopped"):
                continue
            silent = now - link.last_heard
            if silent >= self.lost_s:
                link.end("lost")
                lost(link)
                continue
            if silent >= self.suspect_s:
                link.state = "suspect"
            missing = link.incoming.ask(now)
            if missing is not None:
                self.operate(link, op({"op": msg.AgentOp.RESEND, "from": missing[0], "to": missing[1]}),
                             ordered=False)
            if now - link.last_ping >= config.HOST_PING_S:
                link.last_ping = now
                self.operate(link, op({"op": msg.AgentOp.PING, "sent": now, "wall": time.time_ns(),
                                       "ack": link.incoming.acknowledged}))

    def operate(self, link: HostLink, frames: list[Any], ordered: bool = True) -> None:
        """An operation for ``link``'s agent itself, from the receiver thread (``ordered=False``:
        outside the link's numbering, for what must pass a gap: asking for messages again)."""
        if ordered:
            self._forward([struct.pack("<I", link.host), b"", *frames])
        else:
            self._send(link, 0, [b"", *frames])

    def resend(self, link: HostLink, since: int, until: int, op: Callable[[dict[str, Any]], list[Any]]) -> bool:
        """The agent missed what this side sent from ``since`` to ``until``: send again what is
        kept (receiver thread). What is not is lost: the agent is told which numbers to skip,
        every time it asks (the telling may be lost too). True when a loss is newer than those
        told before: the caller fails the work that waited on that host once, not on every ask."""
        gone = link.outgoing.gone(since, until)
        if gone:
            self.operate(link, op({"op": msg.AgentOp.LOST, "lost": gone}), ordered=False)
        for seq, parts in link.outgoing.since(since, until):
            self._send(link, seq, parts)
        newest = gone[-1][1] if gone else 0
        if newest <= link.told_lost:
            return False
        link.told_lost = newest
        return True

    def stop_agents(self, signer: wire.Wire, timeout: float) -> None:
        """Tell every remote agent to stop its ranks and exit, and wait for each to confirm
        (called once the receiver thread is gone, so this thread owns the sockets)."""
        def stopped(link: HostLink, body: dict[str, Any]) -> bool:
            if body.get("stopped"):
                link.end("stopped")
            return bool(body.get("stopped"))
        self._each_answers(signer, {"op": msg.AgentOp.STOP}, stopped, timeout)

    def hand_over(self, signer: wire.Wire, timeout: float) -> None:
        """Before this kernel lets go of a kept mesh: what it queued goes out, and it waits
        until every agent took all it sent, in order (called once the receiver thread is gone).
        A request sent just before (the last cell's) may still wait in the outbox, or in the
        agent's socket: the next kernel's first message, of a newer epoch, would fence it off
        as an old kernel's, and the ranks would never run it."""
        for frames in wire.ready(self._outbox_in):
            self._forward(frames)
        def took_all(link: HostLink, body: dict[str, Any]) -> bool:
            link.outgoing.acknowledged(body.get("ack", 0))
            return body.get("ack", 0) >= link.outgoing.next - 1
        ping = {"op": msg.AgentOp.PING, "sent": time.monotonic(), "wall": time.time_ns(), "ack": 0}
        self._each_answers(signer, ping, took_all, timeout)

    def _each_answers(self, signer: wire.Wire, op: dict[str, Any],
                      answered: Callable[[HostLink, dict[str, Any]], bool], timeout: float) -> None:
        """Send ``op`` to every live agent and wait, up to ``timeout``, until each one's
        heartbeat ``answered`` it (this thread owns the sockets; other messages are dropped)."""
        waiting = {link.host: link for link in self.links.values() if link.state in ("ok", "suspect")}
        for link in waiting.values():
            self.operate(link, signer.pack({msg.KIND: msg.OP, msg.ID: None, msg.RANKS: []}, op))
        def take(link: HostLink | None, _: bytes, frames: list[Any]) -> None:
            try:
                message = signer.unpack(frames)
            except wire.BadMessage:
                return
            if link is not None and message.kind == msg.HOST_BEAT and answered(link, message.body()):
                waiting.pop(link.host, None)
        poller = zmq.Poller()
        for sock in self.sockets()[1:]:
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while waiting and (left := deadline - time.monotonic()) > 0:
            for sock in dict(poller.poll(int(left * 1000))):
                self.drain(sock, take)

    def close(self) -> None:
        socks = [self._outbox, self._outbox_in, *(s for s in (self._dialler, self.router) if s is not None)]
        for sock in socks:
            sock.close(linger=0)
        if self._zap is not None:
            self._zap.close()
