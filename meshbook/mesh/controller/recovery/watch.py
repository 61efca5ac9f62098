"""Runs that end unevenly: a rank left waiting in a collective that can never complete is freed.

A collective pairs the n-th call of every member of its group. When a member has finished the
run (done, failed, or stopped by an interrupt) and runs nothing else (a member that failed it
is held for the step check at once: :func:`~.step.check_after`), a collective that another
rank of the run waits in, with that member in its group, can only complete by pairing with
whatever the member runs next (a wrong result), or fail at the collective timeout minutes
later: ``if rank != 1: raise ValueError()`` then ``dist.all_reduce(x)`` left rank 1 waiting 300 s
(torchrun ends such a job in seconds). So meshbook aborts it (the recovery ladder's step 2,
:func:`~meshbook.mesh.controller.recovery.ladder.abort`): the rank keeps its variables, its error says
why, and the step check that follows the run re-creates the process groups. A dead member
never joins either, whether or not it was in the run: a cell on the live ranks of a degraded
mesh that calls a collective of the default group is freed with the dead rank named.

The controller's receiver calls :func:`watch` at every tick; it sends nothing. A run whose
ranks have finished unevenly for ``CHECK_AFTER_S`` (or that was interrupted: a member outside the
run that is idle would only join from a later cell) is checked on a thread of its own every
``RECHECK_S`` (on a degraded mesh, every run from ``CHECK_AFTER_S`` after it was sent): a
snapshot of the ranks still in it (their flight recorders, so collectives issued
from C++, like DDP's, count too) and, where a collective cannot complete, the abort. The first
check after an interrupt waits ``FREE_AFTER_S``: a rank stopping at that very moment must not be
taken for one that will never come.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ...protocol.errors import MeshError
from ...protocol.reports import Collective
from ...protocol.text import agree, agreed, group_by_text, ranks_text, restart_hint, why_dead
from ...rank.ops import collective_called, snapshot
from ..insight.hangs import deadlocked, missing_members
from .ladder import abort, recovering
from .step import held_for

if TYPE_CHECKING:
    from ..core.controller import Controller
    from ..core.run import Run

#: How long a run's ranks may end apart before the ones still in it are looked at.
CHECK_AFTER_S = 0.3
#: How long after an interrupt before that (ranks stop at their next bytecode).
FREE_AFTER_S = 1.0
#: How often a run still ending unevenly is looked at again.
RECHECK_S = 0.5
#: How long a snapshot may take.
SNAPSHOT_WAIT_S = 2.0


def watch(controller: "Controller", runs: list["Run"]) -> None:
    """Start a check of each user run that is ending unevenly and is due one (receiver thread)."""
    now = time.monotonic()
    degraded = bool(runs) and bool(controller.dead())
    for run in runs:
        # Due once a rank finished it (and a moment after an interrupt), or after an interrupt
        # alone; on a degraded mesh, a moment after it was sent: a collective over a group that
        # holds a dead rank never completes, and its live members may all be waiting in it
        # (NCCL tells none of them; gloo only the dead rank's neighbours).
        clocks = [(run.first_done_at, CHECK_AFTER_S), (run.interrupted_at, FREE_AFTER_S),
                  *([(run.submitted_at, CHECK_AFTER_S)] if degraded else [])]
        due = [at + wait for at, wait in clocks if at is not None]
        if not run.in_step or run.checking or run.done() or not due:
            continue
        if now >= max(*due, run.checked_at + RECHECK_S):
            run.checking = True
            threading.Thread(target=_check, args=(controller, run), name="meshbook-run-watch", daemon=True).start()


def _check(controller: "Controller", run: "Run") -> None:
    try:
        free_unpairable(controller, run)
    except MeshError:
        pass  # a rank died or the mesh stopped meanwhile: that path frees (or ends) them
    finally:
        run.checked_at, run.checking = time.monotonic(), False


def free_unpairable(controller: "Controller", run: "Run") -> None:
    """Abort the collectives of ``run``'s waiting ranks that a member who finished the run,
    and runs nothing else, will never join, nor a dead member (in the run or not); once the
    run was interrupted, nor a live member outside it that runs nothing (it could only join
    from a later cell, whose collectives would then pair with this one's), nor a member that
    waits, as every rank it waits for does, in another operation: a deadlock (two ranks that
    each ``recv`` from the other) no single rank's interrupt can end, since gloo does not stop
    for one. Not while a recovery runs: it frees them itself, restarting the dead."""
    live = controller.live(run.pending)
    if not live or controller.stopped or recovering(controller):
        return
    asked = controller.call(snapshot, ranks=live, what="stacks")
    asked.wait(SNAPSHOT_WAIT_S)
    held = held_for(controller, run)  # held for its check: they run nothing else before it
    deaths = controller.deaths()
    waiting = {rank: snap.pending[-1] for rank, snap in asked.values().items()  # None: a stand-in
               if snap is not None and snap.request == run.id and snap.pending}
    missing = {rank: missing_members(rank, waiting, controller.topology) or [] for rank in waiting}

    def gone(m: int) -> bool:
        if m in deaths:  # a group with it in never completes (ranks outside the run too)
            return True
        return (m not in run.pending if m in run.ranks else run.interrupted) and (not controller.queued(m) or m in held)

    stuck = confirmed_deadlock(run, waiting, deadlocked(missing, gone)) if run.interrupted else set()
    blocked = {rank: (waiting[rank], out) for rank, members in missing.items()
               if (out := [m for m in members if gone(m) or m in stuck])}
    if not blocked or run.done():
        return
    called = _called_instead(controller, blocked.values(), deaths)
    reasons = {rank: _reason(run, collective, out, waiting, called, deaths)
               for rank, (collective, out) in blocked.items()}
    run.notes.extend(_mismatches(blocked.values(), called))
    run.forced_resync = True  # before the abort: the run may end (and its check start) at once
    abort(controller, list(reasons), reasons)


def _called_instead(controller: "Controller", blocked: Iterable[tuple[Collective, list[int]]],
                    deaths: dict[int, str]) -> dict[tuple[int, str, int], Collective]:
    """What each live member that went on called as the number the others wait in (rank,
    group, number): a call that does not match theirs (other sizes, another operation) gloo
    may complete on one side; the same call, gone on with, failed (its group broke). Asked of
    those members only, once per collective."""
    asking: dict[tuple[str, int], set[int]] = {}
    for collective, gone in blocked:
        if collective.point_to_point:  # numbered per peer: the collective numbered so is another call
            continue
        asking.setdefault((collective.group, collective.seq), set()).update(r for r in gone if r not in deaths)
    called: dict[tuple[int, str, int], Collective] = {}
    for (group, seq), ranks in asking.items():
        if not ranks:
            continue
        answers = controller.call(collective_called, group, seq, ranks=sorted(ranks), what="what a rank called")
        answers.wait(SNAPSHOT_WAIT_S)
        called.update({(rank, group, seq): c for rank, c in answers.values().items() if c is not None})
    return called


def _differing(collective: Collective, gone: list[int], called: dict[tuple[int, str, int], Collective]
               ) -> dict[int, Collective]:
    """The members of ``gone`` whose call as ``collective``'s number was another call than it."""
    return {r: c for r in gone if (c := called.get((r, collective.group, collective.seq))) is not None
            and not c.same_call(collective)}


def _mismatches(blocked: Iterable[tuple[Collective, list[int]]], called: dict[tuple[int, str, int], Collective]
                ) -> list[str]:
    """A note per member whose call did not match: what it computed from it is wrong."""
    notes = {}
    for collective, gone in blocked:
        for rank, theirs in _differing(collective, gone, called).items():
            notes[rank] = (f"rank {rank}'s {theirs.describe()} was paired with the others' "
                           f"{collective.describe()}: whatever rank {rank} computed from it is wrong")
    return [notes[r] for r in sorted(notes)]


def _reason(run: "Run", collective: Collective, gone: list[int], waiting: dict[int, Collective],
            called: dict[tuple[int, str, int], Collective], deaths: dict[int, str]) -> str:
    """Why a rank's collective was aborted, for its error (``deaths``: why each dead rank died)."""
    died = [r for r in gone if r in deaths]
    if died:
        return _dead_reason(collective, died, deaths)
    mismatched = _differing(collective, gone, called)
    if mismatched:
        calls = "; ".join(f"rank {r} called {c.describe()}" for r, c in sorted(mismatched.items()))
        return (f"meshbook aborted its {collective.describe()}: the calls do not match ({calls}, and went "
                f"on), so it could never complete")
    if run.interrupted:
        elsewhere = {r: f"waits in {waiting[r].describe()}" for r in gone if r in waiting}
        stopped = [r for r in gone if r in run.ranks and r not in waiting]
        outside = [r for r in gone if r not in run.ranks]
        who = " and ".join([*(f"{ranks_text(r)} {agreed(why, r)}" for r, why in group_by_text(elsewhere)),
                            *([f"{ranks_text(stopped)} stopped before joining"] if stopped else []),
                            *([f"{ranks_text(outside)} took no part in this {run.noun}"] if outside else [])])
        return f"interrupted: meshbook aborted its {collective.describe()}: {who}, and would never join it"
    failed = run.failed_ranks()
    how = "failed" if set(gone) <= failed else "finished"
    return (f"meshbook aborted its {collective.describe()}: {ranks_text(gone)} {how} the {run.noun} without "
            f"joining it, so it could never complete (at best it would wait out the collective timeout)")


def _dead_reason(collective: Collective, died: list[int], deaths: dict[int, str]) -> str:
    """Why a collective over a group that holds dead ranks was aborted."""
    causes, them = why_dead({r: deaths[r] for r in died}), "it" if len(died) == 1 else "them"
    return (f"meshbook aborted its {collective.describe()}: {ranks_text(died)} of its group {agree('is', died)} "
            f"dead ({causes}), so it could never complete. Restart {them} with {restart_hint(died)}: the process "
            f"groups are made anew with every rank")


def confirmed_deadlock(run: "Run", waiting: dict[int, Collective], stuck: set[int]) -> set[int]:
    """``stuck``, where the look before found the same ranks waiting in the same operations.
    The ranks' snapshots are taken a moment apart: one caught in collective #5 and another,
    snapped after #5 completed, already in #6, seem to wait on each other. Under load that
    passed for a deadlock, and an interrupted plan's measuring was aborted (its groups
    re-created). A deadlock stays: it is freed at the next look, ``RECHECK_S`` on."""
    seen = {rank: waiting[rank] for rank in stuck}
    before, run.deadlock_seen = run.deadlock_seen, seen
    return stuck if seen and seen == before else set()
