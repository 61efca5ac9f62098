"""Following a run until it ends: its events rendered, hangs explained, interrupts escalated.

The one watcher of a run a person waits on, in a script (``run.result()``) or in a notebook
cell (``%%mesh``, which adds its status view and renders displays as rich output): both behave
alike.

Interrupts escalate. A Ctrl-C (a kernel interrupt: the stop button) is forwarded to the running
ranks; ranks that do not stop within the grace period (blocked in a collective or C code) are
shown with where they block, and the wait goes on. A second one frees them with
:meth:`~meshbook.Mesh.recover` (restarting as few ranks as possible, usually none) and the run
ends with the ranks' errors and what the recovery did.

A run that waits behind earlier work on some ranks (a cell that outlived its wait still runs
there) says so after ``QUEUED_HINT_S``, with what it waits for and how to stop that.

When ranks have waited ``STUCK_HINT_S`` inside one collective call that other ranks of the run
have not joined (their heartbeats say so), when some ranks finished and the others stay busy
``HANG_HINT_S`` later, or when the timeout expires, the hang diagnosis
(:meth:`~meshbook.Mesh.diagnose`) is printed, so a hang never goes unexplained, even while no
rank has finished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

from ...protocol.errors import MeshTimeout, RemoteError
from ...protocol.text import agree, format_ranks, ranks_text
from ...protocol.values import RankValues
from ..core.render import EventRenderer, write_stream
from ..core.run import STEP_CHECK_WAIT_S, Run

#: How long ranks get to stop after a forwarded interrupt before we show where they block
#: (ranks blocked in a collective that a stopped rank will never join are freed before that).
INTERRUPT_GRACE_S = 3.0
#: How long ranks may stay busy after others finished before the diagnosis is printed.
HANG_HINT_S = 10.0
#: How long ranks may wait in one collective that others have not joined before it is.
STUCK_HINT_S = 5.0
#: How often the heartbeats are read again for that (they arrive every 0.5 s).
STUCK_CHECK_S = 0.5
#: How long a run may wait behind earlier work on its ranks before that is said.
QUEUED_HINT_S = 1.0


class Watched(Protocol):
    """What the watcher asks of the mesh (a :class:`~meshbook.Mesh`)."""

    def stuck(self, run: Run) -> dict[int, float]: ...

    def queued(self, run: Run) -> dict[int, str]: ...

    def diagnose(self) -> Any: ...

    @property
    def collective_timeout(self) -> float: ...

    def recover(self) -> Any: ...


class View(Protocol):
    """Something showing a run's progress (a cell's live status widget)."""

    def update(self, run: Run) -> None: ...

    def close(self, run: Run) -> None: ...


@dataclass
class FollowOptions:
    timeout: float | None = None
    #: What the run is called in the timeout's message ("the cell" in a notebook), and what
    #: the user can do next, in the words of where it runs (magics in a notebook).
    what: str = ""
    next_steps: str = "wait again with run.result(), inspect them with mesh.stacks(), stop them with run.interrupt()"
    #: How the user stops the earlier work a run waits behind on ``{ranks}``, or drops the run.
    stop_earlier: str = "mesh.interrupt('{ranks}') stops it"
    drop_this: str = "run.interrupt() drops this run instead"
    #: How the user stops the run itself, while it is followed (a collective that cannot end).
    stop_this: str = "Ctrl-C, or run.interrupt(), stops it"
    grace: float = INTERRUPT_GRACE_S
    hang_hint: float = HANG_HINT_S
    stuck_hint: float = STUCK_HINT_S


def follow(run: Run, mesh: Watched, renderer: EventRenderer, options: FollowOptions,
           view: View | None = None) -> RankValues:
    """Render ``run`` until it ends and return its values (or raise its error)."""
    return _Follow(run, mesh, renderer, options, view).show()


class _Follow:
    def __init__(self, run: Run, mesh: Watched, renderer: EventRenderer, options: FollowOptions,
                 view: View | None) -> None:
        self.run, self.mesh, self.renderer, self.options, self.view = run, mesh, renderer, options, view
        self.started = time.monotonic()
        self.interrupted_at: float | None = None
        self.explained = False  # the hang hint was printed
        self.queue_explained = False  # the note that the run waits behind earlier work was printed
        #: Where the hang hint's clock starts: when the first rank finished, or later, when
        #: ranks still waited behind earlier work then (they had not started: no hang yet).
        self.hang_since: float | None = None
        self.queued_seen = False  # ranks waited behind earlier work when the hang clock was read
        self.interrupt_explained = False  # the "did not stop after the interrupt" note was printed
        self.asked_at = float("-inf")  # when the diagnosis was last asked whether a collective is blocked
        self.recovery_report = ""
        self.paused_explained = False  # the note that ranks wait for one paused in the debugger was printed
        renderer.prompts.before_asking = self._paused

    def show(self) -> RankValues:
        try:
            while not self.run.done():
                try:
                    self._pump(self._next_wake())
                    self._check_queued()
                    self._check_time()
                    self._check_stuck()
                except KeyboardInterrupt:
                    if self.interrupted_at is None:
                        self.interrupted_at = time.monotonic()
                        self.run.interrupt()
                    else:
                        self._recover()
            self._pump(0)
        finally:
            self.renderer.close()
            if self.view:
                self.view.close(self.run)
        report = "\n".join(filter(None, [self.recovery_report, self.run.step_report(self._check_wait())]))
        error = self.run.exception()
        if error is not None:
            hint = "\n".join(filter(None, [error.hint, report]))
            raise RemoteError(error.failures, error.partial, hint=hint) from None
        if report:
            _note(report)
        return self.run.values()

    @property
    def first_done_at(self) -> float | None:
        return self.run.first_done_at

    def _next_wake(self) -> float | None:
        now = time.monotonic()
        waits = [self.renderer.next_deadline(), 0.25 if self.view else None,
                 _left(self.options.timeout, self._timed_from(), now)]
        if not self.interrupt_explained:  # once explained, a deadline is past: never spin on it
            waits.append(_left(self.options.grace, self.interrupted_at, now))
        if not self.explained:
            waits += [_left(self.options.hang_hint, self._hang_clock(), now), STUCK_CHECK_S]
        if not self.queue_explained:
            waits.append(_left(QUEUED_HINT_S, self.started, now))
        return min((w for w in waits if w is not None), default=None)

    def _pump(self, timeout: float | None) -> None:
        # From where any earlier result() of this run left off: a second wait (after a
        # MeshTimeout, say) prints what is new, not everything again.
        events, self.run.echoed = self.run.events_since(self.run.echoed, timeout)
        self.renderer.feed(events)
        if self.view:
            self.view.update(self.run)

    def _check_time(self) -> None:
        now = time.monotonic()
        if self.interrupted_at is not None and now - self.interrupted_at >= self.options.grace:
            if not self.interrupt_explained:
                self.interrupt_explained = self.explained = True
                self._explain_interrupt()
        elif (since := self._hang_clock()) is not None and now - since >= self.options.hang_hint \
                and not self.explained:
            if self.mesh.queued(self.run):  # waiting its turn is no hang: the clock starts again
                self.hang_since, self.queued_seen = now, True
            elif self.queued_seen:  # they started since: from about now
                self.hang_since, self.queued_seen = now, False
            else:
                self.explained = True
                self._explain(f"{ranks_text(self.run.pending)} {agree('is', self.run.pending)} still busy "
                              f"{now - since:.0f} s after the others finished.")
        timeout = self.options.timeout
        if timeout is not None and now - self._timed_from() >= timeout and not self.run.done():
            self.renderer.flush()
            raise MeshTimeout(self._timed_out(timeout))

    def _timed_out(self, timeout: float) -> str:
        """Why the wait ends: where the run still runs (and the hang diagnosis of those ranks),
        and where it has not started, behind earlier work (whose lines are not this run's)."""
        what = self.options.what or self.run.what
        behind = self.mesh.queued(self.run)
        running = [r for r in self.run.pending if r not in behind]
        parts = [f"{what} is still running on rank(s) {format_ranks(running)} after {timeout:g} s"] if running else []
        if behind:
            parts.append(f"{what} has not started on rank(s) {format_ranks(behind)} after {timeout:g} s: "
                         f"{still_running(behind)} ({self.options.stop_earlier.format(ranks=format_ranks(behind))})")
        diagnosis = self._diagnosis() if running else ""
        return (". ".join(parts) + f". The ranks keep running as they are: {self.options.next_steps}."
                + (f"\n{diagnosis}" if diagnosis else ""))

    def _explain_interrupt(self) -> None:
        """Ranks still on the run after the interrupt's grace: in its cleanup, blocked outside
        Python, or where the run never started (they run earlier work, and drop it when that ends: a second
        interrupt would stop that work too)."""
        behind = self.mesh.queued(self.run)
        blocked = [r for r in self.run.pending if r not in behind]
        waiting = ""
        if behind:
            steps = self.options.stop_earlier.format(ranks=format_ranks(behind))
            waiting = (f"rank(s) {format_ranks(behind)} have not started {self.options.what or self.run.what}: "
                       f"they drop it once the work they run ends ({steps}).")
        if not blocked:
            self.renderer.flush()
            _note(waiting)
            return
        self._explain(" ".join(filter(None, [
            f"rank(s) {format_ranks(blocked)} did not stop within {self.options.grace:g} s of the interrupt "
            f"(still busy: in the cleanup of the interrupt, or blocked outside Python). Interrupt again to "
            f"free them: meshbook interrupts them once more, aborts the collectives they wait in, and "
            f"restarts only those that still do not stop (usually none; they lose their variables).",
            waiting])))

    def _hang_clock(self) -> float | None:
        return self.hang_since if self.hang_since is not None else self.first_done_at

    def _check_wait(self) -> float:
        """How long the step check after the run may keep the caller: what is left of its
        timeout, at most :data:`STEP_CHECK_WAIT_S` (the check goes on; the report says it waits)."""
        timeout = self.options.timeout
        if timeout is None:
            return STEP_CHECK_WAIT_S
        return max(0.0, min(STEP_CHECK_WAIT_S, self._timed_from() + timeout - time.monotonic()))

    def _timed_from(self) -> float:
        """Where the timeout counts from: the start, later by the time the user took to answer
        the ranks' prompts (``input()``, pdb), which is not the ranks' running time."""
        return self.started + self.renderer.prompts.answering_s

    def _check_queued(self) -> None:
        """Say once that the run waits behind earlier work on some ranks: nothing else would
        tell why it has not started there."""
        if self.queue_explained or time.monotonic() - self.started < QUEUED_HINT_S:
            return
        self.queue_explained = True
        if self.interrupted_at is not None:
            return  # the interrupt's note says it
        behind = self.mesh.queued(self.run)
        if not behind:
            return
        steps = f"{self.options.stop_earlier.format(ranks=format_ranks(behind))}; {self.options.drop_this}"
        self.renderer.flush()
        _note(f"{still_running(behind)}: {self.options.what or self.run.what} starts there once that ends ({steps}).")

    def _check_stuck(self) -> None:
        """Explain ranks waiting in a collective call the other ranks have not joined: ranks
        of the run (their heartbeats say so), or, when every rank of the run waits, ranks
        outside it or in another collective (the diagnosis says so; asked once per
        ``stuck_hint``, as a long collective every member is in may yet complete)."""
        now = time.monotonic()
        if self.explained or self.interrupted_at is not None \
                or self.renderer.prompts.used \
                or now - self.started < self.options.stuck_hint:  # no rank can have waited that long yet
            return
        waiting = self.mesh.stuck(self.run)
        if max(waiting.values(), default=0.0) < self.options.stuck_hint:
            return
        headline = (f"{ranks_text(waiting)} {agree('waits', waiting)} in a collective "
                    f"(for over {self.options.stuck_hint:g} s)")
        busy = [r for r in self.run.pending if r not in waiting]
        finished = [r for r in self.run.ranks if r not in waiting and r not in busy]
        if busy or finished:
            self.explained = True  # once per run: the heartbeats say the same every half second
            where = [*([f"{ranks_text(busy)} {agree('is', busy)} elsewhere"] if busy else []),
                     *([f"{ranks_text(finished)} finished the {self.run.noun}"] if finished else [])]
            self._explain(f"{headline} while {' and '.join(where)}.")
        elif now >= self.asked_at + self.options.stuck_hint:
            self.asked_at = now
            diagnosis, said = self._diagnose()
            if diagnosis is not None and diagnosis.deadlocked:
                self.explained = True
                self._explain(f"{headline}, each for another that waits too (a deadlock): none can go on, and "
                              f"only the collective timeout ends their calls ({self.options.stop_this}).", said)
            elif diagnosis is not None and diagnosis.blocked:
                self.explained = True
                self._explain(f"{headline} that a rank of its group has not joined: without it, only the "
                              f"collective timeout ends the call ({self.options.stop_this}).", said)

    def _paused(self, rank: int) -> None:
        """Before a debugger prompt of ``rank``: say once that other ranks of the run wait in a
        collective meanwhile (while the user reads variables, their collective's timeout runs,
        and it failed them silently, as far as the prompt showed), and when it runs out."""
        waiting = {r: s for r, s in self.mesh.stuck(self.run).items() if r != rank}
        if self.paused_explained or not waiting:
            return
        self.paused_explained = True
        timeout = self.mesh.collective_timeout
        left = max(0.0, timeout - max(waiting.values()))
        _note(f"{ranks_text(waiting)} {agree('waits', waiting)} in a collective while rank {rank} is paused in the "
              f"debugger: it fails with a timeout {timeout:g} s after entering it (the mesh's collective timeout: "
              f"about {left:.0f} s from now) unless rank {rank} joins it first (c continues).")

    def _explain(self, headline: str, said: str | None = None) -> None:
        self.renderer.flush()
        _note(headline + "\n" + (said if said is not None else self._diagnosis()))

    def _diagnose(self) -> tuple[Any, str]:
        """The hang diagnosis (None if it failed), and what it says."""
        try:
            diagnosis = self.mesh.diagnose()
        except Exception as exc:  # noqa: BLE001 - a diagnosis must never make things worse
            return None, f"(no diagnosis: {exc})"
        return diagnosis, "\n".join(diagnosis.verdict)

    def _diagnosis(self) -> str:
        return self._diagnose()[1]

    def _recover(self) -> None:
        self.renderer.flush()
        _note(f"freeing rank(s) {format_ranks(self.run.pending)} ...")
        self.recovery_report = self.mesh.recover().render()


def still_running(behind: Mapping[int, str]) -> str:
    """``rank(s) 0,1 still run cell [3]``: what ranks run that a request waits behind (rank ->
    what it runs, as :meth:`Controller.queued_behind` says), ranks grouped by what they run."""
    ahead: dict[str, list[int]] = {}
    for rank, earlier in sorted(behind.items()):
        ahead.setdefault(earlier, []).append(rank)
    return "; ".join(f"rank(s) {format_ranks(ranks)} still run {earlier}" for earlier, ranks in ahead.items())


def _note(text: str) -> None:
    write_stream("stderr", text.rstrip("\n") + "\n")


def _left(span: float | None, since: float | None, now: float) -> float | None:
    if span is None or since is None:
        return None
    return max(0.0, since + span - now)
