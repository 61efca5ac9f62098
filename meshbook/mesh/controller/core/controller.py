"""The controller: the notebook's end of the wire, as a thin facade over three parts.

One :class:`Controller` per started mesh. It composes

* a :class:`~.book.RankBook`: every rank's state, the runs in flight, each rank's queue and
  what a death fails (pure state, tested without processes);
* a :class:`~.transport.Transport`: the sockets and the receiver thread;
* :class:`~.agents.Agents`: the host agents its launcher starts, configures and restarts;

and does what the book decides. The receiver thread dispatches each message by kind through a
handler table (:mod:`~meshbook.mesh.protocol.messages`; a kind without a handler is counted in
``unknown_kinds`` and logged): events go to the :class:`~.run.Run` they belong to, and a rank's
death becomes an error on every run that waited for it, within the agent's SIGCHLD latency.

What to do about runs that end irregularly (the step check) and ranks a death stranded (the
recovery ladder) is not decided here: :mod:`..recovery` subscribes to these events
(``on_irregular_end``, ``on_stranded``, ``tick_listeners``) when a mesh is started, so the
engine imports nothing above it. :class:`~meshbook.mesh.controller.api.mesh.Mesh` is the
user-facing view; this module is its engine.

Threads and locks (see DESIGN, "The notebook process"): ``_lock`` guards the book (taken by
callers and the receiver, held briefly: in ``submit`` while a request is booked, never while
waiting or sending); ``_send_turn`` makes requests leave in the order of their numbers (taken
under ``_lock`` in ``submit``, held over the send); the transport's ``send_lock``
guards the sockets callers send on; ``recovery_lock`` is held by whatever re-creates the process
groups, and is taken before ``_lock``, never after.
"""

from __future__ import annotations

import atexit
import os
import secrets
import signal
import threading
import time
import weakref
from _signal import getsignal as _getsignal
from collections import Counter
from functools import partial
from typing import Any, Callable, Iterable, Sequence

from ...protocol import bundle, wire
from ...protocol import messages as msg
from ...protocol.cell import native_abort
from ...protocol.errors import MeshError, MeshStoppedError, RankFailure, SendError, broke_its_group
from ...protocol.events import DebugEnd, Display, Error, Event, InputRequest, Output, Result, Results
from ...protocol.limits import DEFAULT_MAX_BYTES
from ...protocol.payload import Landing
from ...protocol.remote import encode_route
from ...protocol.text import agree, format_ranks, ranks_text, restart_hint, why_dead
from ...protocol.topology import Topology
from ...protocol.versions import mismatch, versions
from ...rank.ops import interrupt_request, ready_report, resume, supersede
from ..insight.clock import CollectiveTimes, Mismatched, Mispaired
from ..insight.metrics import MetricsHistory
from ..launch.base import Launcher
from ..launch.local import discard_standby
from ..launch.network import HostLink, Network
from .agents import Agents
from .book import Answer, RankBook, RankState
from .render import print_late
from .run import Run, StepReport, interrupt_error
from .transport import Sent, Transport, log

#: Why a mesh stopped when the user stopped it (any other reason: it ended on its own).
USER_STOP = "stopped by the user"
#: Why a mesh stopped when ``%mesh restart`` started a new one in its place: its handles say
#: where the new one is, not to start one.
REPLACED = "replaced by a new mesh (%mesh restart)"
#: How many rank lists' routes are kept (see ``Controller._routes``); more are grouped anew.
ROUTES_KEPT = 64
#: How long a run answered by every rank waits for the other members of the collectives it
#: completed to say in which request they issued them (they do within a heartbeat, 0.5 s).
SETTLE_S = 3.0

#: A user run that ended irregularly: its request, and its Run (None: one this controller did not
#: send, a kept mesh's from the kernel before).
RunHook = Callable[[int, "Run | None"], "StepReport | None"]
StrandedHook = Callable[[list[int], str, list[str]], None]


class Controller:
    def __init__(self, topology: Topology, launcher: Launcher, backend: str = "auto",
                 collective_timeout: float = 300.0, name: str = "mesh", key: bytes | None = None,
                 env: dict[str, str] | None = None) -> None:
        #: The mesh's name in this notebook (``start(name=...)``, ``%mesh use NAME``).
        self.name = name
        self.topology = topology
        self.launcher = launcher
        self.collective_timeout = collective_timeout
        #: The most a result may weigh before it stays on its rank (``start(max_result_bytes=)``).
        self.max_result_bytes = DEFAULT_MAX_BYTES
        # A launcher refuses a layout here (per_host=0, too few hosts), before anything is built.
        plans = launcher.plans_for(topology.world_size)
        self.book = RankBook({r: p.host for p in plans for r in p.ranks})
        self.wire = wire.Wire(key or secrets.token_bytes(32))  # a kept mesh's, to attach it
        self.transport = Transport()
        self.agents = Agents(launcher, plans, topology, self.wire, self.transport, backend, collective_timeout,
                             dict(env or {}))
        if not launcher.remote:
            for r in self.book.ranks:
                self.transport.connect_rank(r, 0)
        self.stopped = False
        self.stop_reason = ""
        #: Stopped by letting go of a kept mesh: its ranks (and actors) live on without us.
        self.detached = False
        self._stop_begun = False  # by whichever thread came first; the others wait for it
        self._stop_done = threading.Event()
        #: Why this controller may no longer drive the mesh: another kernel attached it.
        self.fenced = ""
        #: A kept mesh's lease (:mod:`..launch.kept`): outlives this controller, renewed by every ping.
        self.lease: Any = None
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        #: Held from a request's booking (taken under ``_lock``) to its send (see submit).
        self._send_turn = threading.Lock()
        #: Held by whatever re-creates the process groups (recovery, a step check's resync).
        self.recovery_lock = threading.Lock()
        #: The last minutes of each rank's memory (for sparklines), kept from the start.
        self.history = MetricsHistory()
        #: When every rank entered and left each collective: exact waiting, who arrives last.
        self.clock = CollectiveTimes()
        #: The files pulled values are mapped from, written over by later pulls once unmapped.
        self.landing = Landing()
        #: Messages of a kind no handler takes, by kind (each is logged too).
        self.unknown_kinds: Counter[str] = Counter()
        self._held: list[Any] | None = None  # a results entry of hosts' bundles not booked yet (see _hold)
        #: Runs answered by every rank whose end waits for the collective clock (see _finish),
        #: and until when: request -> (its last answer, what the book said of it, deadline).
        self._unsettled: dict[int, tuple[tuple[int, ...], Event, Answer, float]] = {}
        #: Agents that said they stopped on their own, not by our stop: when, and why.
        self._stopped_alone: dict[int, tuple[HostLink, float, str]] = {}
        #: Ranks killed to be re-forked (a recovery), and why: what their deaths then say.
        self._refork_why: dict[int, str] = {}
        #: Can the notebook answer a rank's debugger prompt right now? (the kernel layer
        #: replaces this with "does this cell allow stdin").
        self.stdin_probe: Callable[[], bool] = _terminal_stdin
        # -- what the layers above subscribe to --
        #: Called with (rank, metrics) for every heartbeat (receiver thread).
        self.heartbeat_listeners: list[Callable[[int, dict[str, Any]], None]] = [self.history.record]
        #: Called with every new Run (the notebook layer attributes its output to a cell).
        self.run_listeners: list[Callable[[Run], None]] = []
        self._routes_known: dict[tuple[str, tuple[int, ...]], dict[int, bytes]] = {}
        #: Called with (rank, cause) when a rank dies.
        self.death_listeners: list[Callable[[int, str], None]] = []
        #: Called once the mesh has stopped, on the thread that stopped it (a panel freezes in
        #: the cell that stops its mesh, not a refresh later, after a batch runner has gone).
        self.stop_listeners: list[Callable[[], None]] = []
        #: Called with the runs in flight at every receiver tick (the run watcher).
        self.tick_listeners: list[Callable[[list[Run]], None]] = [lambda runs: self.landing.expire()]
        #: A user run ended irregularly (a rank failed or was interrupted), or some of its ranks
        #: did while others still run it: what checks the ranks are still in step, before
        #: anyone sees the run done (the step check; asked again for the same run, the same).
        self.on_irregular_end: RunHook | None = None
        #: Live ranks that ran beside ranks that died: (ranks, reason, lost hosts' addresses).
        self.on_stranded: StrandedHook | None = None
        #: How ``Run.result()`` follows a run (the API's run watcher: hang hints, interrupts).
        self.follow: Callable[..., Any] | None = None
        self._handlers: dict[str, Callable[[wire.Message], None]] = {
            msg.HEARTBEAT: self._on_heartbeat, msg.OUTPUT: self._on_output, msg.DISPLAY: self._on_display,
            msg.INPUT: self._on_input, msg.DEBUG_END: self._on_debug_end, msg.RESULT: self._on_answer,
            msg.ERROR: self._on_answer, msg.EXIT: self._on_exit, msg.HELLO: self._on_hello,
            msg.READY: self._on_ready, msg.INIT_FAILED: self._on_init_failed, msg.AGENT: self._on_agent,
            msg.HOST_BEAT: self._on_host_beat, msg.FENCED: self._on_fenced,
            msg.COLLECTIVES: self._on_collectives, msg.RESEND: self._on_resend, msg.LOST: self._on_lost,
            msg.BUNDLE: self._on_bundle}
        self.transport.start(self._take, self._from_host, self._book_held, self._tick)
        _LIVE.add(self)

    # -- what the parts know, read through the facade ----------------------------------------------

    @property
    def ranks(self) -> dict[int, RankState]:
        return self.book.ranks

    @property
    def generation(self) -> int:
        return self.book.generation

    def live(self, ranks: Sequence[int] | None = None) -> list[int]:
        """``ranks`` (every rank: None) without the dead, in their order."""
        with self._lock:
            return self.book.live(list(self.book.ranks) if ranks is None else list(ranks))

    def dead(self, ranks: Sequence[int] | None = None) -> list[int]:
        """The dead among ``ranks`` (every rank: None), in rank order."""
        with self._lock:
            return [s.rank for s in self.book.dead(ranks)]

    def deaths(self) -> dict[int, str]:
        """Every dead rank, and why it died, as of now (one look: a restart may reset a cause)."""
        with self._lock:
            return {s.rank: s.cause for s in self.book.dead(None)}

    @property
    def host_of(self) -> dict[int, int]:
        return self.agents.host_of

    @property
    def remote(self) -> bool:
        """Ranks on other hosts (or a kept mesh's): requests go once per host, through its agent."""
        return self.agents.remote

    @property
    def network(self) -> Network | None:
        return self.transport.network

    @property
    def rundir(self) -> str:
        return self.transport.rundir

    @property
    def chosen(self) -> Any:
        return self.agents.chosen

    @property
    def notes(self) -> list[str]:
        return self.agents.notes

    @property
    def store_addr(self) -> tuple[str, int] | None:
        return self.agents.store_addr

    # -- listeners: the notebook layer's hooks -------------------------------------------------

    def add_run_listener(self, listener: Callable[[Run], None]) -> None:
        _add(self.run_listeners, listener)

    def remove_run_listener(self, listener: Callable[[Run], None]) -> None:
        _remove(self.run_listeners, listener)

    def add_heartbeat_listener(self, listener: Callable[[int, dict[str, Any]], None]) -> None:
        _add(self.heartbeat_listeners, listener)

    def remove_heartbeat_listener(self, listener: Callable[[int, dict[str, Any]], None]) -> None:
        _remove(self.heartbeat_listeners, listener)

    def add_death_listener(self, listener: Callable[[int, str], None]) -> None:
        _add(self.death_listeners, listener)

    def remove_death_listener(self, listener: Callable[[int, str], None]) -> None:
        _remove(self.death_listeners, listener)

    def add_stop_listener(self, listener: Callable[[], None]) -> None:
        _add(self.stop_listeners, listener)

    def remove_stop_listener(self, listener: Callable[[], None]) -> None:
        _remove(self.stop_listeners, listener)

    # -- start-up ----------------------------------------------------------------------------

    def launch(self, timeout: float) -> None:
        """Start the agents and wait until every rank has torch.distributed ready."""
        try:
            self.agents.launch(timeout)
            self.wait_generation(0, list(self.ranks), timeout, "start")
        except BaseException:
            self.stop()
            raise

    def attach(self, timeout: float) -> None:
        """Take over a kept mesh whose agents run on (its launcher, made from the mesh file,
        dials them with the file's keys and a new epoch): ask each agent for its ranks, and wait
        for the answers."""
        try:
            self.agents.attach(timeout)
            network = self.transport.network
            assert network is not None  # a kept mesh's agents are dialled, like remote ones
            self.book.number_from(network.epoch)
            self.agent_op(msg.AgentOp.ATTACH, list(self.ranks))
            deadline = time.monotonic() + timeout
            with self._changed:
                while any(s.state == "starting" for s in self.ranks.values()):
                    if self.stopped or self.fenced or time.monotonic() > deadline:
                        raise MeshError(self.fenced or f"attach: no answer from the mesh's agents within "
                                        f"{timeout:g} s; %mesh list shows the meshes that are still there")
                    self._changed.wait(0.25)
            self._describe_adopted(max(1.0, deadline - time.monotonic()))
            # A step check the kernel before left unfinished holds its ranks for a verdict only
            # that kernel could give: let them go (they hold back until a check of ours).
            self.call(supersede, self.book.first_request, ranks=self.live()).wait(max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.stop("could not attach", detach=True)  # the mesh is not ours to stop
            raise

    def _describe_adopted(self, timeout: float) -> None:
        """Ask the attached ranks what their READY said (their device, which ``%mesh status``
        and the start line show): answered by their control threads, busy or not. A rank that
        does not answer in time keeps it unsaid; the attach goes on."""
        live = self.book.live(list(self.ranks))
        if not live:
            return
        asked = self.call(ready_report, ranks=live, what="what the attached ranks run on")
        asked.wait(timeout)
        with self._lock:
            for rank, said in asked.values().items():
                self.book.described(rank, said["device"], said["pid"], said["threads"], said.get("running"))

    def wait_generation(self, generation: int, ranks: list[int], timeout: float, what: str) -> None:
        """Wait for ``ranks`` to report ready in ``generation``; a clear error otherwise."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                ready, failed = self.book.startup(ranks, generation)
                if failed or self.stopped:
                    raise MeshError("\n".join([f"{what} failed:", *(f"  rank {s.rank}: {s.cause}" for s in failed),
                                               *([f"  {self.stop_reason}"] if self.stopped else [])]))
                if ready:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MeshError(
                        f"{what} timed out after {timeout:g} s: rank(s) "
                        f"{format_ranks(self.book.not_ready(ranks, generation))} never became ready. "
                        f"{self.agents.report()}Pass a larger timeout= if the machine is slow.")
                self._changed.wait(min(left, 0.25))
                self._check_agents()

    # -- sending -----------------------------------------------------------------------------

    def submit(self, kind: str, body: Any, ranks: list[int], what: str, channel: str = msg.MAIN,
               noun: str | None = None) -> Run:
        """Send one request to ``ranks`` (one message per rank) and return its Run (``noun``:
        what messages call it, when not what its kind says)."""
        self.check_usable(ranks)
        try:
            raw, buffers = wire.dumps(body)
        except Exception as exc:
            raise SendError(f"{what}: {wire.describe_unpicklable(body, exc)}; nothing was sent") from None
        with _SigintHeld() as held:
            with self._lock:
                # Again, under the lock that deaths and stops take: pickling a big argument takes
                # a while, and a run opened after a rank's death or the stop was booked would never
                # be failed by either (nor answered by the dead rank).
                self.check_usable(ranks)
                run = self._new_run(ranks, what, kind, msg.pairs_collectives(kind, body), noun)
                self.book.open(run, queued=channel == msg.MAIN)
                for listener in self.run_listeners:
                    listener(run)
                frames = self.wire.pack({msg.KIND: kind, msg.ID: run.id}, raw_body=raw, buffers=buffers)
                send = self._addressed(frames, ranks, channel, run.id)
                # Requests leave in the order of their numbers, whichever threads submit them (a
                # rank runs them in the order they come, and decides by their numbers whether an
                # interrupt found one not started yet): the next one is booked only once this
                # one holds the turn to send. The book's lock is let go before the send, which
                # wakes the ranks: they take the sender's core, and their answers must not
                # wait for it to come back to be booked.
                self._send_turn.acquire()
            try:
                sent = send()
            finally:
                self._send_turn.release()
        if held.came:  # a Ctrl-C while it was booked and sent: it stops the run, everywhere
            self.interrupt_run(run)
        self.transport.wait_sent(sent, self._alive)  # the caller may change what it sent once we return
        if held.came:
            raise interrupt_error(run)
        return run

    def _new_run(self, ranks: list[int], what: str, kind: str, in_step: bool = False,
                 noun: str | None = None) -> Run:
        return Run(next(self.book.request_ids), ranks, self.topology, what, self.interrupt_run, self.send_input,
                   kind, follow=self.follow, in_step=in_step, noun=noun)

    def call(self, fn: Callable[..., Any], *args: Any, ranks: list[int], what: str = "",
             channel: str | None = None, stdin: bool = False, **kwargs: Any) -> Run:
        """Run a rank operation, ``fn(worker, *args, **kwargs)``, on ``ranks`` (one of
        :mod:`meshbook.mesh.rank.ops`, or an extension's), on the channel the operation
        declares (``@rank_op(channel=CONTROL)``: the ranks' control threads, answered while
        they are busy) unless ``channel`` says otherwise; ``stdin`` says the notebook can answer
        a debugger prompt it opens."""
        body = {"fn": fn, "args": args, "kwargs": kwargs, "stdin": stdin}
        chosen: str = channel if channel else getattr(fn, "channel", msg.MAIN)
        return self.submit(msg.CALL, body, ranks, what or getattr(fn, "__name__", "call"), chosen)

    def agent_op(self, op: str, ranks: list[int], **body: Any) -> Run | None:
        """Ask the agents owning ``ranks`` to do ``op`` (signal, spawn, pyspy, stop)."""
        run = None
        if op == msg.AgentOp.PYSPY:
            with self._lock:
                if self.stopped:  # as in submit: a stop booked before the run would never fail it
                    raise MeshStoppedError(f"the mesh is stopped ({self.stop_reason})")
                run = self._new_run(ranks, f"native stacks of rank(s) {ranks}", msg.OP)
                self.book.open(run, queued=False)
            request = run.id
        else:
            request = next(self.book.request_ids)
        frames = self.wire.pack({msg.KIND: msg.OP, msg.ID: request, msg.RANKS: ranks}, dict(body, op=op))
        self.transport.send_to_agents(frames, sorted({self.host_of[r] for r in ranks}))
        return run

    def _addressed(self, frames: list[Any], ranks: list[int], channel: str,
                   request: int | None = None) -> Callable[[], Sent]:
        """The send of ``frames`` to ``ranks``, addressed by the book as it is now (under its
        lock, for a request just booked). On this host, one message per rank: by the lane to
        those with nothing queued before ``request`` (nothing sent to them earlier can still be
        on its way); to other hosts, one per host (its agent fans it out). Queued once it ran;
        the big buffers of what it returns may still be on their way."""
        transport = self.transport
        if transport.network is None:
            first = {r for r in ranks if self.book.current_request(r) == request} if request is not None else set()
            return partial(transport.send_to_ranks, frames, ranks, channel, first)
        live = self.book.live(ranks)
        return partial(transport.send_to_hosts, frames, self._routes(channel, live), live)

    def _routes(self, channel: str, ranks: list[int]) -> dict[int, bytes]:
        """Each host's route for ``ranks`` on ``channel``. Kept for the rank lists requests
        go to again and again (the whole mesh, a slice): grouping a thousand ranks by host at
        every request would cost more than the rest of sending it."""
        key = (channel, tuple(ranks))
        routes = self._routes_known.get(key)
        if routes is None:
            host_of = self.agents.host_of
            by_host: dict[int, list[int]] = {}
            for r in ranks:
                by_host.setdefault(host_of[r], []).append(r)
            routes = {host: encode_route(channel, chosen) for host, chosen in by_host.items()}
            if len(self._routes_known) >= ROUTES_KEPT:
                self._routes_known.clear()
            self._routes_known[key] = routes
        return routes

    def _alive(self, ranks: list[int]) -> bool:
        """Does any of ``ranks`` live on (to take the big buffers sent to them)?"""
        return not self.stopped and bool(self.book.live(ranks))

    def send_input(self, rank: int, text: str | None, question: int) -> None:
        """A line typed in the notebook, for ``rank``'s ``input()`` or debugger (its control
        thread), answering its ``question``; None: the end of input (nobody will answer)."""
        frames = self.wire.pack({msg.KIND: msg.INPUT, msg.ID: None}, {"question": question, "text": text})
        send = self._addressed(frames, [rank], msg.CONTROL)
        send()

    def kill(self, ranks: list[int], timeout: float = 10.0, why: str = "") -> None:
        """SIGKILL ``ranks`` and wait until their agent reported them dead. ``why``: meshbook
        kills them to re-fork them (a recovery), which is what their runs' errors then say
        (``rank 3 was re-forked ...``), not that they died and want a restart."""
        live = self.book.live(ranks)
        if not live:
            return
        if why:
            with self._lock:
                self._refork_why.update(dict.fromkeys(live, why))
        self.signal(live, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        with self._changed:
            while self.book.live(live):
                if time.monotonic() > deadline or self.stopped:
                    for r in live:  # a death that comes later is not this kill's: it says how it died
                        self._refork_why.pop(r, None)
                    raise MeshError(f"rank(s) {live} did not die within {timeout:g} s of SIGKILL")
                self._changed.wait(0.05)

    def new_generation(self) -> int:
        """A new process-group generation (its ranks meet in a new store)."""
        with self._lock:
            return self.book.new_generation()

    def respawn(self, ranks: list[int], generation: int) -> None:
        """Re-fork dead ``ranks`` under their rank ids; they join ``generation``. The ranks of
        a host whose agent is gone get a new agent, where its launcher can start one."""
        if not ranks:
            return
        # Sockets first: a request sent once the rank is no longer "dead" goes to the new process.
        if not self.remote:  # a remote host's agent points its own sockets at the new ranks
            for r in ranks:
                self.transport.connect_rank(r, generation)
        with self._lock:
            self.book.respawning(ranks)
        gone = self.agents.hosts_gone(ranks)
        for i, host in enumerate(gone):
            try:
                self.agents.relaunch(host, generation)
            except BaseException as exc:  # nothing will start them: say so, never leave "starting"
                self._ranks_died([r for r in self.agents.plans[host].ranks if r in ranks],
                                 {"cause": f"could not start a new agent for them: {exc}"})
                # Nor the ones to be forked after every new agent (one may bring the store).
                later = [r for r in ranks if self.host_of[r] not in gone[:i + 1]]
                if later:
                    self._ranks_died(later, {"cause": f"not started again: the agent of host {host} "
                                                      f"could not start ({exc})"})
                raise
        # With where the ranks meet: host 0 re-formed elsewhere moved the store, which the other
        # hosts' agents learnt only at their start.
        self.agent_op(msg.AgentOp.SPAWN, [r for r in ranks if self.host_of[r] not in gone], generation=generation,
                      store=self.agents.store_addr)

    # -- what runs where (for recovery, stacks and the step check) ---------------------------------

    def current_request(self, rank: int) -> int | None:
        with self._lock:
            return self.book.current_request(rank)

    def own_work(self, request: int | None) -> str:
        with self._lock:
            return self.book.own_work(request)

    def runs_of(self, requests: Iterable[int | None]) -> dict[int, Run]:
        """The runs of ``requests`` still in flight, by request (a recovery reads how each of
        its ranks ended once it is over, when the book has let the run go)."""
        with self._lock:
            return {q: self.book.runs[q] for q in requests if q is not None and q in self.book.runs}

    def nouns(self) -> dict[int, str]:
        """What a user calls each run still booked, by request ("cell", "call"...)."""
        with self._lock:
            return {request: run.noun for request, run in self.book.runs.items()}

    def queued(self, rank: int) -> int:
        with self._lock:
            return self.book.queued(rank)

    def busy_with_other(self, rank: int, request: int) -> bool:
        with self._lock:
            return self.book.busy_with_other(rank, request)

    # -- interrupts ----------------------------------------------------------------------------

    def interrupt(self, ranks: list[int]) -> None:
        """SIGINT to ``ranks``, whatever they run (``%mesh interrupt``)."""
        with self._lock:
            hit = self.book.pending_on(ranks)
        for run in hit:
            run.interrupted, run.interrupted_at = True, time.monotonic()
        self.signal(ranks, signal.SIGINT)

    def interrupt_run(self, run: Run) -> None:
        """Interrupt ``run`` and nothing else: ranks running it get ``KeyboardInterrupt``,
        ranks where it still waits in the queue drop it before it starts. Other runs (a
        background ``mesh.run``) are not touched."""
        run.interrupted, run.interrupted_at = True, time.monotonic()
        ranks = self.book.live(run.pending)
        if ranks and not self.stopped:
            self.call(interrupt_request, run.id, ranks=ranks, what="interrupt")

    def user_runs(self) -> list[Run]:
        """The runs whose collectives pair across ranks (cells, applied functions, parallelize)
        not done yet, in the order they were sent."""
        with self._lock:
            return [run for run in self.book.runs.values() if run.in_step and not run.done()]

    def queued_behind(self, run: Run) -> dict[int, str]:
        """The ranks of ``run`` where it still waits behind other work, and what that is."""
        with self._lock:
            ahead = self.book.ahead(run.id, run.pending)
            return {rank: self.book.what(request) or f"request {request}" for rank, request in ahead.items()}

    def interrupt_where(self, running: dict[int, int]) -> None:
        """Interrupt what each rank runs (``running``: rank -> request), as a second Ctrl-C
        would: a run of the book as a whole, interrupted already or not (a rank still in the
        cleanup of the first interrupt is stopped there, where the recovery's last step would
        re-fork it); a request the book does not have (an endpoint another rank's actor
        called) on its ranks."""
        by_request: dict[int, list[int]] = {}
        for rank, request in running.items():
            by_request.setdefault(request, []).append(rank)
        for request, ranks in by_request.items():
            with self._lock:
                run = self.book.runs.get(request)
            if run is None:
                self.call(interrupt_request, request, ranks=ranks, what="interrupt")
            else:
                self.interrupt_run(run)

    def signal(self, ranks: list[int], sig: int) -> None:
        live = self.book.live(ranks)
        if live and not self.stopped:
            self.agent_op(msg.AgentOp.SIGNAL, live, sig=int(sig))

    def fence_said(self) -> str:
        """Why another kernel fenced this one off, as of now ("": it did not): the mesh may
        have ended since (its agent removes the mesh file), and is not to be attached again."""
        if self.fenced and self.lease is not None and not os.path.exists(self.lease.record.path):
            return "this mesh was attached by another kernel, and has ended since (stopped there, or its lease " \
                   "ran out): start a new one"
        return self.fenced

    def check_usable(self, ranks: list[int]) -> None:
        if self.fenced:
            raise MeshStoppedError(self.fence_said())
        if self.stopped and self.detached:
            raise MeshStoppedError(f"this kernel let go of the mesh, which runs on: {self.stop_reason}")
        if self.stopped:
            advice = ("take the new one: mesh = meshbook.current()" if self.stop_reason == REPLACED
                      else "start a new one with meshbook.start(...)")
            raise MeshStoppedError(f"the mesh is stopped ({self.stop_reason}); {advice}")
        dead = self.book.dead(ranks)
        if dead:
            causes = "; ".join(f"rank {s.rank}: {s.cause}" for s in dead)
            raise MeshError(f"the mesh is degraded ({causes}). Restart the dead rank(s) with "
                            f"{restart_hint(s.rank for s in dead)}, or select live ranks only (a collective over a "
                            f"group that holds a dead rank, the default group included, cannot complete)")

    # -- receiving (the receiver thread) -------------------------------------------------------------

    def _tick(self) -> None:
        self._check_agents()
        self._settle()
        with self._lock:
            runs = list(self.book.runs.values())
        for listener in self.tick_listeners:
            try:  # one failing must not starve the others, nor the links' pings below
                listener(runs)
            except Exception as exc:
                log(f"a tick listener failed: {type(exc).__name__}: {exc}")
        if self.transport.network is not None:
            self.transport.network.tick(self._op, self._host_lost)

    def _take(self, frames: list[Any]) -> None:
        try:
            message = self.wire.unpack(frames)
        except wire.BadMessage:
            return
        if message.kind == msg.RESULT and len(frames) == 1 and len(frames[0]) < wire.ZERO_COPY_MIN:
            self._hold(bundle.results_entry(message))  # a small result (a no-op's): joined, not copied much
            return
        self._dispatch(message)

    def _dispatch(self, message: wire.Message) -> None:
        """A checked message, to the handler of its kind."""
        if self._held is not None and message.kind != msg.BUNDLE:
            self._book_held()  # results before it are booked before it (a bundle's entries see to it)
        try:
            handler = self._handlers.get(message.kind)
            if handler is None:
                self.unknown_kinds[message.kind] += 1
                log(f"no handler for {message.kind!r} messages (from rank {message.header.get(msg.RANK)}, "
                    f"host {message.header.get(msg.HOST)}; {self.unknown_kinds[message.kind]} so far)")
                return
            handler(message)
        except Exception as exc:  # never let one bad message end the receiver
            log(f"receiver: {type(exc).__name__}: {exc}")

    def _from_host(self, link: HostLink | None, identity: bytes, frames: list[Any]) -> None:
        """A message up a remote host's connection (``link`` None: an agent not placed yet,
        which can only be joining)."""
        if link is not None:
            self._take(frames)
            return
        try:
            message = self.wire.unpack(frames)
        except wire.BadMessage:
            return
        network = self.transport.network
        if message.kind == msg.JOIN and network is not None:
            network.on_join(identity, message.body(), self._op({"op": msg.AgentOp.WELCOME}))
        else:
            self.unknown_kinds[f"{message.kind} (before joining)"] += 1

    def _op(self, body: dict[str, Any]) -> list[Any]:
        """An operation for a remote agent, signed (pings, asking for messages again)."""
        return self.wire.pack({msg.KIND: msg.OP, msg.ID: None, msg.RANKS: []}, body)

    def _on_heartbeat(self, message: wire.Message) -> None:
        self.record_metrics(message.header[msg.RANK], message.body())

    def record_metrics(self, rank: int, metrics: dict[str, Any]) -> None:
        """``rank``'s latest metrics (a heartbeat, or the answer when asked for one)."""
        state = self.ranks[rank]
        state.metrics, state.last_seen = metrics, time.monotonic()
        for listener in self.heartbeat_listeners:
            listener(rank, metrics)

    def _on_collectives(self, message: wire.Message) -> None:
        """When a rank entered and left its latest collectives, in its host's clock."""
        rank = message.header[msg.RANK]
        network = self.transport.network
        link = network.links.get(self.host_of[rank]) if network is not None else None
        self.clock.add(rank, message.body(), link.clock_offset_ns if link is not None else 0)
        self._settle()

    def _on_output(self, message: wire.Message) -> None:
        body = message.body()
        self._deliver(message.header[msg.ID], Output(message.header[msg.RANK], body["stream"], body["text"]))

    def _on_display(self, message: wire.Message) -> None:
        self._deliver(message.header[msg.ID], Display(message.header[msg.RANK], message.body()))

    def _on_input(self, message: wire.Message) -> None:
        body = message.body()
        self._deliver(message.header[msg.ID], InputRequest(message.header[msg.RANK], body["prompt"], body["question"],
                                                                 body.get("before", "")))

    def _on_debug_end(self, message: wire.Message) -> None:
        self._deliver(message.header[msg.ID], DebugEnd(message.header[msg.RANK]))

    def _deliver(self, request: int | None, event: Event) -> None:
        with self._lock:
            route = self.book.route(request)
        if isinstance(route, Run):
            route.add_event(event)
        else:
            (route or print_late)(event)

    def _on_answer(self, message: wire.Message) -> None:
        """A rank's (or an agent's) result or error for a request. A result this process cannot
        unpickle (a CUDA storage in a CPU-only kernel, a class of a module only the rank has)
        is that rank's error: the run ends, naming what failed and how to fetch it."""
        header, rank = message.header, message.header[msg.RANK]
        duration = header.get(msg.DURATION, 0.0)
        succeeded = message.kind == msg.RESULT
        try:
            body = message.body()
        except Exception as exc:  # noqa: BLE001 - whatever the payload's unpickling raises
            succeeded, body = False, _unreadable(rank, header.get(msg.TYPE), exc)
        event = Result(rank, body, duration) if succeeded else Error(rank, body, duration)
        self._finish(header[msg.ID], (rank,), event, lost_group=header.get(msg.HAS_GROUP) is False)

    def _on_bundle(self, message: wire.Message) -> None:
        """What an agent on another host gathered from its ranks, checked there and signed once
        (:mod:`~meshbook.mesh.protocol.bundle`): each entry as if its rank had sent it here."""
        for entry in message.body():
            if entry[0] != bundle.RESULTS:
                self._dispatch(wire.Message.gathered(entry[1], entry[2]))
                continue
            self._hold(entry)

    def _hold(self, entry: list[Any]) -> None:
        """Ranks' identical results (a local rank's result, or a host's bundle of them): held,
        and joined by the same results that come next, until anything else comes or the
        receiver has drained what was ready. A no-op to 8 ranks, or to 128 hosts, then books a
        group or two, not one per rank or host (each costs two locks, the run's condition, an
        event, and the renderers' turn). Only consecutive results join, so every rank's
        messages keep their order."""
        if self._held is not None and bundle.join(self._held, entry):
            return
        self._book_held()
        self._held = entry

    def _book_held(self) -> None:
        """Book the results held (the receiver thread, before any other message and once it
        drained what was ready)."""
        held, self._held = self._held, None
        if held is None:
            return
        try:  # as _dispatch guards each message: one failing group loses no other rank's answer
            self._on_results(*held[1:])
        except Exception as exc:
            log(f"receiver: {type(exc).__name__}: {exc}")

    def _on_results(self, request: int, ranks: list[int], durations: list[float], has_group: bool | None,
                    type_name: str | None, body: bytes) -> None:
        """Ranks' identical results, booked as one group. Each rank gets a value of its own
        (unpickled once per rank), except ``None``, which there is only one of."""
        try:
            values = (None,) * len(ranks) if not body else tuple(wire.loads(body) for _ in ranks)
        except Exception as exc:  # noqa: BLE001 - as in _on_answer: each rank's error
            for rank, duration in zip(ranks, durations):
                failure = _unreadable(rank, type_name, exc)
                self._finish(request, (rank,), Error(rank, failure, duration), lost_group=has_group is False)
            return
        group = Results(tuple(ranks), values, tuple(durations))
        self._finish(request, group.ranks, group, lost_group=has_group is False)

    def _finish(self, request: int, ranks: tuple[int, ...], event: Event, lost_group: bool = False) -> None:
        with self._lock:
            answer = self.book.answered(request, ranks, isinstance(event, Error), lost_group)
        run, failed = answer.run, isinstance(event, Error)
        if run is None:
            check = None if self.stopped else self.on_irregular_end
            if failed and check is not None:  # a kept mesh's run, the kernel before's: its ranks hold back too
                check(request, None)
            return
        if answer.done and run.in_step and self.clock.incomplete \
                and self.clock.unsettled(request, _succeeded(run, ranks, event)):
            # A collective it completed on a rank that succeeded has a member outside it that
            # has not said yet in which request it issued it (it does with its next answer or
            # heartbeat): whether that rank's numbers paired with another run's is unknown until
            # then. Told before, a wrong number went out as a success (1 in 6 such pairings, tried).
            self._unsettled[request] = (ranks, event, answer, time.monotonic() + SETTLE_S)
            return
        self._conclude(run, ranks, event, answer)

    def _settle(self, everything: bool = False) -> None:
        """End the runs that waited for the collective clock and no longer need to (the
        receiver thread, after a ``COLLECTIVES`` batch and at each tick; ``everything``: at stop)."""
        if not self._unsettled:
            return
        now = time.monotonic()
        for request, (ranks, event, answer, due) in list(self._unsettled.items()):
            assert answer.run is not None
            if everything or now >= due or not self.clock.unsettled(request, _succeeded(answer.run, ranks, event)):
                del self._unsettled[request]
                self._conclude(answer.run, ranks, event, answer)

    def _conclude(self, run: Run, ranks: tuple[int, ...], event: Event, answer: Answer) -> None:
        """Give ``run`` the answer of ``ranks`` (``event``): a collective that paired across
        runs fails it, an irregular end starts the step check first."""
        request, failed = run.id, isinstance(event, Error)
        check = None if self.stopped else self.on_irregular_end
        events = [event]
        wrong, ours = self._wrong_collectives(run) if answer.done and run.in_step else ({}, False)
        if wrong:  # answers that said success, and are not: told as failures
            run.revoke(wrong)
            events = _without(event, wrong)
        # A run sent to every member of such a group is checked like any that ended irregularly:
        # its members may have issued different numbers of collectives (an async one, unwaited).
        # Not a run on some of them: the run on all that it paired with may still run, and a
        # check would hold the members it waits for.
        run.irregular = run.irregular or ours
        if (answer.check_step or ours) and check is not None:
            # Before the run is seen done: whoever renders it waits for this check too.
            run.step_check = check(request, run)
            if failed and run.step_check is None:
                self._resume(ranks, request)  # they hold back what comes next for a check that will not come
        if isinstance(event, Error) and broke_its_group(event.failure):
            self._blame_the_dead(run)
        for each in events:
            run.add_event(each)
        with self._lock:
            self.book.settle(request)

    def _blame_the_dead(self, run: Run) -> None:
        """A rank of ``run`` whose process group broke, on a degraded mesh: gloo says only
        "Connection closed by peer", and the cause is a rank that died before the run (one that
        died in it has its own note). Said once per run."""
        deaths = {r: cause for r, cause in self.deaths().items() if r not in run.deaths}
        if not deaths:
            return
        dead = sorted(deaths)
        note = (f"{ranks_text(dead)} {agree('is', dead)} dead ({why_dead(deaths)}): a collective over a "
                f"group that holds {'it' if len(dead) == 1 else 'them'} cannot complete. {restart_hint(dead)} "
                f"brings {'it' if len(dead) == 1 else 'them'} back and re-creates the process groups")
        if note not in run.notes:
            run.notes.append(note)

    def _wrong_collectives(self, run: Run) -> tuple[dict[int, RankFailure], bool]:
        """The ranks of ``run`` whose collectives paired with another request's on some member
        (the collective clock lines them up), where that is wrong: one of the requests went to
        every member of the group, so its calls were meant to pair with each other. A run on
        rank 0 only that waits in an all_reduce over ranks 0,1, then a cell on both:
        rank 1's all_reduce pairs with rank 0's old one, and both compute from the wrong data.
        (A send in one cell and its recv in the next, each on its own rank, pair on purpose.)
        Also says whether ``run`` is itself such a request. And the ranks whose collectives
        completed with members that called them with other tensors (``clock.mismatched``)."""
        wrong: dict[int, RankFailure] = {}
        ours = False
        for found in self.clock.mispaired(run.id):
            members = set(found.members)
            with self._lock:
                others = set(found.requests.values()) - {run.id}
                mine = members <= set(run.ranks)
                meant = mine or any(
                    members <= set(other.ranks) for q in others if (other := self.book.runs.get(q)) is not None)
                said = {q: self.book.what(q) or "an earlier request" for q in others}
            ours = ours or mine
            for rank, request in found.requests.items() if meant else ():
                if request == run.id and rank not in wrong:
                    wrong[rank] = RankFailure(rank, "CollectiveMispaired", _mispaired_text(found, said))
        for mismatched in self.clock.mismatched(run.id):
            for rank in mismatched.calls:
                if rank in run.ranks and rank not in wrong:
                    wrong[rank] = RankFailure(rank, "CollectiveMismatched", _mismatched_text(mismatched))
        return wrong, ours

    def _resume(self, ranks: Sequence[int], request: int) -> None:
        """Tell ``ranks``, which failed ``request``, that no step check follows (a rank died, a
        recovery runs: each re-creates the groups), so they run what comes next."""
        live = self.live(list(ranks))
        if live and not self.stopped:
            try:
                self.call(resume, request, ranks=live, what="no step check follows")
            except MeshError:
                pass  # stopped meanwhile: nothing comes next

    def _on_exit(self, message: wire.Message) -> None:
        body = message.body()
        if body.get("last"):  # a local rank's last words (a remote agent sent them on, in order)
            # What it sent that is queued here goes first, in order: its last words would make
            # the replay check refuse what is older than them. Then the ones that never left it.
            self.transport.take_waiting(self._take)
            for kept in body["last"]:
                if not self.wire.taken([kept]):
                    self._take([kept])
            self._book_held()  # the results among them are answers: booked before the death
        self._ranks_died([message.header[msg.RANK]], body)

    def _on_hello(self, message: wire.Message) -> None:
        body, rank = message.body(), message.header[msg.RANK]
        with self._lock:
            self.book.hello(rank, body["pid"], body["host"])
        problem = mismatch(versions(), body.get("versions"), "this kernel", f"rank {rank} (on {body['host']})")
        if problem:  # its agent checked already: a rank forked from another install is a broken host
            self.signal([rank], signal.SIGKILL)
            self._ranks_died([rank], {"cause": problem})

    def _on_ready(self, message: wire.Message) -> None:
        body = message.body()
        with self._changed:
            self.book.ready(message.header[msg.RANK], message.header[msg.GENERATION], body["device"], body["pid"],
                            body.get("threads", ""))
            self._changed.notify_all()

    def _on_init_failed(self, message: wire.Message) -> None:
        with self._changed:
            self.book.init_failed(message.header[msg.RANK], message.header[msg.GENERATION], message.body().headline)
            self._changed.notify_all()

    def _on_agent(self, message: wire.Message) -> None:
        body = message.body()
        with self._changed:
            problem = mismatch(versions(), body.get("versions"), "this kernel",
                               f"the host agent on {body.get('hostname', '?')}")
            if problem:  # an agent of a kept mesh, attached after this kernel's install changed
                self.fenced = problem
                self._changed.notify_all()
                return
            for r, pid in body["pids"].items():
                self.ranks[int(r)].pid = pid
            if body.get("attached"):
                self.book.adopt(body["generations"], body["dead"], body["hostname"])
            self._changed.notify_all()

    def _ranks_died(self, ranks: list[int], body: dict[str, Any]) -> None:
        """``ranks`` died together (a rank's exit, or a lost host): fail what waited on them,
        free the ranks that ran beside them, and say how to bring them back. A death told
        twice (a lost host found by the receiver and by a thread waiting for a start) is
        booked once: ranks already dead are left out, under the lock."""
        cause = body["cause"]
        detail = body.get("crash", "")  # the agent told it as a traceback is told
        with self._changed:
            told = ranks
            ranks = self.book.live(ranks)
            whys = {self._refork_why.pop(r, "") for r in ranks}
            refork = whys.pop() if len(whys) == 1 else ""  # each killed to be re-forked, for one reason
            death = self.book.died(ranks, cause)
            self._changed.notify_all()
        for rank in ranks:
            self.transport.disconnect_rank(rank)
        for stream, text in body.get("output", {}).items():
            if text and told:
                self._deliver(death.running.get(told[0]), Output(told[0], stream, text))
        if not ranks:
            return
        who = ranks_text(ranks)
        freeing = bool(death.stranded) and not refork and not self.stopped and self.on_stranded is not None
        if freeing:
            reason = f"meshbook aborted what this rank ran: {who} died ({cause})"
            threading.Thread(target=self.on_stranded, args=(death.stranded, reason, body.get("lost_hosts", [])),
                             daemon=True).start()
        for run in death.waiting:
            if refork:
                run.notes.append(f"{who} {'was' if len(ranks) == 1 else 'were'} re-forked {refork}: "
                                 f"{'its' if len(ranks) == 1 else 'their'} variables are lost.")
            else:
                self._note_deaths(run, ranks, cause, death.stranded if freeing else [], bool(body.get("ends")))
            for rank in ranks:
                if rank in run.pending:
                    failure = (RankFailure(rank, "RankRestarted", f"rank {rank} was re-forked {refork}", died=cause)
                               if refork else self._died(run, rank, cause, detail))
                    self._finish(run.id, (rank,), Error(rank, failure, time.monotonic() - run.submitted_at))
        for listener in self.death_listeners:
            for rank in ranks:
                listener(rank, cause)

    @staticmethod
    def _died(run: Run, rank: int, cause: str, detail: str) -> RankFailure:
        """``rank``'s part of ``run`` as its death ended it, with the C++ exception it aborted on
        where its last stderr in the run tells one (gloo's "size doesn't match")."""
        native = native_abort(run.recent_output(rank, "stderr"))
        because = f", of an uncaught C++ exception: {native}" if native else ""
        return RankFailure(rank, "RankDied", f"rank {rank} died: {cause}{because}", died=cause, detail=detail)

    def _note_deaths(self, run: Run, ranks: list[int], cause: str, stranded: list[int], ends: bool) -> None:
        """``run``'s note of its ranks that died, ``ranks`` among them: one note for all, however
        their deaths were told (one by one, as each process exited)."""
        run.deaths.update(dict.fromkeys(ranks, cause))
        if run.death_note in run.notes:
            run.notes.remove(run.death_note)
        run.death_note = _death_note(run.deaths, ends, [r for r in stranded if r not in run.deaths],
                                     bool(self.live()))
        run.notes.append(run.death_note)

    def _check_agents(self) -> None:
        """Agents gone: their ranks die (a death found twice, here and on another thread, is
        booked once: see _ranks_died)."""
        if self.stopped or not self.agents.handles:
            return
        for host, agent in self.agents.gone():
            ranks = self.agents.plans[host].ranks
            if self.remote:  # the other hosts' ranks live on: the mesh is degraded, not stopped
                # Its host may have gone silent (an ssh keepalive ended the agent's session
                # first): the connections to it are freed as a lost host's.
                self._ranks_died(ranks, {"cause": agent.exit_reason(), "lost_hosts": self.agents.addresses([host])})
                continue
            reason = f"host agent {host} died ({agent.exit_reason()})"
            self._ranks_died(ranks, {"cause": reason, "ends": True})
            self._end(reason)  # nothing on this host can fork them again
        self._report_stopped_alone()
        if self.remote and not self.stopped:
            self._end_if_beyond_restart()

    def _end_if_beyond_restart(self) -> None:
        """Every rank is dead, no agent lives on to restart one, and no host can be started
        again (a Slurm job that ended, hosts that joined from elsewhere): the mesh has ended.
        It stops, its cells say how it ended, and a new start needs no --force. (Ranks that
        all died of their code, under live agents, are a restart away: the mesh stays.)"""
        if self.launcher.relaunchable or self.live():
            return
        if len(self.agents.hosts_gone(list(self.ranks))) < len(self.agents.plans):
            return
        causes = sorted({s.cause for s in self.ranks.values()})
        self._end(causes[0] if len(causes) == 1 else "every rank died: " + "; ".join(causes))

    def _end(self, reason: str) -> None:
        """The mesh ended on its own: stopped at once (cells say how), and stopped for good
        on a thread of its own (this may be the receiver, which a stop ends): its sockets and
        runtime directory go, and stop listeners (supervisors, views) hear it."""
        self._mark_stopped(reason)
        threading.Thread(target=self.stop, args=(reason,), daemon=True).start()

    # -- the links of a mesh across hosts ------------------------------------------------------------

    def _on_resend(self, message: wire.Message) -> None:
        """An agent missed messages we sent on its link (the connection reset): send them again;
        what is no longer kept (a big push) is lost, and the work it was for fails now (once:
        the agent asks again while its gap waits)."""
        link, network, body = self._link_of(message), self.transport.network, message.body()
        if link is not None and network is not None and network.resend(link, body["from"], body["to"], self._op):
            self._link_lost(link, f"requests to host {link.name}")

    def _on_lost(self, message: wire.Message) -> None:
        """An agent no longer keeps messages we missed from it: go on without those that never
        came, and fail the work they answered (once: it tells again each time we ask)."""
        link = self._link_of(message)
        if link is None:
            return
        newest = link.incoming.newest_lost
        for frames in link.wholes(link.incoming.give_up(message.body()["lost"])):
            self._take(frames)
        if link.incoming.newest_lost > newest:
            self._link_lost(link, f"messages from host {link.name}")

    def _link_of(self, message: wire.Message) -> HostLink | None:
        network = self.transport.network
        host = message.header.get(msg.HOST)
        return network.links.get(host) if network is not None and host is not None else None

    def _link_lost(self, link: HostLink, what: str) -> None:
        """Fail what runs on ``link``'s ranks: part of it was lost when the connection reset.
        Results held (what came before the loss, and was delivered with it) are booked first:
        those ranks did answer."""
        self._book_held()
        with self._lock:
            runs = self.book.pending_on(link.ranks)
        for run in runs:
            for rank in sorted(set(run.pending) & set(link.ranks)):
                failure = RankFailure(rank, "LinkReset", (
                    f"{what} were lost when its connection reset, and were no longer kept to be sent "
                    f"again (a push too big to keep, or too much since): rank {rank}'s part of this run "
                    f"is unknown. Run it again (its ranks keep their variables)"))
                self._finish(run.id, (rank,), Error(rank, failure, time.monotonic() - run.submitted_at))

    def _on_host_beat(self, message: wire.Message) -> None:
        link = self._link_of(message)
        if link is None:
            return
        body = message.body()
        if body.get("stopped"):
            link.end("stopped")
            if not self.stopped:  # not by our stop (that one reads its own answers): on its own
                with self._lock:
                    self._stopped_alone[link.host] = (link, time.monotonic(), body.get("why") or "no reason given")
        elif "sent" in body:
            link.rtt = time.monotonic() - body["sent"]
            link.outgoing.acknowledged(body.get("ack", 0))
            if "wall" in body and "agent_wall" in body:
                link.clocked(body["wall"], body["agent_wall"], time.time_ns())
            if self.lease is not None:
                self.lease.renewed()

    def _on_fenced(self, message: wire.Message) -> None:
        """An agent refused what we sent: another kernel attached this (kept) mesh. Fail what
        runs, and let go of the mesh without stopping it (it is the other kernel's now)."""
        if self.fenced:
            return
        newer = message.body()["epoch"]
        mesh_id = getattr(self.lease, "id", "ID")
        network = self.transport.network
        self.fenced = (f"this mesh was attached by another kernel (epoch {newer}; this kernel had "
                       f"epoch {network.epoch if network else 0}), which drives it now. Use "
                       f"it there, or take it back here with %mesh attach {mesh_id} "
                       f"(meshbook.attach({mesh_id!r}))")
        self._mark_stopped(self.fenced)
        threading.Thread(target=self.stop, args=(self.fenced,), kwargs={"detach": True}, daemon=True).start()

    def _report_stopped_alone(self) -> None:
        """Agents that stopped on their own (terminated, or failed) killed their ranks on their way
        out: their ranks are dead, though their links were never silent long enough to be lost.
        Said with the launcher's reason where it comes in time (``told_since``: "job 12 ended:
        CANCELLED"), else with the agent's own. A handle that died meanwhile, after ``gone()``
        looked, is left to it: its next look says the launcher's reason."""
        due = []
        with self._lock:
            for host, (link, since, why) in list(self._stopped_alone.items()):
                handle = self.agents.handles[host]
                alive = handle.alive()
                if alive and not handle.told_since(since):
                    continue
                del self._stopped_alone[host]
                if alive:
                    due.append((link, why))
        network = self.transport.network
        for link, why in due:
            if network is not None and network.links.get(link.host) is link:  # not replaced since
                self._agent_stopped(link, why)

    def _agent_stopped(self, link: HostLink, why: str) -> None:
        """``link``'s agent stopped on its own: its ranks that are not dead yet die with it."""
        self._ranks_died(link.ranks,
                         {"cause": f"the agent of host {link.name} stopped ({why}): ranks {format_ranks(link.ranks)}",
                          "lost_hosts": [link.address]})

    def _host_lost(self, link: HostLink) -> None:
        """Nothing heard from ``link``'s agent for the loss timeout: its ranks are gone."""
        network = self.transport.network
        cause = (f"host {link.name} lost: ranks {format_ranks(link.ranks)} (nothing heard from its "
                 f"agent for {network.lost_s if network else 0:g} s)")
        self._ranks_died(link.ranks, {"cause": cause, "lost_hosts": [link.address]})

    # -- shutdown ----------------------------------------------------------------------------

    def _mark_stopped(self, reason: str) -> None:
        with self._changed:
            if not self.stopped:
                self.stopped, self.stop_reason = True, reason
                self._changed.notify_all()

    def stop(self, reason: str = USER_STOP, detach: bool = False) -> None:
        """Kill every rank and agent, fail what still runs, and remove the runtime directory.
        ``detach``: leave the agents and ranks running (a kept mesh this kernel lets go of)."""
        with self._lock:
            already = self._stop_begun
            self._stop_begun = True
            self._mark_stopped(reason)
            if not already:
                self.detached = detach
        if already:  # stopping on another thread (the mesh ended on its own): wait for it
            if threading.current_thread() is not self.transport.receiver:
                self._stop_done.wait(60)
            return
        try:
            self._stop(detach)
        finally:
            self._stop_done.set()
        for listener in list(self.stop_listeners):
            try:
                listener()
            except Exception as exc:  # a view's failure must not make stopping fail
                log(f"a stop listener failed: {type(exc).__name__}: {exc}")

    def _stop(self, detach: bool) -> None:
        self.transport.stop_receiver()
        self._settle(everything=True)  # the receiver is gone: as they are
        self.agents.stop(detach)  # the receiver is gone: this thread owns the links
        with self._lock:
            runs = list(self.book.runs.values())
        for run in runs:
            for r in run.pending:
                said = (f"this kernel let go of the mesh, which runs on: {self.stop_reason}" if detach else
                        f"the mesh was stopped ({self.stop_reason})")
                failure = RankFailure(r, "MeshStopped", said, died="stopped")
                run.add_event(Error(r, failure, 0.0))
        with self._lock:
            self.book.stopped("mesh stopped")
        self.transport.close()
        self.landing.close()
        if self.lease is not None:
            self.lease.close()
        _LIVE.discard(self)


def live_controllers() -> list[Controller]:
    """This process's controllers that are running or were not stopped long ago (weakly
    held): the test suite checks with it that nothing a test started is left running."""
    return list(_LIVE)


def _unreadable(rank: int, type_name: str | None, exc: Exception) -> RankFailure:
    """A result the notebook cannot unpickle, as that rank's error: what to do instead."""
    what = f"a {type_name}" if type_name else "it"
    return RankFailure(rank, "UnreadableResult", (
        f"the result ({what}) cannot be unpickled in the notebook: "
        f"{type(exc).__name__}: {exc}. It stays on the rank as `_`: return plain data instead "
        f"(tensors moved with .cpu(), .tolist(), numbers, dicts of them), or fetch plain "
        f"tensors with %mesh pull (mesh.pull)"))


def _without(event: Event, wrong: dict[int, RankFailure]) -> list[Event]:
    """``event`` with the results of ``wrong``'s ranks told as their failures instead."""
    if isinstance(event, Result) and event.rank in wrong:
        return [Error(event.rank, wrong[event.rank], event.duration)]
    if not isinstance(event, Results):
        return [event]
    right = event.only(lambda rank: rank not in wrong)
    return [*([right] if right is not None else []),
            *(Error(r, wrong[r], d) for r, d in zip(event.ranks, event.durations) if r in wrong)]


def _succeeded(run: Run, ranks: tuple[int, ...], event: Event) -> set[int]:
    """The ranks of ``run`` that succeeded, with ``ranks``' answer ``event`` (not yet its)."""
    return set(run.ranks) - run.failed_ranks() - (set(ranks) if isinstance(event, Error) else set())


def _mispaired_text(found: Mispaired, said: dict[int, str]) -> str:
    """Why a rank's part of a run is wrong; ``said``: what each other request involved was. The
    same words on every such rank, so they group."""
    by = " and ".join(f"rank(s) {format_ranks(sorted(r for r, q in found.requests.items() if q == other))} in {what}"
                      for other, what in sorted(said.items()))
    return (f"its collective #{found.n} in the group of ranks {format_ranks(sorted(found.members))} paired with "
            f"the one {by} issued, another request: what this rank computed from it is wrong. A collective pairs "
            f"the n-th call of every member of its group, whichever cell made it: let a cell that calls a group's "
            f"collectives on some of its members end (or interrupt it) before one that calls them on all, then run "
            f"this again")


def _mismatched_text(found: Mismatched) -> str:
    """Why every member's part of a collective called with other tensors is wrong: the same
    words on each, so they group."""
    ops = sorted({call[0] for call in found.calls.values()})
    grouped: dict[tuple[Any, ...], list[int]] = {}
    for rank, call in sorted(found.calls.items()):
        grouped.setdefault(call, []).append(rank)
    calls = "; ".join(f"{ranks_text(ranks)} {_call_text(call, len(ops) > 1)}" for call, ranks in grouped.items())
    what, fix = ((f"collective #{found.n}", "Call the same collective") if len(ops) > 1 else
                 (f"{ops[0]} #{found.n}", "Pass tensors of the same size and dtype"))
    return (f"its {what} in the group of ranks {format_ranks(sorted(found.members))} did not match across them "
            f"({calls}): torch does not check this, the collective completed, and what every member computed "
            f"from it is wrong. {fix} on every member of the group")


def _call_text(call: tuple[Any, ...], with_op: bool) -> str:
    """``passed [3] float``, or with its op ``called broadcast of [3] float``."""
    tensor = f"{list(call[3]) if call[3] else 'scalar'} {call[2].lower()}" if len(call) > 1 else ""
    if not with_op:
        return f"passed {tensor}"
    return f"called {call[0]}" + (f" of {tensor}" if tensor else "")


def _terminal_stdin() -> bool:
    import sys

    return sys.stdin is not None and sys.stdin.isatty()


def _death_note(deaths: dict[int, str], ends: bool, stranded: Sequence[int], others: bool) -> str:
    """What a run says of its ranks that died (rank -> why), and of those meshbook freed
    (``others``: ranks of the mesh live on)."""
    dead = sorted(deaths)
    causes = sorted(set(deaths.values()))
    said = (f"{ranks_text(dead)} died ({causes[0]})" if len(causes) == 1 else
            "; ".join(f"{ranks_text([r])} died ({deaths[r]})" for r in dead))
    them = "it" if len(dead) == 1 else "them"
    if ends:
        return (f"{said}, and the mesh with {them}: nothing is left to fork {them} again. %mesh restart "
                f"(no ranks) starts the mesh again as it was started; in Python, meshbook.start(...).")
    note = (f"{said}. %mesh restart {','.join(map(str, dead))} (mesh.restart({dead})) brings {them} back and "
            f"re-creates the process group" + ("; the other ranks keep their variables." if others else "."))
    if stranded:
        note += (f" Rank(s) {format_ranks(stranded)} ran beside {them}: meshbook freed them from anything "
                 f"waiting on {them}.")
    return note


class _SigintHeld:
    """Ctrl-C held back while a request is booked and sent (the main thread's; the others never
    get ``KeyboardInterrupt``). Raised between any two steps there, it left a request booked and
    never sent, or sent to some ranks only, and those waited in its collectives for the others
    for good. ``came`` says, after the block, whether one came meanwhile. The handler is
    installed at the first hold and stays: it passes every other signal on to the handler it
    found (IPython's, or Python's own), and installs itself again over one set later."""

    holds: list["_SigintHeld"] = []  # the main thread's, innermost last
    before: Any = None

    def __init__(self) -> None:
        self.came = False
        self._main = threading.current_thread() is threading.main_thread()

    def __enter__(self) -> "_SigintHeld":
        if self._main:
            # ipykernel sets Python's own handler again for every cell: each request asks which
            # is there, through signal.getsignal's own function (its wrapper tries the handler as
            # an enum first: 2.4 us against 0.04 us, at every request sent).
            current = _getsignal(signal.SIGINT)
            if current is not _on_sigint and callable(current):
                _SigintHeld.before = current
                signal.signal(signal.SIGINT, _on_sigint)
            self.holds.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._main:
            self.holds.remove(self)


def _on_sigint(signum: int, frame: Any) -> None:
    if _SigintHeld.holds:
        _SigintHeld.holds[-1].came = True
    else:
        _SigintHeld.before(signum, frame)


def _add(listeners: list[Any], listener: Any) -> None:
    if listener not in listeners:
        listeners.append(listener)


def _remove(listeners: list[Any], listener: Any) -> None:
    if listener in listeners:
        listeners.remove(listener)


_LIVE: "weakref.WeakSet[Controller]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for controller in list(_LIVE):
        # A kept mesh outlives the process: its lease runs from the last ping it answered.
        controller.stop("the Python process is exiting", detach=controller.lease is not None)
    discard_standby()
