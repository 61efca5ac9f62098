"""A rank's TCP connections to the other ranks (gloo's, NCCL's bootstrap), listed and shut down.

Why: a gloo collective that waits on a peer ends only when its connection closes (or at the
collective timeout), whatever else the rank does. A recovery shuts down the connections of a
rank stuck in one (from its control thread, :func:`meshbook.mesh.rank.ops.abort_collectives`).
And a rank of a gloo mesh that leaves its groups with work still pending on them (an
``async_op`` collective a peer never joined, left unwaited when the ranks were interrupted)
shuts down its connections first (the worker's ``init_distributed``): gloo's
``destroy_process_group`` waits for that work until the collective timeout, while the other
ranks give up joining the new group long before. A rank with nothing pending destroys its
groups as it is, which closes its ends; so every pair a pending rank is in closes, except a
pair with a rank of a host found lost: it went silent, no FIN will ever close that
connection, so a pending rank also shuts the connections it opened to such hosts.

A rank listens on TCP for its process groups (its requests come over Unix sockets, and it
keeps no file descriptor of its agent's), so a connection on one of its listening ports is a
peer's, unless the user runs a server in the rank: that one's clients are cut too, which is
why leaving a group does this only where work is pending (the destroy would hang instead).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Collection
from typing import Any


def listening_ports() -> list[int]:
    """TCP ports this process listens on."""
    import psutil

    return sorted({c.laddr.port for c in psutil.Process().net_connections("tcp")
                   if c.status == psutil.CONN_LISTEN})


def shut_down(ports: Collection[int] = (), peer_ports: Collection[int] = (), hosts: Collection[str] = (),
              still: Callable[[], bool] = lambda: True) -> int:
    """Shut down this process's established connections on its ``ports``, to ``peer_ports``,
    and to ``hosts``, while ``still()`` holds; how many. A collective waiting on one fails at
    once ("Connection closed by peer"), here and at the peer."""
    import psutil

    closed = 0
    for conn in psutil.Process().net_connections("tcp"):
        if not still():
            break
        if conn.status != psutil.CONN_ESTABLISHED or not conn.raddr or conn.fd < 0:
            continue
        if conn.laddr.port in ports or conn.raddr.port in peer_ports or conn.raddr.ip in hosts:
            closed += _shut(conn)
    return closed


def _shut(conn: Any) -> int:
    try:
        with socket.socket(fileno=os.dup(conn.fd)) as sock:
            # Another thread may have closed that fd and reused its number for a new socket
            # since the listing: only shut down the connection listed.
            if sock.getsockname()[:2] == tuple(conn.laddr) and sock.getpeername()[:2] == tuple(conn.raddr):
                sock.shutdown(socket.SHUT_RDWR)
                return 1
    except OSError:
        pass  # closed meanwhile (gloo closes its end once the peer's is shut)
    return 0
