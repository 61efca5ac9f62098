"""The controller's sockets and its receiver thread: how requests leave and answers come in.

One per mesh, in a private (0700) runtime directory: a PUSH per rank and channel that sends
requests straight to the rank (see :func:`~meshbook.mesh.protocol.wire.rank_address`), a ROUTER
for what it asks of the agent on this host (signals, re-forks), and a PULL on which the ranks
and that agent send everything back; beside them the lane (:mod:`~meshbook.mesh.protocol.lane`),
Unix datagrams past ZeroMQ's I/O threads for requests to idle ranks and what ranks send back.
Agents on other hosts are reached over the links of a :class:`~..launch.network.Network`, once
per host. The receiver thread reads the PULL socket
and the links and hands each message on (``on_message``, ``on_host``), calls ``on_drained``
once it took what every ready socket held (before it sleeps), and every ``TICK_S`` calls
``on_tick`` (agents' liveness, pings, the run watcher).

A ZeroMQ socket belongs to one thread at a time: the receiver owns the PULL socket and the
links; the rank sockets and the ROUTER are used under ``send_lock`` by whichever thread sends.
"""

from __future__ import annotations

import select
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

import zmq

from ...protocol import messages as msg
from ...protocol import wire
from ...protocol.errors import MeshError
from ...protocol.lane import Intake, Lane
from ...protocol.proc import owned_prefix, remove_stale, runtime_base, usable_cores
from ..launch.network import HostLink, Network

#: How often the receiver looks at the agents, pings remote ones and lets the run watcher look.
TICK_S = 0.25
#: What processes of this machine name after themselves (``owned_prefix``) and a killed one
#: leaves behind: runtime directories, and the ssh sessions' logs.
STALE_KINDS = ("mb", "meshbook-ssh")
#: ZeroMQ I/O threads of a controller: each encrypts (CurveZMQ) the links it serves, so pushes to
#: several hosts are encrypted side by side, not one after the other on one core. That pays
#: where each has a core to spare (one per 4 cores, up to 4: a login node); on a small machine
#: they only time-share the cores with the receiver thread. Measured on 2 cores, a no-op to
#: 1,024 ranks on 128 hosts: 18 ms of the controller's CPU per round trip with one, 23 ms with
#: four (the receiver's share grows too: 10.5 ms against 12.9).
NETWORK_IO_THREADS = max(1, min(4, usable_cores() // 4))
#: The one I/O thread (a bit mask) of every ipc socket: a request to 8 local ranks wakes one
#: thread, not up to four, each a thread switch on the request's way (see DESIGN.md, threads).
LOCAL_IO = 1

Handler = Callable[[list[Any]], None]
HostHandler = Callable[["HostLink | None", bytes, list[Any]], None]
#: What a send queued: the ranks of each message, and its tracker where it has big buffers.
Sent = list[tuple[list[int], "zmq.MessageTracker | None"]]


class Transport:
    """Sockets, sends and the receiver thread of one controller."""

    def __init__(self) -> None:
        remove_stale(runtime_base(), STALE_KINDS)  # what killed kernels left on this host
        self.rundir = tempfile.mkdtemp(prefix=owned_prefix("mb"), dir=runtime_base())  # mode 0700
        self.ctx = zmq.Context(io_threads=NETWORK_IO_THREADS)
        try:
            self._bind()
        except BaseException:  # leave nothing: an unclosed context blocks whoever collects it
            self.ctx.destroy(linger=0)
            shutil.rmtree(self.rundir, ignore_errors=True)
            raise
        self.send_lock = threading.Lock()
        self.network: Network | None = None
        self._down: dict[int, dict[str, zmq.Socket]] = {}
        #: Requests to idle ranks, and what ranks send up, past ZeroMQ (see :mod:`~...protocol.lane`).
        self._lane = Lane()
        self._intake = Intake(self.events_address)
        self._receiver: threading.Thread | None = None
        self._running = True
        self._closed = False  # close() ran: nothing is sent any more
        self._rewatch_failed = False  # the receiver could not build its latest watch (said once)

    def _bind(self) -> None:
        self.cmd = self.ctx.socket(zmq.ROUTER)
        self.cmd.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.cmd.setsockopt(zmq.SNDHWM, 0)
        self.cmd.setsockopt(zmq.AFFINITY, LOCAL_IO)
        self.cmd.bind(f"ipc://{self.rundir}/cmd")
        self.events = self.ctx.socket(zmq.PULL)
        self.events.setsockopt(zmq.RCVHWM, 0)
        self.events.setsockopt(zmq.AFFINITY, LOCAL_IO)
        self.events.bind(f"ipc://{self.rundir}/ev")
        self._wake_send = self.ctx.socket(zmq.PAIR)
        self._wake_recv = self.ctx.socket(zmq.PAIR)
        self._wake_recv.bind(f"inproc://wake-{id(self)}")
        self._wake_send.connect(f"inproc://wake-{id(self)}")

    @property
    def cmd_address(self) -> str:
        return f"ipc://{self.rundir}/cmd"

    @property
    def events_address(self) -> str:
        return f"ipc://{self.rundir}/ev"

    # -- the receiver thread -------------------------------------------------------------------

    def start(self, on_message: Handler, on_host: HostHandler, on_drained: Callable[[], None],
              on_tick: Callable[[], None]) -> None:
        self._receiver = threading.Thread(target=self._receive, args=(on_message, on_host, on_drained, on_tick),
                                          name="meshbook-receiver", daemon=True)
        self._receiver.start()

    @property
    def receiver(self) -> threading.Thread | None:
        return self._receiver

    def use_network(self, network: Network) -> None:
        """Poll ``network``'s links from now on (the receiver owns their sockets)."""
        self.network = network
        network.wake = self.wake
        self.wake()

    def wake(self) -> None:
        """Make the receiver poll new sockets now (it looks again every ``TICK_S`` anyway)."""
        with self.send_lock:
            if self._running:
                self._wake_send.send(b"poll")

    def _receive(self, on_message: Handler, on_host: HostHandler, on_drained: Callable[[], None],
                 on_tick: Callable[[], None]) -> None:
        watch, version = Watch(self._sockets(), [self._intake.fileno()]), -1
        next_tick = 0.0
        while self._running:
            ready: set[zmq.Socket] = set()
            try:  # the receiver must outlive any one failure
                network = self.network
                if network is not None and network.version != version:
                    watch, version = self._rewatch(watch, version, network)
                ready = watch.ready(TICK_S)
                if self._wake_recv in ready:
                    if self._wake_recv.recv() == b"stop":
                        break
                    watch.recheck([self._wake_recv])  # one taken: another may wait, its signal taken
                self.take_waiting(on_message)  # the lane's every turn; ZeroMQ's asked, not waited for
                if network is not None:
                    for sock in network.sockets():
                        if sock in ready:
                            network.drain(sock, on_host)
                on_drained()
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + TICK_S
                    on_tick()
            except Exception as exc:
                log(f"receiver: {type(exc).__name__}: {exc}")
                watch.recheck(ready)  # a drain cut short leaves messages whose signal is taken
            # A drain ends on the socket's events, which re-arms its signal; a send may take it.
            if self.network is not None:
                watch.recheck(self.network.sent_on)
                self.network.sent_on.clear()
        watch.close()

    def _rewatch(self, watch: "Watch", version: int, network: Network) -> tuple["Watch", int]:
        """A watch of the sockets as they are now, and the network's version it saw.

        The version is read first: a socket added while the list is taken bumps it again, and
        is watched at the next turn (read after the list, it would be missed until the next
        change, which may never come). The new watch is built before the old one is closed:
        one that cannot be built (no descriptors left) leaves the old one working, and is
        tried again at the next turn, where closing first left nothing to wait on, for ever.
        """
        seen = network.version
        try:
            fresh = Watch(self._sockets(), [self._intake.fileno()])
        except Exception as exc:  # noqa: BLE001 - whatever epoll or ZeroMQ raise
            if not self._rewatch_failed:  # said once, not at every turn while it lasts
                log(f"receiver: cannot watch the hosts' new sockets yet ({type(exc).__name__}: {exc}); "
                    f"trying again")
            self._rewatch_failed = True
            return watch, version
        self._rewatch_failed = False
        watch.close()
        network.settle()
        return fresh, seen

    def take_waiting(self, on_message: Handler) -> None:
        """Hand on what the ranks and the agent sent that is here now, by the lane and through
        ZeroMQ, each in its place (the receiver thread only: at every turn, and from inside a
        handler, where a rank's ``EXIT`` lets through first what that rank sent before it)."""
        self._intake.drain(on_message)
        for frames in wire.ready(self.events):
            self._intake.after_lane(frames, on_message)

    def _sockets(self) -> list[zmq.Socket]:
        return [self.events, self._wake_recv, *(self.network.sockets() if self.network else ())]

    # -- sending ---------------------------------------------------------------------------------

    def connect_rank(self, rank: int, generation: int) -> None:
        """Point ``rank``'s sockets at its process forked in ``generation``. ZeroMQ queues what
        is sent before the rank has bound its sockets, so a request never waits for, or races
        with, the rank's start-up."""
        with self.send_lock:
            if self._closed:
                return  # a restart racing a stop: its sockets would keep the context from ending
            self._disconnect(rank)
            self._down[rank] = wire.connect_rank(self.ctx, self.rundir, rank, generation, LOCAL_IO)
            self._lane.point(rank, wire.rank_address(self.rundir, rank, generation, msg.MAIN))

    def disconnect_rank(self, rank: int) -> None:
        """Drop a rank's sockets with whatever they still held for it (the runs that waited on
        it have failed), so nothing retries connecting to a dead process."""
        with self.send_lock:
            self._disconnect(rank)

    def _disconnect(self, rank: int) -> None:
        self._lane.point(rank, None)
        for sock in self._down.pop(rank, {}).values():
            sock.close(linger=0)

    def send_to_hosts(self, frames: list[Any], routes: dict[int, bytes], ranks: list[int]) -> Sent:
        """One message per host (``routes``: each host's channel and ranks, see
        :func:`~meshbook.mesh.protocol.remote.encode_route`), which its agent fans out to
        ``ranks``. Queued when it returns, in the order of the calls; with big buffers,
        :meth:`wait_sent` waits until the receiver took its copy (what the links send and
        keep), whichever hosts are alive."""
        network = self.network
        assert network is not None
        if not routes:
            return []  # every rank it was for died: nothing to copy for no one
        with self.send_lock:
            if self._closed:
                return []  # the mesh stopped meanwhile, and failed the runs that waited
            return [(ranks, network.send(routes, frames))]

    def send_to_ranks(self, frames: list[Any], ranks: list[int], channel: str,
                      idle: Collection[int] = ()) -> Sent:
        """One message per rank straight to its socket (on this host: relaying through the agent
        would cost a process hop and a copy per request, and buy nothing); by the lane to the
        ``idle`` ranks (nothing queued: nothing sent before can still be on its way). Queued
        when it returns, in the order of the calls; with big buffers, :meth:`wait_sent` waits
        until they left."""
        with self.send_lock:
            # A rank that died since the caller checked has no sockets: its death failed the run.
            live = [r for r in ranks if r in self._down]
            if idle and channel == msg.MAIN:
                missed = set(self._lane.send([r for r in live if r in idle], frames))
                live = [r for r in live if r not in idle or r in missed]
            trackers = wire.fan_out([self._down[r][channel] for r in live], frames)
        return [([rank], tracker) for rank, tracker in zip(live, trackers)]

    def wait_sent(self, sent: Sent, alive: Callable[[list[int]], bool]) -> None:
        """Until the big buffers of what :meth:`send_to_ranks` queued left (for other hosts:
        until the receiver copied them, see ``Network.send``), so the caller may change its
        tensors; ranks that died meanwhile (``alive`` says) never take them."""
        for ranks, tracker in sent:
            while tracker is not None and not tracker.done and self._running and alive(ranks):
                try:
                    tracker.wait(0.1)
                except zmq.NotDone:
                    pass

    def send_to_agents(self, frames: list[Any], hosts: list[int]) -> None:
        """An operation for the agents of ``hosts``: over their links, or to this host's agent."""
        with self.send_lock:
            if self._closed:
                return  # as in send_to_ranks
            if self.network is not None:
                self.network.send(dict.fromkeys(hosts, b""), frames)  # small: an operation for the agents
                return
            for host in hosts:
                for attempt in range(200):
                    try:
                        wire.send(self.cmd, frames, prefix=[f"agent:{host}".encode(), b""], wait=True)
                        break
                    except zmq.ZMQError as exc:
                        # EHOSTUNREACH: the agent's connection is not up yet (start-up only).
                        if exc.errno != zmq.EHOSTUNREACH or attempt == 199:
                            raise MeshError(f"cannot reach the host agent {host}: {exc}") from None
                        time.sleep(0.01)

    # -- ending --------------------------------------------------------------------------------

    def stop_receiver(self) -> None:
        """End the receiver thread (from any other thread); its sockets are this thread's then."""
        with self.send_lock:
            if not self._running:
                return
            self._running = False
            self._wake_send.send(b"stop")
        if self._receiver is not None and threading.current_thread() is not self._receiver:
            self._receiver.join(5)

    def close(self) -> None:
        """Close every socket and the context, and remove the runtime directory. Under the
        send lock: a thread sending meanwhile (a request whose run the stop failed) finds
        nothing to send on, not a closed socket."""
        with self.send_lock:
            self._closed = True
            if self.network is not None:
                self.network.close()
            rank_socks = [sock for socks in self._down.values() for sock in socks.values()]
            self._down.clear()
            for sock in (self.cmd, self.events, self._wake_send, self._wake_recv, *rank_socks):
                sock.close(linger=0)
            self._lane.close()
            self._intake.close()
        self.ctx.term()
        shutil.rmtree(self.rundir, ignore_errors=True)


class Watch:
    """Which of many ZeroMQ sockets have messages, at a cost that does not grow with their number.

    ``zmq.Poller`` asks every socket at every wake-up: with a link per host that is 130 sockets,
    about 270 us a call here, and it wakes many times per round trip. This watches the sockets'
    signalling file descriptors with epoll instead, and asks only the ones that fired. ZeroMQ's
    contract for that descriptor: it signals that a socket's state *may* have changed, and any
    operation on the socket (a receive, a send, asking its events) may consume the signal, and
    asking the events re-arms it when nothing is left. So a drain ends on asking the events
    (:func:`~..protocol.wire.ready`), and a socket this thread sent on, or read only part of,
    is asked directly (:meth:`recheck`) before it sleeps again.
    """

    def __init__(self, sockets: list[zmq.Socket], descriptors: Iterable[int] = ()) -> None:
        """``descriptors``: plain ones to wake up for too (whoever wakes drains them itself)."""
        self._epoll = select.epoll()
        self._by_fd: dict[int, zmq.Socket] = {}
        sockets = [sock for sock in sockets if not sock.closed]
        try:
            for fd in descriptors:
                self._epoll.register(fd, select.EPOLLIN)
            for sock in sockets:
                fd = int(sock.getsockopt(zmq.FD))
                self._by_fd[fd] = sock
                self._epoll.register(fd, select.EPOLLIN)
        except BaseException:
            self._epoll.close()  # not one more descriptor lost when descriptors run out
            raise
        self._recheck: set[zmq.Socket] = set(sockets)  # messages may be waiting already

    def recheck(self, sockets: Iterable[zmq.Socket]) -> None:
        """Ask these sockets before sleeping: this thread operated on them."""
        self._recheck.update(sockets)

    def ready(self, timeout: float) -> set[zmq.Socket]:
        """The sockets with a message to receive, waiting up to ``timeout`` seconds for one."""
        ready = {sock for sock in self._recheck if not sock.closed and wire.readable(sock)}
        self._recheck.clear()
        if ready:
            return ready
        # Asking a socket that fired but holds nothing re-arms its signal, as a drain does.
        return {sock for fd, _ in self._epoll.poll(timeout)
                if fd in self._by_fd and wire.readable(sock := self._by_fd[fd])}

    def close(self) -> None:
        self._epoll.close()




def log(text: str) -> None:
    import sys

    print(f"meshbook: {text}", file=sys.__stderr__)
