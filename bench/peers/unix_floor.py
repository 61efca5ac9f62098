"""The same floor as :mod:`.zmq_floor`, without ZeroMQ: what its I/O threads cost.

The processes and the path are :mod:`.zmq_floor`'s (the controller sends one small message to
each of ``n`` ranks a host agent forked, every rank answers to a receiver thread that wakes
the caller), but over Unix datagram sockets, which each thread reads and writes itself. A
ZeroMQ message passes through an I/O thread at each end (the sender's queues it and wakes
that thread, which writes it; the receiver's reads it and wakes the reader): two more thread
wake-ups per message. The dispatch tables show this as a second reference, so that the part
of the ZeroMQ floor that is thread hand-offs, not work, is measured, not guessed.

Run as ``python -m bench.peers.unix_floor RUNDIR N`` by :func:`start`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

from meshbook.mesh.protocol.proc import die_with_parent

from .zmq_floor import MESSAGE, Counted, fork_ranks

DISPATCH = "same path, Unix datagrams"
_BYE = b"bye"


class UnixFloorHandle(Counted):
    def __init__(self, n: int) -> None:
        self.n = n
        self.rundir = tempfile.mkdtemp(prefix="mb-ufloor-")
        self.events = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.events.bind(f"{self.rundir}/ev")
        self.agent = subprocess.Popen([sys.executable, "-m", __name__, self.rundir, str(n)],
                                      start_new_session=True)
        hellos = [self.events.recv(64) for _ in range(n)]
        self._pids = [int(h) for h in hellos]
        self.down = []
        for rank in range(n):  # each rank bound its socket before it said hello
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.connect(f"{self.rundir}/r{rank}")
            self.down.append(sock)
        self._count()

    def _answer(self) -> bool:
        return self.events.recv(65536) != _BYE

    def _send(self) -> None:
        for sock in self.down:
            sock.send(MESSAGE[0])

    def close(self) -> None:
        os.killpg(self.agent.pid, signal.SIGKILL)  # the agent and the ranks it forked
        self.agent.wait()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as bye:  # ends the receiver thread
            bye.sendto(_BYE, f"{self.rundir}/ev")
        self._receiver.join(5)
        for sock in [*self.down, self.events]:
            sock.close()
        shutil.rmtree(self.rundir, ignore_errors=True)


def start(n: int, dist: bool = False) -> UnixFloorHandle:
    return UnixFloorHandle(n)


def _rank(rundir: str, rank: int, agent: int) -> None:
    die_with_parent(agent)
    requests = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    requests.bind(f"{rundir}/r{rank}")
    answers = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    answers.connect(f"{rundir}/ev")
    answers.send(str(os.getpid()).encode())
    while True:
        requests.recv(65536)
        answers.send(MESSAGE[0])


def _agent(rundir: str, n: int) -> None:
    fork_ranks(n, lambda rank, agent: _rank(rundir, rank, agent))
    signal.pause()  # supervises, as meshbook's agent does, off the request path


if __name__ == "__main__":
    _agent(sys.argv[1], int(sys.argv[2]))
