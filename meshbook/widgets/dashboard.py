"""A live panel of a running mesh: per-rank state, CPU, memory, heartbeats and stragglers.

``Dashboard(mesh)`` (or ``%mesh dashboard``) shows one row per rank: host, pid, device,
state, CPU %, RSS, CUDA allocated / reserved / peak (on GPUs), how full its memory pool is,
the age of its last heartbeat and a sparkline of its memory over the last minutes. Rows are
coloured for dead ranks, stragglers and ranks near their memory limit; below the table sits
the straggler verdict (its score and where the slow rank spends its time).

A daemon thread refreshes the panel every ``REFRESH_S`` seconds from what the heartbeats have
already brought to the controller: it sends nothing to the ranks, never blocks the kernel and
keeps updating while other cells run. The thread ends when the widget is closed or the mesh
stops; the panel then becomes a static snapshot of its last state (HTML and text, no widget
view), so a notebook saved afterwards shows it anywhere.

``rows``, ``stragglers`` and ``live`` are the model state. Where widgets do not render the
output falls back to the same table as HTML and to a deterministic ``text/plain`` line. The
HTML holds live numbers, so a notebook checked by nbval marks a dashboard cell
``# NBVAL_IGNORE_OUTPUT``.
"""

from __future__ import annotations

import threading
from typing import Any

from traitlets import Bool, Dict, Int, List

from ..mesh import MemoryRow, Mesh, StragglerReport, current, format_bytes, format_ranks
from . import html
from .panel import HTMLPanel

#: Seconds between refreshes (heartbeats arrive every 0.5 s).
REFRESH_S = 0.5
#: Points a sparkline draws at most (the history holds about 600 per rank).
SPARK_POINTS = 120


class Dashboard(HTMLPanel):
    """Live per-rank panel of ``mesh`` (default: the current mesh)."""

    #: One dict per rank: what the table shows, as numbers (bytes, %, seconds).
    rows = List(Dict()).tag(sync=True)
    #: Ranks the sampling detector flags, the highest score first.
    stragglers = List(Int()).tag(sync=True)
    #: True while the panel updates; False once closed or once the mesh stopped.
    live = Bool(True).tag(sync=True)

    def __init__(self, mesh: Mesh | None = None, refresh: float = REFRESH_S, **kwargs: Any) -> None:
        self.mesh = mesh if mesh is not None else current()
        self.refresh_s = refresh
        super().__init__(**kwargs)
        self._stop = threading.Event()
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="meshbook-dashboard", daemon=True)
        self._thread.start()
        # Frozen in the cell (or at the exit) that stops the mesh: a batch runner (nbconvert,
        # nbval, papermill) whose last cell is %mesh stop has gone before the next refresh.
        self.mesh.controller.add_stop_listener(self.close)

    @property
    def thread(self) -> threading.Thread:
        """The refresh thread (it ends on ``close()`` or when the mesh stops)."""
        return self._thread

    def refresh(self) -> None:
        """Read the ranks' last heartbeats and redraw."""
        memory = self.mesh.memory()
        report = self.mesh.stragglers()
        self.rows = [self._row(r, report) for r in memory.rows]
        self.stragglers = report.stragglers
        self.html_view.value = self._render(report)

    def close(self) -> None:
        """Stop updating (the thread ends) and leave a static snapshot of the panel, as the
        ranks are now (it says closed, or that the mesh stopped)."""
        if self._stop.is_set():
            return  # closed already (by the user, or as its mesh stopped)
        self._stop.set()
        self.mesh.controller.remove_stop_listener(self.close)
        if threading.current_thread() is not self._thread:
            self._thread.join(5)
        self.refresh()
        super().close()

    def _loop(self) -> None:
        try:
            while not self._stop.wait(self.refresh_s) and not self.mesh.stopped:
                self.refresh()
            if not self._stop.is_set():
                self.close()  # the mesh stopped, and its stop did not close us: show how it ended
        except Exception as exc:  # say why the panel froze rather than freeze silently
            self.html_view.value += html.note(f"the dashboard stopped updating: "
                                              f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self.live = False

    # -- rendering ---------------------------------------------------------------------------

    def _row(self, r: MemoryRow, report: StragglerReport) -> dict[str, Any]:
        sampled = report.get(r.rank)
        return {"rank": r.rank, "host": r.host, "pid": r.pid, "device": r.device,
                "state": r.state, "cpu": r.cpu, "rss": r.rss, "cuda_allocated": r.cuda_allocated,
                "cuda_reserved": r.cuda_reserved, "cuda_peak": r.cuda_peak, "pool": r.pool,
                "pool_used": r.pool_used, "pool_limit": r.pool_limit, "pool_text": r.pool_text(),
                "near_limit": r.near_limit,
                "heartbeat_age": r.heartbeat_age, "dead": r.dead,
                "straggler": r.rank in report.stragglers,
                "score": sampled.score if sampled else None,
                "wait": sampled.wait if sampled and sampled.samples else None}

    def _title(self) -> str:
        state = "mesh stopped" if self.mesh.stopped else "closed" if self._stop.is_set() else "live"
        return f"meshbook: {_named(self.mesh)}{len(self.rows)} ranks ({self.mesh.topology.describe()}), {state}"

    def _render(self, report: StragglerReport) -> str:
        gpu = any(row["cuda_allocated"] is not None for row in self.rows)
        headers = ["rank", "host", "pid", "device", "state", "CPU", "RSS"]
        headers += ["CUDA alloc", "reserved", "peak"] if gpu else []
        headers += ["memory pool", "heartbeat", "memory, last minutes", "straggler"]
        table = [(self._cells(row, gpu), _background(row)) for row in self.rows]
        notes = report.summary()
        near = [row["rank"] for row in self.rows if row["near_limit"]]
        if near:
            notes.append(f"near the memory limit: rank(s) {format_ranks(near)}")
        notes += self._places()
        actors = self.mesh.actors() if not self.mesh.stopped else {}
        if actors:
            notes.append("actors: " + ", ".join(f"{a.name} ({a.cls_name}{', failed' if a.failed else ''})"
                                                for a in actors.values()))
        return html.panel(self._title(), html.table(headers, table), notes)

    def _places(self) -> list[str]:
        """Where the mesh runs, when that can change under it: its Slurm job (state and time
        left) and any host not answering."""
        if self.mesh.stopped:
            return []
        job = self.mesh.job()
        hosts = [f"host {h.name} {h.state}" for h in self.mesh.hosts() if h.state != "ok"]
        return ([str(job)] if job is not None else []) + hosts

    def _cells(self, row: dict[str, Any], gpu: bool) -> list[str]:
        def text(value: Any) -> str:
            return html.esc("-" if value in (None, "") else value)

        cells = [text(row["rank"]), text(row["host"]), text(row["pid"]), text(row["device"]),
                 html.badge(row["state"]),
                 text(None if row["cpu"] is None else f"{row['cpu']:.0f}%"),
                 text(format_bytes(row["rss"]))]
        if gpu:
            cells += [text(format_bytes(row[k])) for k in ("cuda_allocated", "cuda_reserved", "cuda_peak")]
        age = row["heartbeat_age"]
        points = [] if row["dead"] else self.mesh.history.memory(row["rank"])
        values = [p.used for p in points[::max(1, len(points) // SPARK_POINTS)]]
        flag = ""
        if row["score"] is not None:
            flag = (f"{html.FLAG} " if row["straggler"] else "") + f"{row['score']:.2f}"
        cells += [text(row["pool_text"]), text(None if age is None else f"{age:.1f} s"),
                  html.sparkline(values), text(flag)]
        return cells

    def text(self) -> str:
        """Deterministic: what the panel is, never its changing numbers."""
        return (f"meshbook dashboard: {_named(self.mesh)}{len(self.rows)} ranks ({self.mesh.topology.describe()}); "
                f"%mesh memory and %mesh stragglers print the same as text")


def _named(mesh: Mesh) -> str:
    """``mesh 'trainers': `` when the notebook named its mesh (several may run)."""
    return "" if mesh.name == "mesh" else f"mesh {mesh.name!r}: "


def _background(row: dict[str, Any]) -> str:
    if row["dead"]:
        return html.DEAD_BG
    if row["straggler"]:
        return html.STRAGGLER_BG
    return html.NEAR_LIMIT_BG if row["near_limit"] else ""
