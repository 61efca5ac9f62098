"""Which rank holds the others back: scored from when ranks reach their collectives, from
the ranks' own samples, and from cell durations.

Three signals, all cheap and all available while work is still running:

* **Arrivals** are exact: every rank records when it enters each collective
  (:mod:`meshbook.mesh.rank.collectives`; DDP's, issued from C++, from torch's flight
  recorder), and the controller lines the members of each
  collective up (:mod:`.clock`). The rank the others wait for is the one that arrives last:
  its score is its share of the collectives' spread (first arrival to last), about 1 for the
  rank that is always last, leaving out the collective with the longest spread (one stall is
  not a straggler). A score of at least ``LATE_SCORE`` flags it, when the spread,
  without its longest, matters (at least ``MATERIAL_SHARE`` of the time, and ``MATERIAL_S``).
  This is the verdict wherever ranks call torch.distributed's collectives.

* **Sampling** works inside a training loop, where no collective was timed.
  Every heartbeat carries the fraction of the last few seconds a rank's main thread spent
  waiting in collectives (see
  :mod:`meshbook.mesh.rank.sampling`). In a synchronous job everyone waits for the slowest rank, so
  the straggler is the rank that waits *least* while the others wait on it. A rank's score is
  the median waiting fraction of the *other* ranks running the same request minus its own,
  and never below 0: about 0 for a healthy rank (or one that waits more than most: nobody
  waits on it), close to 1 for the rank everyone waits for. A score of at least
  ``STRAGGLER_SCORE`` flags it. A rank needs ``MIN_SAMPLES`` samples in the window to be
  scored, and two ranks are needed to compare.
* **Durations** work per request: a rank whose duration exceeds the median of the others' by
  ``DURATION_FACTOR`` is slow, if it is also at least ``DURATION_MIN_EXCESS_S`` slower (a 3 ms
  cell next to 1 ms ones is not news).

:func:`straggler_report` combines both into a :class:`StragglerReport`, whose text names the
straggler, its score and where it spends its time::

    straggler: rank 2 (score 0.91): it waits in collectives 3% of the time, the others 94%
      rank 2 spends its time at: cell line 5 (95%), all_reduce at cell line 6 (3%)
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...protocol.config import WINDOW_S
from ...protocol.text import format_percent, status_table
from .clock import Lateness

#: An arriving-last share that flags a rank, when the spread is at least MATERIAL_SHARE of the
#: time and MATERIAL_S long; and the fewest complete collectives that count as evidence.
LATE_SCORE = 0.5
MATERIAL_SHARE = 0.1
MATERIAL_S = 0.1
MIN_COLLECTIVES = 3
#: The longest spread is told as a stall when it is this many times the others' average.
STALL_FACTOR = 3.0
STRAGGLER_SCORE = 0.3
MIN_SAMPLES = 5
DURATION_FACTOR = 2.0
DURATION_MIN_EXCESS_S = 0.5


@dataclass(frozen=True)
class Place:
    """Where a rank's main thread was in a share of its samples."""

    where: str
    waiting: bool
    fraction: float

    def __str__(self) -> str:
        return f"{self.where} ({format_percent(self.fraction)})"


@dataclass(frozen=True)
class RankTime:
    """One rank's sampled time: how much of it it waited, and its straggler score."""

    rank: int
    #: The request the samples were taken in (``None``: none sampled).
    request: int | None
    samples: int
    wait: float
    places: tuple[Place, ...]
    #: Median waiting fraction of the other ranks minus this rank's, at least 0; ``None`` if
    #: not scored.
    score: float | None
    others_wait: float | None
    #: Why the rank stopped sampling, if it did (its time is then unknown).
    error: str | None = None
    #: From the arrivals (exact): how late it came in all, at how many collectives it came
    #: last, and the verdict (None: the sampling score decides).
    late_s: float | None = None
    last: int = 0
    flagged: bool | None = None

    @property
    def straggler(self) -> bool:
        if self.flagged is not None:
            return self.flagged
        return self.score is not None and self.score >= STRAGGLER_SCORE


@dataclass(frozen=True)
class SlowRank:
    """A rank whose request took ``factor`` times the median of the other ranks."""

    rank: int
    duration: float
    others_median: float

    @property
    def factor(self) -> float:
        return self.duration / self.others_median if self.others_median > 0 else float("inf")


@dataclass(frozen=True)
class StragglerReport:
    """Straggler scores per rank (from sampling) and ranks slow by duration (from a run)."""

    ranks: tuple[RankTime, ...]
    slow: tuple[SlowRank, ...] = ()
    window: float = WINDOW_S
    #: The arrivals the scores come from, when the ranks' collectives were timed.
    arrivals: Lateness | None = None

    @property
    def stragglers(self) -> list[int]:
        """Ranks flagged by sampling, the highest score first."""
        return [t.rank for t in self._straggling()]

    @property
    def slow_ranks(self) -> list[int]:
        """Ranks flagged by their duration, the slowest first."""
        return [s.rank for s in sorted(self.slow, key=lambda s: -s.duration)]

    def flagged(self) -> set[int]:
        """Every rank flagged by either signal."""
        return set(self.stragglers) | set(self.slow_ranks)

    def get(self, rank: int) -> RankTime | None:
        return next((t for t in self.ranks if t.rank == rank), None)

    @property
    def timed(self) -> bool:
        """Whether the verdict comes from the ranks' timed arrivals (not from sampling)."""
        return any(t.flagged is not None for t in self.ranks)

    def _straggling(self) -> list[RankTime]:
        return sorted((t for t in self.ranks if t.straggler), key=lambda t: -(t.score or 0.0))

    def summary(self) -> list[str]:
        """The verdict in a few lines: each straggler, its score and where its time goes."""
        lines = []
        for t in self._straggling():
            arrivals = self.arrivals
            if t.flagged is not None and arrivals is not None:
                lines.append(f"straggler: rank {t.rank} (score {t.score:.2f}): it arrived last at {t.last} of "
                             f"{arrivals.complete} collectives, {1000 * (t.late_s or 0) / arrivals.complete:.0f} ms "
                             f"late on average: the others waited {t.late_s or 0:.1f} s for it")
            else:
                lines.append(f"straggler: rank {t.rank} (score {t.score:.2f}): it waits in "
                             f"collectives {format_percent(t.wait)} of the time, the others "
                             f"{format_percent(t.others_wait)}")
            if t.places:
                lines.append(f"  rank {t.rank} spends its time at: {', '.join(map(str, t.places))}")
        for s in sorted(self.slow, key=lambda s: -s.duration):
            lines.append(f"slow: rank {s.rank} took {s.duration:.2f} s, {s.factor:.1f}x the "
                         f"median of the others ({s.others_median:.2f} s)")
        if not lines:
            lines.append(self._no_straggler())
        lines += self._stall()
        lines += [f"sampling stopped on rank {t.rank} ({t.error}): where it spends its time is "
                  f"unknown" for t in self.ranks if t.error]
        return lines

    def _stall(self) -> list[str]:
        """The longest spread, when it matters on its own and stands out from the others (not
        one more arrival of a steady straggler): the scores leave it out."""
        arrivals = self.arrivals
        if arrivals is None or not arrivals.longest_late_s or not self.timed:
            return []
        others = arrivals.steady_spread_s / max(1, arrivals.complete - 1)
        if arrivals.longest_spread_s < max(MATERIAL_S, MATERIAL_SHARE * arrivals.span_s, STALL_FACTOR * others):
            return []
        rank = max(arrivals.longest_late_s, key=lambda r: arrivals.longest_late_s[r])
        return [f"stall: rank {rank} arrived {arrivals.longest_spread_s:.2f} s after the first at one collective "
                f"(a single stall, left out of the scores)"]

    def _no_straggler(self) -> str:
        arrivals = self.arrivals
        if arrivals is not None and self.timed:
            apart = arrivals.steady_spread_s / arrivals.steady_span_s if arrivals.steady_span_s > 0 else 0.0
            return (f"no straggler: the ranks reach their collectives together ({format_percent(apart)} "
                    f"of the time between the first and the last to arrive)")
        scored = [t for t in self.ranks if t.score is not None]
        if scored and not any(t.wait for t in scored):  # "alike" would be a verdict on no evidence
            return ("cannot tell: no collective was timed, and no rank was seen waiting in one (torch's "
                    "flight recorder times those it issues from C++, as DistributedDataParallel's "
                    "all_reduce: is it off, TORCH_FR_BUFFER_SIZE=0?); where each spends its time is below")
        if scored:
            return f"no straggler: the ranks wait alike (every score below {STRAGGLER_SCORE:.2f})"
        return (f"no straggler: fewer than two ranks ran code long enough in the last "
                f"{self.window:g} s to compare them (run a loop, then ask again)")

    def __str__(self) -> str:
        exact = self.arrivals is not None and self.timed
        rows = [{"rank": t.rank, **({"late": f"{t.late_s:.2f} s", "last": t.last} if exact else {"samples": t.samples}),
                 "waiting": format_percent(t.wait) if t.samples or exact else "-",
                 "score": f"{t.score:.2f}" if t.score is not None else "-",
                 "flag": "straggler" if t.straggler else "",
                 "most time at": ", ".join(map(str, t.places[:2])) or "-"} for t in self.ranks]
        return "\n".join(self.summary()) + ("\n" + status_table(rows) if rows else "")

    __repr__ = __str__


def score_ranks(sampled: Mapping[int, Mapping[str, Any]]) -> tuple[RankTime, ...]:
    """Straggler scores from each rank's sampling report (the heartbeat's ``sampling``); a
    rank is compared with the ranks that ran the same request."""
    waits = {r: float(s.get("wait", 0.0)) for r, s in sampled.items()
             if int(s.get("n", 0)) >= MIN_SAMPLES}
    out = []
    for rank in sorted(sampled):
        report = sampled[rank]
        request = report.get("request")
        others = [w for r, w in waits.items() if r != rank and sampled[r].get("request") == request]
        others_wait = statistics.median(others) if others else None
        score = None
        if rank in waits and others_wait is not None:
            score = round(max(0.0, others_wait - waits[rank]), 3)
        places = tuple(Place(str(where), bool(waiting), float(fraction))
                       for where, waiting, fraction in report.get("top", ()))
        out.append(RankTime(rank, request, int(report.get("n", 0)),
                            float(report.get("wait", 0.0)), places, score, others_wait,
                            report.get("error")))
    return tuple(out)


def slow_by_duration(durations: Mapping[int, float], factor: float = DURATION_FACTOR,
                     min_excess: float = DURATION_MIN_EXCESS_S) -> tuple[SlowRank, ...]:
    """Ranks whose duration exceeds ``factor`` times the median of the other ranks'."""
    slow = []
    for rank, duration in sorted(durations.items()):
        others = [d for r, d in durations.items() if r != rank]
        if not others:
            continue
        median = statistics.median(others)
        if duration > factor * median and duration - median >= min_excess:
            slow.append(SlowRank(rank, duration, median))
    return tuple(slow)


def score_arrivals(ranks: tuple[RankTime, ...], arrivals: Lateness) -> tuple[RankTime, ...]:
    """The exact scores, from when each rank reached its collectives (see :mod:`.clock`):
    a rank's share of the spread, flagged from ``LATE_SCORE`` when the spread matters."""
    material = arrivals.steady_spread_s >= max(MATERIAL_S, MATERIAL_SHARE * arrivals.steady_span_s)
    known = {t.rank: t for t in ranks}
    out = []
    for rank in sorted(set(known) | set(arrivals.late_s)):
        sampled = known.get(rank) or RankTime(rank, None, 0, 0.0, (), None, None)
        if rank not in arrivals.late_s:
            out.append(sampled)
            continue
        score = round(arrivals.score(rank), 3)
        wait = arrivals.waiting_s.get(rank, 0.0) / arrivals.span_s if arrivals.span_s > 0 else sampled.wait
        out.append(RankTime(rank, sampled.request, sampled.samples, round(min(1.0, wait), 3), sampled.places,
                            score, None, sampled.error, round(arrivals.late_s[rank], 3),
                            arrivals.last.get(rank, 0), material and score >= LATE_SCORE))
    return tuple(out)


def straggler_report(sampled: Mapping[int, Mapping[str, Any]],
                     durations: Mapping[int, float] | None = None,
                     factor: float = DURATION_FACTOR, arrivals: Lateness | None = None) -> StragglerReport:
    """Every signal at once: ``sampled`` per rank, optionally a request's ``durations``, and
    the ``arrivals`` at its collectives (which, when there are enough, decide the verdict)."""
    window = max((float(s.get("window", 0.0)) for s in sampled.values()), default=0.0) or WINDOW_S
    slow = slow_by_duration(durations, factor) if durations else ()
    ranks = score_ranks(sampled)
    if arrivals is not None and arrivals.complete >= MIN_COLLECTIVES:
        return StragglerReport(score_arrivals(ranks, arrivals), slow, window, arrivals)
    return StragglerReport(ranks, slow, window)


def stuck_in_collectives(sampled: Mapping[int, Mapping[str, Any]], request: int) -> dict[int, float]:
    """Seconds each rank running ``request`` has spent inside its current collective call
    (ranks not in one are left out)."""
    return {rank: float(s["stuck_s"]) for rank, s in sampled.items()
            if s.get("request") == request and s.get("stuck_s")}
