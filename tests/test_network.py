"""The network wire's defences, and the order an agent keeps, against a real agent listening
on TCP with CurveZMQ.

The agent is started exactly as the ssh launcher starts one (``python -m meshbook.mesh.agent
listen``, the bootstrap on its stdin), without ssh in between; the test plays the controller
with the keys a real controller would make.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from meshbook.mesh.controller.launch import ssh
from meshbook.mesh.controller.launch.network import HostLink, Network
from meshbook.mesh.protocol import bundle, net, wire
from meshbook.mesh.protocol import messages as msg
from meshbook.mesh.protocol.bodies import AgentConfig
from meshbook.mesh.protocol.fragments import split
from meshbook.mesh.protocol.ordering import Outgoing
from meshbook.mesh.protocol.remote import decode_head, encode_head, encode_route


class ListeningAgent:
    """A listening agent and the controller's side of it, driven by hand."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.network = Network(self.ctx, b"k" * 32)
        self.wire = wire.Wire(self.network.key)
        self.agent = ssh.ListeningAgent("local", [sys.executable, "-m", "meshbook.mesh.agent", "listen"])
        self.bootstrap = self.network.bootstrap()
        self.agent.send(json.dumps(self.bootstrap.to_dict()) + "\n")
        self.info = self.agent.wait_listening(time.monotonic() + 60, sys.executable)
        self.address = net.tcp_address(self.info["addr"], self.info["port"])
        self.sent: dict[zmq.Socket, int] = {}

    def client(self, keys: net.Keys, server_public: bytes) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        net.curve_client(sock, keys, server_public)
        return sock

    def op(self, sock: zmq.Socket, frames: list[Any], epoch: int = 0) -> None:
        """An operation, numbered on its own link as a controller numbers them."""
        self.send(sock, self.number(sock), frames, epoch=epoch)

    def number(self, sock: zmq.Socket) -> int:
        """The next number on ``sock``'s link (for a message the test sends out of order)."""
        self.sent[sock] = self.sent.get(sock, 0) + 1
        return self.sent[sock]

    def send(self, sock: zmq.Socket, seq: int, frames: list[Any], route: bytes = b"", epoch: int = 0) -> None:
        """Message ``seq``: an operation, or with ``route``, a request the agent relays to its ranks."""
        sock.send_multipart([encode_head(epoch, seq, route), *frames])

    def configure(self, sock: zmq.Socket, epoch: int = 0) -> None:
        """Configure the agent with one rank and wait until it is ready."""
        config = AgentConfig(0, 1, [0], [["world", 1]], "gloo", "cpu", self.info["addr"], 60.0,
                             master_port=self.info["store_port"], store=[self.info["addr"], self.info["store_port"]],
                             serve_store=True)
        self.op(sock, self.wire.pack({msg.KIND: msg.OP, msg.ID: None, msg.RANKS: [0]},
                                     {"op": msg.AgentOp.CONFIGURE, "config": config.to_dict()}), epoch)
        ready = [m for m in self.replies(sock, 12, until=msg.READY) if m.kind == msg.READY]
        assert ready, "the configured agent's rank became ready"

    def replies(self, sock: zmq.Socket, seconds: float, until: str | None = None) -> list[wire.Message]:
        """What the agent sends within ``seconds`` (or until a message of kind ``until``); the
        agent gives up on a controller silent for 15 s, so waits stay shorter."""
        out, deadline = [], time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if sock.poll(left * 1000):
                message = self.wire.unpack(sock.recv_multipart()[1:])  # after the link's number
                out += unbundled(message)
                if out[-1].kind == until:
                    break
        return out

    def close(self) -> None:
        self.agent.terminate(5.0)
        self.network.close()
        self.ctx.destroy(linger=0)


def unbundled(message: wire.Message) -> list[wire.Message]:
    """The messages an agent gathered from its ranks, as the controller takes them (a group of
    results: one ``RESULT`` per rank)."""
    if message.kind != msg.BUNDLE:
        return [message]
    return [m for entry in message.body() for m in gathered(entry)]


def gathered(entry: list[Any]) -> list[wire.Message]:
    if entry[0] == bundle.MESSAGE:
        return [wire.Message.gathered(entry[1], entry[2])]
    _, request, ranks, _, _, _, value = entry
    return [wire.Message.gathered({msg.KIND: msg.RESULT, msg.ID: request, msg.RANK: rank}, value) for rank in ranks]


@pytest.fixture
def listening() -> Iterator[ListeningAgent]:
    agent = ListeningAgent()
    yield agent
    agent.close()


def handshake_outcome(sock: zmq.Socket, address: str, seconds: float = 10.0) -> str:
    """Connect and report how the Curve handshake ended: "ok" or "refused"."""
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                      | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    sock.connect(address)
    try:
        if not monitor.poll(seconds * 1000):
            return "no answer"
        event = recv_monitor_message(monitor)["event"]
        return "ok" if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else "refused"
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


def test_only_the_controllers_key_is_admitted(listening: ListeningAgent) -> None:
    stranger = listening.client(net.Keys.new(), listening.network.server.public)
    assert handshake_outcome(stranger, listening.address) == "refused", \
        "a client holding the server's public key but not the controller's key is refused by ZAP"
    controller = listening.client(listening.network.me, listening.network.server.public)
    assert handshake_outcome(controller, listening.address) == "ok"
    for sock in (stranger, controller):
        sock.close(linger=0)


def test_a_replayed_message_is_refused(listening: ListeningAgent) -> None:
    sock = listening.client(listening.network.me, listening.network.server.public)
    sock.connect(listening.address)
    listening.configure(sock)
    ping = listening.wire.pack({msg.KIND: msg.OP, msg.ID: 7, msg.RANKS: []},
                               {"op": msg.AgentOp.PING, "sent": 123.0})
    listening.op(sock, ping)
    listening.op(sock, ping)  # captured and sent again, by someone holding the keys
    beats = [m for m in listening.replies(sock, 3) if m.kind == msg.HOST_BEAT and m.body().get("sent") == 123.0]
    assert len(beats) == 1, "the replayed ping was dropped, not answered twice"
    listening.op(sock, listening.wire.pack({msg.KIND: msg.OP, msg.ID: None, msg.RANKS: []},
                                           {"op": msg.AgentOp.STOP}))
    assert any(m.kind == msg.HOST_BEAT and m.body().get("stopped")
               for m in listening.replies(sock, 10, until=msg.HOST_BEAT))
    sock.close(linger=0)


def test_an_older_epoch_is_refused_and_told_it_is_fenced(listening: ListeningAgent) -> None:
    """Two controllers with the mesh's keys (a kept mesh attached by a second kernel): the
    agent answers the newest epoch only, and tells the older one it was fenced off."""
    old, new = (listening.client(listening.network.me, listening.network.server.public) for _ in range(2))
    for sock in (old, new):
        sock.connect(listening.address)
    ping = lambda sent: listening.wire.pack({msg.KIND: msg.OP, msg.ID: None, msg.RANKS: []},  # noqa: E731
                                           {"op": msg.AgentOp.PING, "sent": sent})
    listening.configure(old, epoch=1)
    listening.op(old, ping(1.0), epoch=1)
    assert [m.body()["sent"] for m in listening.replies(old, 10, until=msg.HOST_BEAT)
            if m.kind == msg.HOST_BEAT] == [1.0]
    listening.op(new, ping(2.0), epoch=2)
    assert [m.body()["sent"] for m in listening.replies(new, 10, until=msg.HOST_BEAT)
            if m.kind == msg.HOST_BEAT] == [2.0]
    listening.op(old, ping(3.0), epoch=1)
    fenced = [m for m in listening.replies(old, 10, until=msg.FENCED) if m.kind == msg.FENCED]
    assert [m.body() for m in fenced] == [{"epoch": 2}], "refused, and told why"
    listening.op(new, ping(4.0), epoch=2)
    assert [m.body()["sent"] for m in listening.replies(new, 10, until=msg.HOST_BEAT)
            if m.kind == msg.HOST_BEAT] == [4.0]
    assert listening.replies(old, 1) == [], "nothing goes to the older controller but that it is fenced"
    for sock in (old, new):
        sock.close(linger=0)


def test_secrets_never_appear_on_a_command_line(listening: ListeningAgent) -> None:
    secrets = [listening.network.key.hex(), listening.bootstrap.server_secret,
               listening.network.me.secret.decode()]
    seen = 0
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        seen += "meshbook.mesh.agent" in line
        assert not any(secret in line for secret in secrets), f"a secret on the command line of {proc.pid}"
    assert seen, "the agent was among the processes looked at"


def test_an_operation_runs_before_the_requests_the_link_delivers_after_it(listening: ListeningAgent) -> None:
    """A re-fork and a request for the new rank, delivered together (the request arrived first
    and waited for the gap before it): the request reaches the new rank, not the dead one's
    socket, which the re-fork closes."""
    sock = listening.client(listening.network.me, listening.network.server.public)
    sock.connect(listening.address)
    listening.configure(sock)
    listening.op(sock, listening.wire.pack({msg.KIND: msg.OP, msg.ID: None, msg.RANKS: [0]},
                                           {"op": msg.AgentOp.SIGNAL, "sig": signal.SIGKILL}))
    assert [m for m in listening.replies(sock, 10, until=msg.EXIT) if m.kind == msg.EXIT], "the rank died"
    spawn = listening.wire.pack({msg.KIND: msg.OP, msg.ID: None, msg.RANKS: [0]},
                                {"op": msg.AgentOp.SPAWN, "generation": 1})
    request = listening.wire.pack({msg.KIND: msg.EXEC, msg.ID: 42}, {"code": "6 * 7"})
    spawn_seq, request_seq = listening.number(sock), listening.number(sock)
    listening.send(sock, request_seq, request, route=encode_route(msg.MAIN, [0]))
    listening.send(sock, spawn_seq, spawn)
    results = [m for m in listening.replies(sock, 12, until=msg.RESULT) if m.kind == msg.RESULT]
    assert [(m.header[msg.ID], m.body()) for m in results] == [(42, 42)], "the new rank ran the request"
    sock.close(linger=0)


def test_a_loss_asked_about_again_fails_the_runs_once() -> None:
    """Each side asks again while a gap waits (the answer may queue behind a big transfer): the
    agent is told of the loss and sent what is kept each time (the answer may be lost too), but
    only a loss not reported before fails the runs on its ranks (a re-run is not failed)."""
    ctx = zmq.Context()
    network = Network(ctx, b"k" * 32)
    agent, sock = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    agent.bind("inproc://agent")
    sock.connect("inproc://agent")
    link = HostLink(1, "h", "10.0.0.1", [1], sock=sock, outgoing=Outgoing(keep_bytes=10))
    signer, reader = wire.Wire(network.key), wire.Wire(network.key)

    def op(body: dict[str, Any]) -> list[Any]:
        return signer.pack({msg.KIND: msg.OP, msg.ID: None, msg.RANKS: []}, body)

    def answer() -> tuple[Any, int, list[bytes]]:
        assert agent.poll(5000), "the agent is told"
        told = agent.recv_multipart()
        assert agent.poll(5000), "what is kept comes again"
        again = agent.recv_multipart()
        _, seq, route = decode_head(again[0])
        return reader.unpack(told[1:]).body()["lost"], seq, [route, *again[1:]]

    try:
        kept, big = link.outgoing.number([b"", b"kept"]), link.outgoing.number([b"", b"x" * 11])
        assert network.resend(link, kept, big, op), "a new loss"
        assert answer() == ([(big, big)], kept, [b"", b"kept"])
        assert not network.resend(link, kept, big, op), "asked again: the same loss"
        assert answer() == ([(big, big)], kept, [b"", b"kept"])
        newer = link.outgoing.number([b"", b"y" * 11])
        assert network.resend(link, kept, newer, op), "a newer loss"
        assert answer() == ([(big, newer)], kept, [b"", b"kept"])
    finally:
        agent.close(linger=0)
        sock.close(linger=0)
        network.close()
        ctx.destroy(linger=0)


@pytest.fixture
def py_spy_gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A stand-in py-spy, first on the PATH of the agents started meanwhile, that dumps a stack
    only once the test writes a line to the descriptor this yields (it reads a FIFO)."""
    fifo = tmp_path / "release"
    os.mkfifo(fifo)
    fake = tmp_path / "py-spy"
    fake.write_text(f'#!/bin/sh\nread line < "{fifo}"\necho "stack of $3"\n')
    fake.chmod(0o700)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    gate = os.open(fifo, os.O_RDWR)  # never blocks, and py-spy's read waits for a line
    yield gate
    os.close(gate)


def test_the_agent_answers_while_py_spy_dumps_a_rank(py_spy_gate: int) -> None:
    """py-spy may take seconds per rank: meanwhile the agent goes on answering its controller
    (a blocked agent stops hearing it, and its ranks stop themselves as if it were gone)."""
    listening = ListeningAgent()
    try:
        sock = listening.client(listening.network.me, listening.network.server.public)
        sock.connect(listening.address)
        listening.configure(sock)
        listening.op(sock, listening.wire.pack({msg.KIND: msg.OP, msg.ID: 9, msg.RANKS: [0]},
                                               {"op": msg.AgentOp.PYSPY}))
        listening.op(sock, listening.wire.pack({msg.KIND: msg.OP, msg.ID: None, msg.RANKS: []},
                                               {"op": msg.AgentOp.PING, "sent": 1.0}))
        answers = [m.kind for m in listening.replies(sock, 12, until=msg.HOST_BEAT)
                   if m.kind in (msg.HOST_BEAT, msg.RESULT)]
        assert answers == [msg.HOST_BEAT], "the ping was answered while py-spy still ran"
        os.write(py_spy_gate, b"go\n")
        dumps = [m for m in listening.replies(sock, 10, until=msg.RESULT) if m.kind == msg.RESULT]
        assert [(m.header[msg.ID], m.header[msg.RANK]) for m in dumps] == [(9, 0)]
        assert dumps[0].body().startswith("stack of "), "py-spy's output is the answer"
        sock.close(linger=0)
    finally:
        listening.close()


def test_a_big_message_held_behind_a_lost_one_comes_whole() -> None:
    """Number 1 never came and is lost; a fragmented message came after it, held behind the
    gap. Given up on, the link delivers that message put together, not its fragments."""
    link = HostLink(1, "h", "127.0.0.1", [0])
    message = [b"envelope" * 8, bytes(range(256)) * 1000]
    cut = split(message, piece=64 << 10)
    assert len(cut.fragments) > 1
    for seq, part in enumerate([*cut.fragments, cut.last()], start=2):
        assert list(link.wholes(link.incoming.take(seq, part, 0.0))) == []
    delivered = list(link.wholes(link.incoming.give_up([(1, 1)])))
    assert [[bytes(f) for f in m] for m in delivered] == [message]


def test_an_operation_outside_the_order_between_fragments_breaks_nothing(listening: ListeningAgent) -> None:
    """A big request comes down in fragments, and an operation outside the link's numbering (an
    ask for messages again, a ping) comes between two of them: both are handled, and the
    request reaches the rank whole (it used to be dropped, with the operation)."""
    import torch

    sock = listening.client(listening.network.me, listening.network.server.public)
    sock.connect(listening.address)
    listening.configure(sock)
    data = torch.arange(10 << 20, dtype=torch.int32)  # 40 MiB: in fragments
    request = listening.wire.pack({msg.KIND: msg.EXEC, msg.ID: 43}, {"code": "6 * 7", "data": data})
    cut = split(request, at=1)
    assert len(cut.fragments) >= 2
    ping = listening.wire.pack({msg.KIND: msg.OP, msg.ID: None, msg.RANKS: []},
                               {"op": msg.AgentOp.PING, "sent": time.monotonic(), "wall": time.time_ns(), "ack": 0})
    for i, fragment in enumerate(cut.fragments):
        sock.send_multipart([encode_head(0, listening.number(sock), fragment[0]), *fragment[1:]])
        if i == 0:
            listening.send(sock, 0, ping)  # outside the order, as asking again is
    last = cut.last([encode_route(msg.MAIN, [0])])
    sock.send_multipart([encode_head(0, listening.number(sock), last[0]), *last[1:]])
    got = listening.replies(sock, 12, until=msg.RESULT)
    assert [m for m in got if m.kind == msg.HOST_BEAT], "the ping was answered"
    assert [(m.header[msg.ID], m.body()) for m in got if m.kind == msg.RESULT] == [(43, 42)]
    sock.close(linger=0)
