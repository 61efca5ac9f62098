"""The controller's book of ranks and runs: pure state, events in, decisions out.

Everything the controller knows about its ranks and the requests in flight, with no socket,
thread or clock of its own (as dask's ``worker_state_machine``): the receiver thread and the
callers feed it what happened (a request was sent, a rank answered, said hello, became ready,
died) and it answers with what follows (the run is done; a step check must start before this
answer is seen, its last or a failure while others still run it; these runs waited on the dead
rank, and these ranks ran beside it). The
:class:`~.controller.Controller` facade holds the lock around it and does what it decides.
Tested on its own (tests/test_book.py).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...protocol import messages as msg
from ...protocol.events import Event
from .run import Run

#: How many finished runs still get their late output routed to them.
LATE_OUTPUT_RUNS = 256


@dataclass
class RankState:
    rank: int
    host: int
    pid: int | None = None
    hostname: str = ""
    device: str = ""
    state: str = "starting"  # starting | idle | busy | failed (its group did not start) | dead
    cause: str = ""  # why it is dead
    generation: int = -1
    metrics: dict[str, Any] = field(default_factory=dict)
    last_seen: float = 0.0
    #: Set when the rank was restarted and its variables are gone.
    lost_namespace: bool = False
    #: The variables the rank had at the last who() or push: what a restart loses.
    known_names: frozenset[str] = frozenset()
    #: How its torch threads were set (``OMP_NUM_THREADS=1 per rank, as torchrun sets it``).
    threads: str = ""
    #: The newest request of the kernel before (a kept mesh's) it answered since this one
    #: attached: its report of what it runs may be older.
    answered_before: int = 0


@dataclass(frozen=True)
class Answer:
    """What follows a rank's answer: the run it was for (None: already retired, or never
    known), whether a step check must start (or have started) before the answer is seen (the
    run ends irregularly with it, or these ranks ended it irregularly while others still run
    it: nothing sent after it may run on them before the check), and whether the run is done."""

    run: Run | None
    check_step: bool = False
    done: bool = False


@dataclass(frozen=True)
class Death:
    """What follows ranks' deaths: the request each ran (its output goes there), the runs that
    waited on them (they fail for those ranks), and the live ranks that ran beside them in those
    runs (their collectives can no longer complete: they are freed)."""

    running: dict[int, int | None]
    waiting: list[Run]
    stranded: list[int]


class RankBook:
    """Ranks, the runs in flight, each rank's queue of requests, and the process-group generation."""

    def __init__(self, host_of: dict[int, int]) -> None:
        self.ranks = {r: RankState(r, host) for r, host in sorted(host_of.items())}
        self.runs: dict[int, Run] = {}
        self.queues: dict[int, deque[int]] = {r: deque() for r in self.ranks}
        #: The ranks whose state is "dead": asked before every request, which must not look
        #: at every rank of a thousand to learn that none is.
        self._dead: set[int] = set()
        self.generation = 0
        #: The number this controller's requests start from (a kept mesh's: see number_from).
        self.first_request = 1
        #: Where request ids come from (one per request, ranks and agents alike).
        self.request_ids = itertools.count(self.first_request)
        #: Each retired run's late-output route, and what it was ("cell [3]"), for a while.
        self._late: OrderedDict[int, tuple[Callable[[Event], None], str]] = OrderedDict()

    #: Request numbers one controller uses at most: an attaching controller of a later epoch
    #: numbers its requests past all of them (see :meth:`number_from`).
    IDS_PER_EPOCH = 1 << 40

    def number_from(self, epoch: int) -> None:
        """Number requests past any that an older controller of this (kept) mesh sent. Ranks
        and agents tell requests apart by number: an interrupt names one, and a run the old
        kernel left busy on a rank sends its output and result under its own. Counting from 1
        again, a new kernel's run would take those, and interrupting it would stop the old run."""
        self.first_request = epoch * self.IDS_PER_EPOCH + 1
        self.request_ids = itertools.count(self.first_request)

    # -- requests ------------------------------------------------------------------------------

    def open(self, run: Run, queued: bool) -> None:
        """``run`` was sent; ``queued``: to its ranks' main threads, in order behind what they run."""
        self.runs[run.id] = run
        if queued:
            for r in run.ranks:
                self.queues[r].append(run.id)
                self.ranks[r].state = "busy"

    def answered(self, request: int, ranks: Sequence[int], failed: bool, lost_group: bool) -> Answer:
        """``ranks`` answered ``request`` (one rank, or a group whose results an agent bundled;
        ``failed``: with an error; ``lost_group``: they no longer have a process group): their
        queues move on at once (a request the caller sends as soon as it sees the answer finds
        them idle). Call :meth:`settle` once the event was given to the run."""
        queues, states = self.queues, self.ranks
        if request < self.first_request:  # the kernel before's: not a run of ours, rare
            for rank in ranks:
                states[rank].answered_before = max(states[rank].answered_before, request)
        for rank in ranks:
            queue = queues[rank]
            if queue and queue[0] == request:
                queue.popleft()
                state = states[rank]
                if state.state == "busy" and not queue:
                    state.state = "idle"
        run = self.runs.get(request)
        if run is None:
            return Answer(None)
        if lost_group or failed:
            run.irregular = True
        last = run.waits_only_for(ranks)
        check = run.in_step and (last and (run.irregular or run.interrupted) or failed or lost_group)
        return Answer(run, check, last)

    def settle(self, request: int) -> None:
        """The answers to ``request`` were given to its run: a run done is retired."""
        run = self.runs.get(request)
        if run is not None and run.done():
            del self.runs[request]
            self._late[request] = (run.on_late_output, run.what)
            while len(self._late) > LATE_OUTPUT_RUNS:
                self._late.popitem(last=False)

    def what(self, request: int) -> str | None:
        """What ``request`` is ("cell [3]", "run('x = 1')"), in flight or retired lately."""
        run = self.runs.get(request)
        if run is not None:
            return run.what
        retired = self._late.get(request)
        if retired is not None:
            return retired[1]
        return "a run the kernel before this one sent" if request < self.first_request else None

    def route(self, request: int | None) -> "Run | Callable[[Event], None] | None":
        """Where an event of ``request`` goes: its run, or, once retired, its late-output route."""
        if request is None:
            return None
        retired = self._late.get(request)
        return self.runs.get(request) or (retired[0] if retired is not None else None)

    # -- ranks ---------------------------------------------------------------------------------

    def hello(self, rank: int, pid: int, host: str) -> None:
        state = self.ranks[rank]
        state.pid, state.hostname = pid, host

    def ready(self, rank: int, generation: int, device: str, pid: int, threads: str) -> None:
        state = self.ranks[rank]
        state.device, state.pid, state.threads, state.generation = device, pid, threads, generation
        if not self.queues[rank]:
            state.state = "idle"
            self._dead.discard(rank)

    def described(self, rank: int, device: str, pid: int, threads: str, running: int | None = None) -> None:
        """What an attached rank's READY had said (its device: a kept mesh's new kernel never
        heard it), and the request of the kernel before that its main thread runs: booked at
        the head of its queue, so it shows busy, and what this kernel sends says it waits
        behind that (unless its answer came meanwhile)."""
        state = self.ranks[rank]
        state.device, state.pid, state.threads = device, pid, threads
        queue = self.queues[rank]
        if running is not None and self.first_request > running > state.answered_before and running not in queue:
            queue.appendleft(running)
            if state.state == "idle":
                state.state = "busy"

    def init_failed(self, rank: int, generation: int, headline: str) -> None:
        state = self.ranks[rank]
        state.generation, state.state = generation, "failed"
        self._dead.discard(rank)
        state.cause = f"torch.distributed did not initialise: {headline}"

    def adopt(self, generations: dict[Any, int], dead: list[Any], hostname: str) -> None:
        """An agent's answer to ATTACH: its ranks as they are. An agent knows the generation
        each rank was forked into; a restart moves every live rank into the new one, so the
        newest is every rank's."""
        self.generation = max([self.generation, *generations.values()])
        for r in generations:
            state = self.ranks[int(r)]
            state.generation, state.state, state.hostname = self.generation, "idle", hostname
            self._dead.discard(int(r))
        for r in dead:
            self._died(int(r), "died while no kernel was attached")

    def died(self, ranks: list[int], cause: str) -> Death:
        """``ranks`` died together (a rank's exit, a lost host). A rank whose process group
        failed to initialise keeps that as its cause, the exit after it added: 'exit code 1'
        alone would hide why it exited."""
        running = {}
        for rank in ranks:
            state = self.ranks[rank]
            why = f"{state.cause}; then it exited ({cause})" if state.state == "failed" and state.cause else cause
            self._died(rank, why)
            state.pid = None
            queue = self.queues[rank]
            running[rank] = queue[0] if queue else None
            queue.clear()
        waiting = [run for run in self.runs.values() if set(run.pending) & set(ranks)]
        stranded = sorted({r for run in waiting for r in run.pending if r not in ranks})
        return Death(running, waiting, stranded)

    def stopped(self, cause: str) -> None:
        """The mesh stopped: every rank not dead already is, for ``cause``."""
        for rank, state in self.ranks.items():
            if state.state != "dead":
                self._died(rank, cause)

    def _died(self, rank: int, cause: str) -> None:
        state = self.ranks[rank]
        state.state, state.cause = "dead", cause
        self._dead.add(rank)

    def respawning(self, ranks: list[int]) -> None:
        """``ranks`` are being forked anew: their variables are gone."""
        for r in ranks:
            state = self.ranks[r]
            state.state, state.cause, state.lost_namespace = "starting", "", True
            self._dead.discard(r)

    def new_generation(self) -> int:
        """A new process-group generation (its ranks meet in a new store)."""
        self.generation += 1
        return self.generation

    def dead(self, ranks: Iterable[int] | None = None) -> list[RankState]:
        """The dead among ``ranks`` (all ranks: None), in rank order."""
        if not self._dead:
            return []
        return [self.ranks[r] for r in sorted(self._dead if ranks is None else self._dead.intersection(ranks))]

    def live(self, ranks: list[int]) -> list[int]:
        """``ranks`` without the dead, in their order (the same list when none is dead)."""
        dead = self._dead
        return [r for r in ranks if r not in dead] if dead else ranks

    def startup(self, ranks: list[int], generation: int) -> tuple[bool, list[RankState]]:
        """Are ``ranks`` ready in ``generation``; and which failed (dead, or their group did not start)?"""
        states = [self.ranks[r] for r in ranks]
        failed = [s for s in states if s.state == "dead" or (s.generation == generation and s.state == "failed")]
        return not self.not_ready(ranks, generation), failed

    def not_ready(self, ranks: list[int], generation: int) -> list[int]:
        """The ``ranks`` yet to say they are ready in ``generation`` (a rank re-forked into it
        is of it, and starting)."""
        return [r for r in ranks if self.ranks[r].generation != generation or self.ranks[r].state == "starting"]

    # -- what runs where -----------------------------------------------------------------------

    def current_request(self, rank: int) -> int | None:
        """The request ``rank``'s main thread runs now (the head of its queue)."""
        queue = self.queues[rank]
        return queue[0] if queue else None

    def ahead(self, request: int, ranks: Iterable[int]) -> dict[int, int]:
        """The ranks where ``request`` still waits in the queue behind another request, and
        that request (the one each of them runs now)."""
        queues, found = self.queues, {}
        for rank in ranks:
            queue = queues[rank]
            if queue and queue[0] != request and request in queue:
                found[rank] = queue[0]
        return found

    def queued(self, rank: int) -> int:
        """How many requests ``rank``'s main thread has not finished (the running one included)."""
        return len(self.queues[rank])

    def busy_with_other(self, rank: int, request: int) -> bool:
        """Is ``rank`` still running something queued before ``request``?"""
        queue = self.queues[rank]
        return bool(queue) and queue[0] != request and self.ranks[rank].state != "dead"

    def own_work(self, request: int | None) -> str:
        """What ``request`` is, when it is meshbook's own work rather than user code ("")."""
        run = self.runs.get(request) if request is not None else None
        return run.what if run is not None and run.kind == msg.CALL else ""

    def pending_on(self, ranks: list[int]) -> list[Run]:
        """The runs still waiting for any of ``ranks``."""
        return [run for run in self.runs.values() if set(run.pending) & set(ranks)]
