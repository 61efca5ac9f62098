"""Getting a mesh back in step, subscribed to its controller's events.

The engine (:mod:`..core`) only says what happened: a user run ended irregularly, ranks were
stranded by a death, a tick passed. What to do about it is decided here, and wired in by
:func:`install` when a mesh is started or attached:

* ``on_irregular_end``: the step check (:mod:`.step`), which compares every rank's position in
  each process group and re-creates the groups when they differ;
* ``on_stranded``: the ranks that ran beside a rank that died are freed at once
  (:func:`.ladder.free_stranded`);
* every tick, the run watcher (:mod:`.watch`) frees ranks waiting in a collective that peers who
  finished the run will never join.

``mesh.recover()`` / ``mesh.restart()`` are :func:`.ladder.recover`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .ladder import free_stranded
from .step import check_after
from .watch import watch

if TYPE_CHECKING:
    from ..core.controller import Controller


def install(controller: "Controller") -> None:
    """Subscribe the step check, the freeing of stranded ranks and the run watcher."""
    controller.on_irregular_end = lambda request, run: check_after(controller, request, run)
    controller.on_stranded = lambda ranks, reason, lost: free_stranded(controller, ranks, reason, lost)
    controller.tick_listeners.append(lambda runs: watch(controller, runs))
