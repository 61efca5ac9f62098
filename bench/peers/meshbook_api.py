"""meshbook through its Python API, as a script or a notebook uses it."""

from __future__ import annotations

from typing import Any

import meshbook
from meshbook import Mesh

NAME = "meshbook"
DISPATCH = 'Mesh.run("pass")'
DATA_API = "Mesh.push/pull"
#: Ranks are forks of a host agent that imported torch (they share its pages).
RANKS_FORKED = True


class MeshbookHandle:
    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh

    def noop(self) -> None:
        self.mesh.run("pass").result()

    def push(self, tensor: Any) -> None:
        self.mesh.push(t=tensor)

    def pull(self) -> list[Any]:
        return list(self.mesh.pull("t", max_bytes=1 << 40).values())

    def pids(self) -> list[int]:
        return [s.pid for s in self.mesh.status() if s.pid is not None]

    def close(self) -> None:
        self.mesh.stop()


def start(n: int, dist: bool = True) -> MeshbookHandle:
    """``meshbook.start(n)``: torch.distributed is ready on every rank when it returns."""
    return MeshbookHandle(meshbook.start(n))
