"""The ``%mesh`` / ``%%mesh`` face: argument parsing and rendering over the Python API."""

from __future__ import annotations

from typing import Any

from ..mesh import MeshError


def load(shell: Any) -> None:
    """Register the magics and hook the kernel bridge (what ``%load_ext meshbook`` does)."""
    if shell is None or not hasattr(shell, "register_magics"):
        raise MeshError("the %mesh magics need IPython or Jupyter; in a plain script use the "
                        "Python API: mesh = meshbook.start(4); mesh.run('...').result()")
    from .. import kernel
    from ..mesh import prewarm
    from .mesh_magic import MeshMagics

    kernel.install(shell)
    shell.register_magics(MeshMagics(shell))
    prewarm()  # import torch in a standby agent now, so %mesh start is quick


def unload(shell: Any) -> None:
    from .. import kernel

    magics = shell.magics_manager.registry.get("MeshMagics")
    if magics is not None:
        magics.unload()
    kernel.uninstall()
