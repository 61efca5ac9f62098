"""The mesh runtime: host agents, rank processes, the wire and the Python API.

This room knows nothing of IPython: it is usable from a plain script. See DESIGN.md.
"""

from .data import RemoteRef
from .errors import (
    CellSyntaxError,
    MeshError,
    MeshStoppedError,
    MeshTimeout,
    MissingNameError,
    RankFailure,
    RemoteError,
    SelectionError,
    SendError,
    ShapeError,
    TooLargeError,
)
from .launchers import prewarm
from .mesh import Mesh, current, start
from .namespaces import Namespaces, VarInfo
from .run import Display, Error, Output, Result, Run
from .topology import Topology
from .values import RankValues

__all__ = [
    "start", "current", "prewarm", "Mesh", "Run", "RankValues", "Topology",
    "Output", "Display", "Result", "Error", "RankFailure",
    "MeshError", "RemoteError", "SelectionError", "MeshStoppedError", "MeshTimeout",
    "SendError", "CellSyntaxError",
    "RemoteRef", "Namespaces", "VarInfo", "MissingNameError", "TooLargeError", "ShapeError",
]
