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

import ctypes
import select
import socket
import struct
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from . import wire
from .proc import LIBC, let_go_in_children

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
        self._burst = Burst(self._sock.fileno()) if Burst.available() else None

    def point(self, rank: int, address: str | None) -> None:
        """``rank``'s main channel is now at ``address`` (None: the rank is gone)."""
        path = lane_path(address) if address is not None else ""
        if 0 < len(path.encode()) < _PATH_MAX:
            self._paths[rank] = path
        else:  # gone, or a path no socket binds to: ZeroMQ's
            self._paths.pop(rank, None)
        if self._burst is not None:
            self._burst.forget()  # its addresses were made for the paths before

    def send(self, ranks: list[int], frames: list[Any]) -> list[int]:
        """Send ``frames`` by the lane to each of ``ranks`` that takes them now; the ranks it
        did not reach (send them through ZeroMQ)."""
        if not _fits(frames):
            return ranks
        paths = self._paths
        reached = [r for r in ranks if r in paths]
        missed = [r for r in ranks if r not in paths] if len(reached) < len(ranks) else []
        if self._burst is not None:
            return missed + self._burst.send(frames[0], reached, paths)
        for rank in reached:  # one by one where there is no sendmmsg
            try:
                self._sock.sendto(frames[0], paths[rank])
            except OSError:  # not bound yet, gone, or its queue full
                missed.append(rank)
        return missed

    def close(self) -> None:
        self._sock.close()


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


class _MsgHdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("name_length", ctypes.c_uint32), ("iov", ctypes.POINTER(_IoVec)),
                ("iov_length", ctypes.c_size_t), ("control", ctypes.c_void_p), ("control_length", ctypes.c_size_t),
                ("flags", ctypes.c_int)]


class _MMsgHdr(ctypes.Structure):
    _fields_ = [("header", _MsgHdr), ("sent", ctypes.c_uint)]


#: The longest path a Unix socket address holds, with its closing NUL (Linux's sun_path).
_PATH_MAX = 108


class _SockAddrUn(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("path", ctypes.c_char * _PATH_MAX)]


class Burst:
    """One datagram to many ranks in one system call (Linux's ``sendmmsg``).

    Why: each ``sendto`` wakes its rank, and the woken rank takes the sender's core at once,
    so a request sent rank by rank ran on the ranks one after another, each before the next
    was even sent, while the other cores waited. Sent in one call, every rank is woken
    before the sender gives up its core, and they run side by side.
    """

    def __init__(self, fd: int) -> None:
        assert LIBC is not None
        self._sendmmsg = LIBC.sendmmsg
        self._fd = fd
        self._data = ctypes.create_string_buffer(LANE_MAX)
        self._iov = _IoVec(ctypes.addressof(self._data), 0)
        #: Message headers per list of ranks (the whole mesh, a slice), with the addresses they
        #: point at: made once, until a rank's path changes.
        self._headers: dict[tuple[int, ...], tuple[Any, list[_SockAddrUn]]] = {}

    @staticmethod
    def available() -> bool:
        return LIBC is not None and hasattr(LIBC, "sendmmsg")

    def forget(self) -> None:
        self._headers.clear()

    def send(self, data: bytes, ranks: list[int], paths: dict[int, str]) -> list[int]:
        """Send ``data`` to each of ``ranks`` (at ``paths``); the ranks it did not reach."""
        key = tuple(ranks)
        known = self._headers.get(key)
        headers = known[0] if known is not None else self._made(key, paths)
        ctypes.memmove(self._data, data, len(data))
        self._iov.length = len(data)
        missed: list[int] = []
        first = 0
        while first < len(ranks):
            sent = self._sendmmsg(self._fd, ctypes.byref(headers, first * ctypes.sizeof(_MMsgHdr)),
                                  len(ranks) - first, 0)
            if sent < 0:  # the first one failed (not bound yet, gone, or its queue full): go on after it
                missed.append(ranks[first])
                sent = 1
            first += sent
        return missed

    def _made(self, ranks: tuple[int, ...], paths: dict[int, str]) -> Any:
        if len(self._headers) >= 64:
            self._headers.clear()
        addresses = [_SockAddrUn(socket.AF_UNIX, paths[r].encode()) for r in ranks]
        headers = (_MMsgHdr * len(ranks))()
        for header, address in zip(headers, addresses):
            # The whole structure: Linux reads the path up to its NUL.
            header.header.name, header.header.name_length = ctypes.addressof(address), ctypes.sizeof(address)
            header.header.iov, header.header.iov_length = ctypes.pointer(self._iov), 1
        self._headers[ranks] = (headers, addresses)
        return headers


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

        A datagram is sent only to a rank with nothing else on its way, so one in the lane is
        older than anything ZeroMQ holds: the lane is read first, and again after ZeroMQ said it
        holds a request, since a datagram that came in between is the older one. (Read only
        before ZeroMQ, a datagram sent while this thread was between the two questions would be
        taken after the request sent behind it.) ZeroMQ's events are asked once per request:
        asking re-arms its descriptor before each wait."""
        while True:
            data = self._datagram()
            if data is not None:
                return data
            if wire.readable(self._zmq):
                return self._datagram() or wire.recv(self._zmq, wire.NOBLOCK)
            self._poller.poll()

    def _datagram(self) -> list[Any] | None:
        try:
            data = self._lane.recv(LANE_MAX)
        except BlockingIOError:
            return None
        self.by_lane += 1
        return [data]


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
