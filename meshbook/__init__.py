"""meshbook: the notebook as the single controller of a mesh of PyTorch ranks.

Python API (usable anywhere)::

    import meshbook
    mesh = meshbook.start(4, dims={"dp": 2, "tp": 2})
    mesh.run("dist.get_rank()").result()

In Jupyter: ``%load_ext meshbook``, then ``%mesh start -n 4`` and ``%%mesh`` cells.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "start", "current", "prewarm", "SSH", "Join", "Slurm", "Launcher", "AgentHandle", "HostPlan",
    "LaunchContext", "Mesh", "Run", "RankValues", "Topology",
    "meshes", "use", "mesh_named", "attach", "list_meshes", "Actor", "endpoint", "ActorMesh", "ActorFuture",
    "SupervisionEvent",
    "NoEndpointError",
    "Output", "Display", "Result", "Error", "RankFailure",
    "MeshError", "RemoteError", "SelectionError", "MeshStoppedError", "MeshTimeout",
    "SendError", "CellSyntaxError",
    "RemoteRef", "Namespaces", "VarInfo", "MissingNameError", "TooLargeError", "ShapeError",
    "Layout", "PlanReport", "Row",
]


def __getattr__(name: str) -> Any:
    """The public names, imported from :mod:`meshbook.mesh` on first use: a host agent or a
    rank imports this package too, and must not load the controller with it."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import mesh

    return getattr(mesh, name)


if TYPE_CHECKING:
    from .mesh import (
        SSH,
        Actor,
        ActorFuture,
        ActorMesh,
        AgentHandle,
        CellSyntaxError,
        Display,
        Error,
        HostPlan,
        LaunchContext,
        Launcher,
        Layout,
        Mesh,
        MeshError,
        MeshStoppedError,
        MeshTimeout,
        MissingNameError,
        Namespaces,
        NoEndpointError,
        Output,
        PlanReport,
        RankFailure,
        RankValues,
        RemoteError,
        RemoteRef,
        Result,
        Row,
        Run,
        SelectionError,
        SendError,
        ShapeError,
        Slurm,
        SupervisionEvent,
        TooLargeError,
        Topology,
        VarInfo,
        attach,
        current,
        endpoint,
        list_meshes,
        mesh_named,
        meshes,
        prewarm,
        start,
        use,
    )


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext meshbook``: register the %mesh magics and the kernel hooks."""
    from .magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from .magics import unload

    unload(ipython)
