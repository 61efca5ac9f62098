"""Getting a stuck or broken mesh usable again, losing as few namespaces as possible.

A rank blocked in a gloo collective ignores SIGINT until the collective's timeout. What does
end it is its connection to a peer closing. :func:`recover` uses that, in escalating steps,
and stops at the first that frees every rank:

1. every free rank re-creates its process group (``destroy_process_group`` closes its
   connections), and every rank that said it waits in a collective gets its inter-rank
   sockets shut down from its control thread at once, which fails the collective in the same
   way. No namespace is lost;
2. ranks still stuck after :data:`ABORT_AFTER_S` (they said nothing in time, or entered a
   collective since) are aborted the same way, with what they say then. No namespace is lost;
3. ranks still stuck after that (C code that holds on regardless) are killed and re-forked
   under the same rank id: only these lose their variables.

Ranks asked to restart (``mesh.restart([1])``) and ranks that died are re-forked first. Then
every rank joins a new process group (a new generation in a new store), rebuilds
``device_mesh``, and the :class:`Recovery` report says exactly who kept and who lost what.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, Sequence

from ...protocol.errors import MeshError, remaking
from ...protocol.text import format_ranks, group_by_text, ranks_text
from ...rank.ops import abort_collectives, heartbeat, prepare_abort, reinit

if TYPE_CHECKING:
    from ..core.controller import Controller
    from ..core.run import Run

#: How long ranks not aborted at once get to join before their sockets are shut down.
ABORT_AFTER_S = 0.2
#: How long shut-down sockets get to end a collective before the rank is re-forked.
KILL_AFTER_S = 2.0
#: How long a recovery waits for the ranks to say what they run (a control thread answers at
#: once unless C code holds the GIL: the book's word stands for such a rank).
ASK_RUNNING_S = 1.0
#: How long ranks get to join re-created groups after a step check before being re-forked.
RESYNC_TIMEOUT_S = 30.0


@dataclass
class Recovery:
    """What :func:`recover` did: who was re-forked (variables lost), who kept everything."""

    restarted: list[int]
    aborted: list[int]
    kept: list[int]
    generation: int
    seconds: float
    #: Ranks that ran Python (not a collective) and were interrupted, as a Ctrl-C does.
    interrupted: list[int] = field(default_factory=list)
    #: Each kept rank's variables still bound to the old groups (name, kind).
    bound: Mapping[int, list[tuple[str, str]]] = field(default_factory=dict)

    def render(self) -> str:
        lines = []
        if self.restarted:
            listed = ",".join(map(str, self.restarted))
            lines.append(f"{ranks_text(self.restarted)} restarted: {_their(self.restarted)} variables are lost. "
                         f"Run the cells that set {_them(self.restarted)} up again there (%%mesh --ranks {listed}, "
                         f"or ranks=[{listed}] in mesh.run); a cell that calls collectives (one that builds a DDP "
                         f"or FSDP module does) must run on every rank of their groups.")
        if self.aborted:
            lines.append(f"{ranks_text(self.aborted)} had {_their(self.aborted)} collective aborted "
                         f"(no process restarted).")
        if self.interrupted:
            lines.append(f"{ranks_text(self.interrupted)} {'were' if len(self.interrupted) > 1 else 'was'} "
                         f"interrupted (no process restarted).")
        if self.kept:
            lines.append(f"{ranks_text(self.kept)} kept {_their(self.kept)} variables.")
        if self.aborted:
            lines.append(f"What an aborted collective wrote into may hold partial results on "
                         f"{ranks_text(self.aborted)} (a collective writes as it goes, and may differ between "
                         f"ranks): compute it again before you use it.")
        lines.append(f"The process group was re-created on all ranks (generation {self.generation}) "
                     f"in {self.seconds:.1f} s; what holds the old groups (DDP and FSDP modules, groups "
                     f"of your own) must be re-created from the new `device_mesh`; DTensors and tensor "
                     f"parallel modules on `device_mesh` keep working.")
        for ranks, remedy in group_by_text({r: remaking(stale) for r, stale in self.bound.items() if stale}):
            lines.append(f"[{format_ranks(ranks)}] bound to the old groups, re-create: {remedy}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.render()


class Cancellable(Protocol):
    """A check holding ranks (a step check): a recovery lets them go first."""

    done: threading.Event

    def cancel(self) -> None: ...

    def settled(self) -> bool:
        """Done, and of a run that is done: nothing will ask for it again."""
        ...


#: The step checks, per controller and the request they check, until settled: one cancelled
#: by a recovery stays, so that its run's later answers start no other.
_checks: "weakref.WeakKeyDictionary[Controller, dict[int, Cancellable]]" = weakref.WeakKeyDictionary()
_checks_lock = threading.Lock()


def track(controller: "Controller", request: int, check: Cancellable) -> None:
    """``check`` of ``request`` holds ranks of ``controller`` until it is done, or a recovery
    cancels it."""
    with _checks_lock:
        checks = _checks.setdefault(controller, {})
        for settled in [r for r, c in checks.items() if c.settled()]:
            del checks[settled]
        checks[request] = check


def tracked(controller: "Controller", request: int) -> Cancellable | None:
    """The check of ``request``, if one started and is not settled."""
    with _checks_lock:
        check = _checks.get(controller, {}).get(request)
    return None if check is None or check.settled() else check


def forget(controller: "Controller", request: int) -> None:
    """Let go of the check of ``request`` once settled (its run's values, the controller)."""
    with _checks_lock:
        checks = _checks.get(controller, {})
        if request in checks and checks[request].settled():
            del checks[request]


def cancel_checks(controller: "Controller") -> None:
    """Release ranks held by step checks (recovery re-creates every group anyway)."""
    with _checks_lock:
        checks = list(_checks.get(controller, {}).values())
    for check in checks:
        if not check.done.is_set():
            check.cancel()


def recover(controller: "Controller", restart: list[int], timeout: float, cause: str = "mesh.recover()") -> Recovery:
    """Free every rank and re-create the process group on all of them (see module doc).
    ``cause`` is what a rank whose collective is aborted says it was aborted for."""
    with _recovering_lock:
        _recovering[controller] = _recovering.get(controller, 0) + 1
    try:
        drop_queued(controller)  # first: a check let go below must not let them start
        cancel_checks(controller)  # ranks held for a check would never reach the re-creation
        with controller.recovery_lock:
            return _recover(controller, restart, timeout, cause)
    finally:
        with _recovering_lock:
            _recovering[controller] -= 1


#: Recoveries under way, per controller: no step check starts meanwhile (the recovery
#: re-creates every group, and a check's hold queued before its ``reinit`` would keep the
#: ranks from joining it).
_recovering: "weakref.WeakKeyDictionary[Controller, int]" = weakref.WeakKeyDictionary()
_recovering_lock = threading.Lock()


def recovering(controller: "Controller") -> bool:
    """Is a recovery of ``controller``'s mesh under way?"""
    with _recovering_lock:
        return _recovering.get(controller, 0) > 0


def drop_queued(controller: "Controller") -> None:
    """Drop the user runs that have started on none of the ranks still to run them (queued
    behind the stuck work, or a step check). They were sent for the old group: run before the
    new one is joined, a recv among them would take what a failed cell's send left on the old
    connections (a wrong number, as a success). Each ends as interrupted before it started."""
    for run in controller.user_runs():
        if not run.interrupted and all(controller.current_request(r) != run.id for r in run.pending):
            controller.interrupt_run(run)


def _recover(controller: "Controller", restart: list[int], timeout: float, cause: str) -> Recovery:
    started = time.monotonic()
    # What each rank that stays runs, asked of the ranks themselves as well as read from the
    # book: an endpoint another rank's actor called is in no book of this controller. A rank
    # that does not answer at once (its control thread cannot run) keeps the book's word.
    # Whatever they run other than joining is aborted by what follows.
    staying = [r for r in controller.live() if r not in restart]
    running = _running(controller, staying)
    interrupted = [r for r in staying if running.get(r, controller.current_request(r)) is not None]
    reason = (f"meshbook aborted the collective it waited in, to free the ranks ({cause}); "
              f"the process group was re-created")
    doing = {r: running.get(r) or controller.current_request(r) for r in interrupted}
    runs = controller.runs_of(doing.values())  # how each ended says whether the interrupt or the abort stopped it
    # Told first, before the kill: ranks that leave the old group, and the ranks killed, free a
    # collective with a closed connection, which said only gloo's "Connection closed by peer".
    told = _tell_why(controller, doing, reason)  # rank -> (its listening ports, whether it waits in a collective)
    in_python = {r for r, (_, waiting) in told.items() if not waiting}
    controller.kill(restart, why=f"by {cause}")
    restarted = controller.dead()
    generation = controller.new_generation()
    survivors = [r for r in controller.ranks if r not in restarted]
    doing = {r: q for r, q in doing.items() if r in survivors}  # a rank may have died meanwhile
    interrupted = list(doing)
    if interrupted:
        # Then a Ctrl-C, a second one where the run was interrupted already: a rank running
        # Python stops and keeps its variables, where only the kill below would free it (the
        # abort frees collectives, not a sleep, a loop, or the cleanup of a first interrupt).
        controller.interrupt_where({r: q for r, q in doing.items() if q is not None})
    lost_before = controller.agents.lost_addresses()  # a host re-formed elsewhere replaces its link
    # Re-forked first: a host re-formed elsewhere brings the store with it (across hosts).
    controller.respawn(restarted, generation)
    lost_hosts = sorted({*lost_before, *controller.agents.lost_addresses()})  # (and one lost meanwhile)
    joined = controller.call(reinit, generation, controller.store_addr, lost_hosts, ranks=survivors,
                             what="re-create the process group") if survivors else None
    _abort_waiting(controller, {r: doing[r] for r, (_, waiting) in told.items() if waiting and r in doing}, told,
                   lost_hosts)
    if joined is None:
        controller.wait_generation(generation, list(controller.ranks), timeout, "recovery")
        return Recovery(sorted(restarted), [], [], generation, time.monotonic() - started)

    def stuck() -> list[int]:
        """Ranks yet to join that run something else, as the book says or they said last."""
        waiting = set(joined.pending)
        return [r for r in survivors if r in waiting and (
            controller.busy_with_other(r, joined.id) or running.get(r) not in (None, joined.id))]

    def still_stuck() -> list[int]:
        """:func:`stuck`, asked of the ranks again; one that says it began to join is spared
        (the book may not have its last answer yet)."""
        running.update(_running(controller, stuck()))
        return [r for r in stuck() if running.get(r) != joined.id]

    aborted: list[int] = []
    while stuck():
        waited = time.monotonic() - started
        if not aborted and waited >= ABORT_AFTER_S:
            aborted = still_stuck()
            # In what each said it is stuck; a rank that said nothing, or idle, in what the book
            # says (a request on its way to it, or one whose answer is on its way here). A rank
            # that said it ran Python may be slow to leave the interrupt, or blocked in a gloo
            # send or recv, which no flight recorder lists: the abort frees the latter.
            abort(controller, aborted, reason, lost_hosts,
                  stuck_in={r: running.get(r) or controller.current_request(r) for r in aborted})
        elif aborted and waited >= ABORT_AFTER_S + KILL_AFTER_S:
            hopeless = still_stuck()
            for in_none, why in ((True, "did not stop on an interrupt, and waits in nothing torch's flight "
                                        "recorder lists (a gloo send or recv, code that catches KeyboardInterrupt "
                                        "or blocks SIGINT, or C code)"),
                                 (False, "did not stop on an interrupt nor when its collectives were aborted "
                                         "(SIGINT blocked, or C code)")):
                controller.kill([r for r in hopeless if (r in in_python) == in_none],
                                why=f"to free the mesh ({cause}): it {why}")
            controller.respawn(hopeless, generation)
            restarted += hopeless
            break
        if waited > timeout:
            raise MeshError(f"recovery timed out: rank(s) {format_ranks(stuck())} stay busy")
        time.sleep(0.02)
    controller.wait_generation(generation, list(controller.ranks), timeout, "recovery")
    stopped = [r for r in interrupted if r not in restarted]
    kept = [r for r in controller.ranks if r not in restarted]
    joined.wait(5)  # each rank's list of objects bound to the old groups (answered after its run)
    python = _stopped_by_interrupt(stopped, doing, runs, in_python - set(aborted))
    bound = {r: stale for r, stale in joined.values().items() if r in kept}
    return Recovery(sorted(restarted), [r for r in stopped if r not in python], kept, generation,
                    time.monotonic() - started, python, bound)


def _stopped_by_interrupt(stopped: list[int], doing: dict[int, int | None], runs: "Mapping[int, Run]",
                          said: set[int]) -> list[int]:
    """The ranks of ``stopped`` that the interrupt stopped, not the abort: those whose run ended
    in a ``KeyboardInterrupt`` (a rank keeps it only where it waited in no collective, see the
    rank's worker). How soon a rank stopped does not tell: one slow to leave its interrupt (a
    loaded machine, a cleanup) has its sockets shut as well. Where the run's end is not known
    here (an endpoint another rank's actor called, the kernel before's request, an answer held
    back for the collective clock) or is neither, those ``said`` to run Python and stopped
    before the abort."""
    def by_interrupt(rank: int) -> bool:
        request = doing[rank]
        run = runs.get(request) if request is not None else None
        failure = run.failure(rank) if run is not None else None
        if failure is None or failure.type_name not in ("KeyboardInterrupt", "CollectiveAborted"):
            return rank in said
        return failure.type_name == "KeyboardInterrupt"

    return [r for r in stopped if by_interrupt(r)]


def _tell_why(controller: "Controller", doing: dict[int, int | None],
              reason: str) -> dict[int, tuple[list[int], bool]]:
    """Each rank of ``doing`` (rank -> the request it runs) that answers within
    :data:`ASK_RUNNING_S`: its listening ports, and whether it waits in a collective now. Those
    that do learn ``reason`` first, so their error says why it ends even if a peer's closed
    connection ends it first."""
    if not doing:
        return {}
    told = controller.call(prepare_abort, doing, dict.fromkeys(doing, reason), True, ranks=list(doing),
                           what="why collectives end")
    told.wait(ASK_RUNNING_S)
    return {r: (ports, waiting) for r, (ports, waiting) in told.values().items()}


def _abort_waiting(controller: "Controller", waiting: dict[int, int | None],
                   told: Mapping[int, tuple[list[int], bool]], lost_hosts: Sequence[str]) -> None:
    """Shut down the connections of the ranks ``waiting`` in a collective (rank -> the request
    they wait in) at once, with the ports the ranks ``told`` and to ``lost_hosts``, without
    waiting for the answers.
    Every rank leaves the old group in a recovery, so nothing is lost: waiting for the free
    ranks to release them first (the ladder's first step) cost the abort's delay, and the
    report reads how each run ended either way. A rank that moved on meanwhile is left alone
    (``abort_collectives``); one still stuck after :data:`ABORT_AFTER_S` is aborted again."""
    ranks = controller.live(list(waiting))
    if not ranks:
        return
    ports = sorted({p for listened, _ in told.values() for p in listened})
    with contextlib.suppress(MeshError):  # one died meanwhile: the loop after sees to the rest
        controller.call(abort_collectives, {r: waiting[r] for r in ranks}, ports, list(lost_hosts), ranks=ranks,
                        what="abort collectives")


def resync(controller: "Controller", held: "Run", ahead: list[int],
           release: Callable[[int], None]) -> Recovery:
    """Put ranks waiting in a step check (``held``) into a new process-group generation.

    The ranks ``ahead`` issued collectives no peer will pair: those hold their old group's
    connections, so they are shut down first (every rank is idle in the check, so only old
    connections exist). A rank that still cannot join in time is re-forked.
    """
    with controller.recovery_lock:
        started = time.monotonic()
        ranks = held.pending
        abort(controller, ahead)
        generation = controller.new_generation()
        release(generation)
        restarted: list[int] = []
        try:
            controller.wait_generation(generation, ranks, RESYNC_TIMEOUT_S, "re-creating the process groups")
        except MeshError:
            restarted = [r for r in ranks if controller.ranks[r].generation != generation]
            controller.kill(restarted)
            controller.respawn(restarted, generation)
            controller.wait_generation(generation, ranks, RESYNC_TIMEOUT_S, "re-creating the process groups")
        held.wait(5)  # each rank's list of objects bound to the old groups
        kept = [r for r in ranks if r not in restarted]
        return Recovery(restarted, sorted(set(ahead) - set(restarted)), kept, generation,
                        time.monotonic() - started, bound=dict(held.values().items()))


def abort(controller: "Controller", ranks: list[int], reason: str | Mapping[int, str] = "",
          lost_hosts: Sequence[str] = (), stuck_in: Mapping[int, int | None] | None = None) -> None:
    """Shut down the inter-rank connections of ``ranks``, while they still run the request
    they run now (``stuck_in``, where the ranks said; else the controller's book): a
    collective blocked on them fails at once (with ``reason`` as its error). Connections to
    ``lost_hosts`` (addresses of hosts found lost) and to every host found lost by now go too:
    no FIN ever closes a connection to a silent host."""
    ranks = controller.live(ranks)
    if not ranks:
        return
    lost_hosts = sorted({*lost_hosts, *controller.agents.lost_addresses()})
    reasons = {r: reason if isinstance(reason, str) else reason[r] for r in ranks}
    stuck_in = {r: stuck_in[r] if stuck_in and r in stuck_in else controller.current_request(r) for r in ranks}
    live = controller.live()
    asked = controller.call(prepare_abort, stuck_in, {r: t for r, t in reasons.items() if t},
                            ranks=live, what="listening ports")
    asked.wait(5)
    ports = sorted({p for value in asked.values().values() for p in value[0]})
    controller.call(abort_collectives, stuck_in, ports, list(lost_hosts), ranks=ranks,
                    what="abort collectives").wait(5)


def _running(controller: "Controller", ranks: list[int]) -> dict[int, int | None]:
    """The request each of ``ranks`` runs now, as its control thread says (a negative number:
    an endpoint another rank's actor called); a rank that does not say within
    :data:`ASK_RUNNING_S` (its control thread cannot run) is left out."""
    live = controller.live(ranks)
    if not live:
        return {}
    asked = controller.call(heartbeat, ranks=live, what="what the ranks run")
    asked.wait(ASK_RUNNING_S)
    return {rank: metrics["request"] for rank, metrics in asked.values().items()}


def free_stranded(controller: "Controller", ranks: list[int], reason: str, lost_hosts: list[str]) -> None:
    """Ranks that were running beside a rank that died: the group is broken, so abort their
    collectives now instead of letting them wait for the collective timeout."""
    if not controller.recovery_lock.acquire(blocking=False):
        return  # a recovery (restart, the second interrupt) frees them and re-creates the group
    try:
        abort(controller, [r for r in ranks if controller.ranks[r].state == "busy"], reason, lost_hosts)
    except MeshError as exc:
        alive = controller.live(ranks)  # the others died too meanwhile: nothing is left to free
        if alive and not controller.stopped:
            print(f"meshbook: could not free rank(s) {format_ranks(alive)}: {exc}", file=sys.__stderr__)
    finally:
        controller.recovery_lock.release()


def _their(ranks: list[int]) -> str:
    return "their" if len(ranks) > 1 else "its"


def _them(ranks: list[int]) -> str:
    return "them" if len(ranks) > 1 else "it"
