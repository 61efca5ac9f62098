"""How a host agent talks to its controller: locally over ipc, or over the network as a relay.

Every message the controller sends an agent is ``[head, *message frames]`` (epoch, seq, route)
(:mod:`meshbook.mesh.protocol.remote`): an operation for the agent itself, or a message it
relays, unchanged, to some of its ranks. Both directions are numbered, and kept until
acknowledged (:mod:`meshbook.mesh.protocol.ordering`): a connection that resets loses
nothing unnoticed.

* :class:`LocalLink`: the agent on the controller's host. Operations arrive on an ipc socket;
  the controller sends to each rank directly and the ranks answer it directly (a relay on one
  host buys nothing, see DESIGN.md "Wire").
* :class:`RemoteLink`: an agent on another host. One Curve-encrypted TCP connection carries
  everything: requests for its ranks arrive once per host and are fanned out here over ipc,
  and whatever its ranks send goes back up the same connection, checked here and gathered
  into one signed bundle per drain of the relay (:class:`Gatherer`,
  :mod:`meshbook.mesh.protocol.bundle`); a message with big buffers goes up as the rank
  signed it, frames untouched, and the controller checks that one. The controller pings it every second;
  an agent that hears nothing from its controller for the grace period gives up, kills its
  ranks and exits, so a lost notebook leaves nothing running on remote hosts either (a kept
  mesh's grace is its lease, and a new controller may attach with a newer epoch).

:func:`listen` and :func:`join` make the connection for the two ways an agent is started:
by the ``ssh`` launcher (the agent listens, the controller dials it: compute nodes often
cannot reach the login node) or by any external launcher running the ``join`` command (the
agent dials the controller with a one-time join key).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import zmq

from ..protocol import fragments, net, wire
from ..protocol import messages as msg
from ..protocol.bodies import AgentConfig, Bootstrap
from ..protocol.bundle import Bundle
from ..protocol.ordering import Incoming, Outgoing
from ..protocol.remote import LISTENING, decode_head, decode_route, encode_seq
from ..protocol.versions import versions

#: How long a send up a link may wait for its connection.
SEND_TIMEOUT_MS = 1000

#: The agent's handler for a message for itself (its frames), called as the link drains.
Operate = Callable[[list[Any]], None]


class LocalLink:
    """Operations on an ipc DEALER, the agent's own events on an ipc PUSH."""

    remote: Literal[False] = False  # the agent branches on it (and a type checker with it)

    def __init__(self, ctx: zmq.Context, cfg: AgentConfig) -> None:
        self.cmd = ctx.socket(zmq.DEALER)
        self.cmd.setsockopt(zmq.IDENTITY, f"agent:{cfg.host}".encode())
        self.cmd.connect(cfg.cmd_addr)
        self.up = ctx.socket(zmq.PUSH)
        self.up.setsockopt(zmq.LINGER, 2000)
        self.up.connect(cfg.events_addr)
        #: Where this host's ranks send what they emit: the controller itself.
        self.rank_events = cfg.events_addr
        self.last_heard = time.monotonic()

    def sockets(self) -> list[zmq.Socket]:
        return [self.cmd]

    def send(self, frames: list[Any]) -> None:
        wire.send(self.up, frames)

    def drain(self, sock: zmq.Socket, operate: Operate) -> None:
        """Hand each message for the agent itself that ``sock`` has ready to ``operate``."""
        while sock.poll(0):
            route, *frames = wire.recv(sock)
            operate(frames)

    def connect_rank(self, rank: int, generation: int, rundir: str) -> None:
        """Nothing to do: the controller connects to its ranks itself."""

    def last_words(self, kept: list[bytes]) -> list[bytes]:
        """A dead rank's last messages (:mod:`~..protocol.lastwords`) go up inside its ``EXIT``:
        the controller, which took the ones that arrived, tells which did not."""
        return kept

    def close(self) -> None:
        for sock in (self.cmd, self.up):
            sock.close(linger=2000)


@dataclass
class Peer:
    """The controller an agent answers: the newest epoch it has heard, and (on a listening
    agent's ROUTER) that controller's routing id."""

    epoch: int = 0
    identity: bytes = b""


def unwrap(frames: list[Any], routed: bool) -> tuple[Peer, int, bytes, list[Any]]:
    """``[identity if routed, head, *message]`` (see :func:`~..protocol.remote.encode_head`)
    -> (who sent it, its number on the link, route, message)."""
    identity = frames[0].bytes if routed else b""
    head, *message = frames[1:] if routed else frames
    epoch, seq, route = decode_head(head.bytes)
    return Peer(epoch, identity), seq, route, message


class Gatherer:
    """Checks this host's ranks' messages as the controller would (signature, replay stamp,
    header) and gathers them into one bundle, signed as this host's agent: one message up the
    link per drain of the relay instead of one per rank (see :mod:`~..protocol.bundle`)."""

    def __init__(self, key: bytes, host: int) -> None:
        self.wire = wire.Wire(key)  # its own receiving window and stream: the relay's thread
        self.host = host
        self.bundle = Bundle()

    def add(self, frames: list[Any]) -> None:
        """A rank's message without buffers; a forged or replayed one is dropped here."""
        try:
            self.bundle.add(self.wire.unpack(frames))
        except wire.BadMessage:
            pass  # counted in wire.dropped (a replay is logged), as the controller did

    def take(self) -> list[Any] | None:
        """The bundle's frames, signed (None: nothing gathered)."""
        if not self.bundle:
            return None
        return self.wire.pack({msg.KIND: msg.BUNDLE, msg.ID: None, msg.HOST: self.host}, self.bundle.take())


class RemoteLink:
    """One Curve TCP connection to the controller, relaying for this host's ranks.

    A listening agent binds a ROUTER: when a new kernel attaches a kept mesh, the old
    controller may still be connected, and a bound DEALER would deal the ranks' answers
    round-robin between the two. Everything goes to the controller of the newest epoch; what
    an older one sends is refused and collected in ``stale`` (the agent tells it it is fenced).
    """

    remote: Literal[True] = True

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, rundir: str, peer: Peer, last_seq: int,
                 gatherer: Gatherer) -> None:
        self.ctx = ctx
        self.sock = sock
        self.routed = sock.getsockopt(zmq.TYPE) == zmq.ROUTER
        self.peer = peer
        #: What this agent sent up and the controller has not acknowledged; what came down, in
        #: order (``last_seq``: the configuration's number, taken before this link existed).
        self.outgoing = Outgoing()
        self.incoming = Incoming(expected=last_seq + 1)
        self.assembly = fragments.Assembly()  # what came down in fragments
        self.rundir = rundir
        #: What this host's ranks emit arrives here, and goes up the connection unchanged.
        self.rank_events = f"ipc://{rundir}/ev"
        self.relay = ctx.socket(zmq.PULL)
        self.relay.setsockopt(zmq.RCVHWM, 0)
        self.relay.bind(self.rank_events)
        self.gatherer = gatherer
        self.down: dict[int, dict[str, zmq.Socket]] = {}
        self.last_heard = time.monotonic()
        #: Controllers of an older epoch that sent something since the agent last looked.
        self.stale: list[Peer] = []
        #: Messages that could not be sent up (the connection was down).
        self.dropped = 0

    def sockets(self) -> list[zmq.Socket]:
        return [self.sock, self.relay]

    def send(self, frames: list[Any], to: Peer | None = None, ordered: bool = True) -> None:
        """Up to the newest controller (or, outside the link's order, to ``to``), numbered and
        kept until acknowledged. A ROUTER drops what no one is there for, and so does a DEALER
        whose connection is down for longer than a send may wait: the numbers have it sent
        again. A big message goes in fragments (:mod:`~..protocol.fragments`): the controller
        hears this host as each arrives."""
        if not ordered or to is not None:
            self._send(0, frames, to)
            return
        cut = fragments.split(frames)  # measures the message: numbering it need not again
        if not cut.fragments:
            self._send(self.outgoing.number(frames, cut.nbytes), frames)
            return
        for part in (*cut.fragments, cut.last()):
            self._send(self.outgoing.number(part, of=cut.nbytes), part)

    def _send(self, seq: int, frames: list[Any], to: Peer | None = None) -> None:
        try:
            wire.send(self.sock, [encode_seq(seq), *frames], prefix=[(to or self.peer).identity] if self.routed else ())
        except zmq.Again:
            self.dropped += 1

    def resend(self, since: int, until: int, lost: Any) -> None:
        """The controller missed what this agent sent from ``since`` to ``until``: send again
        what is kept; what is not is lost, and ``lost(ranges)`` says which numbers first."""
        gone = self.outgoing.gone(since, until)
        if gone:
            lost(gone)
        for seq, frames in self.outgoing.since(since, until):
            self._send(seq, frames)

    def drain(self, sock: zmq.Socket, operate: Operate) -> None:
        """Relay what is ready on ``sock``, and hand each message for the agent itself to
        ``operate`` in its place in the link's order (see :meth:`deliver`)."""
        if sock is self.relay:
            self._drain_relay()
            return
        for frames in wire.ready(sock):
            peer, seq, route, message = unwrap(frames, self.routed)
            if peer.epoch < self.peer.epoch or \
                    (peer.epoch == self.peer.epoch and self.routed and peer.identity != self.peer.identity):
                self.stale.append(peer)  # an older controller, or a rival at the same epoch
                continue
            if peer.epoch > self.peer.epoch:  # a new controller attached: a new link's numbers
                self.outgoing, self.incoming = Outgoing(), Incoming(expected=max(seq, 1))
                self.assembly = fragments.Assembly()
            self.peer = peer
            self.last_heard = time.monotonic()
            if seq == 0:  # outside the link's order (asking for messages again): never a fragment
                self._deliver_one(route, message, operate)
            else:
                self.deliver(self.incoming.take(seq, [route, *message], self.last_heard), operate)

    def _drain_relay(self) -> None:
        """What this host's ranks sent: up the link, gathered."""
        for frames in wire.ready(self.relay):
            self._relay_up(frames)
        self._send_gathered()

    def _relay_up(self, frames: list[Any]) -> None:
        """A rank's message: into the bundle, or, with big buffers, up as the rank signed it
        (after what was gathered before it, to keep the order)."""
        if len(frames) == 1:
            self.gatherer.add(frames)
            return
        self._send_gathered()
        self.send(frames)

    def last_words(self, kept: list[bytes]) -> list[bytes]:
        """A dead rank's last messages (:mod:`~..protocol.lastwords`): after what it sent that
        is here already, the ones that never arrived go up, in order, ahead of its ``EXIT``
        (this agent checked and relayed the others); nothing is left for the ``EXIT``."""
        self._drain_relay()
        for message in kept:
            if not self.gatherer.wire.taken([message]):
                self.gatherer.add([message])
        self._send_gathered()
        return []

    def _send_gathered(self) -> None:
        frames = self.gatherer.take()
        if frames is not None:
            self.send(frames)

    def deliver(self, messages: list[list[Any]], operate: Operate) -> None:
        """Relay what is for the ranks and hand what is for the agent itself to ``operate``,
        one after the other in the link's order: a re-fork must point a rank's sockets at its
        new process before the requests sent after it are relayed (the old process's socket
        is closed, and what it held is dropped), and a signal must reach the ranks before the
        cell sent after it."""
        for delivered in messages:
            whole = self.assembly.take(delivered)
            if whole is not None:  # None: a fragment (its message comes whole with the last one)
                self._deliver_one(whole[0], whole[1:], operate)

    def _deliver_one(self, route: Any, message: list[Any], operate: Operate) -> None:
        route = route.bytes if isinstance(route, zmq.Frame) else route
        if not route:
            operate(message)
        else:
            self._relay_down(route, message)

    def _relay_down(self, route: bytes, frames: list[Any]) -> None:
        channel, ranks = decode_route(route)
        socks = [self.down[r][channel] for r in ranks if r in self.down]
        wire.fan_out(socks, [f.buffer if isinstance(f, zmq.Frame) else f for f in frames])

    def connect_rank(self, rank: int, generation: int, rundir: str) -> None:
        """Point ``rank``'s sockets at its process forked in ``generation`` (before the fork:
        ZeroMQ queues what arrives until the rank binds)."""
        for sock in self.down.pop(rank, {}).values():
            sock.close(linger=0)
        self.down[rank] = wire.connect_rank(self.ctx, rundir, rank, generation)

    def close(self) -> None:
        for socks in self.down.values():
            for sock in socks.values():
                sock.close(linger=0)
        self.relay.close(linger=0)
        self.sock.close(linger=1000)


# -- the two ways an agent on another host connects --------------------------------------------


def listen(ctx: zmq.Context, data: Bootstrap, gpus: int,
           announce_dir: str | None = None) -> tuple[zmq.Socket, net.ZapHandler]:
    """Bind a Curve server socket only the controller's key may use, and say where: on stdout,
    or in ``announce_dir`` (a file per task, named by the scheduler's task id) for a
    controller that cannot read our stdout."""
    allowlist = net.Allowlist({data.controller_public.encode()})
    zap = allowlist.serve(ctx)
    sock = _link_socket(ctx, zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a controller that reconnects keeps its routing id
    net.curve_server(sock, net.Keys(data.server_public.encode(), data.server_secret.encode()))
    address = advertised_address(data.controller_hint or None)
    bind = "127.0.0.1" if data.tunnel else address
    port = net.bind_in_range(sock, bind)
    info = {"addr": address, "port": port, "pid": os.getpid(), "hostname": socket.gethostname(),
            "store_port": net.free_port_in_range(address), "gpus": gpus, "versions": versions()}
    line = f"{LISTENING} {json.dumps(info)}\n"
    if announce_dir:
        _announce(announce_dir, line)
    else:
        sys.stdout.write(line)
        sys.stdout.flush()
    return sock, zap


def _announce(directory: str, line: str) -> None:
    """Write ``line`` whole (a file appears only once complete), readable by the user only."""
    task = os.environ.get("SLURM_PROCID") or f"{socket.gethostname()}-{os.getpid()}"
    path = os.path.join(directory, f"listening-{task}")
    fd = os.open(path + ".part", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(line)
    os.rename(path + ".part", path)


def join(ctx: zmq.Context, data: Bootstrap, gpus: int, timeout: float = 60.0) -> zmq.Socket:
    """Dial the controller with the join key and announce this host with a key of its own;
    once the controller admits that key, dial again with it (the connection a reset link
    reconnects with: the join key is revoked once the hosts have joined). A token the
    controller refuses (spent, or its mesh gone), or a controller that cannot be reached, ends
    the agent at once, saying so."""
    mine = net.Keys.new()
    identity = os.urandom(8).hex().encode()
    signer = wire.Wire(bytes.fromhex(data.key))
    assert data.controller is not None and data.join is not None
    host, port = data.controller
    address = net.route_to(host)
    about = {"addr": address, "pid": os.getpid(), "hostname": socket.gethostname(),
             "store_port": net.free_port_in_range(address), "gpus": gpus, "versions": versions()}
    first = _dial(ctx, net.Keys.from_json(data.join), data, identity, timeout)
    try:
        joining = signer.pack({msg.KIND: msg.JOIN, msg.ID: None}, {**about, "key": mine.public.decode()})
        wire.send(first, [encode_seq(0), *joining])  # outside any link's order: there is none yet
        _await_welcome(first, signer, timeout)
        second = _dial(ctx, mine, data, identity, timeout)
        switched = signer.pack({msg.KIND: msg.JOIN, msg.ID: None}, {**about, "switched": True})
        wire.send(second, [encode_seq(0), *switched])
    finally:
        first.close(linger=0)
    return second


def _dial(ctx: zmq.Context, keys: net.Keys, data: Bootstrap, identity: bytes, timeout: float) -> zmq.Socket:
    """A connection to the controller with ``keys``, once its handshake succeeded."""
    from zmq.utils.monitor import recv_monitor_message

    sock = _link_socket(ctx)
    sock.setsockopt(zmq.IDENTITY, identity)
    net.curve_client(sock, keys, data.server_public.encode())
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    assert data.controller is not None
    host, port = data.controller
    sock.connect(net.tcp_address(host, port))
    try:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if monitor.poll(int(left * 1000)):
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    return sock
                raise SystemExit(f"meshbook agent join: the controller at {host}:{port} refused this token: "
                                 f"the hosts it was for have joined already, or its mesh has stopped. Copy "
                                 f"the command again from the notebook (%mesh start --join prints a new one)")
        raise SystemExit(f"meshbook agent join: no answer from the controller at {host}:{port} within "
                         f"{timeout:g} s: check that this host can reach it (the notebook waits for the "
                         f"hosts only as long as its start timeout)")
    except BaseException:
        sock.close(linger=0)
        raise
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


def _await_welcome(sock: zmq.Socket, signer: wire.Wire, timeout: float) -> None:
    """Wait for the controller to admit this agent's own key."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000)):
            break
        _, _, route, frames = unwrap(wire.recv(sock), False)
        try:
            message = signer.unpack(frames)
        except wire.BadMessage:
            continue
        if route == b"" and message.kind == msg.OP and message.body().get("op") == msg.AgentOp.WELCOME:
            return
    raise SystemExit(f"meshbook agent join: the controller did not answer within {timeout:g} s")


def _link_socket(ctx: zmq.Context, kind: int = zmq.DEALER) -> zmq.Socket:
    """A link's socket. A send never blocks the agent's one thread for long (a DEALER with no
    connection blocks until it has one, and the agent would never reach the timer that ends it
    when its controller is gone): what cannot leave in ``SEND_TIMEOUT_MS`` is dropped, and the
    link's sequence numbers have it sent again or reported missing."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    return sock


def advertised_address(hint: str | None = None) -> str:
    """The address of the interface that routes to the controller.

    Under ssh, ``SSH_CONNECTION`` names the address the client came from (the controller, or
    the last jump host on its way): the interface routing there is the one the controller (or
    the tunnel) reaches. Without it, the controller's address as the launcher knew it.
    """
    client = (os.environ.get("SSH_CONNECTION") or "").split()
    peer = client[0] if client else hint
    if not peer:
        return "127.0.0.1"
    try:
        return net.route_to(peer)
    except OSError:
        return client[2] if len(client) > 2 else "127.0.0.1"
