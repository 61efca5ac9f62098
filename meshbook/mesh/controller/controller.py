"""The controller: the notebook's end of the wire, and the book-keeping of every rank.

One :class:`Controller` per started mesh. Its sockets live in a private (0700) runtime
directory: a PUSH per rank and channel that sends requests straight to the rank (see
:func:`~meshbook.mesh.protocol.wire.rank_address`), a ROUTER for what it asks of the host agents
(signals, re-forks), and a PULL on which ranks and agents send everything back. A receiver
thread reads that PULL socket and dispatches each message by kind through a handler table
(:mod:`~meshbook.mesh.protocol.messages`; a kind without a handler is counted in
``unknown_kinds`` and logged): it feeds events to the :class:`~meshbook.mesh.controller.run.Run`
they belong to, tracks each rank's state and last heartbeat, and turns a rank's death into an
error on every run that waited for it, within the agent's SIGCHLD latency.

:class:`~meshbook.mesh.controller.mesh.Mesh` is the user-facing view; this module is its engine.
"""

from __future__ import annotations

import atexit
import itertools
import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
import weakref
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from ..protocol import messages as msg
from ..protocol import wire
from ..protocol.backends import Backend, HostGpus, choose
from ..protocol.errors import MeshError, MeshStoppedError, RankFailure, SendError
from ..protocol.events import DebugEnd, Display, Error, Event, InputRequest, Output, Result
from ..protocol.limits import DEFAULT_MAX_BYTES
from ..protocol.proc import owned_prefix, remove_stale, runtime_base
from ..protocol.remote import encode_route
from ..protocol.text import format_ranks
from ..protocol.topology import Topology
from ..rank.ops import interrupt_request
from .clock import CollectiveTimes
from .hosts import HostLink, Network
from .launchers import AgentHandle, HostPlan, Launcher, agent_environment
from .metrics import MetricsHistory
from .recovery import abort
from .render import print_late
from .run import Run
from .step import StepCheck
from .watch import watch

#: How many finished runs still get their late output routed to them.
LATE_OUTPUT_RUNS = 256
#: Why a mesh stopped when the user stopped it (any other reason: it ended on its own).
USER_STOP = "stopped by the user"
#: What processes of this machine name after themselves (``owned_prefix``) and a killed one
#: leaves behind: runtime directories, and the ssh sessions' logs.
STALE_KINDS = ("mb", "meshbook-ssh")
#: ZeroMQ I/O threads of a controller: each encrypts (CurveZMQ) the links it serves, so pushes to
#: several hosts are encrypted side by side, not one after the other on one core.
NETWORK_IO_THREADS = max(1, min(4, (os.cpu_count() or 1)))


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


class Controller:
    def __init__(self, topology: Topology, launcher: Launcher, backend: str = "auto",
                 collective_timeout: float = 300.0, name: str = "mesh", key: bytes | None = None,
                 env: dict[str, str] | None = None) -> None:
        #: The mesh's name in this notebook (``start(name=...)``, ``%mesh use NAME``).
        self.name = name
        self.topology = topology
        #: The backend asked for (``auto``...), and the one chosen from the agents' GPU counts.
        self.backend = backend
        self.chosen: Backend | None = None
        #: Variables the user named for the ranks (``start(env=...)``): other hosts get only these.
        self.env = dict(env or {})
        #: What the user should know about how the mesh started (printed by ``start()``).
        self.notes: list[str] = []
        self.collective_timeout = collective_timeout
        #: The most a result may weigh before it stays on its rank (``start(max_result_bytes=)``).
        self.max_result_bytes = DEFAULT_MAX_BYTES
        self.launcher = launcher
        #: Which ranks go on which host; a launcher refuses a layout here (per_host=0, too few
        #: hosts), before anything is built that would need closing.
        self.plans: list[HostPlan] = launcher.plan(topology.world_size)
        self.wire = wire.Wire(key or secrets.token_bytes(32))  # a kept mesh's, to attach it
        self.master_port = free_port()  # what a pasted torchrun script reads as MASTER_PORT
        remove_stale(runtime_base(), STALE_KINDS)  # what killed kernels left on this host
        self.rundir = tempfile.mkdtemp(prefix=owned_prefix("mb"), dir=runtime_base())  # mode 0700
        self.ctx = zmq.Context(io_threads=NETWORK_IO_THREADS)
        try:
            self._bind()
        except BaseException:  # leave nothing: an unclosed context blocks whoever collects it
            self.ctx.destroy(linger=0)
            shutil.rmtree(self.rundir, ignore_errors=True)
            raise
        self.host_of = {r: p.host for p in self.plans for r in p.ranks}
        self.ranks = {r: RankState(r, self.host_of[r]) for r in range(topology.world_size)}
        #: Ranks on other hosts: requests go once per host, through its agent (see hosts.py).
        self.remote = bool(getattr(launcher, "remote", False))
        self.network: Network | None = None
        self._relaunching: set[int] = set()
        self._down: dict[int, dict[str, zmq.Socket]] = {}
        if not self.remote:
            for r in self.ranks:
                self._connect_rank(r, 0)
        self.generation = 0
        self.stopped = False
        self.stop_reason = ""
        self._stop_begun = False  # by whichever thread came first; the others wait for it
        self._stop_done = threading.Event()
        #: Why this controller may no longer drive the mesh: another kernel attached it.
        self.fenced = ""
        #: A kept mesh's lease (:mod:`.lease`): outlives this controller, renewed by every ping.
        self.lease: Any = None
        self.agents: list[AgentHandle] = []
        self._lock = threading.RLock()
        self._send_lock = threading.Lock()
        #: Where request ids come from (one per request, ranks and agents alike).
        self.request_ids = itertools.count(1)
        self._runs: dict[int, Run] = {}
        self._queues: dict[int, deque[int]] = {r: deque() for r in self.ranks}
        self._late: OrderedDict[int, Callable[[Event], None]] = OrderedDict()
        self._generation_changed = threading.Condition(self._lock)
        #: Held by whatever re-creates the process groups (recovery, a step check's resync).
        self.recovery_lock = threading.Lock()
        self._step_checks: list[StepCheck] = []
        #: The last minutes of each rank's memory (for sparklines), kept from the start.
        self.history = MetricsHistory()
        #: When every rank entered and left each collective: exact waiting, who arrives last.
        self.clock = CollectiveTimes()
        #: Called on the receiver thread with (rank, metrics) for every heartbeat.
        self.heartbeat_listeners: list[Callable[[int, dict[str, Any]], None]] = [self.history.record]
        #: Called with every new Run (the notebook layer attributes its output to a cell).
        self.run_listeners: list[Callable[[Run], None]] = []
        #: Messages of a kind no handler takes, by kind (each is logged too).
        self.unknown_kinds: Counter[str] = Counter()
        self._handlers: dict[str, Callable[[wire.Message], None]] = {
            msg.HEARTBEAT: self._on_heartbeat, msg.OUTPUT: self._on_output, msg.DISPLAY: self._on_display,
            msg.INPUT: self._on_input, msg.DEBUG_END: self._on_debug_end, msg.RESULT: self._on_answer,
            msg.ERROR: self._on_answer, msg.EXIT: self._on_exit, msg.HELLO: self._on_hello,
            msg.READY: self._on_ready, msg.INIT_FAILED: self._on_init_failed, msg.AGENT: self._on_agent,
            msg.HOST_BEAT: self._on_host_beat, msg.FENCED: self._on_fenced,
            msg.COLLECTIVES: self._on_collectives, msg.RESEND: self._on_resend, msg.LOST: self._on_lost}
        #: Can the notebook answer a rank's debugger prompt right now? (the kernel layer
        #: replaces this with "does this cell allow stdin").
        self.stdin_probe: Callable[[], bool] = _terminal_stdin
        #: Called with (rank, cause) when a rank dies.
        self.death_listeners: list[Callable[[int, str], None]] = []
        #: Called once the mesh has stopped, on the thread that stopped it (a panel freezes in
        #: the cell that stops its mesh, not a refresh later, after a batch runner has gone).
        self.stop_listeners: list[Callable[[], None]] = []
        self._receiver = threading.Thread(target=self._receive, name="meshbook-receiver", daemon=True)
        self._receiver.start()
        _LIVE.add(self)

    def _bind(self) -> None:
        """The controller's own sockets, in its private runtime directory."""
        self.cmd = self.ctx.socket(zmq.ROUTER)
        self.cmd.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.cmd.setsockopt(zmq.SNDHWM, 0)
        self.cmd.bind(f"ipc://{self.rundir}/cmd")
        self.events = self.ctx.socket(zmq.PULL)
        self.events.setsockopt(zmq.RCVHWM, 0)
        self.events.bind(f"ipc://{self.rundir}/ev")
        self._wake_send = self.ctx.socket(zmq.PAIR)
        self._wake_recv = self.ctx.socket(zmq.PAIR)
        self._wake_recv.bind(f"inproc://wake-{id(self)}")
        self._wake_send.connect(f"inproc://wake-{id(self)}")

    # -- listeners: the notebook layer's hooks -------------------------------------------------

    def add_run_listener(self, listener: Callable[[Run], None]) -> None:
        if listener not in self.run_listeners:
            self.run_listeners.append(listener)

    def remove_run_listener(self, listener: Callable[[Run], None]) -> None:
        if listener in self.run_listeners:
            self.run_listeners.remove(listener)

    def add_heartbeat_listener(self, listener: Callable[[int, dict[str, Any]], None]) -> None:
        self.heartbeat_listeners.append(listener)

    def remove_heartbeat_listener(self, listener: Callable[[int, dict[str, Any]], None]) -> None:
        if listener in self.heartbeat_listeners:
            self.heartbeat_listeners.remove(listener)

    def add_death_listener(self, listener: Callable[[int, str], None]) -> None:
        self.death_listeners.append(listener)

    def remove_death_listener(self, listener: Callable[[int, str], None]) -> None:
        if listener in self.death_listeners:
            self.death_listeners.remove(listener)

    def add_stop_listener(self, listener: Callable[[], None]) -> None:
        self.stop_listeners.append(listener)

    def remove_stop_listener(self, listener: Callable[[], None]) -> None:
        if listener in self.stop_listeners:
            self.stop_listeners.remove(listener)

    # -- start-up ----------------------------------------------------------------------------

    def launch(self, timeout: float) -> None:
        """Start the agents and wait until every rank has torch.distributed ready."""
        try:
            if self.remote:
                self._launch_remote(timeout)
            else:
                agents = self.launcher.launch(self.plans, agent_environment(self.env), timeout)
                self.agents = list(agents)
                self._choose_backend([HostGpus("this host", a.gpus, len(p.ranks)) for p, a in zip(self.plans, agents)])
                for plan, agent in zip(self.plans, agents):
                    agent.configure(self._agent_config(plan))
            self.wait_generation(0, list(self.ranks), timeout, "start")
        except BaseException:
            self.stop()
            raise

    def attach(self, timeout: float) -> None:
        """Take over a kept mesh whose agents run on (the launcher dials them with the keys and
        the new epoch of its mesh file): ask each agent for its ranks, and wait for the answers."""
        try:
            self._network()
            assert self.network is not None
            self.agents = self.launcher.launch(self.plans, self.network, timeout)
            self.agent_op(msg.AgentOp.ATTACH, list(self.ranks))
            deadline = time.monotonic() + timeout
            with self._generation_changed:
                while any(s.state == "starting" for s in self.ranks.values()):
                    if self.stopped or time.monotonic() > deadline:
                        raise MeshError(self.fenced or f"attach: no answer from the mesh's agents within "
                                        f"{timeout:g} s; %mesh list shows the meshes that are still there")
                    self._generation_changed.wait(0.25)
        except BaseException:
            self.stop("could not attach", detach=True)  # the mesh is not ours to stop
            raise

    def _choose_backend(self, hosts: list[HostGpus]) -> None:
        """One backend for the whole mesh, from every agent's GPU count (see protocol/backends.py)."""
        self.chosen = choose(self.backend, hosts)
        if self.chosen.note:
            self.notes.append(self.chosen.note)

    def _backend_config(self) -> dict[str, str]:
        assert self.chosen is not None
        return {"backend": self.chosen.torch, "device_type": self.chosen.device_type}

    def _agent_config(self, plan: HostPlan) -> dict[str, Any]:
        return {
            "host": plan.host, "hosts": len(self.plans), "ranks": plan.ranks, "dims": list(self.topology.dims),
            "key": self.wire.key.hex(), **self._backend_config(), "listen_addr": "127.0.0.1",
            "collective_timeout": self.collective_timeout, "rundir": self.rundir,
            "master_port": self.master_port,
            "cmd_addr": f"ipc://{self.rundir}/cmd", "events_addr": f"ipc://{self.rundir}/ev",
        }

    def _launch_remote(self, timeout: float) -> None:
        """Start (or wait for) an agent per host, connect, then configure each over its link.

        Host 0's agent keeps the store (at the address it advertised, on the port it reserved),
        and each host's ranks listen on the interface its agent advertised.
        """
        self._network()
        assert self.network is not None
        self.agents = self.launcher.launch(self.plans, self.network, timeout)
        links = self.network.links
        self._choose_backend([HostGpus(links[p.host].name, links[p.host].gpus, len(p.ranks)) for p in self.plans])
        for plan in self.plans:
            self._configure(plan, 0)

    def _network(self) -> None:
        """The links to remote agents; a kept mesh's launcher brings its Curve keys and epoch."""
        launcher: Any = self.launcher
        self.network = Network(self.ctx, self.wire.key, launcher.suspect_s, launcher.lost_s,
                               getattr(launcher, "keys", None), getattr(launcher, "epoch", 0), self.env)
        self.network.wake = self._wake

    def _configure(self, plan: HostPlan, generation: int) -> None:
        """Send a remote agent its configuration: it forks its ranks into ``generation``."""
        assert self.network is not None
        link, store = self.network.links[plan.host], self.store_addr
        assert store is not None
        config = {
            "host": plan.host, "hosts": len(self.plans), "ranks": plan.ranks, "generation": generation,
            "dims": list(self.topology.dims), **self._backend_config(), "listen_addr": link.address,
            "store": list(store), "serve_store": plan.host == 0, "master_port": store[1],
            "collective_timeout": self.collective_timeout}
        frames = self.wire.pack({msg.KIND: msg.OP, msg.ID: None, msg.RANKS: plan.ranks},
                                {"op": msg.AgentOp.CONFIGURE, "config": config})
        with self._send_lock:
            self.network.send(plan.host, b"", frames)

    @property
    def store_addr(self) -> tuple[str, int] | None:
        """Where the ranks of a mesh across hosts meet: host 0's agent keeps the store (None:
        a file store on this host)."""
        if self.network is None or 0 not in self.network.links:
            return None
        first = self.network.links[0]
        return first.address, first.store_port

    def _wake(self) -> None:
        """Make the receiver poll new sockets now (it looks again every 250 ms anyway)."""
        with self._send_lock:
            if not self.stopped:
                self._wake_send.send(b"poll")

    def wait_generation(self, generation: int, ranks: list[int], timeout: float, what: str) -> None:
        """Wait for ``ranks`` to report ready in ``generation``; a clear error otherwise."""
        deadline = time.monotonic() + timeout
        with self._generation_changed:
            while True:
                states = [self.ranks[r] for r in ranks]
                failed = [s for s in states if s.state == "dead" or
                          (s.generation == generation and s.state == "failed")]
                if failed or self.stopped:
                    raise MeshError(self._startup_failure(failed, what))
                if all(s.generation == generation and s.state != "starting" for s in states):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    waiting = [s.rank for s in states if s.generation != generation]
                    raise MeshError(
                        f"{what} timed out after {timeout:g} s: rank(s) {waiting} never became ready. "
                        f"{self._agent_report()}Pass a larger timeout= if the machine is slow.")
                self._generation_changed.wait(min(left, 0.25))
                self._check_agents()

    def _startup_failure(self, failed: list[RankState], what: str) -> str:
        lines = [f"{what} failed:"]
        for s in failed:
            lines.append(f"  rank {s.rank}: {s.cause}")
        if self.stopped:
            lines.append(f"  {self.stop_reason}")
        return "\n".join(lines)

    def _agent_report(self) -> str:
        return "".join(f"(host agent {i}: {a.exit_reason()}) " for i, a in enumerate(self.agents)
                       if not a.alive())

    # -- sending -----------------------------------------------------------------------------

    def submit(self, kind: str, body: Any, ranks: list[int], what: str, channel: str = msg.MAIN) -> Run:
        """Send one request to ``ranks`` (one message per rank) and return its Run."""
        self.check_usable(ranks)
        try:
            raw, buffers = wire.dumps(body)
        except Exception as exc:
            raise SendError(f"{what}: cannot send {wire.describe_unpicklable(body, exc)}") from None
        with self._lock:
            request = next(self.request_ids)
            run = Run(request, ranks, self.topology, what, self.interrupt_run, self.send_input, kind)
            self._runs[request] = run
            if channel == msg.MAIN:
                for r in ranks:
                    self._queues[r].append(request)
                    self.ranks[r].state = "busy"
        for listener in self.run_listeners:
            listener(run)
        frames = self.wire.pack({msg.KIND: kind, msg.ID: request}, raw_body=raw, buffers=buffers)
        self._send_to_ranks(frames, ranks, channel)
        return run

    def call(self, fn: Callable[..., Any], *args: Any, ranks: list[int], what: str = "",
             channel: str = msg.MAIN, stdin: bool = False, **kwargs: Any) -> Run:
        """Run a rank operation, ``fn(worker, *args, **kwargs)``, on ``ranks`` (one of
        :mod:`meshbook.mesh.rank.ops`, or an extension's). ``channel=CONTROL`` runs it on their
        control threads, answered while they are busy; ``stdin`` says the notebook can answer a
        debugger prompt it opens."""
        body = {"fn": fn, "args": args, "kwargs": kwargs, "stdin": stdin}
        return self.submit(msg.CALL, body, ranks, what or getattr(fn, "__name__", "call"), channel)

    def agent_op(self, op: str, ranks: list[int], **body: Any) -> Run | None:
        """Ask the agents owning ``ranks`` to do ``op`` (signal, spawn, pyspy, stop)."""
        request = next(self.request_ids)
        run = None
        if op == msg.AgentOp.PYSPY:
            run = Run(request, ranks, self.topology, f"native stacks of rank(s) {ranks}", self.interrupt_run,
                      self.send_input, msg.OP)
            with self._lock:
                self._runs[request] = run
        frames = self.wire.pack({msg.KIND: msg.OP, msg.ID: request, msg.RANKS: ranks}, dict(body, op=op))
        self._send_to_hosts(frames, ranks)
        return run

    def _connect_rank(self, rank: int, generation: int) -> None:
        """Point ``rank``'s sockets at its process forked in ``generation`` (caller holds the
        send lock).

        ZeroMQ queues what is sent before the rank has bound its sockets, so a request never
        waits for, or races with, the rank's start-up.
        """
        self._disconnect_rank(rank)
        self._down[rank] = wire.connect_rank(self.ctx, self.rundir, rank, generation)

    def _disconnect_rank(self, rank: int) -> None:
        """Drop a rank's sockets with whatever they still held for it (the runs that waited on
        it have failed), so nothing retries connecting to a dead process."""
        for sock in self._down.pop(rank, {}).values():
            sock.close(linger=0)

    def _send_to_ranks(self, frames: list[Any], ranks: list[int], channel: str) -> None:
        """One message per rank, straight to its socket: on one host, relaying through the
        agent would cost a process hop and a copy per request, and buy nothing. To other
        hosts, one message per host, which its agent fans out."""
        if self.network is not None:
            by_host: dict[int, list[int]] = {}
            for r in ranks:
                if self.ranks[r].state != "dead":
                    by_host.setdefault(self.host_of[r], []).append(r)
            with self._send_lock:
                sent = [(host_ranks, self.network.send(host, encode_route(channel, host_ranks), frames))
                        for host, host_ranks in by_host.items()]
            for host_ranks, tracker in sent:
                self._wait_sent(tracker, host_ranks)
            return
        with self._send_lock:
            # A rank that died since the caller checked has no sockets: its death failed the run.
            live = [r for r in ranks if r in self._down]
            trackers = wire.fan_out([self._down[r][channel] for r in live], frames)
        for rank, tracker in zip(live, trackers):
            self._wait_sent(tracker, [rank])

    def _wait_sent(self, tracker: zmq.MessageTracker | None, ranks: list[int]) -> None:
        """Big buffers: return once they left for ``ranks``, so the caller may change its
        tensors; ranks that died meanwhile never will (their runs fail on their death)."""
        while (tracker is not None and not tracker.done and not self.stopped
               and any(self.ranks[r].state != "dead" for r in ranks)):
            try:
                tracker.wait(0.1)
            except zmq.NotDone:
                pass

    def _send_to_hosts(self, frames: list[Any], ranks: list[int]) -> None:
        hosts = sorted({self.host_of[r] for r in ranks})
        with self._send_lock:
            for host in hosts:
                if self.network is not None:
                    self.network.send(host, b"", frames)  # small: an operation for the agent
                    continue
                for attempt in range(200):
                    try:
                        wire.send(self.cmd, frames, prefix=[f"agent:{host}".encode(), b""], wait=True)
                        break
                    except zmq.ZMQError as exc:
                        # EHOSTUNREACH: the agent's connection is not up yet (start-up only).
                        if exc.errno != zmq.EHOSTUNREACH or attempt == 199:
                            raise MeshError(f"cannot reach the host agent {host}: {exc}") from None
                        time.sleep(0.01)

    def kill(self, ranks: list[int], timeout: float = 10.0) -> None:
        """SIGKILL ``ranks`` and wait until their agent reported them dead."""
        live = [r for r in ranks if self.ranks[r].state != "dead"]
        if not live:
            return
        self.signal(live, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        with self._generation_changed:
            while any(self.ranks[r].state != "dead" for r in live):
                if time.monotonic() > deadline or self.stopped:
                    raise MeshError(f"rank(s) {live} did not die within {timeout:g} s of SIGKILL")
                self._generation_changed.wait(0.05)

    def new_generation(self) -> int:
        """A new process-group generation (its ranks meet in a new store)."""
        with self._lock:
            self.generation += 1
            return self.generation

    def respawn(self, ranks: list[int], generation: int) -> None:
        """Re-fork dead ``ranks`` under their rank ids; they join ``generation``."""
        if not ranks:
            return
        # Sockets first: a request sent once the rank is no longer "dead" goes to the new process.
        if not self.remote:  # a remote host's agent points its own sockets at the new ranks
            with self._send_lock:
                for r in ranks:
                    self._connect_rank(r, generation)
        with self._lock:
            for r in ranks:
                state = self.ranks[r]
                state.state, state.cause, state.lost_namespace = "starting", "", True
        gone = self._hosts_gone(ranks)
        for host in gone:
            try:
                self._relaunch(self.plans[host], generation)
            except BaseException as exc:  # nothing will start them: say so, never leave "starting"
                self._ranks_died([r for r in self.plans[host].ranks if r in ranks],
                                 {"cause": f"could not start a new agent for them: {exc}"})
                raise
        self.agent_op(msg.AgentOp.SPAWN, [r for r in ranks if self.host_of[r] not in gone], generation=generation)

    def _hosts_gone(self, ranks: list[int]) -> list[int]:
        """The hosts of ``ranks`` whose agent is gone (lost, or its process ended)."""
        if self.network is None:
            return []
        hosts = sorted({self.host_of[r] for r in ranks})
        return [h for h in hosts if self.network.links[h].state in ("lost", "stopped")
                or not self.agents[h].alive()]

    def move_lost_host(self, ranks: list[int], host_name: str) -> None:
        """Start the agent of the lost host of ``ranks`` on ``host_name`` at the next restart."""
        gone = self._hosts_gone(ranks)
        if len(gone) != 1 or not hasattr(self.launcher, "replace"):
            raise MeshError(f"restart ... on {host_name!r}: give the ranks of exactly one lost host of a "
                            f"mesh started through ssh (lost hosts of these ranks: {len(gone)})")
        self.launcher.replace(gone[0], host_name)

    def _relaunch(self, plan: HostPlan, generation: int, timeout: float = 120.0) -> None:
        """Start a new agent for a host whose agent is gone (``%mesh restart`` of its ranks);
        the other hosts' ranks keep their variables."""
        assert self.network is not None
        self._relaunching.add(plan.host)  # its old agent's end is no news for _check_agents
        try:
            self.agents[plan.host].terminate(1.0)
            self.agents[plan.host] = self.launcher.relaunch(plan, self.network, timeout)
        finally:
            self._relaunching.discard(plan.host)
        link = self.network.links[plan.host]
        if self.chosen is not None and self.chosen.device_type == "cuda" and link.gpus < len(plan.ranks):
            raise MeshError(f"host {link.name} has {link.gpus} GPU(s) for {len(plan.ranks)} rank(s), and this "
                            f"mesh runs NCCL (a GPU per rank): restart them on a host with enough GPUs "
                            f"(%mesh restart ... --on HOST)")
        self._configure(plan, generation)

    def current_request(self, rank: int) -> int | None:
        """The exec request ``rank`` is running now (the head of its queue)."""
        queue = self._queues[rank]
        return queue[0] if queue else None

    def own_work(self, request: int | None) -> str:
        """What ``request`` is, when it is meshbook's own work rather than user code ("")."""
        run = self._runs.get(request) if request is not None else None
        return run.what if run is not None and run.kind == msg.CALL else ""

    def queued(self, rank: int) -> int:
        """How many requests ``rank``'s main thread has not finished (the running one included)."""
        return len(self._queues[rank])

    def busy_with_other(self, rank: int, request: int) -> bool:
        """Is ``rank`` still running something queued before ``request``?"""
        queue = self._queues[rank]
        return bool(queue) and queue[0] != request and self.ranks[rank].state != "dead"

    def send_input(self, rank: int, text: str) -> None:
        """A line typed in the notebook, for ``rank``'s debugger (its control thread)."""
        self._send_to_ranks(self.wire.pack({msg.KIND: msg.INPUT, msg.ID: None}, text), [rank], msg.CONTROL)

    def interrupt(self, ranks: list[int]) -> None:
        """SIGINT to ``ranks``, whatever they run (``%mesh interrupt``)."""
        with self._lock:
            hit = [run for run in self._runs.values() if set(run.pending) & set(ranks)]
        for run in hit:
            run.interrupted, run.interrupted_at = True, time.monotonic()
        self.signal(ranks, signal.SIGINT)

    def interrupt_run(self, run: Run) -> None:
        """Interrupt ``run`` and nothing else: ranks running it get ``KeyboardInterrupt``,
        ranks where it still waits in the queue drop it before it starts. Other runs (a
        background ``mesh.run``) are not touched."""
        run.interrupted, run.interrupted_at = True, time.monotonic()
        ranks = [r for r in run.pending if self.ranks[r].state != "dead"]
        if ranks and not self.stopped:
            self.call(interrupt_request, run.id, ranks=ranks, what="interrupt", channel=msg.CONTROL)

    def signal(self, ranks: list[int], sig: int) -> None:
        live = [r for r in ranks if self.ranks[r].state != "dead"]
        if live and not self.stopped:
            self.agent_op(msg.AgentOp.SIGNAL, live, sig=int(sig))

    def check_usable(self, ranks: list[int]) -> None:
        if self.fenced:
            raise MeshStoppedError(self.fenced)
        if self.stopped:
            raise MeshStoppedError(f"the mesh is stopped ({self.stop_reason}); start a new one "
                                   f"with meshbook.start(...)")
        dead = [self.ranks[r] for r in ranks if self.ranks[r].state == "dead"]
        if dead:
            causes = "; ".join(f"rank {s.rank}: {s.cause}" for s in dead)
            raise MeshError(f"the mesh is degraded ({causes}). Restart the dead rank(s) with "
                            f"mesh.restart({[s.rank for s in dead]}) (or %mesh restart "
                            f"{','.join(str(s.rank) for s in dead)}), or select live ranks only")

    # -- receiving ---------------------------------------------------------------------------

    def _receive(self) -> None:
        poller, version = self._poller(), -1
        next_check = 0.0
        while not self.stopped:
            if self.network is not None and self.network.version != version:
                poller, version = self._poller(), self.network.version
                self.network.close_retired()
            ready = dict(poller.poll(250))
            if self._wake_recv in ready and self._wake_recv.recv() == b"stop":
                break
            if self.events in ready:
                while True:
                    try:
                        frames = wire.recv(self.events, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._take(frames)
            try:
                if self.network is not None:
                    for sock in self.network.sockets():
                        if sock in ready:
                            self.network.drain(sock, self._from_host)
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + 0.25
                    self._check_agents()
                    with self._lock:
                        runs = list(self._runs.values())
                    watch(self, runs)
                    if self.network is not None:
                        self.network.tick(self._op, self._host_lost)
            except Exception as exc:  # the receiver must outlive any one failure
                _log(f"receiver: {type(exc).__name__}: {exc}")

    def _poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        for sock in (self.events, self._wake_recv, *(self.network.sockets() if self.network else ())):
            poller.register(sock, zmq.POLLIN)
        return poller

    def _take(self, frames: list[Any]) -> wire.Message | None:
        try:
            message = self.wire.unpack(frames)
            self._handle(message)
            return message
        except wire.BadMessage:
            return None
        except Exception as exc:  # never let one bad message end the receiver
            _log(f"receiver: {type(exc).__name__}: {exc}")
            return None

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
        if message.kind == msg.JOIN and self.network is not None:
            welcome = self.wire.pack({msg.KIND: msg.OP, msg.ID: None, msg.RANKS: []}, {"op": msg.AgentOp.WELCOME})
            self.network.on_join(identity, message.body(), welcome)
        else:
            self.unknown_kinds[f"{message.kind} (before joining)"] += 1

    def _op(self, body: dict[str, Any]) -> list[Any]:
        """An operation for a remote agent, signed (pings, asking for messages again)."""
        return self.wire.pack({msg.KIND: msg.OP, msg.ID: None, msg.RANKS: []}, body)

    def _on_resend(self, message: wire.Message) -> None:
        """An agent missed messages we sent on its link (the connection reset): send them again;
        what is no longer kept (a big push) is lost, and the work it was for fails now."""
        link = self._link_of(message)
        if link is not None and self.network is not None:
            lost = self.network.resend(link, message.body()["from"], self._op)
            if lost is not None:
                self._link_lost(link, f"requests to host {link.name}")

    def _on_lost(self, message: wire.Message) -> None:
        """An agent no longer keeps messages we missed from it: go on without them, and fail the
        work they answered."""
        link = self._link_of(message)
        if link is None:
            return
        for frames in link.incoming.give_up(message.body()["upto"]):
            self._take(frames)
        self._link_lost(link, f"messages from host {link.name}")

    def _link_of(self, message: wire.Message) -> HostLink | None:
        return self.network.links.get(message.header.get(msg.HOST)) if self.network is not None else None

    def _link_lost(self, link: HostLink, what: str) -> None:
        """Fail what runs on ``link``'s ranks: part of it was lost when the connection reset."""
        with self._lock:
            runs = [run for run in self._runs.values() if set(run.pending) & set(link.ranks)]
        for run in runs:
            for rank in sorted(set(run.pending) & set(link.ranks)):
                failure = RankFailure(rank, "LinkReset", (
                    f"{what} were lost when its connection reset, and were no longer kept to be sent "
                    f"again (a push too big to keep, or too much since): rank {rank}'s part of this run "
                    f"is unknown. Run it again (its ranks keep their variables)"))
                self._finish(run.id, rank, Error(rank, failure, time.monotonic() - run.submitted_at))

    def _on_host_beat(self, message: wire.Message) -> None:
        if self.network is None or (link := self.network.links.get(message.header[msg.HOST])) is None:
            return
        body = message.body()
        if body.get("stopped"):
            link.state = "stopped"
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
        self.fenced = (f"this mesh was attached by another kernel (epoch {newer}; this kernel had "
                       f"epoch {self.network.epoch if self.network else 0}), which drives it now. Use "
                       f"it there, or take it back here with %mesh attach {mesh_id} "
                       f"(meshbook.attach({mesh_id!r}))")
        self._mark_stopped(self.fenced)
        threading.Thread(target=self.stop, args=(self.fenced,), kwargs={"detach": True}, daemon=True).start()

    def _host_lost(self, link: HostLink) -> None:
        """Nothing heard from ``link``'s agent for the loss timeout: its ranks are gone."""
        cause = (f"host {link.name} lost: ranks {format_ranks(link.ranks)} (nothing heard from its "
                 f"agent for {self.network.lost_s if self.network else 0:g} s)")
        self._ranks_died([r for r in link.ranks if self.ranks[r].state != "dead"],
                         {"cause": cause, "lost_hosts": [link.address]})

    def _handle(self, message: wire.Message) -> None:
        handler = self._handlers.get(message.kind)
        if handler is None:
            self.unknown_kinds[message.kind] += 1
            _log(f"no handler for {message.kind!r} messages (from rank {message.header.get(msg.RANK)}, "
                 f"host {message.header.get(msg.HOST)}; {self.unknown_kinds[message.kind]} so far)")
            return
        handler(message)

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
        link = self.network.links.get(self.host_of[rank]) if self.network is not None else None
        self.clock.add(rank, message.body(), link.clock_offset_ns if link is not None else 0)

    def _on_output(self, message: wire.Message) -> None:
        body = message.body()
        self._deliver(message.header[msg.ID], Output(message.header[msg.RANK], body["stream"], body["text"]))

    def _on_display(self, message: wire.Message) -> None:
        self._deliver(message.header[msg.ID], Display(message.header[msg.RANK], message.body()))

    def _on_input(self, message: wire.Message) -> None:
        self._deliver(message.header[msg.ID], InputRequest(message.header[msg.RANK], message.body()["prompt"]))

    def _on_debug_end(self, message: wire.Message) -> None:
        self._deliver(message.header[msg.ID], DebugEnd(message.header[msg.RANK]))

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
            succeeded = False
            what = f"a {header[msg.TYPE]}" if msg.TYPE in header else "it"
            body = RankFailure(rank, "UnreadableResult", (
                f"the result ({what}) cannot be unpickled in the notebook: "
                f"{type(exc).__name__}: {exc}. It stays on the rank as `_`: return plain data instead "
                f"(tensors moved with .cpu(), .tolist(), numbers, dicts of them), or fetch plain "
                f"tensors with %mesh pull (mesh.pull)"))
        event = Result(rank, body, duration) if succeeded else Error(rank, body, duration)
        self._finish(header[msg.ID], rank, event, lost_group=header.get(msg.HAS_GROUP) is False)

    def _on_exit(self, message: wire.Message) -> None:
        self._ranks_died([message.header[msg.RANK]], message.body())

    def _on_hello(self, message: wire.Message) -> None:
        body = message.body()
        with self._lock:
            state = self.ranks[message.header[msg.RANK]]
            state.pid, state.hostname = body["pid"], body["host"]

    def _on_ready(self, message: wire.Message) -> None:
        body, rank = message.body(), message.header[msg.RANK]
        with self._lock:
            state = self.ranks[rank]
            state.device, state.pid, state.threads = body["device"], body["pid"], body.get("threads", "")
            state.generation = message.header[msg.GENERATION]
            if not self._queues[rank]:
                state.state = "idle"
            self._generation_changed.notify_all()

    def _on_init_failed(self, message: wire.Message) -> None:
        failure = message.body()
        with self._lock:
            state = self.ranks[message.header[msg.RANK]]
            state.generation, state.state = message.header[msg.GENERATION], "failed"
            state.cause = f"torch.distributed did not initialise: {failure.headline}"
            self._generation_changed.notify_all()

    def _on_agent(self, message: wire.Message) -> None:
        body = message.body()
        with self._lock:
            for r, pid in body["pids"].items():
                self.ranks[int(r)].pid = pid
            if body.get("attached"):
                self._adopt_ranks(body)

    def _adopt_ranks(self, body: dict[str, Any]) -> None:
        """An agent's answer to ATTACH: its ranks as they are (caller holds the lock). An agent
        knows the generation each rank was forked into; a restart moves every live rank into
        the new one, so the newest is every rank's."""
        self.generation = max([self.generation, *body["generations"].values()])
        for r in body["generations"]:
            state = self.ranks[int(r)]
            state.generation, state.state, state.hostname = self.generation, "idle", body["hostname"]
        for r in body["dead"]:
            state = self.ranks[int(r)]
            state.state, state.cause = "dead", "died while no kernel was attached"
        self._generation_changed.notify_all()

    def _deliver(self, request: int | None, event: Event) -> None:
        run = self._runs.get(request) if request is not None else None
        if run is not None:
            run.add_event(event)
            return
        late = self._late.get(request) if request is not None else None
        (late or print_late)(event)

    def _finish(self, request: int, rank: int, event: Event, lost_group: bool = False) -> None:
        run = self._runs.get(request)
        if run is None:
            return
        if lost_group or isinstance(event, Error):
            run.irregular = True
        if (run.irregular or run.interrupted) and run.kind in msg.USER_KINDS and run.pending == [rank]:
            # Before the run is seen done: whoever renders it waits for this check too.
            run.step_check = self.check_step(run)
        run.add_event(event)
        with self._lock:
            queue = self._queues[rank]
            if queue and queue[0] == request:
                queue.popleft()
                state = self.ranks[rank]
                if state.state == "busy" and not queue:
                    state.state = "idle"
            if run.done():
                self._retire(run)

    def _retire(self, run: Run) -> None:
        del self._runs[run.id]
        self._late[run.id] = run.on_late_output
        while len(self._late) > LATE_OUTPUT_RUNS:
            self._late.popitem(last=False)

    def _ranks_died(self, ranks: list[int], body: dict[str, Any]) -> None:
        """``ranks`` died together (a rank's exit, or a lost host): fail what waited on them,
        free the ranks that ran beside them, and say how to bring them back."""
        if not ranks:
            return
        cause = body["cause"]
        detail = "\n".join(filter(None, [body.get("crash", "").strip()]))
        with self._lock:
            current = {}
            for rank in ranks:
                state = self.ranks[rank]
                state.state, state.cause, state.pid = "dead", cause, None
                queue = self._queues[rank]
                current[rank] = queue[0] if queue else None
                queue.clear()
            waiting = [run for run in self._runs.values() if set(run.pending) & set(ranks)]
            self._generation_changed.notify_all()
        with self._send_lock:
            for rank in ranks:
                self._disconnect_rank(rank)
        for stream, text in body.get("output", {}).items():
            if text:
                self._deliver(current[ranks[0]], Output(ranks[0], stream, text))
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
        note = (f"{who} died ({cause}). %mesh restart {','.join(map(str, ranks))} (mesh.restart({ranks})) "
                f"brings {'it' if len(ranks) == 1 else 'them'} back and re-creates the process group; "
                f"the other ranks keep their variables.")
        stranded = sorted({r for run in waiting for r in run.pending if r not in ranks})
        if stranded and not self.stopped:
            note += (f" Rank(s) {format_ranks(stranded)} ran beside it: meshbook freed them from "
                     f"anything waiting on it.")
            reason = f"meshbook aborted what this rank ran: {who} died ({cause})"
            threading.Thread(target=self._free_stranded, args=(stranded, reason, body.get("lost_hosts", [])),
                             daemon=True).start()
        for run in waiting:
            run.notes.append(note)
            for rank in ranks:
                if rank in run.pending:
                    failure = RankFailure(rank, "RankDied", f"rank {rank} died: {cause}", died=cause, detail=detail)
                    self._finish(run.id, rank, Error(rank, failure, time.monotonic() - run.submitted_at))
        for listener in self.death_listeners:
            for rank in ranks:
                listener(rank, cause)

    def _free_stranded(self, ranks: list[int], reason: str, lost_hosts: list[str]) -> None:
        """Ranks that were running beside a rank that died: the group is broken, so abort
        their collectives now instead of letting them wait for the collective timeout."""
        if not self.recovery_lock.acquire(blocking=False):
            return  # a recovery (restart, the second interrupt) frees them and re-creates the group
        try:
            abort(self, [r for r in ranks if self.ranks[r].state == "busy"], reason, lost_hosts)
        except MeshError as exc:
            if not self.stopped:
                _log(f"could not free rank(s) {format_ranks(ranks)}: {exc}")
        finally:
            self.recovery_lock.release()

    def check_step(self, run: Run) -> "StepCheck | None":
        """Check that every rank is at the same collective in each group after ``run``
        stopped irregularly (see :mod:`meshbook.mesh.controller.step`)."""
        if self.stopped or any(s.state == "dead" for s in self.ranks.values()):
            return None  # a dead rank's restart re-creates every group anyway
        check = StepCheck(self, "the interrupt" if run.interrupted else "the failed cell", run.forced_resync)
        try:
            check.start()
        except MeshError:
            return None  # stopped, or a rank died, meanwhile: nothing to check (see above)
        with self._lock:
            self._step_checks = [c for c in self._step_checks if not c.done.is_set()] + [check]
        return check

    def cancel_step_checks(self) -> None:
        """Release ranks held by step checks (recovery re-creates every group anyway)."""
        with self._lock:
            checks, self._step_checks = self._step_checks, []
        for check in checks:
            check.cancel()

    def _check_agents(self) -> None:
        if self.stopped or not self.agents:
            return
        for host, agent in enumerate(self.agents):
            if agent.alive() or host in self._relaunching:
                continue
            ranks = [r for r in self.plans[host].ranks if self.ranks[r].state != "dead"]
            if self.remote:  # the other hosts' ranks live on: the mesh is degraded, not stopped
                if ranks:
                    self._ranks_died(ranks, {"cause": agent.exit_reason()})
                continue
            reason = f"host agent {host} died ({agent.exit_reason()})"
            self._ranks_died(ranks, {"cause": reason})
            self._mark_stopped(reason)
        if self.remote and not self.stopped:
            self._end_if_beyond_restart()

    def _end_if_beyond_restart(self) -> None:
        """Every rank is dead and no host can be started again (a Slurm job that ended, hosts
        that joined from elsewhere): the mesh has ended. It stops, its cells say how it ended,
        and a new start needs no --force."""
        if getattr(self.launcher, "relaunchable", True) or any(s.state != "dead" for s in self.ranks.values()):
            return
        causes = sorted({s.cause for s in self.ranks.values()})
        reason = causes[0] if len(causes) == 1 else "every rank died: " + "; ".join(causes)
        self._mark_stopped(reason)
        threading.Thread(target=self.stop, args=(reason,), daemon=True).start()

    def _mark_stopped(self, reason: str) -> None:
        with self._lock:
            if not self.stopped:
                self.stopped, self.stop_reason = True, reason
                self._generation_changed.notify_all()

    # -- shutdown ----------------------------------------------------------------------------

    def stop(self, reason: str = USER_STOP, detach: bool = False) -> None:
        """Kill every rank and agent, fail what still runs, and remove the runtime directory.
        ``detach``: leave the agents and ranks running (a kept mesh this kernel lets go of)."""
        with self._lock:
            already = self._stop_begun
            self._stop_begun = True
            self._mark_stopped(reason)
            agents, self.agents = self.agents, []
        if already:  # stopping on another thread (the mesh ended on its own): wait for it
            if threading.current_thread() is not self._receiver:
                self._stop_done.wait(60)
            return
        try:
            self._stop(agents, detach)
        finally:
            self._stop_done.set()
        for listener in list(self.stop_listeners):
            try:
                listener()
            except Exception as exc:  # a view's failure must not make stopping fail
                _log(f"a stop listener failed: {type(exc).__name__}: {exc}")

    def _stop(self, agents: list[AgentHandle], detach: bool) -> None:
        if threading.current_thread() is not self._receiver:
            with self._send_lock:
                self._wake_send.send(b"stop")
            self._receiver.join(5)
        if self.network is not None and not detach:  # the receiver is gone: this thread owns the links
            self.network.stop_agents(self.wire, 5.0)
        for agent in agents if not detach else ():
            agent.terminate(5.0)
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            for r in run.pending:
                failure = RankFailure(r, "MeshStopped", f"the mesh was stopped ({self.stop_reason})",
                                      died="stopped")
                run.add_event(Error(r, failure, 0.0))
        for state in self.ranks.values():
            if state.state != "dead":
                state.state, state.cause = "dead", "mesh stopped"
        if self.network is not None:
            self.network.close()
        rank_socks = [sock for socks in self._down.values() for sock in socks.values()]
        for sock in (self.cmd, self.events, self._wake_send, self._wake_recv, *rank_socks):
            sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.rundir, ignore_errors=True)
        _LIVE.discard(self)


def live_controllers() -> list[Controller]:
    """This process's controllers that are running or were not stopped long ago (weakly
    held): the test suite checks with it that nothing a test started is left running."""
    return list(_LIVE)


def _terminal_stdin() -> bool:
    import sys

    return sys.stdin is not None and sys.stdin.isatty()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _log(text: str) -> None:
    import sys

    print(f"meshbook: {text}", file=sys.__stderr__)


_LIVE: "weakref.WeakSet[Controller]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    from .launchers import discard_standby

    for controller in list(_LIVE):
        # A kept mesh outlives the process: its lease runs from the last ping it answered.
        controller.stop("the Python process is exiting", detach=controller.lease is not None)
    discard_standby()
