"""Render a run into the current cell: streamed output, displays, prompts, its status view.

:func:`show_run` runs on the kernel's main thread while the cell executes. It follows the run
with the runtime's own watcher (:func:`~meshbook.mesh.controller.api.follow.follow`, which
``Run.result()`` uses too: hang hints, escalating interrupts, the timeout's diagnosis) and
renders with the runtime's one event renderer, writing through the cell's own
``sys.stdout``/``sys.stderr`` (so Jupyter attributes the output to this cell), merged across
ranks or buffered in rank order, answering ranks' debugger prompts through the kernel's stdin.
What is the cell's own: ranks' ``display()`` calls are published as display data, and the
cell's live status view is updated as the run goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..mesh import (
    EventRenderer,
    FollowOptions,
    Mesh,
    MeshTimeout,
    RankValues,
    Run,
    View,
    follow,
    labelled_display,
    write_stream,
)


@dataclass
class RenderOptions:
    ordered: bool = False
    timeout: float | None = None
    #: Called with the values of a run that ends after the cell stopped waiting for it (its
    #: timeout); what it returns ends the late note of how the run ended (``--out``: where
    #: the values went).
    late_values: Callable[[RankValues], str] | None = None


def publish_display(ranks: list[int], data: dict[str, Any]) -> None:
    """The ranks' display in the cell, labelled as their lines are."""
    from IPython.display import publish_display_data

    label, shown = labelled_display(ranks, data)
    if label:
        write_stream("stdout", label)
    publish_display_data(shown, metadata={"meshbook": {"ranks": ranks}})


def show_run(run: Run, options: RenderOptions, mesh: Mesh, view: View | None = None) -> RankValues:
    """Stream ``run`` into the cell and return its values (or raise its error)."""
    renderer = EventRenderer(run, write_stream, publish_display, ordered=options.ordered)
    steps = ("inspect them with %mesh stacks, stop them with %mesh interrupt; what they print, and "
             "how the cell ends, still comes here")
    try:
        follow_options = FollowOptions(options.timeout, "the cell", steps, "%mesh interrupt {ranks} stops it",
                                       "interrupting this cell drops this cell instead",
                                       stop_this="interrupting the kernel (the stop button) stops it")
        return follow(run, mesh, renderer, follow_options, view)
    except MeshTimeout:
        if options.late_values is not None:
            late_values, told = options.late_values, run.on_late_end
            run.on_late_end = lambda text: told(text + late_values(run.values()))
        run.let_go()  # nobody can follow it again: its output and its end come to this cell
        raise
