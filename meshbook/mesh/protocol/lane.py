"""Requests to an idle rank on this host, and everything a rank sends its controller on this
host, go as Unix datagrams, past ZeroMQ's I/O threads.

Why: every ZeroMQ message passes through an I/O thread at each end. A no-op to 8 local ranks
wakes the controller's I/O thread, then each rank's I/O thread before its main thread, and the
same again on the way back: on a machine whose cores the ranks share, those wake-ups are a large
part of the round trip (bench/: the floor over Unix datagrams is a quarter to a half of the
bare-pyzmq floor). A datagram is written by the sending thread straight into the receiving
socket's queue, and read there by the thread that handles it. The lane carries the same signed
messages: they are checked as the others are.

Order is what the lane must not cost, and it is a second way in beside a ZeroMQ socket:

* Down (:class:`Lane`, :class:`Inbox`): a rank's main thread runs its requests in the order they
  were sent. The controller sends by the lane only to a rank with nothing queued (it answered
  every request sent to it before, so nothing sent earlier through ZeroMQ can still be on its
  way), and the rank takes what its lane holds before what its ZeroMQ socket holds (a datagram is
  in the rank's queue once ``sendto`` returns, before anything sent after it reaches ZeroMQ).
  Requests to a busy rank go through ZeroMQ, which queues them without bound: the controller
  must never block on a rank, and a datagram queue is small.
* Up (:class:`Uplink`, :class:`Intake`): a rank's messages reach the controller in the order it
  sent them (its output before its result). Each datagram says how many messages its process
  had sent through ZeroMQ before it; the controller holds it until it has taken that many from
  that process (known by the stamp every message carries), and drains the lane before each
  message it takes from ZeroMQ. A message the lane cannot carry goes through ZeroMQ and is counted: a full queue
  never blocks a rank, whether or not its controller reads (a kept mesh's does not).

Everything else goes through ZeroMQ as before: messages over :data:`LANE_MAX` or with separate
buffers, control calls, ranks on other hosts (their agent relays both ways), and any datagram
the kernel refuses (no one listening, or gone).
"""

from __future__ import annotations

import select
import socket
import struct
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from . import wire
from .proc import let_go_in_children

#: The biggest request the lane carries, in bytes (under any system's datagram limit).
LANE_MAX = 64 * 1024

#: What leads a datagram up: how many messages its process had sent through ZeroMQ before it.
_BEFORE = struct.Struct("<Q")


def _fits(frames: list[Any]) -> bool:
    """One envelope, no separate buffers, within :data:`LANE_MAX`."""
    return len(frames) == 1 and len(frames[0]) <= LANE_MAX


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
        if where is None or not _fits(frames):
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
        """The next request's frames, waiting for one.

        ZeroMQ is asked first, the lane second: a datagram is sent only to a rank that has
        nothing else on its way, so one that waits beside a ZeroMQ request is the older, and is
        in the lane's queue before that request can be seen. Asked the other way round, a
        request that arrives through ZeroMQ while this thread is between the two questions
        (descheduled) would be taken before the datagram sent ahead of it."""
        while True:
            through_zmq = wire.readable(self._zmq)
            try:
                data = self._lane.recv(LANE_MAX)
            except BlockingIOError:
                pass
            else:
                self.by_lane += 1
                return [data]
            if through_zmq:
                return wire.recv(self._zmq, wire.NOBLOCK)
            self._poller.poll()


class Uplink:
    """A rank's end of its messages up, used under its send lock: by the lane while its
    controller listens on this host (its agent relays them otherwise: the lane is left then)."""

    def __init__(self, events_address: str) -> None:
        self._path: str | None = lane_path(events_address)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._by_zmq = 0
        #: Messages that went up by the lane (the tests check that it is used).
        self.by_lane = 0
        let_go_in_children(self, "leave")

    def send(self, frames: list[Any]) -> bool:
        """Send ``frames`` by the lane if it carries them now; False: nothing was sent (send
        them through ZeroMQ, then say so with :meth:`sent_by_zmq`)."""
        if self._path is None or not _fits(frames):
            return False
        try:
            self._sock.sendto(_BEFORE.pack(self._by_zmq) + frames[0], self._path)
        except (FileNotFoundError, ConnectionRefusedError):
            self._path = None  # no controller listens on this host: the agent relays
            return False
        except OSError:  # the controller's queue is full: this one through ZeroMQ, in order still
            return False
        self.by_lane += 1
        return True

    def sent_by_zmq(self) -> None:
        self._by_zmq += 1

    def leave(self) -> None:
        """A forked child writes through ZeroMQ only (its messages never keep an order with
        the rank's anyway, and its count would not be the rank's)."""
        self._path = None


Handler = Callable[[list[Any]], None]


class Intake:
    """The controller's end of what ranks send up by the lane: each message handed on in its
    place among its process's ZeroMQ messages (the receiver thread's)."""

    def __init__(self, events_address: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(lane_path(events_address))
        self._sock.setblocking(False)
        #: ZeroMQ messages handed on, and datagrams that wait for some, per sending process.
        self._taken: dict[bytes, int] = {}
        self._held: dict[bytes, deque[tuple[int, bytes]]] = {}

    def fileno(self) -> int:
        return self._sock.fileno()

    def drain(self, handle: Handler) -> None:
        """Hand on what the lane holds, each message once its process's ZeroMQ messages sent
        before it were."""
        while True:
            try:
                data = self._sock.recv(_BEFORE.size + LANE_MAX)
            except BlockingIOError:
                return
            sender = wire.stamp_sender(memoryview(data)[_BEFORE.size:])
            if sender is None:
                continue  # not a message: nothing to keep in order (it would be dropped anyway)
            (before,) = _BEFORE.unpack_from(data)
            held = self._held.get(sender)
            if held is None and self._taken.get(sender, 0) >= before:
                handle([memoryview(data)[_BEFORE.size:]])
            else:
                self._held.setdefault(sender, deque()).append((before, data))

    def after_lane(self, frames: list[Any], handle: Handler) -> None:
        """Hand on a message that came through ZeroMQ: after what the lane holds (whatever a
        process sent there before this message is there by now, and one ZeroMQ drain may
        take several of its messages), and before what its process sent by the lane after it."""
        self.drain(handle)
        handle(frames)
        sender = wire.stamp_sender(frames[0])
        if sender is None:
            return
        taken = self._taken[sender] = self._taken.get(sender, 0) + 1
        held = self._held.get(sender)
        while held and held[0][0] <= taken:
            handle([memoryview(held.popleft()[1])[_BEFORE.size:]])
        if held is not None and not held and self._held.get(sender) is held:
            del self._held[sender]  # (a handler may have come back here: a rank's EXIT takes what waits)

    def close(self) -> None:
        self._sock.close()
