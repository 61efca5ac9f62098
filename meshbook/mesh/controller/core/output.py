"""Rank output as people want to read it: one line for what several ranks print alike.

:class:`LineMerger` streams: a line printed by ranks 0-3 is written once as ``[0-3] epoch 1``
as soon as every rank still running has printed it, or has printed another line in its place
(ranks print in step: rank 2's third line was not this one, so it will not join it), or after
a window (``MERGE_WINDOW_S``) long enough for ranks a busy machine schedules a moment apart.
Only a line that some ranks never print waits that long (``if rank == 0: print(...)``).
Each rank's lines keep their order: a line joins a waiting line of the same text only if that
one shows after every line the rank printed before (ranks 0,1 printing ``A B`` and rank 2
``B A`` show ``[0,1] A``, ``[0-2] B``, ``[2] A``), so a rank that prints the same text twice
contributes to two separate lines. A progress line (``\r``, as tqdm writes) shows at once, labelled, and each
update overwrites it (``\r[0] 50%|...``), as in a terminal, the lowest rank's while several ranks have
one going; a line is what it shows in the end
(its text after its last ``\r``). A line a rank leaves unfinished for ``PARTIAL_S`` (dots
printed with ``end="", flush=True`` while it works) shows the same way, live, until it ends:
sooner, output written in pieces would flicker. A rank's ``display()`` takes its place among its
lines, and the same display from several ranks (same data) shows once, ``show(ranks, data)``
(each labelled by its caller), as lines merge. Per-rank lines written together are sorted by
rank between the merged lines around them (``[0] loss 1.2``, ``[1] loss 1.3``, ... whatever
order they arrived in).

:class:`OrderedCollector` buffers instead and writes each rank's output in rank order when the
run ends (ranks with identical output shown once): deterministic, for tests and docs.

Both take events from :class:`~meshbook.mesh.controller.core.run.Run` and write through a
``write(stream, text)`` callable, so scripts and the notebook share one implementation.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ...protocol.events import Display, Error, Event, Output, Result, Results
from ...protocol.text import format_ranks, group_by_text

Write = Callable[[str, str], None]
#: Shows one display of the ranks given: its data, a MIME bundle.
Show = Callable[[list[int], dict[str, Any]], None]
#: The stream a rank's displays wait on, beside its lines (never written as text).
DISPLAYS = "display"

#: How long a line waits for the other ranks to print it too: from when it came, or, while
#: a rank that has not reached it keeps printing the lines the others printed before it (it
#: is catching up: a long output, a rank the machine ran later), from that rank's last such
#: line; at most ``MERGE_CAP_S``.
MERGE_WINDOW_S = 1.0
MERGE_CAP_S = 10.0
#: How long a rank's unfinished line (no ``\r``, no newline yet) waits before it shows live.
PARTIAL_S = 0.5


@dataclass
class _Line:
    stream: str
    text: str
    first_seen: float
    position: int  # how many lines of its stream its first rank had printed before it
    serial: int  # where it shows: lines show in the order of their serials
    ranks: set[int] = field(default_factory=set)
    data: dict[str, Any] | None = None  # a display's MIME bundle (its text is the bundle's key)


class _Splitter:
    """Cuts each rank's stream into complete lines; the unfinished tail waits."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._partial: dict[tuple[int, str], str] = defaultdict(str)
        self._since: dict[tuple[int, str], float] = {}  # when each unfinished tail began
        self._clock = clock

    def lines(self, rank: int, stream: str, text: str) -> list[str]:
        """The lines ``text`` completes, each as it shows in the end (:func:`shown`)."""
        key = (rank, stream)
        pending = self._partial[key] + text
        *complete, self._partial[key] = pending.split("\n")
        if not self._partial[key]:
            self._since.pop(key, None)
        elif complete or key not in self._since:
            self._since[key] = self._clock()
        return [shown(line) for line in complete]

    def _live(self, key: tuple[int, str], now: float) -> bool:
        """Does the unfinished tail show: a progress line (it has a ``\r``), or one left
        unfinished for :data:`PARTIAL_S`?"""
        tail = self._partial.get(key, "")
        return "\r" in tail or bool(tail) and now - self._since[key] >= PARTIAL_S

    def progress(self, rank: int, stream: str) -> str:
        """What the unfinished tail shows now, if it shows (:meth:`_live`)."""
        key = (rank, stream)
        return shown(self._partial[key]) if self._live(key, self._clock()) else ""

    def first_in_progress(self, stream: str) -> int | None:
        """The lowest rank whose unfinished tail on ``stream`` shows."""
        now = self._clock()
        return min((rank for (rank, on) in self._partial if on == stream and self._live((rank, on), now)),
                   default=None)

    def next_shown(self) -> float | None:
        """When the next unfinished line that does not show yet will (None: none waits)."""
        now = self._clock()
        return min((since + PARTIAL_S for key, since in self._since.items()
                    if since + PARTIAL_S > now and "\r" not in self._partial[key]), default=None)

    def streams(self) -> set[str]:
        """The streams a rank left a line unfinished on."""
        return {stream for (_, stream), tail in self._partial.items() if tail}

    def tails(self) -> list[tuple[int, str, str]]:
        out = [(rank, stream, text) for (rank, stream), text in self._partial.items() if text]
        self._partial.clear()
        self._since.clear()
        return out


class LineMerger:
    """Streams output, merging identical lines across ranks."""

    def __init__(self, ranks: Iterable[int], write: Write, window: float = MERGE_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic, show: Show | None = None) -> None:
        self._running = set(ranks)
        self._write = write
        self._rich = show  # None: displays are written as their text
        self._window = window
        self._clock = clock
        self._splitter = _Splitter(clock)
        self._printed: dict[tuple[int, str], int] = defaultdict(int)  # lines per (rank, stream)
        self._lines: dict[int, _Line] = {}  # waiting, by serial (insertion order = display order)
        self._alike: dict[tuple[str, str], list[_Line]] = defaultdict(list)  # waiting, by text
        self._serials = itertools.count()
        #: The serial of the newest line each rank showed or joined, per stream.
        self._newest: dict[tuple[int, str], int] = {}
        #: Streams whose last write is a progress line, not ended, and its length: the next
        #: write overwrites it (blanking what a shorter one would leave of it).
        self._progress: dict[str, int] = {}
        #: What each stream's progress line shows now (not written again unchanged).
        self._live: dict[str, str] = {}
        #: When each rank last joined a line another rank printed first (it is catching up).
        self._joined: dict[int, float] = {}
        self._everyone = frozenset(self._running)

    def feed_event(self, event: Event) -> None:
        if isinstance(event, Output):
            for line in self._splitter.lines(event.rank, event.stream, event.text):
                self._add(event.rank, event.stream, line)
            self._show_progress(event.stream, event.rank)
        elif isinstance(event, Display):
            self._add(event.rank, DISPLAYS, json.dumps(event.data, sort_keys=True, default=repr), event.data)
        elif isinstance(event, (Result, Error)):
            self._running.discard(event.rank)
        elif isinstance(event, Results):
            self._running.difference_update(event.ranks)

    def _add(self, rank: int, stream: str, line: str, data: dict[str, Any] | None = None) -> None:
        """Join the first waiting line of this text that shows after the rank's newest one (a
        rank that printed it already is in none of those), or wait as a new one."""
        newest = self._newest.get((rank, stream), -1)
        alike = self._alike[(stream, line)]
        entry = next((e for e in alike if e.serial > newest), None)
        if entry is None:
            entry = _Line(stream, line, self._clock(), self._printed[(rank, stream)], next(self._serials), data=data)
            self._lines[entry.serial] = entry
            alike.append(entry)
        else:
            self._joined[rank] = self._clock()
        entry.ranks.add(rank)
        self._printed[(rank, stream)] += 1
        self._newest[(rank, stream)] = entry.serial

    def _show_progress(self, stream: str, updated: int | None = None) -> None:
        """One live line per stream, the lowest rank's: bars of several ranks updating one line
        took turns there (tqdm on every rank flickered between them). Each shows as it ends.
        ``updated``: only if that rank's is the one shown (its output just came)."""
        rank = self._splitter.first_in_progress(stream)
        if rank is None or updated not in (None, rank):
            return
        text = f"[{rank}] {self._splitter.progress(rank, stream)}"
        if text != self._live.get(stream) or stream not in self._progress:
            self._show(stream, text, ended=False)
            self._live[stream] = text

    def poll(self) -> None:
        """Write every line that is complete or has waited long enough, each after the lines
        its ranks printed before it, then the unfinished lines that show by now."""
        self._emit_due()
        for stream in self._splitter.streams():
            self._show_progress(stream)

    def _emit_due(self) -> None:
        now = self._clock()
        ready: list[_Line] = []
        held: set[int] = set()  # ranks with an earlier line still waiting
        for entry in self._lines.values():
            if entry.ranks & held or now < self._due(entry):
                held |= entry.ranks
                if held >= self._everyone:
                    break  # every later line has a rank held: none can go before it
            else:
                ready.append(entry)
        self._emit(ready)

    def _due(self, entry: _Line) -> float:
        """When ``entry`` goes without the ranks that have not reached it: at once if there
        are none (every running rank printed it, or another line in its place), else a window
        after it came or after the last line one of them caught up on, at most the cap."""
        behind = [rank for rank in self._running
                  if rank not in entry.ranks and self._printed[(rank, entry.stream)] <= entry.position]
        if not behind:
            return 0.0
        catching_up = max((self._joined.get(rank, 0.0) for rank in behind), default=0.0)
        return min(entry.first_seen + MERGE_CAP_S, max(entry.first_seen, catching_up) + self._window)

    def next_deadline(self) -> float | None:
        """Seconds until the oldest waiting line must be written, or an unfinished one shows
        (None: nothing waits)."""
        due = [self._due(entry) for entry in itertools.islice(self._lines.values(), 1)]
        shown_at = self._splitter.next_shown()
        due += [shown_at] if shown_at is not None else []
        return max(0.0, min(due) - self._clock()) if due else None

    def flush(self) -> None:
        """Write everything waiting now (before a display, say), keeping unfinished lines."""
        self._emit(list(self._lines.values()))

    def close(self) -> None:
        """The run is over: write everything, unfinished lines included."""
        for rank, stream, text in self._splitter.tails():
            self._add(rank, stream, text)
        self.flush()

    def _emit(self, lines: list[_Line]) -> None:
        chunks: list[tuple[str, str]] = []
        for entry in lines:
            del self._lines[entry.serial]
            alike = self._alike[(entry.stream, entry.text)]
            alike.remove(entry)
            if not alike:
                del self._alike[(entry.stream, entry.text)]
        for entry in _by_rank(lines):
            if entry.data is not None:
                self._flush_chunks(chunks)
                if self._rich is None:
                    self._show("stdout", display_text(sorted(entry.ranks), entry.data), ended=True)
                else:
                    self._progress.pop("stdout", None)  # what follows a rich display starts below it
                    self._rich(sorted(entry.ranks), entry.data)
                continue
            text = f"[{format_ranks(entry.ranks)}] {entry.text}\n"
            if chunks and chunks[-1][0] == entry.stream:
                chunks[-1] = (entry.stream, chunks[-1][1] + text)
            else:
                chunks.append((entry.stream, text))
        self._flush_chunks(chunks)

    def _flush_chunks(self, chunks: list[tuple[str, str]]) -> None:
        for stream, text in chunks:
            self._show(stream, text, ended=True)
        chunks.clear()


    def _show(self, stream: str, text: str, ended: bool) -> None:
        """Write ``text``, over the progress line the stream shows (if any)."""
        shown_before = self._progress.pop(stream, None)
        if shown_before is not None:
            first, newline, rest = text.partition("\n")
            text = "\r" + first.ljust(shown_before) + newline + rest
        if not ended:
            self._progress[stream] = len(text.rsplit("\r", 1)[-1])
        self._write(stream, text)


def display_text(ranks: list[int], data: dict[str, Any]) -> str:
    """A display where only text can be shown (a script): its plain-text form, labelled."""
    return f"[{format_ranks(ranks)}] {data.get('text/plain', '')}\n"


def shown(line: str) -> str:
    """What a line shows once written to a terminal: its text after its last ``\r`` (a
    progress bar's last state; ``\r\n`` ends a line as ``\n`` does)."""
    return line.rstrip("\r").rsplit("\r", 1)[-1]


def _by_rank(lines: list[_Line]) -> list[_Line]:
    """Lines of a single rank sorted by rank (each rank's own lines keep their order) between
    the lines several ranks printed, which stay where they are."""
    out: list[_Line] = []
    single: list[_Line] = []
    for entry in lines:
        if len(entry.ranks) == 1:
            single.append(entry)
            continue
        out += sorted(single, key=lambda e: min(e.ranks))
        out.append(entry)
        single = []
    return out + sorted(single, key=lambda e: min(e.ranks))


class OrderedCollector:
    """Buffers output and writes it per rank, in rank order, when the run ends."""

    def __init__(self, ranks: Iterable[int], write: Write, show: Show | None = None) -> None:
        self._write = write
        self._show = show or (lambda ranks, data: write("stdout", display_text(ranks, data)))
        self._text: dict[str, dict[int, str]] = {"stdout": {}, "stderr": {}}

    def feed_event(self, event: Event) -> None:
        if isinstance(event, Display):  # shown as it comes, the rank's output after the run
            self._show([event.rank], event.data)
        elif isinstance(event, Output):
            texts = self._text.setdefault(event.stream, {})
            texts[event.rank] = texts.get(event.rank, "") + event.text

    def poll(self) -> None:
        pass

    def next_deadline(self) -> float | None:
        return None

    def flush(self) -> None:
        pass

    def close(self) -> None:
        for stream, texts in self._text.items():
            out: list[str] = []
            for ranks, text in group_by_text(texts):
                label = f"[{format_ranks(ranks)}] "
                out.extend(label + shown(line) + "\n" for line in text.rstrip("\n").split("\n"))
            if out:
                self._write(stream, "".join(out))
        self._text = {"stdout": {}, "stderr": {}}
