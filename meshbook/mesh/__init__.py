"""The mesh runtime: the controller, host agents, ranks and the protocol between them.

This room knows nothing of IPython: it is usable from a plain script. Its folders are its
processes (see DESIGN.md, "Layout"): ``controller/`` runs in the notebook, ``agent/`` in each
host agent, ``rank/`` in each rank, and ``protocol/`` is what they share.

Every public name is imported on first use (a module ``__getattr__``), so a host agent or a
rank that imports ``meshbook.mesh.protocol`` never loads the controller. The names the
notebook face uses (``kernel/``, ``magics/``, ``widgets/``) are public here too: the face
imports this package, never its folders.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: Public name -> the module (under this package) that defines it.
_WHERE = {
    # the Python API
    "start": "controller.mesh", "current": "controller.mesh", "Mesh": "controller.mesh",
    "SSH": "controller.remote", "Join": "controller.remote", "Slurm": "controller.slurm",
    "meshes": "controller.mesh", "use": "controller.mesh", "mesh_named": "controller.mesh",
    "attach": "controller.mesh", "list_meshes": "controller.mesh", "ended_meshes": "controller.mesh",
    **dict.fromkeys(["Actor", "endpoint", "ActorFuture", "SupervisionEvent", "NoEndpointError"],
                    "protocol.actors"),
    "ActorMesh": "controller.actors",
    "prewarm": "controller.launchers", "Run": "controller.run", "RemoteRef": "controller.data",
    "RankValues": "protocol.values", "Topology": "protocol.topology",
    "Namespaces": "protocol.namespaces", "VarInfo": "protocol.namespaces",
    **dict.fromkeys(["Output", "Display", "Result", "Error", "InputRequest", "DebugEnd", "Event"],
                    "protocol.events"),
    **dict.fromkeys(["MeshError", "RemoteError", "SelectionError", "MeshStoppedError", "MeshTimeout",
                     "SendError", "CellSyntaxError", "RankFailure", "MissingNameError", "TooLargeError",
                     "ShapeError"], "protocol.errors"),
    # for the notebook face
    "add_start_listener": "controller.mesh", "remove_start_listener": "controller.mesh",
    "EventRenderer": "controller.render", "write_stream": "controller.render",
    "print_late": "controller.render",
    "MemoryRow": "controller.memory",
    "StragglerReport": "controller.stragglers", "DURATION_FACTOR": "controller.stragglers",
    "slow_by_duration": "controller.stragglers",
    "DEFAULT_MAX_BYTES": "protocol.limits",
    "parse_dims": "protocol.topology", "parse_where": "protocol.topology",
    **dict.fromkeys(["format_ranks", "group_by_text", "format_bytes", "status_table"], "protocol.text"),
}

__all__ = [
    "start", "current", "prewarm", "SSH", "Join", "Slurm", "Mesh", "Run", "RankValues", "Topology",
    "meshes", "use", "mesh_named", "attach", "list_meshes", "ended_meshes", "Actor", "endpoint", "ActorMesh",
    "ActorFuture", "SupervisionEvent",
    "NoEndpointError",
    "Output", "Display", "Result", "Error", "InputRequest", "DebugEnd", "Event", "RankFailure",
    "MeshError", "RemoteError", "SelectionError", "MeshStoppedError", "MeshTimeout",
    "SendError", "CellSyntaxError",
    "RemoteRef", "Namespaces", "VarInfo", "MissingNameError", "TooLargeError", "ShapeError",
    "add_start_listener", "remove_start_listener", "EventRenderer", "write_stream", "print_late",
    "MemoryRow", "StragglerReport", "DURATION_FACTOR", "slow_by_duration", "DEFAULT_MAX_BYTES",
    "parse_dims", "parse_where", "format_ranks", "group_by_text", "format_bytes", "status_table",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and editors see
    from .controller.actors import ActorMesh
    from .controller.data import RemoteRef
    from .controller.launchers import prewarm
    from .controller.memory import MemoryRow
    from .controller.mesh import (
        Mesh,
        add_start_listener,
        attach,
        current,
        ended_meshes,
        list_meshes,
        mesh_named,
        meshes,
        remove_start_listener,
        start,
        use,
    )
    from .controller.remote import SSH, Join
    from .controller.render import EventRenderer, print_late, write_stream
    from .controller.run import Run
    from .controller.slurm import Slurm
    from .controller.stragglers import DURATION_FACTOR, StragglerReport, slow_by_duration
    from .protocol.actors import Actor, ActorFuture, NoEndpointError, SupervisionEvent, endpoint
    from .protocol.errors import (
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
    from .protocol.events import DebugEnd, Display, Error, Event, InputRequest, Output, Result
    from .protocol.limits import DEFAULT_MAX_BYTES
    from .protocol.namespaces import Namespaces, VarInfo
    from .protocol.text import format_bytes, format_ranks, group_by_text, status_table
    from .protocol.topology import Topology, parse_dims, parse_where
    from .protocol.values import RankValues
