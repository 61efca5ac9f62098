"""The floor of meshbook's design: its processes and sockets, with nothing of meshbook.

The controller sends one small message to each of ``n`` rank processes, which a host agent
forked, through a PUSH socket per rank; every rank answers straight to the controller's
PULL socket, where a receiver thread counts the answers and wakes the caller. That is
meshbook's path on one host (``ipc://``, no relay, a receiver thread) without
signing, pickling, running code or any book-keeping, so its round trip is what the design
costs on this machine before meshbook does anything: the dispatch tables show it as a
reference, and the gap above it is meshbook's own work.

Run as ``python -m bench.peers.zmq_floor RUNDIR N`` by :func:`start`; not a system a user
would pick, so it is not one of :data:`bench.peers.SYSTEMS`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable

import zmq

from meshbook.mesh.protocol import wire
from meshbook.mesh.protocol.proc import die_with_parent

DISPATCH = "bare pyzmq, same path"
MESSAGE = [b"e" * 160]  # meshbook's one-frame envelope for a small request


class Counted:
    """What a floor's controller side does besides its sockets: a receiver thread counts the
    answers, and a no-op waits for one from every rank. Subclasses take one answer
    (:meth:`_answer`, False once told to stop) and send the request (:meth:`_send`)."""

    n: int
    _pids: list[int]

    def _count(self) -> None:
        self._answers = 0
        self._cond = threading.Condition()
        self._receiver = threading.Thread(target=self._receive, daemon=True)
        self._receiver.start()

    def _answer(self) -> bool:
        raise NotImplementedError

    def _send(self) -> None:
        raise NotImplementedError

    def _receive(self) -> None:
        while self._answer():
            with self._cond:
                self._answers += 1
                if self._answers % self.n == 0:
                    self._cond.notify_all()

    def noop(self) -> None:
        with self._cond:
            target = self._answers + self.n
        self._send()
        with self._cond:
            self._cond.wait_for(lambda: self._answers >= target)

    def pids(self) -> list[int]:
        return list(self._pids)


class FloorHandle(Counted):
    def __init__(self, n: int) -> None:
        self.n = n
        self.rundir = tempfile.mkdtemp(prefix="mb-floor-")
        self.ctx = zmq.Context()
        self.events = self.ctx.socket(zmq.PULL)
        self.events.bind(f"ipc://{self.rundir}/ev")
        self.down = []
        for rank in range(n):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.RECONNECT_IVL, 10)
            sock.connect(f"ipc://{self.rundir}/r{rank}")
            self.down.append(sock)
        self.agent = subprocess.Popen([sys.executable, "-m", __name__, self.rundir, str(n)],
                                      start_new_session=True)
        hellos = [wire.recv(self.events)[0].bytes for _ in range(n + 1)]  # the ranks' and the agent's
        self._pids = [int(h) for h in hellos if h.isdigit()]
        self._count()

    def _answer(self) -> bool:
        return bool(wire.recv(self.events)[0].bytes != b"bye")

    def _send(self) -> None:
        wire.fan_out(self.down, MESSAGE)

    def close(self) -> None:
        os.killpg(self.agent.pid, signal.SIGKILL)  # the agent and the ranks it forked
        self.agent.wait()
        with self.ctx.socket(zmq.PUSH) as bye:  # ends the receiver thread
            bye.connect(f"ipc://{self.rundir}/ev")
            bye.send(b"bye")
        self._receiver.join(5)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.rundir, ignore_errors=True)


def start(n: int, dist: bool = False) -> FloorHandle:
    return FloorHandle(n)


def _rank(rundir: str, rank: int, agent: int) -> None:
    die_with_parent(agent)
    ctx = zmq.Context()
    requests = ctx.socket(zmq.PULL)
    requests.bind(f"ipc://{rundir}/r{rank}")
    answers = ctx.socket(zmq.PUSH)
    answers.connect(f"ipc://{rundir}/ev")
    answers.send(str(os.getpid()).encode())
    while True:
        wire.recv(requests)
        wire.send(answers, MESSAGE)


def fork_ranks(n: int, rank_main: Callable[[int, int], None]) -> None:
    """The agent: fork ``n`` ranks, each running ``rank_main(rank, agent pid)`` (before this
    process has a zmq context, and its threads)."""
    die_with_parent(os.getppid())
    me = os.getpid()
    for rank in range(n):
        if os.fork() == 0:
            rank_main(rank, me)
            os._exit(0)


def _agent(rundir: str, n: int) -> None:
    fork_ranks(n, lambda rank, agent: _rank(rundir, rank, agent))
    with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as up:
        up.connect(f"ipc://{rundir}/ev")
        up.send(b"agent up")  # supervises, as meshbook's agent does, off the request path
        signal.pause()


if __name__ == "__main__":
    _agent(sys.argv[1], int(sys.argv[2]))
