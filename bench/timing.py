"""Repeat a measurement within a budget and summarise it as a median and a p99.

A :class:`Budget` bounds a measurement twice: at most ``samples`` repeats, and no more than
``seconds`` of wall time once ``min_samples`` are in. The first bound gives fast systems
enough samples for a meaningful p99; the second keeps a system that is 50x slower from
taking 50x as long, so every row of a table finishes. ``warmup`` repeats run first and are
thrown away (first calls pay for imports, connections and caches, which is startup's
business, not dispatch's).

A sample is a callable that returns the seconds one repeat took: :func:`clock` wraps a plain
call, and a sample that measures itself (a notebook cell, timed from the request to the
reply) returns its own duration.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

Sample = Callable[[], float]


@dataclass(frozen=True)
class Budget:
    samples: int
    seconds: float
    warmup: int = 3
    min_samples: int = 5


@dataclass(frozen=True)
class Samples:
    """Durations in seconds, in the order they were taken."""

    seconds: tuple[float, ...]

    def __len__(self) -> int:
        return len(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def p99(self) -> float:
        """Nearest-rank 99th percentile: with fewer than 100 samples, the slowest one."""
        ordered = sorted(self.seconds)
        return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def clock(fn: Callable[[], object]) -> Sample:
    """A sample that times one call of ``fn``."""

    def sample() -> float:
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started

    return sample


def measure(sample: Sample, budget: Budget) -> Samples:
    """Run ``sample`` ``budget.warmup`` times, then collect durations within the budget."""
    for _ in range(budget.warmup):
        sample()
    taken: list[float] = []
    deadline = time.monotonic() + budget.seconds
    while len(taken) < budget.samples:
        taken.append(sample())
        if len(taken) >= budget.min_samples and time.monotonic() >= deadline:
            break
    return Samples(tuple(taken))


def interleave(samples: dict[str, Sample], budget: Budget) -> dict[str, Samples]:
    """Measure several samples in turn (a, b, a, b...), so load that comes and goes on a
    shared machine lands on all of them alike; for comparisons within one process."""
    for _ in range(budget.warmup):
        for sample in samples.values():
            sample()
    taken: dict[str, list[float]] = {name: [] for name in samples}
    deadline = time.monotonic() + budget.seconds
    for count in range(1, budget.samples + 1):
        for name, sample in samples.items():
            taken[name].append(sample())
        if count >= budget.min_samples and time.monotonic() >= deadline:
            break
    return {name: Samples(tuple(values)) for name, values in taken.items()}


def median_of(samples: Samples | None) -> float | None:
    """The median, or None for a measurement that failed."""
    return samples.median if samples else None


def after_idle(fn: Callable[[], object], gap: float) -> Sample:
    """A sample that leaves everything idle for ``gap`` seconds, then times one call of ``fn``:
    a call as a notebook cell makes it, after the processes involved went to sleep."""
    timed = clock(fn)

    def sample() -> float:
        time.sleep(gap)
        return timed()

    return sample
