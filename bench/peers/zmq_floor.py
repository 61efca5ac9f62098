"""The floor of meshbook's design: its processes and sockets, with nothing of meshbook.

The controller's ROUTER sends one 3-frame message to a host agent process, which forwards
it to each of ``n`` rank processes it forked; every rank answers straight to the
controller's PULL socket, where a receiver thread counts the answers and wakes the caller.
That is meshbook's path (``ipc://``, one hop through the agent, a receiver thread) without
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

import zmq

from meshbook.mesh import wire
from meshbook.mesh.proc import die_with_parent

DISPATCH = "bare pyzmq, same path"
MESSAGE = [b"s" * 32, b"h" * 64, b"b" * 64]  # meshbook's frames for a small request


class FloorHandle:
    def __init__(self, n: int) -> None:
        self.n = n
        self.rundir = tempfile.mkdtemp(prefix="mb-floor-")
        self.ctx = zmq.Context()
        self.cmd = self.ctx.socket(zmq.ROUTER)
        self.cmd.bind(f"ipc://{self.rundir}/cmd")
        self.events = self.ctx.socket(zmq.PULL)
        self.events.bind(f"ipc://{self.rundir}/ev")
        self.agent = subprocess.Popen([sys.executable, "-m", __name__, self.rundir, str(n)],
                                      start_new_session=True)
        self.identity, *pids = self.cmd.recv_multipart()
        self._pids = [int(p) for p in pids]
        self._answers = 0
        self._cond = threading.Condition()
        self._receiver = threading.Thread(target=self._receive, daemon=True)
        self._receiver.start()

    def _receive(self) -> None:
        while True:
            frames = wire.recv(self.events)
            if frames[0].bytes == b"bye":
                return
            with self._cond:
                self._answers += 1
                if self._answers % self.n == 0:
                    self._cond.notify_all()

    def noop(self) -> None:
        with self._cond:
            target = self._answers + self.n
        wire.forward(self.cmd, MESSAGE, prefix=[self.identity])
        with self._cond:
            self._cond.wait_for(lambda: self._answers >= target)

    def pids(self) -> list[int]:
        return list(self._pids)

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
    requests = ctx.socket(zmq.DEALER)
    requests.setsockopt(zmq.IDENTITY, str(rank).encode())
    requests.connect(f"ipc://{rundir}/down")
    answers = ctx.socket(zmq.PUSH)
    answers.connect(f"ipc://{rundir}/ev")
    requests.send(b"hello")
    while True:
        wire.recv(requests)
        wire.forward(answers, MESSAGE)


def _agent(rundir: str, n: int) -> None:
    die_with_parent(os.getppid())
    # Fork the ranks before this process has a zmq context (and its threads).
    me = os.getpid()
    ranks = []
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            _rank(rundir, rank, me)
            os._exit(0)
        ranks.append(pid)
    ctx = zmq.Context()
    down = ctx.socket(zmq.ROUTER)
    down.bind(f"ipc://{rundir}/down")
    for _ in range(n):
        down.recv_multipart()  # every rank's hello: all are connected
    cmd = ctx.socket(zmq.DEALER)
    cmd.connect(f"ipc://{rundir}/cmd")
    cmd.send_multipart([str(pid).encode() for pid in ranks])
    identities = [str(rank).encode() for rank in range(n)]
    while True:
        frames = wire.recv(cmd)
        for identity in identities:
            wire.forward(down, frames, prefix=[identity])


if __name__ == "__main__":
    _agent(sys.argv[1], int(sys.argv[2]))
