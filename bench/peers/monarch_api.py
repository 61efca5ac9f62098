"""PyTorch Monarch: a ``ProcMesh`` of processes on this host, one actor on each.

Dispatch is an endpoint ``call().get()`` on the actor mesh (every proc answers); tensors
travel as an endpoint argument and an endpoint return value.
"""

from __future__ import annotations

from typing import Any

from monarch.actor import Actor, current_rank, endpoint, this_host

from meshbook.mesh.controller.core.agents import free_port

from . import rank_side, tolerate_monarch_faults

NAME = "Monarch"
DISPATCH = "endpoint.call().get()"
#: Procs are fresh interpreters that import torch themselves.
RANKS_FORKED = False
DATA_API = "endpoint argument/return"


tolerate_monarch_faults()


class Rank(Actor):
    """The actor each proc runs: the shared rank-side functions as endpoints."""

    @endpoint
    def noop(self) -> None:
        return rank_side.noop()

    @endpoint
    def pid(self) -> int:
        return rank_side.pid()

    @endpoint
    def keep(self, tensor: Any) -> None:
        rank_side.keep(tensor)

    @endpoint
    def kept(self) -> Any:
        return rank_side.kept()

    @endpoint
    def init_gloo(self, world_size: int, port: int) -> int:
        return rank_side.init_gloo(current_rank().rank, world_size, port)


class MonarchHandle:
    def __init__(self, procs: Any, actors: Any) -> None:
        self.procs = procs
        self.actors = actors

    def noop(self) -> None:
        self.actors.noop.call().get()

    def push(self, tensor: Any) -> None:
        self.actors.keep.call(tensor).get()

    def pull(self) -> list[Any]:
        return list(self.actors.kept.call().get().values())

    def pids(self) -> list[int]:
        return list(self.actors.pid.call().get().values())

    def close(self) -> None:
        self.procs.stop().get()


def start(n: int, dist: bool = False) -> MonarchHandle:
    """``this_host().spawn_procs(...)`` and an actor on each proc; (``dist``) a gloo init."""
    procs = this_host().spawn_procs(per_host={"procs": n})
    try:
        actors = procs.spawn("bench", Rank)
        if dist:
            actors.init_gloo.call(n, free_port()).get()
        return MonarchHandle(procs, actors)
    except BaseException:
        procs.stop().get()
        raise
