"""The one event renderer: a run's events as a reader sees them, in a script or in a cell.

:class:`EventRenderer` takes a run's events in arrival order and writes the ranks' output
merged across ranks (:class:`~.output.LineMerger`) or buffered in rank order
(:class:`~.output.OrderedCollector`), shows each ``display()`` after what its rank printed
before it (the same display of several ranks once, labelled as lines are), and answers
debugger prompts (:class:`~.prompts.PromptServer`). ``Run.result()`` renders with it to this
process's streams; the ``%%mesh`` cell renders with it into the cell (displays published as
rich output), adding the cell's own status view, hang hints and interrupts around it.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Protocol

from ...protocol.events import Display, Event, InputRequest, Output
from ...protocol.text import format_ranks
from .output import LineMerger, OrderedCollector, Show
from .prompts import PromptServer
from .transport import log


class Rendered(Protocol):
    """What the renderer needs of a run (:class:`~.run.Run`): its ranks, and where a rank's
    debugger prompt is answered."""

    ranks: list[int]

    def send_input(self, rank: int, text: str | None, question: int) -> None: ...


def write_stream(stream: str, text: str) -> None:
    """Write ``text`` to this process's ``stream`` ("stdout"/"stderr") at once."""
    target = sys.stderr if stream == "stderr" else sys.stdout
    target.write(text)
    target.flush()


def labelled_display(ranks: list[int], data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The ranks' display labelled as their lines are (``[0-3]``), as RankValues labels an
    HTML result: inside its HTML, Markdown and text forms; a bundle a notebook shows as neither
    (an image: its text form is not shown) gets a label line to write before it, returned
    first ("" where none is needed)."""
    label = f"[{format_ranks(ranks)}]"
    out = dict(data)
    if "text/plain" in out:
        out["text/plain"] = f"{label} {out['text/plain']}"
    if "text/html" in out:
        out["text/html"] = f"<div><b>{label}</b>{out['text/html']}</div>"
    if "text/markdown" in out:
        out["text/markdown"] = f"**{label}** {out['text/markdown']}"
    shown_as_text = any(kind in out for kind in ("text/html", "text/markdown")) or set(out) <= {"text/plain"}
    return ("" if shown_as_text else label + "\n"), out


def print_late(event: Event) -> None:
    """Output of a run this process no longer knows, each line marked with its rank."""
    if isinstance(event, Output):
        write_stream(event.stream, "".join(f"[{event.rank}] {line}\n" for line in event.text.splitlines()))


class LateOutput:
    """Where a run's output goes once nobody renders it (a background thread's prints, a
    timed-out cell's): merged across its ranks as a cell's output is (a line waits up to the
    merge window for the other ranks to print it too; a timer writes it then), through
    ``write(stream, text)``; displays through ``show``. Called from any thread. The merger is
    built at the first such output: a run that has none pays for this object only."""

    def __init__(self, ranks: list[int], write: Callable[[str, str], None] = write_stream,
                 show: Show | None = None) -> None:
        self._ranks, self._write, self._show = ranks, write, show
        self._merger: LineMerger | None = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        with self._lock:
            if isinstance(event, (Output, Display)):
                if self._merger is None:
                    self._merger = LineMerger(self._ranks, self._write, show=self._show)
                self._merger.feed_event(event)
                self._merger.poll()
                self._arm(self._merger)

    def end(self, text: str) -> None:
        """How the run ended (a line), after everything it printed."""
        with self._lock:
            if self._merger is not None:
                self._merger.flush()
            self._write("stderr", text + "\n")

    def _arm(self, merger: LineMerger) -> None:
        due = merger.next_deadline()
        if due is not None and self._timer is None:
            self._timer = threading.Timer(due + 0.01, self._due, (merger,))
            self._timer.daemon = True
            self._timer.start()

    def _due(self, merger: LineMerger) -> None:
        """The timer: write what waited out the window. A write that fails (the kernel's socket
        gone at exit) is logged, as the run's own hand-off of late output is."""
        with self._lock:
            self._timer = None
            try:
                merger.poll()
            except Exception as exc:  # noqa: BLE001 - whatever the route raises
                log(f"late output was lost: {type(exc).__name__}: {exc}")
                return
            self._arm(merger)


class EventRenderer:
    """Renders one run's events through ``write(stream, text)`` and ``show_display(ranks,
    data)`` (by default: the display's text, written)."""

    def __init__(self, run: Rendered, write: Callable[[str, str], None] = write_stream,
                 show_display: Show | None = None, ordered: bool = False,
                 ask: Callable[[str], str] = input) -> None:
        self.writer = OrderedCollector(run.ranks, write, show_display) if ordered else \
            LineMerger(run.ranks, write, show=show_display)
        self.prompts = PromptServer(ask, run.send_input, self._show_before_prompt)

    def feed(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, InputRequest):
                self.writer.flush()  # what the rank printed before comes first
            self.writer.feed_event(event)
            self.prompts.feed(event)
        self.writer.poll()

    def _show_before_prompt(self, rank: int, text: str) -> None:
        """What a rank's debugger printed since its last prompt, written as its output is."""
        self.writer.feed_event(Output(rank, "stdout", text))
        self.writer.flush()

    def next_deadline(self) -> float | None:
        """Seconds until a waiting line must be written (None: nothing waits)."""
        return self.writer.next_deadline()

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
