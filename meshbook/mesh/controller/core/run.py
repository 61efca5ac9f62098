"""A request in flight on some ranks, and the events it produces.

:class:`Run` is the future every mesh call returns. Its events arrive on the controller's
receiver thread and are kept in order; any thread can wait for them:

* :meth:`Run.result` waits for every rank and returns a :class:`~meshbook.RankValues`, or
  raises :class:`~meshbook.RemoteError` (the successful ranks' values ride along as
  ``partial``). While it waits it prints the ranks' output, merged across ranks, so a script
  sees what the ranks print as they print it.
* :meth:`Run.events` yields the events of :mod:`meshbook.mesh.protocol.events` (output,
  displays, results, errors, debugger prompts) as they arrive: renderers read them.

Output a rank writes after its run finished (a background thread it started) is handed to
``on_late_output``, so it can be attributed to the run that started it, not to whatever runs
next.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator, Protocol, Sequence

from ...protocol import messages as msg
from ...protocol.errors import MeshError, MeshTimeout, RankFailure, RemoteError, blame_order, check_seconds
from ...protocol.events import DebugEnd, Display, Error, Event, InputRequest, Output, Result, Results
from ...protocol.reports import Collective
from ...protocol.text import format_ranks, group_by_text
from ...protocol.topology import Topology
from ...protocol.values import RankValues
from .render import EventRenderer, LateOutput, write_stream
from .transport import log

#: What no rank's value is (a value may be None).
_MISSING = object()
#: How much of a value a line about a finished run shows.
BRIEF_CHARS = 60
#: How long a run's result waits for the step check that follows an irregular end.
STEP_CHECK_WAIT_S = 30.0
#: How long it waits for a check that waits for ranks busy with earlier work: they may run for
#: hours. The check goes on; what is sent next waits behind it, and says so.
STEP_CHECK_BUSY_S = 3.0


def interrupt_error(run: Run) -> KeyboardInterrupt:
    """What a Ctrl-C that came while ``run`` was booked and sent raises, once the run was
    interrupted on every rank it went to: a plain ``KeyboardInterrupt``, as the notebook shows
    one, that names the run (:func:`interrupted_run`), for meshbook's own multi-step work that
    must not go on before the ranks stopped."""
    exc = KeyboardInterrupt()
    exc.run = run  # type: ignore[attr-defined]
    return exc


def interrupted_run(exc: KeyboardInterrupt) -> Run | None:
    """The run a Ctrl-C interrupted as it was sent (:func:`interrupt_error`); None for another."""
    return getattr(exc, "run", None)


class StepReport(Protocol):
    """The check of the ranks' collective positions after a run ended irregularly (done by
    :mod:`..recovery.step`; the run only waits for it and shows what it says)."""

    report: str

    def wait(self, timeout: float | None = None) -> bool: ...

    @property
    def waiting_for(self) -> list[int]: ...


def _checked_within(check: StepReport, timeout: float | None) -> bool:
    """Did ``check`` end within ``timeout``? Given up after :data:`STEP_CHECK_BUSY_S` where
    it still waits for ranks busy with earlier work; a check that re-creates the process
    groups (no rank keeps it waiting) is progress, and is waited for."""
    if check.wait(STEP_CHECK_BUSY_S if timeout is None else min(timeout, STEP_CHECK_BUSY_S)):
        return True
    if check.waiting_for:
        return False
    return check.wait(None if timeout is None else max(0.0, timeout - STEP_CHECK_BUSY_S))


#: How ``result()`` follows a run when a mesh's API is there: ``follow(run, renderer, timeout)``
#: with hang hints and escalating interrupts (:mod:`..api.follow`).
Follow = Callable[["Run", EventRenderer, "float | None"], RankValues]

#: What a user calls a run of each kind where messages name it ("failed the call without
#: joining it"); a rank operation (``CALL``) is an operation.
NOUNS = {msg.EXEC: "cell", msg.APPLY: "function", msg.ACTOR: "call", msg.CALL: "operation"}


class Run:
    """Handle on one request to a set of ranks."""

    def __init__(self, request_id: int, ranks: list[int], topology: Topology, what: str,
                 interrupt: Callable[["Run"], None], send_input: Callable[[int, str | None, int], None],
                 kind: str = msg.EXEC, follow: Follow | None = None, in_step: bool | None = None,
                 noun: str | None = None) -> None:
        self.id = request_id
        self.ranks = list(ranks)
        self.what = what
        self.kind = kind  # EXEC, APPLY, ACTOR, CALL (a rank operation) or OP (the agents'), see messages.py
        #: What messages call it: "cell", "function", "call", "spawn", "operation".
        self.noun = noun or NOUNS.get(kind, "request")
        #: Its collectives pair across ranks (``messages.pairs_collectives``): an irregular end
        #: is step-checked, the run watcher frees what it leaves waiting, a recovery drops it
        #: if it has not started.
        self.in_step = kind in msg.USER_KINDS if in_step is None else in_step
        #: Set once an interrupt was sent for this run; with ``irregular`` (some rank failed or
        #: lost its process group), the ranks' collective positions are checked when it ends.
        self.interrupted = False
        self.irregular = False
        #: meshbook aborted some rank's collective in this run: the groups must be re-created.
        self.forced_resync = False
        #: The check of every rank's collective positions after this run (see ``step.py``).
        self.step_check: StepReport | None = None
        #: What meshbook did about this run on its own (e.g. freeing ranks a dead rank stranded).
        self.notes: list[str] = []
        #: Its ranks that died, and why, and the one note in ``notes`` that says them all
        #: (``Controller._ranks_died``: deaths told one by one read as one).
        self.deaths: dict[int, str] = {}
        self.death_note = ""
        self.submitted_at = time.monotonic()
        #: When its first rank finished it, and when it was interrupted (the run watcher's
        #: clocks, see ``watch.py``), when the watcher last looked, and whether it looks now.
        self.first_done_at: float | None = None
        self.interrupted_at: float | None = None
        self.checked_at = 0.0
        self.checking = False
        #: The ranks the watcher's last look found deadlocked, and what each waited in.
        self.deadlock_seen: dict[int, Collective] = {}
        self._topology = topology
        self._interrupt = interrupt
        self._follow = follow
        self.send_input = send_input  # answers a rank's debugger prompt (InputRequest)
        self._cond = threading.Condition()
        self._events: list[Event] = []
        self._values: dict[int, Any] = {}
        self._failures: dict[int, RankFailure] = {}
        self._durations: dict[int, float] = {}
        self._pending = set(ranks)
        self.echoed = 0  #: events already printed (by result(), or the follower of a cell)
        #: Called with each Output/Display event that arrives after the run finished (also
        #: after this object is gone: the controller keeps the callable for a while), or
        #: after nobody follows it (:meth:`let_go`); by default merged across the ranks.
        late = LateOutput(self.ranks)
        self.on_late_output: Callable[[Event], None] = late
        #: Called with how a run nobody follows ended (one line; where late output goes).
        self.on_late_end: Callable[[str], None] = late.end
        #: Called with what its step check found, after that (where late output goes).
        self.on_late_note: Callable[[str], None] = late.end
        self.followed = True
        #: Ranks whose input request (``input()``, pdb) waits for an answer: its question.
        self._asking: dict[int, int] = {}
        #: Held while what nobody follows is handed on: in the order it came.
        self._handing = threading.Lock()

    # -- fed by the controller's receiver thread ---------------------------------------------

    def add_event(self, event: Event) -> None:
        """An event for this run (the controller's receiver thread)."""
        with self._cond:
            late = (not self._pending or not self.followed) and isinstance(event, (Output, Display))
            running = bool(self._pending)
            first = self.first_done_at is None
            unanswered = None
            if isinstance(event, (InputRequest, DebugEnd)):  # a prompt opened or closed
                if isinstance(event, InputRequest):
                    self._asking[event.rank] = event.question
                    unanswered = None if self.followed else (event.rank, event.question)
                else:
                    self._asking.pop(event.rank, None)
            if isinstance(event, Results):
                fresh = self._fresh(event)
                if fresh is None:
                    return  # every one answered already
                event = fresh
                self._pending.difference_update(event.ranks)
                self._values.update(zip(event.ranks, event.values))
                self._durations.update(zip(event.ranks, event.durations))
            elif isinstance(event, (Result, Error)):
                if event.rank not in self._pending:
                    return  # a second answer (e.g. death after the result): keep the first
                self._pending.discard(event.rank)
                self._durations[event.rank] = event.duration
                if isinstance(event, Result):
                    self._values[event.rank] = event.value
                else:
                    self._failures[event.rank] = event.failure
            if first and isinstance(event, (Result, Results, Error)):
                self.first_done_at = time.monotonic()
            self._events.append(event)
            # Waking the waiting thread costs a thread switch and a GIL hand-off per event, and
            # the results of a many-rank run arrive back to back: wake for what a waiter acts
            # on (output, errors, and the last result); the results before it are picked up
            # with the next event. The clocks the first result starts (hang hints, stragglers)
            # are read from ``first_done_at`` at the waiter's next scheduled look.
            if not isinstance(event, (Result, Results)) or not self._pending:
                self._cond.notify_all()
            ended = self._how_it_ended() if running and not self._pending and not self.followed else ""
        if late or ended or unanswered is not None:
            with self._handing:
                self._hand_on([event] if late else [], ended, [] if unanswered is None else [unanswered])

    def revoke(self, failures: dict[int, RankFailure]) -> None:
        """Results this run booked that turned out wrong (a collective that paired with another
        request's, see ``Controller._mispaired``): each of those ranks' value becomes its
        failure, told as an :class:`Error` after what came before."""
        with self._cond:
            for rank, failure in failures.items():
                if self._values.pop(rank, _MISSING) is not _MISSING:
                    self._failures[rank] = failure
                    self._events.append(Error(rank, failure, self._durations.get(rank, 0.0)))
            self._cond.notify_all()

    def let_go(self) -> None:
        """Nobody follows this run from now on (a cell that stopped waiting at its timeout):
        what its ranks print, and how it ends, go where late output goes (that cell), where
        nobody would see them again; a rank's input request gets an end of input, where
        nobody would answer it."""
        with self._handing:
            with self._cond:
                self.followed = False
                missed = [e for e in self._events[self.echoed:] if isinstance(e, (Output, Display))]
                self.echoed = len(self._events)
                ended = "" if self._pending else self._how_it_ended()
                asking = sorted(self._asking.items())
            self._hand_on(missed, ended, asking)
        if ended:
            self.step_checked()  # a check that ended before it was let go: said after the end

    def _hand_on(self, events: Sequence[Event], ended: str, asking: list[tuple[int, int]]) -> None:
        """What nobody follows, to where late output goes (under ``_handing``, so in order).
        A failing hand-off (the kernel's socket gone at exit) is logged: it must not fail the
        receiver's booking of this run."""
        try:
            for event in events:
                self.on_late_output(event)
            if ended:
                self.on_late_end(ended)
            for rank, question in asking:
                self.send_input(rank, None, question)  # end of input: input() raises EOFError, pdb quits
        except Exception as exc:  # noqa: BLE001 - whatever the callbacks raise
            log(f"the late output of {self.what} was lost: {type(exc).__name__}: {exc}")

    def _how_it_ended(self) -> str:
        """How the run ended, one line: the ranks that finished (with their values, briefly),
        and each error with its ranks."""
        finished = group_by_text({r: _briefly(v) for r, v in self._values.items()})
        parts = [f"[{format_ranks(ranks)}] finished" + (f": {text}" if text else "") for ranks, text in finished]
        failed = group_by_text({r: f"{f.type_name}: {f.message}" for r, f in self._failures.items()})
        parts += [f"[{format_ranks(ranks)}] {text}" for ranks, text in failed]
        # Where an exception was raised there (a death, or an answer meshbook found wrong, has no frames)
        raised = [rank for rank, failure in self._failures.items() if failure.frames and not failure.died]
        first = min(raised, key=lambda r: (blame_order(self._failures[r]), r), default=None)
        hint = f" (%mesh debug {first} shows where)" if first is not None else ""
        return f"meshbook: {self.what} ended after the wait for it timed out: {'; '.join(parts)}{hint}"

    def _fresh(self, group: Results) -> Results | None:
        """The part of ``group`` from ranks that had not answered yet (None: no part)."""
        pending = self._pending
        return group if pending.issuperset(group.ranks) else group.only(pending.__contains__)

    # -- the public face ---------------------------------------------------------------------

    def done(self) -> bool:
        return not self._pending

    def waits_only_for(self, ranks: Sequence[int]) -> bool:
        """Every rank still to answer is one of ``ranks`` (no sort: asked once per answer)."""
        pending = self._pending
        if len(ranks) == 1:
            return len(pending) == 1 and ranks[0] in pending
        return len(pending) <= len(ranks) and pending.issubset(ranks)

    @property
    def pending(self) -> list[int]:
        """Ranks that have not answered yet."""
        return sorted(self._pending)

    @property
    def durations(self) -> dict[int, float]:
        """Seconds each finished rank spent on the request."""
        return dict(self._durations)

    def wait(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout)

    def events(self) -> Iterator[Event]:
        """Every event in arrival order, blocking until the run is done; results that arrived
        as a group come one :class:`Result` per rank."""
        index = 0
        while True:
            batch, index = self.events_since(index, None)
            if not batch and self.done():
                return
            for event in batch:
                if isinstance(event, Results):
                    yield from event.each()
                else:
                    yield event

    def events_since(self, index: int, timeout: float | None) -> tuple[list[Event], int]:
        """Events from position ``index`` on (waiting up to ``timeout`` for one), and the next
        position. For renderers that must wake up on their own schedule too. A result other
        than the last does not end the wait on its own (see :meth:`add_event`)."""
        with self._cond:
            if len(self._events) <= index and self._pending:
                self._cond.wait(timeout)
            return self._events[index:], len(self._events)

    def recent_output(self, rank: int, stream: str, events: int = 16) -> str:
        """What ``rank`` wrote on ``stream`` in this run's last ``events`` output events (a
        dead rank's last words on stderr say why it died)."""
        with self._cond:
            said = [e.text for e in self._events[-events:] if isinstance(e, Output) and e.rank == rank
                    and e.stream == stream]
        return "".join(said)

    def failed_ranks(self) -> set[int]:
        """Ranks whose part of the run failed (so far)."""
        return set(self._failures)

    def failure(self, rank: int) -> RankFailure | None:
        """How ``rank``'s part failed (None: it succeeded, or has not answered yet)."""
        with self._cond:
            return self._failures.get(rank)

    def values(self) -> RankValues:
        """Results of the ranks that have succeeded so far."""
        return RankValues(self._values, self._topology)

    def result(self, timeout: float | None = None, echo: bool = True) -> RankValues:
        """Wait for every rank; per-rank values, or :class:`RemoteError`.

        ``echo`` prints the ranks' output (merged across ranks) while waiting, and follows the
        run as a ``%%mesh`` cell does: ranks still busy long after the others finished, or
        waiting in a collective the others have not joined, are explained; a first Ctrl-C
        interrupts the ranks and keeps waiting for their errors, a second frees ranks that did
        not stop (``mesh.recover()``). Without ``echo``, Ctrl-C interrupts the ranks and
        returns at once (``KeyboardInterrupt``).
        """
        if timeout is not None:
            timeout = check_seconds(timeout, "timeout", now=True)
        if echo and self._follow is not None and threading.current_thread() is threading.main_thread():
            # A cell's way of waiting (hints, a second Ctrl-C frees ranks) is for the user's
            # thread; meshbook's own waits on its threads (a supervisor, Slurm's time-limit
            # hook) print the output and nothing more.
            try:
                return self._follow(self, EventRenderer(self), timeout)
            except MeshError as exc:  # the same error, its frames in meshbook's following left out:
                raise exc.with_traceback(None) from exc.__cause__  # a script's traceback ends here
        try:
            values = self._wait_and_echo(timeout, echo)
        except KeyboardInterrupt:
            self.interrupt()  # Ctrl-C here must stop the remote work too, not only our wait
            raise
        except RemoteError:
            self._report_step_check(echo)
            raise
        self._report_step_check(echo)
        return values

    def step_report(self, timeout: float | None = STEP_CHECK_WAIT_S) -> str:
        """What the check after this run did: empty when the ranks were in step (or no check
        was needed); a note when it still waits for busy ranks after ``timeout``."""
        check = self.step_check
        if check is None:
            return ""
        if not _checked_within(check, timeout):
            busy = check.waiting_for
            doing = (f"it waits for rank(s) {format_ranks(busy)} to finish what they run" if busy
                     else "it is re-creating the process groups")
            return f"meshbook checks that every rank is at the same collective before anything else runs; {doing}."
        self.step_check = None  # said once
        return check.report

    def step_checked(self) -> None:
        """Its step check ended (the check's thread). Where nobody follows this run (a cell
        that stopped waiting at its ``--timeout``), what the check did goes where late output
        goes, after how the run ended: a follower reads it itself."""
        with self._handing:
            with self._cond:
                check, followed = self.step_check, self.followed
            if followed or check is None or not check.wait(0):
                return
            self.step_check = None  # said once
            if check.report:
                try:
                    self.on_late_note(check.report)
                except Exception as exc:  # noqa: BLE001 - as _hand_on: the check's thread goes on
                    log(f"the step report of {self.what} was lost: {type(exc).__name__}: {exc}")

    def _report_step_check(self, echo: bool) -> None:
        if echo and self.step_check is not None:
            report = self.step_report()
            if report:
                write_stream("stderr", report + "\n")

    def _wait_and_echo(self, timeout: float | None, echo: bool) -> RankValues:
        deadline = None if timeout is None else time.monotonic() + timeout
        renderer = EventRenderer(self) if echo else None
        seen = self.echoed
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait = renderer.next_deadline() if renderer else None
            events, seen = self.events_since(seen, min(filter(None, (left, wait)), default=left))
            if renderer:
                renderer.feed(events)
                self.echoed = seen
            else:  # a wait that shows nothing asks nothing: a rank's question gets an end of input
                for event in events:
                    if isinstance(event, InputRequest):
                        self.send_input(event.rank, None, event.question)
            if self.done() and seen == len(self._events):
                break
            if deadline is not None and time.monotonic() >= deadline:
                if renderer:
                    renderer.close()
                raise MeshTimeout(
                    f"{self.what} still running on rank(s) {format_ranks(self.pending)} after "
                    f"{timeout:g} s; it keeps running: wait again, or interrupt it with "
                    f"run.interrupt()")
        if renderer:
            renderer.close()
        return self._outcome()

    def _outcome(self) -> RankValues:
        values = self.values()
        if self._failures:
            raise RemoteError(dict(self._failures), partial=values, hint="\n".join(self.notes))
        return values

    def exception(self) -> RemoteError | None:
        """The :class:`RemoteError` of a finished run, or ``None``."""
        try:
            self._outcome()
        except RemoteError as exc:
            return exc
        return None

    def interrupt(self) -> None:
        """Interrupt this request on the ranks still running it (ranks where it has not started
        drop it); other requests are not touched."""
        if self._pending:
            self._interrupt(self)

    def __repr__(self) -> str:
        state = "done" if self.done() else f"running on {format_ranks(self.pending)}"
        return f"<Run {self.id} {self.what}: {state}>"


def _briefly(value: Any) -> str:
    """A finished rank's value in one line: its repr, cut short (nothing for None)."""
    if value is None:
        return ""
    try:
        text = " ".join(repr(value).split())
    except Exception:  # noqa: BLE001 - a user's __repr__ that raises
        return f"a {type(value).__name__}"
    return text if len(text) <= BRIEF_CHARS else text[:BRIEF_CHARS - 3] + "..."
