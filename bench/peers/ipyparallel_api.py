"""ipyparallel: a local ``Cluster`` of engines driven through a ``DirectView`` on all of them.

Each engine is a fresh Python process (plus a nanny process watching it) behind a
controller; tensors travel as ``DirectView.push``/``pull`` values, pickled on the way.
"""

from __future__ import annotations

import logging
from typing import Any

import ipyparallel as ipp

from meshbook.mesh.controller.core.agents import free_port

from . import rank_side

NAME = "ipyparallel"
DISPATCH = "DirectView.apply_sync"
#: Engines are fresh interpreters that import torch themselves.
RANKS_FORKED = False
DATA_API = "DirectView.push/pull"
START_TIMEOUT_S = 600.0


class IpyparallelHandle:
    def __init__(self, cluster: Any, client: Any) -> None:
        self.cluster = cluster
        self.client = client
        self.view = client[:]

    def noop(self) -> None:
        _blocking(self.view.apply_sync(rank_side.noop))

    def push(self, tensor: Any) -> None:
        _blocking(self.view.push({"t": tensor}, block=True))

    def pull(self) -> list[Any]:
        return list(_blocking(self.view.pull("t", block=True)))

    def pids(self) -> list[int]:
        return list(_blocking(self.view.apply_sync(rank_side.pid)))

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.cluster.stop_cluster_sync()


def _blocking(value: Any) -> Any:
    """The value of a blocking call, or the interrupt it swallowed.

    On Ctrl-C, ipyparallel's blocking calls return their pending ``AsyncResult`` instead of
    raising: the interrupt is raised again here, so Ctrl-C stops the benchmark (and every
    system is stopped on the way out) instead of being taken for a result.
    """
    if isinstance(value, ipp.AsyncResult):
        raise KeyboardInterrupt
    return value


def start(n: int, dist: bool = False) -> IpyparallelHandle:
    """``Cluster(n=n).start_and_connect_sync()``, then (``dist``) a gloo init on every engine."""
    cluster = ipp.Cluster(n=n, log_level=logging.ERROR)
    try:
        client = cluster.start_and_connect_sync()
        client.wait_for_engines(n, timeout=START_TIMEOUT_S)
        handle = IpyparallelHandle(cluster, client)
        if dist:
            port = free_port()
            pending = [client[engine].apply_async(rank_side.init_gloo, rank, n, port)
                       for rank, engine in enumerate(client.ids)]
            for result in pending:
                result.get(timeout=START_TIMEOUT_S)
        return handle
    except BaseException:
        cluster.stop_cluster_sync()
        raise
