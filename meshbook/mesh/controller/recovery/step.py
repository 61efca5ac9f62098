"""Keeping ranks in step: after anything that stopped ranks at different points, check each
rank's position in every process group before the next collective can run, and re-create the
groups when the positions differ.

Why: a collective pairs the *n*-th call of every member. A rank interrupted between issuing an
async ``all_reduce`` and waiting on it has issued one more than a rank interrupted before
issuing it; the next cell's collective would then be paired with the stale one and return a
wrong number, or hang. torch counts the collectives each group has issued on each rank
(``ProcessGroup._get_sequence_number_for_group``), so the positions are known exactly.

The check is a barrier in the ranks' request order, so nothing queued after it can run first:

1. the controller sends every live rank two requests, ``positions`` and ``hold``
   (:mod:`meshbook.mesh.rank.ops`); each
   rank reports its position in each group and then waits;
2. the controller compares (:func:`compare`): in step, it releases the ranks with no verdict;
   out of step (or a group destroyed), it releases them with a new process-group generation,
   which each rank joins inside ``hold`` (the recovery ladder frees any rank whose old,
   unpaired collective keeps it from leaving), and the cell says what happened.

What holds the old groups as objects (DDP and FSDP modules, groups and meshes of the user's
own) cannot follow: the report names those variables (``stale_objects``, on the ranks) so the
user knows what to re-create. A DTensor or tensor parallel module on ``device_mesh`` finds the
new groups by name, and is not named.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from ...protocol.errors import MeshError, broke_its_group
from ...protocol.reports import Positions
from ...protocol.text import format_ranks, group_by_text, ranks_text
from ...rank.ops import hold, positions, release
from .ladder import Recovery, forget, recovering, resync, track, tracked

if TYPE_CHECKING:
    from ..core.controller import Controller
    from ..core.run import Run


@dataclass(frozen=True)
class Skew:
    """One process group whose members have issued different numbers of collectives."""

    label: str
    issued: dict[int, int]  # rank -> collectives issued

    @property
    def ahead(self) -> list[int]:
        """Ranks that issued collectives their peers never will: those are aborted."""
        low = min(self.issued.values())
        return sorted(r for r, n in self.issued.items() if n > low)

    def describe(self) -> str:
        by_count: dict[int, list[int]] = {}
        for rank, n in sorted(self.issued.items()):
            by_count.setdefault(n, []).append(rank)
        parts = [f"{ranks_text(ranks)} {'have' if len(ranks) > 1 else 'has'} issued {n}"
                 for n, ranks in sorted(by_count.items(), reverse=True)]
        return f"in {self.label}, " + ", ".join(parts)


def compare(reports: Mapping[int, Positions]) -> tuple[list[Skew], list[int]]:
    """Groups whose members disagree on how many collectives they issued, and the ranks
    whose default group is gone (destroyed by user code)."""
    gone = sorted(r for r, p in reports.items() if not p.initialized)
    seen: dict[str, dict[int, int]] = {}
    labels: dict[str, str] = {}
    for rank, report in reports.items():
        for name, group in report.groups.items():
            seen.setdefault(name, {})[rank] = group.issued
            labels[name] = group.label
    skews = [Skew(labels[name], issued) for name, issued in sorted(seen.items())
             if len(set(issued.values())) > 1]
    return skews, gone


def apart(reports: Mapping[int, Positions]) -> list[tuple[str, list[list[int]]]]:
    """The objects whose replicas differ between the ranks that keep them (a DDP module, its
    optimizer), each with its ranks grouped by what they hold, in name order."""
    prints: dict[tuple[str, tuple[int, ...]], dict[int, str]] = {}
    for rank, report in reports.items():
        for name, (members, numbers) in report.replicas.items():
            prints.setdefault((name, members), {})[rank] = repr(numbers)
    found = []
    for (name, _), by_rank in sorted(prints.items()):
        alike = group_by_text(by_rank)
        if len(alike) > 1:
            found.append((name, [ranks for ranks, _ in alike]))
    return found


def render_apart(found: list[tuple[str, list[list[int]]]]) -> str:
    """What the cell says of replicas that differ: which, where, and how to bring them together."""
    where = "; ".join(f"{name} ({' | '.join(format_ranks(r) for r in groups)})" for name, groups in found)
    return (f"Replicas differ between ranks: {where}. An update (an optimizer step) ran on some of them and "
            f"not the others, and DDP never syncs weights nor optimizer state: they would drift apart from "
            f"here on, with no error. Bring one rank's to every rank before you go on, e.g. "
            f"`for t in [*model.parameters(), *model.buffers()]: dist.broadcast(t.data, 0)` and, for an "
            f"optimizer, `kept = [opt.state_dict()]; dist.broadcast_object_list(kept, 0); "
            f"opt.load_state_dict(kept[0])` (or load both from a checkpoint).")


def check_after(controller: "Controller", request: int, run: "Run | None") -> "StepCheck | None":
    """Check that every rank is at the same collective in each group after ``run`` (request
    ``request``) stopped irregularly (the controller's ``on_irregular_end``, on the receiver
    thread): once its last rank ended it, or as soon as one did irregularly while others still
    run it. The check's requests then wait in every rank's queue before whatever is sent later:
    a rank that failed at once would otherwise run the next cell, and pair its collective with
    one the others still issue in this run (a wrong number, reported as a success). ``run`` is
    None for a run of a kept mesh that the kernel before this one sent. Asked again for the
    same request, the same check (one a recovery cancelled included: that re-created the groups)."""
    started = tracked(controller, request)
    if isinstance(started, StepCheck):
        return started
    if controller.stopped or controller.dead() or recovering(controller):
        return None  # a dead rank's restart, or the recovery, re-creates every group anyway
    cause = "a cell the kernel before this one sent" if run is None else \
        "the interrupt" if run.interrupted else f"the failed {run.noun}"
    check = StepCheck(controller, cause, run, request)
    try:
        check.start()
    except MeshError:
        return None  # stopped, or a rank died, meanwhile: nothing to check (see above)
    track(controller, request, check)
    return check


def held_for(controller: "Controller", run: "Run") -> list[int]:
    """The ranks ``run``'s check holds, or will once they get there, while it runs (the run
    watcher: a rank held runs nothing else before the check)."""
    check = tracked(controller, run.id)
    return check.ranks if isinstance(check, StepCheck) and not check.done.is_set() else []


class StepCheck:
    """One check of every live rank's positions, coordinated on its own thread."""

    def __init__(self, controller: "Controller", cause: str, run: "Run | None" = None,
                 request: int | None = None) -> None:
        self.controller = controller
        self.cause = cause
        self.request = request  # the request checked, as the ladder's registry knows it
        #: The run checked: its forced_resync (connections were cut) and its errors (a broken
        #: group) re-create the groups even where the counts agree.
        self.run = run
        self.report = ""
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._owner = ""  # who gives the verdict: "check" or "cancel", whoever comes first
        self._released = False
        self.ranks = controller.live()

    def start(self) -> None:
        ctl = self.controller
        self.asked = ctl.call(positions, ranks=self.ranks, what="collective positions")
        self.held = ctl.call(hold, ranks=self.ranks, what="step check of every rank's collective count")
        threading.Thread(target=self._run, name="meshbook-step-check", daemon=True).start()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    @property
    def waiting_for(self) -> list[int]:
        """Ranks that have not reached the check yet (busy with earlier requests)."""
        return self.asked.pending

    def _run(self) -> None:
        try:
            self.report = self._check()
        except Exception as exc:  # the ranks must never stay held
            self.report = f"meshbook could not check the ranks' collective positions: {exc}"
            self._release(None)
        finally:
            self.done.set()
            if self.request is not None:
                forget(self.controller, self.request)
            if self.run is not None:
                self.run.step_checked()

    def settled(self) -> bool:
        return self.done.is_set() and (self.run is None or self.run.done())

    def cancel(self) -> None:
        """Let the held ranks go unchecked (recovery is about to re-create every group),
        unless the check already decided."""
        if self._own("cancel"):
            self._release(None)

    def _own(self, who: str) -> bool:
        with self._lock:
            self._owner = self._owner or who
            return self._owner == who

    def _check(self) -> str:
        ctl = self.controller
        while not self.asked.wait(0.25):
            if ctl.stopped or self._owner == "cancel":
                return ""
        reports = dict(self.asked.values().items())
        skews, gone = compare(reports)
        if not self._own("check"):
            return ""
        broken = broken_groups(self.run) if self.run is not None else []
        # Read now: an abort may have come since the check started.
        force = self.run is not None and self.run.forced_resync or bool(broken)
        differ = render_apart(found) if (found := apart(reports)) else ""
        if self.asked.exception() is not None or (not skews and not gone and not force):
            self._release(None)  # in step (or a rank died: its restart re-creates the groups)
            return differ

        recovery = resync(ctl, self.held, [r for s in skews for r in s.ahead], self._release)
        report = render_resync(self.cause, skews, gone, recovery, broken)
        return "\n".join(filter(None, [report, differ]))

    def _release(self, verdict: int | None) -> None:
        with self._lock:  # once: a second verdict would wait in a rank's queue for its next check
            if self._released:
                return
            self._released = True
        ctl = self.controller
        ranks = ctl.live(self.held.pending)
        try:
            if ranks:
                ctl.call(release, self.held.id, verdict, ranks=ranks, what="step verdict")
        except MeshError:
            pass  # stopped meanwhile: nobody is left to hold


def broken_groups(run: "Run") -> list[int]:
    """The ranks whose error in ``run`` says their process group broke (see ``broke_its_group``)."""
    error = run.exception()  # the failures so far: the ranks the check waited for ended the run
    failures = error.failures if error is not None else {}
    return sorted(r for r, f in failures.items() if broke_its_group(f))


def render_resync(cause: str, skews: list[Skew], gone: list[int], recovery: Recovery,
                  broken: Sequence[int] = ()) -> str:
    """What the cell says after the groups were re-created to put the ranks back in step."""
    lines = []
    if broken:
        lines.append(f"A collective failed on {ranks_text(broken)} in a way that breaks its process group (a "
                     f"timeout, or a closed connection: every later collective on it would fail too), so "
                     f"meshbook re-created the process groups.")
    elif not skews and not gone:
        lines.append(f"meshbook aborted a collective after {cause}, so it re-created the process groups.")
    if skews:
        lines.append(f"The ranks were out of step after {cause}: " +
                     "; ".join(s.describe() for s in skews) + " collectives. The next collective "
                     "would have paired different calls, so meshbook re-created the process groups. "
                     "Your own state may differ between ranks too (a loop counter, a data iterator): "
                     "set it alike on every rank before you go on.")
    if gone:
        lines.append(f"{ranks_text(gone)} destroyed the default process group; meshbook re-created it.")
    lines.append(recovery.render())
    return "\n".join(lines)
