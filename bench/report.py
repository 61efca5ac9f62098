"""Tables of results, the targets they are checked against, and how numbers are written.

Every workload returns :class:`Table` s (one per question it answers) and :class:`Check` s
(the targets its issue set, checked against this very run). Tables render as markdown with
padded columns, which reads well both in a terminal and in ``bench/RESULTS.md``.

Numbers are written one way everywhere: latencies as ``median (p99 x)`` in the unit that
suits them, throughputs in GB/s (10^9 bytes), and comparisons with a peer as the peer's
time (or memory) over meshbook's, so that above 1x always means meshbook is better. The
one column the other way round, meshbook over the floor of its own design, says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .timing import Samples


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: object) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{self.title}: {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append([str(c) for c in cells])

    def markdown(self) -> str:
        widths = [max(len(c), *(len(r[i]) for r in self.rows)) if self.rows else len(c)
                  for i, c in enumerate(self.columns)]

        def line(cells: list[str]) -> str:
            return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

        out = [f"### {self.title}", "", line(self.columns),
               "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        out += [line(r) for r in self.rows]
        if self.notes:
            out += [""] + [f"- {note}" for note in self.notes]
        return "\n".join(out)


@dataclass(frozen=True)
class Check:
    """A target an issue set, and how this run did against it (``met`` None: not measured)."""

    target: str
    measured: str
    met: bool | None
    #: Why a missed target was missed, from what the same run measured (shown when missed).
    why: str = ""
    #: A figure an issue asks to see beside a target, not a target itself: ``met`` is None.
    reported: bool = False

    def markdown(self) -> str:
        mark = {True: "met", False: "**missed**", None: "not measured"}[self.met]
        if self.reported:
            mark = "reported, no target"
        return f"| {self.target} | {self.measured} | {mark} |"


def duration(seconds: float) -> str:
    """``0.000612`` -> ``"0.61 ms"``; microseconds, milliseconds or seconds as fits."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.2f} s"


def latency(samples: Samples) -> str:
    """``"0.61 ms (p99 1.2 ms)"``."""
    return f"{duration(samples.median)} (p99 {duration(samples.p99)})"


def throughput(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as ``"12x"`` (``"-"`` where either is missing); with a peer's time or memory
    over meshbook's, above 1x means meshbook is better."""
    if not a or not b:
        return "-"
    value = a / b
    return f"{value:.0f}x" if value >= 10 else f"{value:.2g}x"


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.0f} MiB"
