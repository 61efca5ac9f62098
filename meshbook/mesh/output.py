"""Rank output as people want to read it: one line for what several ranks print alike.

:class:`LineMerger` streams: a line printed by ranks 0-3 is written once as ``[0-3] epoch 1``
as soon as every rank still running has printed it, or after a short window (so a line only
rank 0 prints is not held back for long). Lines keep their order; a rank that prints the same
text twice contributes to two separate lines.

:class:`OrderedCollector` buffers instead and writes each rank's output in rank order when the
run ends (ranks with identical output shown once): deterministic, for tests and docs.

Both take events from :class:`~meshbook.mesh.run.Run` and write through a
``write(stream, text)`` callable, so scripts and the notebook share one implementation.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .errors import format_ranks, group_by_text
from .run import Error, Event, Output, Result

Write = Callable[[str, str], None]

#: How long a line waits for the other ranks to print it too.
MERGE_WINDOW_S = 0.2


@dataclass
class _Line:
    first_seen: float
    ranks: set[int] = field(default_factory=set)


class _Splitter:
    """Cuts each rank's stream into complete lines; the unfinished tail waits."""

    def __init__(self) -> None:
        self._partial: dict[tuple[int, str], str] = defaultdict(str)

    def lines(self, rank: int, stream: str, text: str) -> list[str]:
        pending = self._partial[(rank, stream)] + text
        *complete, self._partial[(rank, stream)] = pending.split("\n")
        return complete

    def tails(self) -> list[tuple[int, str, str]]:
        out = [(rank, stream, text) for (rank, stream), text in self._partial.items() if text]
        self._partial.clear()
        return out


class LineMerger:
    """Streams output, merging identical lines across ranks."""

    def __init__(self, ranks: Iterable[int], write: Write, window: float = MERGE_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._running = set(ranks)
        self._write = write
        self._window = window
        self._clock = clock
        self._splitter = _Splitter()
        self._occurrences: dict[tuple[int, str, str], int] = defaultdict(int)
        self._lines: dict[tuple[str, str, int], _Line] = {}  # insertion order = display order

    def feed_event(self, event: Event) -> None:
        if isinstance(event, Output):
            for line in self._splitter.lines(event.rank, event.stream, event.text):
                self._add(event.rank, event.stream, line)
        elif isinstance(event, (Result, Error)):
            self._running.discard(event.rank)

    def _add(self, rank: int, stream: str, line: str) -> None:
        nth = self._occurrences[(rank, stream, line)]
        self._occurrences[(rank, stream, line)] += 1
        entry = self._lines.setdefault((stream, line, nth), _Line(self._clock()))
        entry.ranks.add(rank)

    def poll(self) -> None:
        """Write every line that is complete or has waited long enough (in order)."""
        now = self._clock()
        ready = []
        for key, entry in self._lines.items():
            if not (self._running <= entry.ranks or now - entry.first_seen >= self._window):
                break
            ready.append(key)
        self._emit(ready)

    def next_deadline(self) -> float | None:
        """Seconds until the oldest waiting line must be written (None: nothing waits)."""
        for entry in self._lines.values():
            return max(0.0, entry.first_seen + self._window - self._clock())
        return None

    def flush(self) -> None:
        """Write everything waiting now (before a display, say), keeping unfinished lines."""
        self._emit(list(self._lines))

    def close(self) -> None:
        """The run is over: write everything, unfinished lines included."""
        for rank, stream, text in self._splitter.tails():
            self._add(rank, stream, text)
        self.flush()

    def _emit(self, keys: list[tuple[str, str, int]]) -> None:
        chunks: list[tuple[str, str]] = []
        for key in keys:
            stream, line, _ = key
            text = f"[{format_ranks(self._lines.pop(key).ranks)}] {line}\n"
            if chunks and chunks[-1][0] == stream:
                chunks[-1] = (stream, chunks[-1][1] + text)
            else:
                chunks.append((stream, text))
        for stream, text in chunks:
            self._write(stream, text)


class OrderedCollector:
    """Buffers output and writes it per rank, in rank order, when the run ends."""

    def __init__(self, ranks: Iterable[int], write: Write) -> None:
        self._write = write
        self._text: dict[str, dict[int, str]] = {"stdout": {}, "stderr": {}}

    def feed_event(self, event: Event) -> None:
        if isinstance(event, Output):
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
            out = []
            for ranks, text in group_by_text(texts):
                label = f"[{format_ranks(ranks)}] "
                out.extend(label + line + "\n" for line in text.rstrip("\n").split("\n"))
            if out:
                self._write(stream, "".join(out))
        self._text = {"stdout": {}, "stderr": {}}
