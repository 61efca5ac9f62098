"""Render a run into the current cell: streamed output, displays, interrupts, the outcome.

:func:`show_run` runs on the kernel's main thread while the cell executes. It writes the
ranks' output through the cell's own ``sys.stdout``/``sys.stderr`` (so Jupyter attributes it
to this cell), merged across ranks or buffered in rank order, and publishes ranks'
``display()`` calls as display data.

A kernel interrupt (the stop button, SIGINT) arrives here as ``KeyboardInterrupt`` while we
wait. It is forwarded to the running ranks; the cell then waits a grace period for them to
stop and ends with their ``KeyboardInterrupt``, naming any rank still busy.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from ..mesh import Display, MeshTimeout, RankFailure, RankValues, RemoteError, Run
from ..mesh.errors import format_ranks
from ..mesh.output import LineMerger, OrderedCollector
from ..mesh.table import status_table  # noqa: F401  - re-exported for the commands

#: How long ranks get to stop after a forwarded interrupt before the cell gives up on them.
INTERRUPT_GRACE_S = 2.0


class CellView(Protocol):
    """Something showing a run's progress in the cell (the live status widget)."""

    def update(self, run: Run) -> None: ...

    def close(self, run: Run) -> None: ...


@dataclass
class RenderOptions:
    ordered: bool = False
    timeout: float | None = None
    grace: float = INTERRUPT_GRACE_S


def write_stream(stream: str, text: str) -> None:
    target = sys.stderr if stream == "stderr" else sys.stdout
    target.write(text)
    target.flush()


def publish_display(event: Display) -> None:
    from IPython.display import publish_display_data

    publish_display_data(event.data, metadata={"meshbook": {"rank": event.rank}})


def show_run(run: Run, options: RenderOptions, view: CellView | None = None,
             on_timeout: Callable[[Run], str] | None = None) -> RankValues:
    """Stream ``run`` into the cell and return its values (or raise its error)."""
    writer = (OrderedCollector if options.ordered else LineMerger)(run.ranks, write_stream)
    started = time.monotonic()
    interrupted_at: float | None = None
    index = 0
    try:
        while True:
            try:
                now = time.monotonic()
                waits = [writer.next_deadline(), 0.25 if view else None,
                         _left(options.timeout, started, now),
                         _left(options.grace, interrupted_at, now)]
                events, index = run.events_since(index, min((w for w in waits if w is not None),
                                                            default=None))
                for event in events:
                    if isinstance(event, Display):
                        writer.flush()
                        publish_display(event)
                    else:
                        writer.feed_event(event)
                writer.poll()
                if view:
                    view.update(run)
                if run.done():
                    break
                now = time.monotonic()
                if interrupted_at is not None and now - interrupted_at >= options.grace:
                    break
                if options.timeout is not None and now - started >= options.timeout:
                    writer.close()
                    detail = on_timeout(run) if on_timeout else ""
                    raise MeshTimeout(
                        f"the cell is still running on rank(s) {format_ranks(run.pending)} after "
                        f"{options.timeout:g} s. The ranks keep running as they are: inspect them "
                        f"with %mesh stacks, stop them with %mesh interrupt." + detail)
            except KeyboardInterrupt:
                if interrupted_at is not None:
                    break  # a second interrupt while waiting: stop waiting at once
                interrupted_at = time.monotonic()
                run.interrupt()
    finally:
        writer.close()
        if view:
            view.close(run)
    if interrupted_at is not None and not run.done():
        raise still_busy_error(run, options.grace)
    return run.result(timeout=0, echo=False)


def still_busy_error(run: Run, grace: float) -> RemoteError:
    """The interrupted ranks' errors, plus one entry for each rank that did not stop."""
    so_far = run.exception()
    failures = dict(so_far.failures) if so_far else {}
    for rank in run.pending:
        failures[rank] = RankFailure(
            rank, "StillRunning",
            f"did not stop within {grace:g} s of the interrupt: it is blocked outside Python "
            f"(a collective, or C code)")
    hint = (f"rank(s) {format_ranks(run.pending)} are still busy. See where with %mesh stacks; "
            f"interrupt again (or %mesh restart {format_ranks(run.pending)}) to restart them.")
    return RemoteError(failures, partial=run.values(), hint=hint)


def _left(span: float | None, since: float | None, now: float) -> float | None:
    if span is None or since is None:
        return None
    return max(0.0, since + span - now)
