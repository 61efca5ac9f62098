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
    "start": "controller.api.mesh", "current": "controller.api.mesh", "Mesh": "controller.api.mesh",
    "SSH": "controller.launch.ssh", "Join": "controller.launch.join", "Slurm": "controller.launch.slurm",
    "Launcher": "controller.launch.base", "add_start_arguments": "controller.launch",
    "launcher_from_args": "controller.launch", "launchers": "controller.launch",
    "AgentHandle": "controller.launch.base",
    "HostPlan": "controller.launch.base", "LaunchContext": "controller.launch.base",
    "meshes": "controller.api.mesh", "use": "controller.api.mesh", "mesh_named": "controller.api.mesh",
    "attach": "controller.api.mesh", "list_meshes": "controller.api.mesh", "ended_meshes": "controller.api.mesh",
    **dict.fromkeys(["Actor", "endpoint", "ActorFuture", "SupervisionEvent", "NoEndpointError"],
                    "protocol.actors"),
    "ActorMesh": "controller.api.actors",
    "prewarm": "controller.launch.local", "Run": "controller.core.run", "RemoteRef": "controller.api.data",
    "RankValues": "protocol.values", "Topology": "protocol.topology",
    "Namespaces": "protocol.namespaces", "VarInfo": "protocol.namespaces",
    **dict.fromkeys(["Output", "Display", "Result", "Error", "InputRequest", "DebugEnd", "Event"],
                    "protocol.events"),
    **dict.fromkeys(["MeshError", "RemoteError", "SelectionError", "MeshStoppedError", "MeshTimeout",
                     "SendError", "CellSyntaxError", "RankFailure", "MissingNameError", "TooLargeError",
                     "ShapeError", "check_seconds"], "protocol.errors"),
    # for the notebook face
    "add_start_listener": "controller.api.mesh", "remove_start_listener": "controller.api.mesh",
    "EventRenderer": "controller.core.render", "write_stream": "controller.core.render",
    "LateOutput": "controller.core.render", "labelled_display": "controller.core.render",
    "follow": "controller.api.follow", "FollowOptions": "controller.api.follow", "View": "controller.api.follow",
    "MemoryRow": "controller.insight.memory",
    "StragglerReport": "controller.insight.stragglers", "DURATION_FACTOR": "controller.insight.stragglers",
    "slow_by_duration": "controller.insight.stragglers",
    "DEFAULT_MAX_BYTES": "protocol.limits",
    "parse_dims": "protocol.topology", "parse_where": "protocol.topology",
    **dict.fromkeys(["format_ranks", "group_by_text", "format_bytes", "status_table", "parse_size"], "protocol.text"),
    **dict.fromkeys(["Layout", "ModelFacts", "CHECKPOINTING"], "protocol.layout"),
    **dict.fromkeys(["PlanReport", "parse_batch"], "controller.api.plan"), "Row": "protocol.plan",
}

__all__ = [
    "start", "current", "prewarm", "SSH", "Join", "Slurm", "Launcher", "AgentHandle", "HostPlan", "LaunchContext",
    "Mesh", "Run", "RankValues", "Topology",
    "meshes", "use", "mesh_named", "attach", "list_meshes", "ended_meshes", "Actor", "endpoint", "ActorMesh",
    "ActorFuture", "SupervisionEvent",
    "NoEndpointError",
    "Output", "Display", "Result", "Error", "InputRequest", "DebugEnd", "Event", "RankFailure",
    "MeshError", "RemoteError", "SelectionError", "MeshStoppedError", "MeshTimeout",
    "SendError", "CellSyntaxError",
    "RemoteRef", "Namespaces", "VarInfo", "MissingNameError", "TooLargeError", "ShapeError", "check_seconds",
    "add_start_listener", "remove_start_listener", "EventRenderer", "write_stream", "LateOutput", "labelled_display",
    "follow", "FollowOptions", "View", "add_start_arguments", "launcher_from_args", "launchers",
    "MemoryRow", "StragglerReport", "DURATION_FACTOR", "slow_by_duration", "DEFAULT_MAX_BYTES",
    "parse_dims", "parse_where", "format_ranks", "group_by_text", "format_bytes", "status_table", "parse_size",
    "Layout", "ModelFacts", "PlanReport", "Row", "parse_batch", "CHECKPOINTING",
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
    from .controller.api.actors import ActorMesh
    from .controller.api.data import RemoteRef
    from .controller.api.follow import FollowOptions, View, follow
    from .controller.api.mesh import (
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
    from .controller.api.plan import PlanReport, parse_batch
    from .controller.core.render import EventRenderer, LateOutput, write_stream
    from .controller.core.run import Run
    from .controller.insight.memory import MemoryRow
    from .controller.insight.stragglers import DURATION_FACTOR, StragglerReport, slow_by_duration
    from .controller.launch import add_start_arguments, launcher_from_args, launchers
    from .controller.launch.base import AgentHandle, HostPlan, LaunchContext, Launcher
    from .controller.launch.join import Join
    from .controller.launch.local import prewarm
    from .controller.launch.slurm import Slurm
    from .controller.launch.ssh import SSH
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
        check_seconds,
    )
    from .protocol.events import DebugEnd, Display, Error, Event, InputRequest, Output, Result
    from .protocol.layout import CHECKPOINTING, Layout, ModelFacts
    from .protocol.limits import DEFAULT_MAX_BYTES
    from .protocol.namespaces import Namespaces, VarInfo
    from .protocol.plan import Row
    from .protocol.text import format_bytes, format_ranks, group_by_text, parse_size, status_table
    from .protocol.topology import Topology, parse_dims, parse_where
    from .protocol.values import RankValues
