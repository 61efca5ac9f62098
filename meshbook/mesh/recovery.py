"""Getting a stuck or broken mesh usable again, losing as few namespaces as possible.

A rank blocked in a gloo collective ignores SIGINT until the collective's timeout. What does
end it is its connection to a peer closing. :func:`recover` uses that, in escalating steps,
and stops at the first that frees every rank:

1. every free rank re-creates its process group (``destroy_process_group`` closes its
   connections): ranks waiting for a free rank fail at once and follow. No namespace is lost;
2. ranks still stuck after :data:`ABORT_AFTER_S` (they wait only on other stuck ranks, e.g.
   mismatched collectives) get their inter-rank sockets shut down from their control thread,
   which fails their collective in the same way. No namespace is lost;
3. ranks still stuck after that (C code that holds on regardless) are killed and re-forked
   under the same rank id: only these lose their variables.

Ranks asked to restart (``mesh.restart([1])``) and ranks that died are re-forked first. Then
every rank joins a new process group (a new generation in a new store), rebuilds
``device_mesh``, and the :class:`Recovery` report says exactly who kept and who lost what.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import MeshError, format_ranks

if TYPE_CHECKING:
    from .controller import Controller
    from .worker import Worker

#: How long free ranks get to release stuck ones before their sockets are shut down.
ABORT_AFTER_S = 0.2
#: How long shut-down sockets get to end a collective before the rank is re-forked.
KILL_AFTER_S = 2.0


@dataclass
class Recovery:
    """What :func:`recover` did: who was re-forked (variables lost), who kept everything."""

    restarted: list[int]
    aborted: list[int]
    kept: list[int]
    generation: int
    seconds: float

    def render(self) -> str:
        lines = []
        if self.restarted:
            lines.append(f"{_ranks(self.restarted)} restarted: {_their(self.restarted)} variables are lost.")
        if self.aborted:
            lines.append(f"{_ranks(self.aborted)} had {_their(self.aborted)} collective aborted "
                         f"(no process restarted).")
        if self.kept:
            lines.append(f"{_ranks(self.kept)} kept {_their(self.kept)} variables.")
        lines.append(f"The process group was re-created on all ranks (generation {self.generation}) "
                     f"in {self.seconds:.1f} s; objects built on the old one (DDP/FSDP modules, "
                     f"DTensors, subgroups) must be re-created from the new `device_mesh`.")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.render()


# -- rank side --------------------------------------------------------------------------------


def reinit(worker: "Worker", generation: int) -> None:
    """Leave the old process group and join generation ``generation``'s (exec thread)."""
    worker.reinit(generation)


def listening_ports(worker: "Worker") -> list[int]:
    """TCP ports this rank listens on (its gloo/NCCL endpoints; control thread)."""
    import psutil

    return sorted({c.laddr.port for c in psutil.Process().net_connections("tcp")
                   if c.status == psutil.CONN_LISTEN})


def abort_collectives(worker: "Worker", stuck_in: dict[int, int], peer_ports: list[int]) -> int:
    """Shut down this rank's connections to other ranks' endpoints (control thread).

    A collective blocked on such a connection fails at once ("Connection closed by peer");
    the rank's other connections (the notebook's, the user's own) are left alone. Only done
    while the rank is still stuck in the request ``stuck_in[rank]``: once it moved on it may
    be building the new process group, whose connections must live.
    """
    import psutil

    if worker.request != stuck_in.get(worker.rank):
        return 0
    own = set(listening_ports(worker))
    peers = set(peer_ports)
    closed = 0
    for conn in psutil.Process().net_connections("tcp"):
        if conn.status != psutil.CONN_ESTABLISHED or not conn.raddr or conn.fd < 0:
            continue
        if conn.raddr.port in peers or conn.laddr.port in own:
            try:
                with socket.socket(fileno=os.dup(conn.fd)) as sock:
                    # The main thread may have closed that fd and reused its number for a new
                    # socket since the listing: only shut down the connection we listed.
                    if sock.getsockname()[:2] == tuple(conn.laddr) and \
                            sock.getpeername()[:2] == tuple(conn.raddr):
                        sock.shutdown(socket.SHUT_RDWR)
                        closed += 1
            except OSError:
                pass
    return closed


# -- controller side --------------------------------------------------------------------------


def recover(controller: "Controller", restart: list[int], timeout: float) -> Recovery:
    """Free every rank and re-create the process group on all of them (see module doc)."""
    started = time.monotonic()
    controller.kill(restart)
    restarted = [r for r, s in controller.ranks.items() if s.state == "dead"]
    generation = controller.new_generation()
    survivors = [r for r in controller.ranks if r not in restarted]
    joined = controller.submit("call", {"fn": reinit, "args": (generation,), "kwargs": {}},
                               survivors, "re-create the process group") if survivors else None
    controller.respawn(restarted, generation)

    def stuck() -> list[int]:
        return [r for r in survivors if controller.busy_with_other(r, joined.id)] if joined else []

    aborted: list[int] = []
    while stuck():
        waited = time.monotonic() - started
        if not aborted and waited >= ABORT_AFTER_S:
            aborted = stuck()
            _abort(controller, aborted)
        elif aborted and waited >= ABORT_AFTER_S + KILL_AFTER_S:
            hopeless = stuck()
            controller.kill(hopeless)
            controller.respawn(hopeless, generation)
            restarted += hopeless
            break
        if waited > timeout:
            raise MeshError(f"recovery timed out: rank(s) {format_ranks(stuck())} stay busy")
        time.sleep(0.02)
    controller.wait_generation(generation, list(controller.ranks), timeout, "recovery")
    aborted = [r for r in aborted if r not in restarted]
    kept = [r for r in controller.ranks if r not in restarted]
    return Recovery(sorted(restarted), aborted, kept, generation, time.monotonic() - started)


def _abort(controller: "Controller", ranks: list[int]) -> None:
    live = [r for r, s in controller.ranks.items() if s.state != "dead"]
    asked = controller.submit("call", {"fn": listening_ports, "args": (), "kwargs": {}}, live,
                              "listening ports", channel="c")
    asked.wait(5)
    ports = sorted({p for value in asked.values().values() for p in value})
    stuck_in = {r: controller.current_request(r) for r in ranks}
    controller.submit("call", {"fn": abort_collectives, "args": (stuck_in, ports), "kwargs": {}},
                      ranks, "abort collectives", channel="c").wait(5)


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}"


def _their(ranks: list[int]) -> str:
    return "their" if len(ranks) > 1 else "its"
