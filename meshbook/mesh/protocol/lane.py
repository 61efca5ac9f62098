"""A request to an idle rank on this host goes as one Unix datagram, past ZeroMQ's I/O threads.

Why: every ZeroMQ message passes through an I/O thread at each end. A request to 8 local ranks
wakes the controller's I/O thread, then each rank's I/O thread before the rank's main thread:
on a machine whose cores the ranks share, those wake-ups are a large part of a no-op round trip
(bench/: the floor over Unix datagrams is a quarter to a half of the bare-pyzmq floor). A
datagram is written by the sending thread straight into the receiving socket's queue, and read
there by the thread that runs the request.

Order: a rank's main thread runs its requests in the order they were sent, and the lane is a
second way in beside its ZeroMQ socket. Two rules keep that one order:

* the controller sends by the lane only to a rank with nothing queued (it answered every request
  sent to it before, so nothing sent earlier through ZeroMQ can still be on its way); and
* the rank takes what its lane holds before what its ZeroMQ socket holds: a datagram is in the
  rank's queue once ``sendto`` returns, before anything sent after it reaches ZeroMQ.

Everything else goes through ZeroMQ as before: requests to a busy rank (ZeroMQ queues them
without bound, where a datagram queue is small and the controller must never block on a rank),
messages over :data:`LANE_MAX` or with separate buffers, control calls, ranks on other hosts
(their agent relays), and any datagram the kernel refuses (the rank not listening, or gone).
The lane carries the same signed messages: the rank checks them as it checks the others.
"""

from __future__ import annotations

import select
import socket
from typing import Any

import zmq

from . import wire

#: The biggest request the lane carries, in bytes (under any system's datagram limit).
LANE_MAX = 64 * 1024

_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


def lane_path(address: str) -> str:
    """The lane beside a rank's main-channel ipc address (:func:`~.wire.rank_address`): named
    after the rank and the generation it was forked in, as that address is."""
    return address.removeprefix("ipc://") + "l"


class Lane:
    """The controller's end: one unbound datagram socket, used under the transport's send lock."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._paths: dict[int, str] = {}

    def point(self, rank: int, address: str | None) -> None:
        """``rank``'s main channel is now at ``address`` (None: the rank is gone)."""
        if address is None:
            self._paths.pop(rank, None)
        else:
            self._paths[rank] = lane_path(address)

    def send(self, rank: int, frames: list[Any]) -> bool:
        """Send ``frames`` to ``rank`` by the lane if they fit and it takes them now; False:
        nothing was sent (send them through ZeroMQ)."""
        where = self._paths.get(rank)
        if where is None or len(frames) != 1 or len(frames[0]) > LANE_MAX:
            return False
        try:
            self._sock.sendto(frames[0], where)
        except OSError:  # not bound yet, gone, or its queue full
            return False
        return True

    def close(self) -> None:
        self._sock.close()


class Inbox:
    """A rank's main-thread requests: from its lane first, then from its ZeroMQ socket."""

    def __init__(self, address: str, sock: zmq.Socket) -> None:
        self._zmq = sock
        self._lane = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._lane.bind(lane_path(address))
        self._lane.setblocking(False)
        self._poller = select.poll()
        self._poller.register(self._lane.fileno(), select.POLLIN)
        # ZeroMQ's descriptor only signals that the socket's state may have changed: asking
        # its events (below, before every wait) is what tells, and re-arms it.
        self._poller.register(int(sock.getsockopt(zmq.FD)), select.POLLIN)
        #: Requests that came by the lane (the tests check that it is used).
        self.by_lane = 0

    def next(self) -> list[Any]:
        """The next request's frames, waiting for one."""
        while True:
            try:
                data = self._lane.recv(LANE_MAX)
            except BlockingIOError:
                pass
            else:
                self.by_lane += 1
                return [data]
            if int(self._zmq.getsockopt(_EVENTS)) & _POLLIN:
                return wire.recv(self._zmq, _NOBLOCK)
            self._poller.poll()
