"""The live status of a ``%%mesh`` cell: one tile per rank while it runs, durations at the end.

:class:`CellStatusView` is the ``view`` that :func:`meshbook.magics.render.show_run` drives
(``update(run)`` about every 0.25 s on the kernel's main thread, ``close(run)`` at the end).
Most cells end within a second and show nothing; a cell still running after ``SHOW_AFTER_S``
gets a :class:`CellStatus` widget: per rank its state (running / done / error / interrupted /
dead, or queued: the rank still runs earlier work), elapsed time, the cell line it is on now
(from its heartbeat) and a straggler mark. When the cell ends the widget turns into a bar
chart of the final per-rank durations, each split into computing and waiting in collectives
(exactly, from when each rank entered and left each collective,
:mod:`meshbook.mesh.rank.collectives`; from the ranks' own sampling for collectives issued
from C++): ranks that end in a collective all take the same time, and the straggler is the one
that spent it computing while the others waited.

A cell that opens a debugger (``breakpoint()``) shows no status once a prompt came: the
widget would land inside the pdb transcript. If it was already showing, it ends with the
ranks' states only, since their durations count the time the user spent at the prompt.

A rank is marked as a straggler when it keeps arriving last at the cell's collectives, or the
sampling detector flags it (:meth:`meshbook.Mesh.stragglers`), or when its time exceeds the
median of the other ranks' by ``DURATION_FACTOR`` (a running rank counts with its time so far).

Where widgets do not render, the output falls back to the same HTML, and to a deterministic
``text/plain`` (the ranks' final states, no times: ``cell status: [0-2] done, [3] dead``).
When the cell ends the display is replaced by that HTML and text alone
(:meth:`~meshbook.widgets.panel.HTMLPanel.freeze`), so a saved notebook shows the final
state anywhere, without the kernel that drew it.
"""

from __future__ import annotations

import time
from typing import Any

from traitlets import Dict, List, Unicode

from ..mesh import DURATION_FACTOR, InputRequest, Mesh, Run, format_ranks, group_by_text, slow_by_duration
from . import html
from .panel import HTMLPanel

#: A cell shows its status once it has run this long.
SHOW_AFTER_S = 1.0
#: The overall state of a finished cell: the worst of its ranks' states.
_SEVERITY = ("done", "interrupted", "error", "dead")


class CellStatus(HTMLPanel):
    """Per-rank state of one cell's run; ``ranks`` and ``state`` are its model state."""

    #: One dict per rank: rank, state, elapsed (s), line (cell line or None), straggler.
    ranks = List(Dict()).tag(sync=True)
    #: running while any rank runs, then the worst final state (done < interrupted < error < dead).
    state = Unicode("running").tag(sync=True)

    def __init__(self, mesh: Mesh, run: Run, factor: float = DURATION_FACTOR, **kwargs: Any) -> None:
        self._mesh: Mesh | None = mesh
        self._run: Run | None = run
        self._factor = factor
        self._final = ""  # "durations" or "states" once the cell ended
        rows = rank_rows(mesh, run, factor)  # the model opens with its state complete
        super().__init__(_render(rows, _overall(rows), final=""), ranks=rows,
                         state=_overall(rows), **kwargs)

    def refresh(self) -> None:
        """Read the run and the ranks' heartbeats again."""
        if self._run is None or self._mesh is None:
            return  # finished: the final state stays
        self.ranks = rank_rows(self._mesh, self._run, self._factor)
        self.state = _overall(self.ranks)
        self.html_view.value = _render(self.ranks, self.state, self._final)

    def finish(self, durations: bool = True) -> None:
        """The cell ended: show the final durations (or only the states, when they would
        count time spent at a debugger prompt) and let go of the run and the mesh."""
        self._final = "durations" if durations else "states"
        self.refresh()
        self._run = self._mesh = None

    def text(self) -> str:
        """Deterministic: the ranks' states grouped, no times (they differ run to run)."""
        groups = group_by_text({row["rank"]: row["state"] for row in self.ranks})
        return "cell status: " + ", ".join(f"[{format_ranks(r)}] {s}" for r, s in groups)


class CellStatusView:
    """What ``show_run`` drives: shows a :class:`CellStatus` once the cell runs long enough."""

    def __init__(self, mesh: Mesh, show_after: float = SHOW_AFTER_S) -> None:
        self._mesh = mesh
        self.show_after = show_after
        #: The widget, once shown (``None`` for a cell that ended quickly).
        self.widget: CellStatus | None = None
        #: A rank of the run asked for debugger input.
        self.debugged = False
        self._seen = 0  # the run's events looked at so far

    def update(self, run: Run) -> None:
        self._look_for_prompts(run)
        if self.widget is not None:
            self.widget.refresh()
        elif time.monotonic() - run.submitted_at >= self.show_after and not run.done() \
                and not self.debugged:
            self.widget = CellStatus(self._mesh, run)
            self.widget.show()

    def close(self, run: Run) -> None:
        if self.widget is None:
            return  # a quick cell: nothing was shown, nothing stays
        self._look_for_prompts(run)
        self.widget.finish(durations=not self.debugged)
        self.widget.close()  # leaves the final state as static HTML and text

    def _look_for_prompts(self, run: Run) -> None:
        events, self._seen = run.events_since(self._seen, 0)
        self.debugged = self.debugged or any(isinstance(e, InputRequest) for e in events)


def rank_rows(mesh: Mesh, run: Run, factor: float = DURATION_FACTOR) -> list[dict[str, Any]]:
    """Per rank of ``run``: state, elapsed seconds, of which waiting in collectives (``None``
    if not sampled), current cell line, straggler flag."""
    now = time.monotonic()
    failures = getattr(run.exception(), "failures", {})
    done = run.values()
    durations = run.durations
    states = {s.rank: s for s in mesh.status()}
    queued = mesh.queued(run)  # not started there: it waits behind earlier work
    elapsed = {r: durations.get(r, 0.0 if r in queued else _running_for(states.get(r), run, now))
               for r in run.ranks}
    # The run's own arrivals at its collectives; sampling counts only if taken in this run.
    exact = mesh.waiting(run) or {}
    sampled = {t.rank for t in mesh.stragglers(run).ranks
               if t.straggler and (t.flagged is not None or t.request == run.id)}
    started = {r: t for r, t in elapsed.items() if r not in queued}
    flagged = sampled | {s.rank for s in slow_by_duration(started, factor)}
    rows = []
    for rank in run.ranks:
        metrics = states[rank].metrics if rank in states else {}
        sampling = metrics.get("sampling") or {}
        waiting = None
        if rank in exact:
            waiting = round(min(exact[rank], elapsed[rank]), 2)
        elif sampling.get("request") == run.id and sampling.get("total_n"):
            waiting = round(elapsed[rank] * sampling["total_wait"], 2)
        if rank in failures:
            failure = failures[rank]
            state = "dead" if failure.died else \
                "interrupted" if failure.type_name == "KeyboardInterrupt" else "error"
        elif rank in done:
            state = "done"
        elif rank in states and states[rank].state == "dead":
            state = "dead"
        elif rank in queued:
            state = "queued"
        else:
            state = "running"
        line = metrics.get("line") if state == "running" and metrics.get("request") == run.id else None
        rows.append({"rank": rank, "state": state, "elapsed": round(elapsed[rank], 2),
                     "waiting": waiting, "line": line, "straggler": rank in flagged})
    return rows


def _running_for(state: Any, run: Run, now: float) -> float:
    """How long a rank has run ``run``: since it was sent, or, where its heartbeat says it
    started later (it ran earlier work first), since then."""
    submitted = now - run.submitted_at
    metrics = state.metrics if state is not None else {}
    if metrics.get("request") != run.id or "busy_s" not in metrics:
        return submitted
    return min(submitted, metrics["busy_s"] + max(0.0, now - state.last_seen))


def _overall(rows: list[dict[str, Any]]) -> str:
    states = {row["state"] for row in rows}
    busy = [state for state in ("running", "queued") if state in states]
    return busy[0] if busy else max(states, key=_SEVERITY.index)


def _render(rows: list[dict[str, Any]], state: str, final: str) -> str:
    if final == "durations":
        items = [(f"r{row['rank']}", _segments(row), _duration_text(row)) for row in rows]
        legend = [f"each bar: computing, then waiting in collectives ({html.WAITING_NAME})"]
        return html.panel(f"%%mesh {state}: per-rank durations", html.bars(items),
                          legend if any(row["waiting"] is not None for row in rows) else [])
    if final == "states":
        return html.panel(f"%%mesh {state}: {_counts(rows)}", html.tiles(
            [(f"r{row['rank']} {row['state']}", html.state_colour(row["state"]), "") for row in rows]),
            ["durations not shown: the cell waited at debugger prompts"])
    tiles = [(f"r{row['rank']} {row['state']} {row['elapsed']:.1f} s"
              + (f" line {row['line']}" if row["line"] is not None else "")
              + (f" {html.FLAG}" if row["straggler"] else ""),
              html.state_colour(row["state"]), html.STRAGGLER_BG if row["straggler"] else "")
             for row in rows]
    return html.panel(f"%%mesh {state}: {_counts(rows)}", html.tiles(tiles))


def _counts(rows: list[dict[str, Any]]) -> str:
    groups = group_by_text({row["rank"]: row["state"] for row in rows})
    return ", ".join(f"{len(ranks)} {state}" for ranks, state in groups)


def _segments(row: dict[str, Any]) -> list[tuple[float, str]]:
    """A rank's bar: its time computing in its state's colour, then its time waiting."""
    colour = html.state_colour(row["state"])
    waiting = row["waiting"]
    if waiting is None:
        return [(row["elapsed"], colour)]
    return [(row["elapsed"] - waiting, colour), (waiting, html.WAITING_COLOUR)]


def _duration_text(row: dict[str, Any]) -> str:
    text = f"{row['elapsed']:.2f} s {row['state']}"
    if row["waiting"] is not None:
        text += f" ({row['elapsed'] - row['waiting']:.2f} s computing, {row['waiting']:.2f} s waiting)"
    return text + (f" {html.FLAG} straggler" if row["straggler"] else "")
