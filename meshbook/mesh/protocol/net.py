"""The network wire: TCP with CurveZMQ, an allowlist of the mesh's own keys, and addresses.

On one host everything travels over ``ipc://`` inside a private directory. Across hosts it
travels over ``tcp://``, and every such socket is encrypted and authenticated with CurveZMQ
(libsodium, shipped with pyzmq). The side that binds is the Curve *server*, with the mesh's
server key; a ZAP handler (:class:`Allowlist`) admits a connecting peer only if its public key
is one the mesh made for it, which is stricter than admitting anyone who holds the server's public
key. The HMAC signature and the per-sender sequence numbers of :mod:`.wire` stay inside.

Which way the connections go matters more than it seems: compute nodes often cannot open a
connection to the login node where the notebook runs, so agents *listen* and the controller
dials them (or an ``ssh -L`` tunnel does). An agent that joins from an external launcher dials
the controller instead, with a join key the allowlist admits until that many hosts joined.

An agent advertises the address of the interface that routes to the controller, never
``gethostname()`` (which often resolves to 127.0.1.1), and the same interface is handed to
gloo and NCCL.
"""

from __future__ import annotations

import os
import random
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

from .config import PORT_RANGE_ENV

#: Where the ZAP handler listens, as RFC 27 names it (per ZeroMQ context).
ZAP_ENDPOINT = "inproc://zeromq.zap.01"

#: ``MESHBOOK_PORT_RANGE=40000-40999``: the ports meshbook listens on (agents, a joining
#: controller, the store), for sites whose firewalls open only a range.


@dataclass(frozen=True)
class Keys:
    """A CurveZMQ key pair, as the z85 text ZeroMQ takes."""

    public: bytes
    secret: bytes

    @classmethod
    def new(cls) -> "Keys":
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    def to_json(self) -> dict[str, str]:
        return {"public": self.public.decode(), "secret": self.secret.decode()}

    @classmethod
    def from_json(cls, data: dict[str, str]) -> "Keys":
        return cls(data["public"].encode(), data["secret"].encode())


def curve_server(sock: zmq.Socket, server: Keys) -> None:
    """Make ``sock`` a Curve server (before it binds): peers must pass the context's ZAP handler."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, server.secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, b"meshbook")


def curve_client(sock: zmq.Socket, mine: Keys, server_public: bytes) -> None:
    """Make ``sock`` a Curve client of the server whose public key is ``server_public``."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, mine.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, mine.secret)


@dataclass
class Allowlist:
    """The ZAP handler's rule for one ZeroMQ context: admit the listed public keys only.

    A listening agent lists the controller's key alone. A controller waiting for joining hosts
    lists the join key until the hosts have joined, then revokes it: the token is spent, and a
    copy of it found later opens nothing (ZAP cannot tell peers apart by more than their key
    and address, so "once" is enforced by revoking, not by counting).
    """

    keys: set[bytes]
    admitted: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def allow(self, key: bytes) -> None:
        with self._lock:
            self.keys.add(key)

    def revoke(self, key: bytes) -> None:
        with self._lock:
            self.keys.discard(key)

    def decide(self, key: bytes) -> bool:
        with self._lock:
            return key in self.keys

    def count(self, peer: str, admitted: bool) -> None:
        """A handshake from ``peer`` was admitted (or refused): the ZAP handler's thread."""
        with self._lock:
            (self.admitted if admitted else self.refused)[peer] += 1

    def tally(self) -> tuple[int, int]:
        """How many handshakes were admitted and refused so far (any thread)."""
        with self._lock:
            return sum(self.admitted.values()), sum(self.refused.values())

    def serve(self, ctx: zmq.Context) -> "ZapHandler":
        """Start answering ZAP requests of ``ctx`` (before any Curve server socket binds)."""
        return ZapHandler(ctx, self)


class ZapHandler:
    """A thread answering ZeroMQ's authentication requests (RFC 27) from an :class:`Allowlist`."""

    def __init__(self, ctx: zmq.Context, allowlist: Allowlist) -> None:
        self.allowlist = allowlist
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._stop_send = ctx.socket(zmq.PAIR)
        self._stop_recv = ctx.socket(zmq.PAIR)
        name = f"inproc://zap-stop-{id(self)}"
        self._stop_recv.bind(name)
        self._stop_send.connect(name)
        self._thread = threading.Thread(target=self._serve, name="meshbook-zap", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._stop_recv, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._stop_recv in ready:
                break
            self._answer(self._sock.recv_multipart())
        for sock in (self._sock, self._stop_recv):
            sock.close(linger=0)

    def _answer(self, frames: list[bytes]) -> None:
        try:
            split = frames.index(b"")
        except ValueError:
            return
        envelope, request = frames[:split + 1], frames[split + 1:]
        if len(request) < 6:
            return
        version, request_id, _domain, address, _identity, mechanism = request[:6]
        credentials = request[6:]
        admitted = (mechanism == b"CURVE" and len(credentials) == 1
                    and self.allowlist.decide(z85.encode(credentials[0])))
        peer = address.decode(errors="replace")
        self.allowlist.count(peer, admitted)
        status = (b"200", b"OK") if admitted else (b"400", b"not one of this mesh's keys")
        self._sock.send_multipart([*envelope, version, request_id, *status, b"", b""])

    def close(self) -> None:
        self._stop_send.send(b"")
        self._thread.join(5)
        self._stop_send.close(linger=0)


def port_range() -> range | None:
    """The ports meshbook may listen on (``MESHBOOK_PORT_RANGE``), or None: any free port."""
    text = os.environ.get(PORT_RANGE_ENV, "").strip()
    if not text:
        return None
    try:
        low, _, high = text.partition("-")
        ports = range(int(low), int(high or low) + 1)
    except ValueError:
        raise ValueError(f"{PORT_RANGE_ENV}={text!r}: give a range like 40000-40999") from None
    if not ports or ports.start < 1 or ports.stop > 65536:
        raise ValueError(f"{PORT_RANGE_ENV}={text!r}: give a range of ports within 1-65535")
    return ports


def bind_in_range(sock: zmq.Socket, address: str) -> int:
    """Bind ``sock`` to ``tcp://address`` on a port of ``MESHBOOK_PORT_RANGE`` (any free port
    without one); returns the port."""
    host = f"[{address}]" if ":" in address else address
    ports = port_range()
    if ports is None:
        sock.bind(f"tcp://{host}:0")
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)  # a string option
        return int(endpoint.decode().rsplit(":", 1)[1])
    for port in random.sample(ports, len(ports)):
        try:
            sock.bind(f"tcp://{host}:{port}")
            return port
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE:
                raise
    raise OSError(f"no free port in {PORT_RANGE_ENV}={os.environ[PORT_RANGE_ENV]} on {address}")


def free_port_in_range(address: str) -> int:
    """A port of ``MESHBOOK_PORT_RANGE`` (or any) that nothing listens on at ``address`` now."""
    ports = port_range()
    candidates = [0] if ports is None else random.sample(ports, len(ports))
    for port in candidates:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
            try:
                s.bind((address, port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError(f"no free port in {PORT_RANGE_ENV}={os.environ.get(PORT_RANGE_ENV)} on {address}")


def route_to(peer: str) -> str:
    """The address of this machine's interface that packets to ``peer`` leave from (no packet
    is sent: a UDP socket is connected, which only asks the routing table)."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return str(s.getsockname()[0])


def resolve(host: str) -> str:
    """``host``'s IPv4 address (or IPv6 if it has none), as the controller dials it."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])


def tcp_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
