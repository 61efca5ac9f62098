"""A stand-in for a host agent on another host that answers for its ranks itself.

Why: issue 16 asks how dispatch grows with 1,024 ranks on 128 hosts. On a machine with a few
cores, 1,024 real ranks (each a forked torch process) cannot run at once, and what the
measurement is about is the controller's side: one request per host out, one answer per
rank back, over one Curve TCP connection per host. So each host is this small process,
listening on its own loopback address (Linux routes all of 127/8 to loopback), which

* makes its connection with the real link code: :func:`meshbook.mesh.agent.link.listen`, the
  Curve server key of the mesh, a ZAP allowlist that admits the controller's key only, the
  ``LISTENING`` line the ssh launcher reads;
* takes the controller's messages in the real format (the link's ``[identity, epoch, seq, route,
  *signed frames]``, read by the link's own :func:`~meshbook.mesh.agent.link.unwrap`), checks
  their signature once, and answers the agent operations a remote agent answers (configure,
  ping with its acknowledgement, stop);
* answers a request for its ranks with one ``RESULT`` per rank, each signed with the mesh
  key by a :class:`~meshbook.mesh.protocol.wire.Wire` of that rank's own, as a rank signs,
  and then does what a real agent does with them: checks each and gathers them into one
  signed bundle with the agent's own :class:`~meshbook.mesh.agent.link.Gatherer`.
  What it sends goes outside the link's numbering (number 0): over loopback nothing is lost,
  so it keeps nothing to send again.

What it skips, and the fan-out table says so: the agent's ipc hop to real rank processes
and back (each rank receiving, checking and running the request), and the ranks' own
heartbeats. Run as ``python -m bench.standin_host ADDRESS`` by the fan-out workload's
launcher; the bootstrap arrives on stdin as for ``python -m meshbook.mesh.agent listen``,
and the process ends when stdin closes or the controller says stop.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any, Callable
from unittest import mock

import zmq

from meshbook.mesh.agent import link
from meshbook.mesh.protocol import messages as msg
from meshbook.mesh.protocol import wire
from meshbook.mesh.protocol.bodies import Bootstrap
from meshbook.mesh.protocol.remote import decode_route, encode_seq
from meshbook.mesh.protocol.versions import versions


class StandIn:
    """One host's connection, and the answers its ranks would give."""

    def __init__(self, sock: zmq.Socket, key: bytes) -> None:
        self.sock = sock
        self.key = key
        self.checker = wire.Wire(key)
        self.host: int | None = None
        self.signers: dict[int, wire.Wire] = {}
        self.gatherer: link.Gatherer | None = None
        self.stopping = False
        #: The controller that wrote last (its routing identity), and its newest message's number.
        self.peer: link.Peer | None = None
        self.acknowledged = 0
        self._ops: dict[str, Callable[[wire.Message, dict[str, Any]], None]] = {
            msg.AgentOp.CONFIGURE: self._configure, msg.AgentOp.PING: self._ping,
            msg.AgentOp.STOP: self._stop}

    def serve(self) -> None:
        """Answer until stdin closes (the launcher is done with us) or the controller stops us."""
        stdin = sys.stdin.fileno()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(stdin, zmq.POLLIN)
        while not self.stopping:
            ready = dict(poller.poll(1000))
            if stdin in ready and not os.read(stdin, 4096):
                return
            while not self.stopping and self.sock.poll(0):
                self._take(wire.recv(self.sock))

    def _take(self, frames: list[Any]) -> None:
        self.peer, seq, route, message = link.unwrap(frames, routed=True)
        self.acknowledged = max(self.acknowledged, seq)  # loopback keeps the order
        try:
            request = self.checker.unpack(message)
        except wire.BadMessage:
            return
        if route:
            self._answer(request, decode_route(route)[1])
            return
        body = request.body() if request.kind == msg.OP else {}
        handler = self._ops.get(body.get("op"))
        if handler is None:
            print(f"stand-in host {self.host}: ignored {request.kind} {body.get('op')}",
                  file=sys.stderr, flush=True)
            return
        handler(request, body)

    def _answer(self, request: wire.Message, ranks: list[int]) -> None:
        """What each rank sends back for a request that returns None (a no-op), gathered."""
        for rank in ranks:
            self._gather(self.signers[rank].pack(
                {msg.KIND: msg.RESULT, msg.ID: request.header[msg.ID], msg.RANK: rank,
                 msg.DURATION: 0.0, msg.HAS_GROUP: True, msg.TYPE: "builtins.NoneType"}))
        self._send_gathered()

    def _configure(self, request: wire.Message, body: dict[str, Any]) -> None:
        config = body["config"]
        self.host = config["host"]
        self.signers = {rank: wire.Wire(self.key) for rank in config["ranks"]}
        self.gatherer = link.Gatherer(self.key, self.host)
        pid = os.getpid()
        self._emit(msg.AGENT, None, {"pid": pid, "hostname": socket.gethostname(), "versions": versions(),
                                     "pids": {rank: pid for rank in self.signers}})
        for rank, signer in self.signers.items():
            self._gather(signer.pack({msg.KIND: msg.READY, msg.ID: None, msg.RANK: rank,
                                      msg.GENERATION: 0}, {"device": "cpu", "pid": pid}))
        self._send_gathered()

    def _ping(self, request: wire.Message, body: dict[str, Any]) -> None:
        self._emit(msg.HOST_BEAT, request.header[msg.ID],
                   {"sent": body["sent"], "ranks": sorted(self.signers), "ack": self.acknowledged})

    def _stop(self, request: wire.Message, body: dict[str, Any]) -> None:
        self._emit(msg.HOST_BEAT, None, {"stopped": True})
        self.stopping = True

    def _gather(self, frames: list[Any]) -> None:
        assert self.gatherer is not None  # configured first
        self.gatherer.add(frames)

    def _send_gathered(self) -> None:
        assert self.gatherer is not None
        frames = self.gatherer.take()
        if frames is not None:
            self._send(frames)

    def _emit(self, kind: str, request: int | None, body: Any) -> None:
        self._send(self.checker.pack({msg.KIND: kind, msg.ID: request, msg.HOST: self.host}, body))

    def _send(self, frames: list[Any]) -> None:
        assert self.peer is not None  # the stand-in only answers
        wire.send(self.sock, [encode_seq(0), *frames], prefix=[self.peer.identity])


def main(address: str) -> None:
    boot = json.loads(sys.stdin.readline())
    ctx = zmq.Context()
    # The stand-in plays a host whose interface is ``address``: that is what it listens on
    # and advertises, where a real agent finds the interface that routes to the controller.
    with mock.patch.object(link, "advertised_address", lambda hint=None: address):
        sock, zap = link.listen(ctx, Bootstrap.from_dict(boot), 0)
    try:
        StandIn(sock, bytes.fromhex(boot["key"])).serve()
    finally:
        sock.close(linger=1000)
        zap.close()
        ctx.term()


if __name__ == "__main__":
    main(sys.argv[1])
