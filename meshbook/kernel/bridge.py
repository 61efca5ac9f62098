"""Glue between meshes and the running Jupyter kernel: output lands in the right cell.

Output produced by a cell while it runs is printed by the cell itself (the notebook layer
renders its run on the kernel's main thread). What the ranks print *after* their cell ended,
from a background thread they started, is published here with the parent header of the
cell that submitted the run, so it lands in that cell, never in whichever cell runs next.

The bridge hooks every mesh started in this kernel, through ``%mesh start`` or the Python
API alike, so ``mesh.run(...)`` in a plain cell gets the same attribution.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from ..mesh import (
    LateOutput,
    Mesh,
    Run,
    add_start_listener,
    current,
    labelled_display,
    remove_start_listener,
)


class KernelBridge:
    """Attributes every run of every mesh to the cell that submitted it."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.kernel = getattr(shell, "kernel", None)  # None in a terminal IPython

    def hook(self, mesh: Mesh) -> None:
        controller = mesh.controller
        controller.add_run_listener(self.attach)
        if self.kernel is not None:
            # Ranks may open a debugger prompt only if this cell's frontend can answer it.
            controller.stdin_probe = lambda: cell_allows_stdin(self.kernel)

    def attach(self, run: Run) -> None:
        if self.kernel is not None:
            parent = self.kernel.get_parent()
            late = LateOutput(run.ranks, partial(self.publish_text, parent), partial(self.publish_display, parent))
            run.on_late_output, run.on_late_end, run.on_late_note = late, late.end, late.end

    def publish_display(self, parent: dict[str, Any], ranks: list[int], data: dict[str, Any]) -> None:
        """The ranks' late ``display()`` in the cell whose ``parent`` header is given (any
        thread), labelled as their lines are."""
        kernel = self.kernel
        assert kernel is not None  # attach() hooks this up only in a kernel
        label, shown = labelled_display(ranks, data)
        if label:
            self.publish_text(parent, "stdout", label)
        kernel.session.send(kernel.iopub_socket, "display_data",
                            {"data": shown, "metadata": {"meshbook": {"ranks": ranks}},
                             "transient": {}}, parent=parent)

    def publish_text(self, parent: dict[str, Any], stream: str, text: str) -> None:
        """``text`` on ``stream`` of the cell whose ``parent`` header is given (any thread)."""
        kernel = self.kernel
        assert kernel is not None
        kernel.session.send(kernel.iopub_socket, "stream", {"name": stream, "text": text.rstrip("\n") + "\n"},
                            parent=parent, ident=b"stream." + stream.encode())


def cell_allows_stdin(kernel: Any) -> bool:
    """Can the frontend of the running cell answer ``input()``? Batch runners (nbval,
    nbconvert, papermill) execute with ``allow_stdin=False``: nobody is watching."""
    return bool(kernel.get_parent().get("content", {}).get("allow_stdin", False))


_bridge: KernelBridge | None = None


def install(shell: Any) -> KernelBridge:
    """Hook the bridge into this kernel's meshes, present and future (idempotent)."""
    global _bridge
    if _bridge is None or _bridge.shell is not shell:
        _bridge = KernelBridge(shell)
        add_start_listener(_bridge.hook)
    try:
        _bridge.hook(current())
    except Exception:
        pass  # no mesh yet
    return _bridge


def uninstall() -> None:
    global _bridge
    if _bridge is not None:
        remove_start_listener(_bridge.hook)
    _bridge = None
