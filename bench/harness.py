"""The harness: what a workload gets (:class:`Context`), what it returns (:class:`Outcome`),
and how workloads are found.

A workload is a module in :mod:`bench.workloads` with three names::

    TITLE = "Dispatch"            # the section heading in the report
    ORDER = 10                    # where the section goes (lower first)
    def run(ctx: Context) -> Outcome: ...

Dropping such a file into ``bench/workloads/`` is all it takes to add one: :func:`workloads`
discovers them. A workload measures every system the same way, in the same run, and turns
the numbers into :class:`~bench.report.Table` s; a system that fails on one row costs that
row (``ctx.attempt``), not the whole run.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from . import peers
from .report import Check, Table
from .timing import Budget

T = TypeVar("T")


@dataclass
class Outcome:
    tables: list[Table]
    checks: list[Check] = field(default_factory=list)


@dataclass
class Context:
    """Run-wide settings, and the book-keeping of what could not be measured."""

    quick: bool
    #: One line per measurement that failed, for the report.
    failures: list[str] = field(default_factory=list)
    _missing: dict[str, str | None] = field(default_factory=dict)

    def log(self, text: str) -> None:
        print(f"[bench] {text}", file=sys.stderr, flush=True)

    def pick(self, full: T, quick: T) -> T:
        """The full run's setting, or the ``--quick`` one."""
        return quick if self.quick else full

    def budget(self, full: Budget, quick: Budget) -> Budget:
        return self.pick(full, quick)

    def systems(self) -> list[str]:
        """meshbook and every peer installed here (a missing peer is reported once)."""
        out = []
        for name in peers.SYSTEMS:
            if name not in self._missing:
                self._missing[name] = peers.missing(name)
                if self._missing[name]:
                    self.failures.append(f"{name} skipped: {self._missing[name]}")
                    self.log(self.failures[-1])
            if not self._missing[name]:
                out.append(name)
        return out

    def attempt(self, what: str, fn: Callable[[], T]) -> T | None:
        """``fn()``, or None with the failure logged and kept for the report."""
        self.log(what)
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - one failed row must not cost the others
            detail = traceback.format_exception_only(type(exc), exc)[-1].strip()
            self.failures.append(f"{what}: {detail}")
            self.log(f"FAILED {what}: {detail}")
            return None


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    order: int
    run: Callable[[Context], Outcome]


def workloads() -> list[Workload]:
    """Every module of :mod:`bench.workloads`, in report order."""
    from . import workloads as package

    found = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        found.append(Workload(info.name, module.TITLE, module.ORDER, module.run))
    return sorted(found, key=lambda w: (w.order, w.name))
