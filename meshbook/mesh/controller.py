"""The controller: the notebook's end of the wire, and the book-keeping of every rank.

One :class:`Controller` per started mesh. Its sockets live in a private (0700) runtime
directory: a PUSH per rank and channel that sends requests straight to the rank (see
:func:`~meshbook.mesh.wire.rank_address`), a ROUTER for what it asks of the host agents
(signals, re-forks), and a PULL on which ranks and agents send everything back. A receiver
thread reads that PULL socket and feeds each message to the :class:`~meshbook.mesh.run.Run`
it belongs to, tracks each rank's state and last heartbeat, and turns a rank's death into an
error on every run that waited for it, within the agent's SIGCHLD latency.

:class:`~meshbook.mesh.mesh.Mesh` is the user-facing view; this module is its engine.
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
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from . import wire
from .errors import MeshError, MeshStoppedError, RankFailure, SendError, format_ranks
from .launchers import AgentHandle, HostPlan, Launcher
from .limits import DEFAULT_MAX_BYTES
from .metrics import MetricsHistory
from .recovery import abort, free_after_interrupt
from .run import DebugEnd, Display, Error, Event, InputRequest, Output, Result, Run
from .step import StepCheck
from .topology import Topology
from .worker import interrupt_request

#: How many finished runs still get their late output routed to them.
LATE_OUTPUT_RUNS = 256
#: Requests that run user code: those whose irregular end triggers a step check.
USER_KINDS = ("exec", "apply")


@dataclass
class RankState:
    rank: int
    host: int
    pid: int | None = None
    hostname: str = ""
    device: str = ""
    state: str = "starting"  # starting | idle | busy | dead
    cause: str = ""  # why it is dead
    generation: int = -1
    metrics: dict[str, Any] = field(default_factory=dict)
    last_seen: float = 0.0
    #: Set when the rank was restarted and its variables are gone.
    lost_namespace: bool = False
    #: The variables the rank had at the last who() or push: what a restart loses.
    known_names: frozenset[str] = frozenset()


class Controller:
    def __init__(self, topology: Topology, launcher: Launcher, backend: str = "auto",
                 collective_timeout: float = 300.0) -> None:
        self.topology = topology
        self.backend = backend
        self.collective_timeout = collective_timeout
        #: The most a result may weigh before it stays on its rank (``start(max_result_bytes=)``).
        self.max_result_bytes = DEFAULT_MAX_BYTES
        self.launcher = launcher
        self.wire = wire.Wire(secrets.token_bytes(32))
        self.rundir = tempfile.mkdtemp(prefix="mb-", dir=_runtime_base())  # mode 0700
        self.master_port = free_port()  # what a pasted torchrun script reads as MASTER_PORT
        self.ctx = zmq.Context()
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
        self.plans: list[HostPlan] = launcher.plan(topology.world_size)
        self.host_of = {r: p.host for p in self.plans for r in p.ranks}
        self.ranks = {r: RankState(r, self.host_of[r]) for r in range(topology.world_size)}
        self._down: dict[int, dict[str, zmq.Socket]] = {}
        for r in self.ranks:
            self._connect_rank(r, 0)
        self.generation = 0
        self.stopped = False
        self.stop_reason = ""
        self.agents: list[AgentHandle] = []
        self._lock = threading.RLock()
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._runs: dict[int, Run] = {}
        self._queues: dict[int, deque[int]] = {r: deque() for r in self.ranks}
        self._late: OrderedDict[int, Callable[[Event], None]] = OrderedDict()
        self._generation_changed = threading.Condition(self._lock)
        #: Held by whatever re-creates the process groups (recovery, a step check's resync).
        self.recovery_lock = threading.Lock()
        self._step_checks: list[StepCheck] = []
        #: The last minutes of each rank's memory (for sparklines), kept from the start.
        self.history = MetricsHistory()
        #: Called on the receiver thread with (rank, metrics) for every heartbeat.
        self.heartbeat_listeners: list[Callable[[int, dict[str, Any]], None]] = [self.history.record]
        #: Called with every new Run (the notebook layer attributes its output to a cell).
        self.run_listeners: list[Callable[[Run], None]] = []
        #: Can the notebook answer a rank's debugger prompt right now? (the kernel layer
        #: replaces this with "does this cell allow stdin").
        self.stdin_probe: Callable[[], bool] = _terminal_stdin
        #: Called with (rank, cause) when a rank dies.
        self.death_listeners: list[Callable[[int, str], None]] = []
        self._receiver = threading.Thread(target=self._receive, name="meshbook-receiver", daemon=True)
        self._receiver.start()
        _LIVE.add(self)

    # -- start-up ----------------------------------------------------------------------------

    def launch(self, timeout: float) -> None:
        """Start the agents and wait until every rank has torch.distributed ready."""
        configs = {p.host: self._agent_config(p) for p in self.plans}
        try:
            self.agents = self.launcher.launch(self.plans, configs)
            self.wait_generation(0, list(self.ranks), timeout, "start")
        except BaseException:
            self.stop()
            raise

    def _agent_config(self, plan: HostPlan) -> dict[str, Any]:
        return {
            "host": plan.host, "hosts": len(self.plans), "ranks": plan.ranks, "dims": list(self.topology.dims),
            "key": self.wire._key.hex(), "backend": self.backend,
            "store_host": self.launcher.store_host,
            "collective_timeout": self.collective_timeout, "rundir": self.rundir,
            "master_port": self.master_port,
            "cmd_addr": f"ipc://{self.rundir}/cmd", "events_addr": f"ipc://{self.rundir}/ev",
        }

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

    def submit(self, kind: str, body: Any, ranks: list[int], what: str, channel: str = "x") -> Run:
        """Send one request to ``ranks`` (one message per host) and return its Run."""
        self.check_usable(ranks)
        try:
            raw, buffers = wire.dumps(body)
        except Exception as exc:
            raise SendError(f"{what}: cannot send {_describe_unpicklable(body, exc)}") from None
        with self._lock:
            request = next(self._ids)
            run = Run(request, ranks, self.topology, what, self.interrupt_run, self.send_input, kind)
            self._runs[request] = run
            if channel == "x":
                for r in ranks:
                    self._queues[r].append(request)
                    self.ranks[r].state = "busy"
        for listener in self.run_listeners:
            listener(run)
        frames = self.wire.pack({"k": kind, "id": request}, raw_body=raw, buffers=buffers)
        self._send_to_ranks(frames, ranks, channel)
        return run

    def call(self, fn: Callable[..., Any], *args: Any, ranks: list[int], what: str,
             channel: str = "x") -> Run:
        """Run one of meshbook's own rank operations, ``fn(worker, *args)``, on ``ranks``
        (``channel="c"``: on their control threads, answered while they are busy)."""
        return self.submit("call", {"fn": fn, "args": args, "kwargs": {}}, ranks, what, channel)

    def agent_op(self, op: str, ranks: list[int], **body: Any) -> Run | None:
        """Ask the agents owning ``ranks`` to do ``op`` (signal, spawn, pyspy, stop)."""
        request = next(self._ids)
        run = None
        if op == "pyspy":
            run = Run(request, ranks, self.topology, f"native stacks of rank(s) {ranks}", self.interrupt_run,
                      self.send_input, "op")
            with self._lock:
                self._runs[request] = run
        frames = self.wire.pack({"k": "op", "id": request, "ranks": ranks}, dict(body, op=op))
        self._send_to_hosts(frames, ranks)
        return run

    def _connect_rank(self, rank: int, generation: int) -> None:
        """Point ``rank``'s sockets at its process forked in ``generation`` (caller holds the
        send lock).

        ZeroMQ queues what is sent before the rank has bound its sockets, so a request never
        waits for, or races with, the rank's start-up.
        """
        self._disconnect_rank(rank)
        socks = {}
        for channel in ("x", "c"):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            # Retry every 10 ms until the rank binds, never backing off: a backed-off retry
            # would hold the first request for up to the back-off after the rank is ready.
            sock.setsockopt(zmq.RECONNECT_IVL, 10)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 0)
            sock.connect(wire.rank_address(self.rundir, rank, generation, channel))
            socks[channel] = sock
        self._down[rank] = socks

    def _disconnect_rank(self, rank: int) -> None:
        """Drop a rank's sockets with whatever they still held for it (the runs that waited on
        it have failed), so nothing retries connecting to a dead process."""
        for sock in self._down.pop(rank, {}).values():
            sock.close(linger=0)

    def _send_to_ranks(self, frames: list[Any], ranks: list[int], channel: str) -> None:
        """One message per rank, straight to its socket: on one host, relaying through the
        agent would cost a process hop and a copy per request, and buy nothing."""
        with self._send_lock:
            # A rank that died since the caller checked has no sockets: its death failed the run.
            live = [r for r in ranks if r in self._down]
            trackers = wire.fan_out([self._down[r][channel] for r in live], frames)
        for rank, tracker in zip(live, trackers):
            # Big buffers: return once every rank has them, so the caller may change its
            # tensors; a rank that died meanwhile never will (its run fails on its death).
            while not tracker.done and self.ranks[rank].state != "dead" and not self.stopped:
                try:
                    tracker.wait(0.1)
                except zmq.NotDone:
                    pass

    def _send_to_hosts(self, frames: list[Any], ranks: list[int]) -> None:
        hosts = sorted({self.host_of[r] for r in ranks})
        with self._send_lock:
            for host in hosts:
                for attempt in range(200):
                    try:
                        wire.send(self.cmd, frames, prefix=[f"agent:{host}".encode()], wait=True)
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
        with self._send_lock:
            for r in ranks:
                self._connect_rank(r, generation)
        with self._lock:
            for r in ranks:
                state = self.ranks[r]
                state.state, state.cause, state.lost_namespace = "starting", "", True
        self.agent_op("spawn", ranks, generation=generation)

    def current_request(self, rank: int) -> int | None:
        """The exec request ``rank`` is running now (the head of its queue)."""
        queue = self._queues[rank]
        return queue[0] if queue else None

    def busy_with_other(self, rank: int, request: int) -> bool:
        """Is ``rank`` still running something queued before ``request``?"""
        queue = self._queues[rank]
        return bool(queue) and queue[0] != request and self.ranks[rank].state != "dead"

    def send_input(self, rank: int, text: str) -> None:
        """A line typed in the notebook, for ``rank``'s debugger (its control thread)."""
        self._send_to_ranks(self.wire.pack({"k": "input", "id": None}, text), [rank], "c")

    def interrupt(self, ranks: list[int]) -> None:
        """SIGINT to ``ranks``, whatever they run (``%mesh interrupt``)."""
        with self._lock:
            hit = [run for run in self._runs.values() if set(run.pending) & set(ranks)]
        for run in hit:
            run.interrupted = True
        self.signal(ranks, signal.SIGINT)
        for run in hit:
            self._free_after_interrupt(run)

    def interrupt_run(self, run: Run) -> None:
        """Interrupt ``run`` and nothing else: ranks running it get ``KeyboardInterrupt``,
        ranks where it still waits in the queue drop it before it starts. Other runs (a
        background ``mesh.run``) are not touched."""
        run.interrupted = True
        ranks = [r for r in run.pending if self.ranks[r].state != "dead"]
        if ranks and not self.stopped:
            self.call(interrupt_request, run.id, ranks=ranks, what="interrupt", channel="c")
            self._free_after_interrupt(run)

    def _free_after_interrupt(self, run: Run) -> None:
        if run.kind in USER_KINDS and not self.stopped:
            threading.Thread(target=free_after_interrupt, args=(self, run), daemon=True).start()

    def signal(self, ranks: list[int], sig: int) -> None:
        live = [r for r in ranks if self.ranks[r].state != "dead"]
        if live and not self.stopped:
            self.agent_op("signal", live, sig=int(sig))

    def check_usable(self, ranks: list[int]) -> None:
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
        poller = zmq.Poller()
        poller.register(self.events, zmq.POLLIN)
        poller.register(self._wake_recv, zmq.POLLIN)
        next_check = 0.0
        while not self.stopped:
            ready = dict(poller.poll(250))
            if self._wake_recv in ready:
                break
            if self.events in ready:
                while True:
                    try:
                        frames = wire.recv(self.events, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._handle(self.wire.unpack(frames))
                    except wire.BadMessage:
                        continue
                    except Exception as exc:  # never let one bad message end the receiver
                        _log(f"receiver: {type(exc).__name__}: {exc}")
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.25
                self._check_agents()

    def _handle(self, message: wire.Message) -> None:
        header = message.header
        kind = header["k"]
        rank = header.get("rank")
        if kind == "hb":
            state = self.ranks[rank]
            state.metrics = message.body()
            state.last_seen = time.monotonic()
            for listener in self.heartbeat_listeners:
                listener(rank, state.metrics)
            return
        if kind in ("out", "display", "input", "debug_end"):
            body = message.body()
            event: Event
            if kind == "out":
                event = Output(rank, body["stream"], body["text"])
            elif kind == "display":
                event = Display(rank, body)
            elif kind == "input":
                event = InputRequest(rank, body["prompt"])
            else:
                event = DebugEnd(rank)
            self._deliver(header["id"], event)
            return
        if kind in ("result", "error"):
            body = message.body()
            duration = header.get("t", 0.0)
            event = Result(rank, body, duration) if kind == "result" else Error(rank, body, duration)
            self._finish(header["id"], rank, event, lost_group=header.get("pg") is False)
            return
        if kind == "exit":
            self._rank_died(rank, message.body())
            return
        with self._lock:
            body = message.body()
            if kind == "hello":
                self.ranks[rank].pid = body["pid"]
                self.ranks[rank].hostname = body["host"]
            elif kind == "ready":
                state = self.ranks[rank]
                state.device, state.pid = body["device"], body["pid"]
                state.generation = header["generation"]
                if not self._queues[rank]:
                    state.state = "idle"
                self._generation_changed.notify_all()
            elif kind == "init_failed":
                state = self.ranks[rank]
                state.generation, state.state = header["generation"], "failed"
                state.cause = f"torch.distributed did not initialise: {body.headline}"
                self._generation_changed.notify_all()
            elif kind == "agent":
                for r, pid in body["pids"].items():
                    self.ranks[int(r)].pid = pid

    def _deliver(self, request: int | None, event: Event) -> None:
        run = self._runs.get(request) if request is not None else None
        if run is not None:
            run._add(event)
            return
        late = self._late.get(request) if request is not None else None
        (late or _print_stray)(event)

    def _finish(self, request: int, rank: int, event: Event, lost_group: bool = False) -> None:
        run = self._runs.get(request)
        if run is None:
            return
        run.irregular = run.irregular or lost_group or isinstance(event, Error)
        if run.pending == [rank] and run.kind in USER_KINDS and (run.irregular or run.interrupted):
            # Before the run is seen done: whoever renders it waits for this check too.
            run.step_check = self.check_step(run)
        run._add(event)
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

    def _rank_died(self, rank: int, body: dict[str, Any]) -> None:
        cause = body["cause"]
        detail = "\n".join(filter(None, [body.get("crash", "").strip()]))
        with self._lock:
            state = self.ranks[rank]
            state.state, state.cause, state.pid = "dead", cause, None
            queue = self._queues[rank]
            current = queue[0] if queue else None
            waiting = [run for run in self._runs.values() if rank in run.pending]
            queue.clear()
            self._generation_changed.notify_all()
        with self._send_lock:
            self._disconnect_rank(rank)
        for stream, text in body.get("output", {}).items():
            if text:
                self._deliver(current, Output(rank, stream, text))
        failure = RankFailure(rank, "RankDied", f"rank {rank} died: {cause}", died=cause, detail=detail)
        stranded = sorted({r for run in waiting for r in run.pending if r != rank})
        note = (f"rank {rank} died ({cause}). %mesh restart {rank} (mesh.restart([{rank}])) brings it "
                f"back and re-creates the process group; the other ranks keep their variables.")
        if stranded and not self.stopped:
            note += (f" Rank(s) {format_ranks(stranded)} ran beside it: meshbook freed them from "
                     f"anything waiting on it.")
            reason = f"meshbook aborted what this rank ran: rank {rank} died ({cause})"
            threading.Thread(target=self._free_stranded, args=(stranded, reason), daemon=True).start()
        for run in waiting:
            run.notes.append(note)
        for run in waiting:
            self._finish(run.id, rank, Error(rank, failure, time.monotonic() - run.submitted_at))
        for listener in self.death_listeners:
            listener(rank, cause)

    def _free_stranded(self, ranks: list[int], reason: str) -> None:
        """Ranks that were running beside a rank that died: the group is broken, so abort
        their collectives now instead of letting them wait for the collective timeout."""
        if not self.recovery_lock.acquire(blocking=False):
            return  # a recovery (restart, the second interrupt) frees them and re-creates the group
        try:
            abort(self, [r for r in ranks if self.ranks[r].state == "busy"], reason)
        except MeshError as exc:
            if not self.stopped:
                _log(f"could not free rank(s) {format_ranks(ranks)}: {exc}")
        finally:
            self.recovery_lock.release()

    def check_step(self, run: Run) -> "StepCheck | None":
        """Check that every rank is at the same collective in each group after ``run``
        stopped irregularly (see :mod:`meshbook.mesh.step`)."""
        if self.stopped or any(s.state == "dead" for s in self.ranks.values()):
            return None  # a dead rank's restart re-creates every group anyway
        check = StepCheck(self, "the interrupt" if run.interrupted else "the failed cell", run.forced_resync)
        with self._lock:
            self._step_checks = [c for c in self._step_checks if not c.done.is_set()] + [check]
        check.start()
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
            if not agent.alive():
                reason = f"host agent {host} died ({agent.exit_reason()})"
                for r in self.plans[host].ranks:
                    if self.ranks[r].state != "dead":
                        self._rank_died(r, {"cause": reason})
                self._mark_stopped(reason)

    def _mark_stopped(self, reason: str) -> None:
        with self._lock:
            if not self.stopped:
                self.stopped, self.stop_reason = True, reason
                self._generation_changed.notify_all()

    # -- shutdown ----------------------------------------------------------------------------

    def stop(self, reason: str = "stopped by the user") -> None:
        """Kill every rank and agent, fail what still runs, and remove the runtime directory."""
        with self._lock:
            already = self.stopped and not self.agents
            self._mark_stopped(reason)
            agents, self.agents = self.agents, []
        if already:
            return
        for agent in agents:
            agent.terminate(5.0)
        if threading.current_thread() is not self._receiver:
            self._wake_send.send(b"stop")
            self._receiver.join(5)
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            for r in run.pending:
                failure = RankFailure(r, "MeshStopped", f"the mesh was stopped ({self.stop_reason})",
                                      died="stopped")
                run._add(Error(r, failure, 0.0))
        for state in self.ranks.values():
            if state.state != "dead":
                state.state, state.cause = "dead", "mesh stopped"
        rank_socks = [sock for socks in self._down.values() for sock in socks.values()]
        for sock in (self.cmd, self.events, self._wake_send, self._wake_recv, *rank_socks):
            sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.rundir, ignore_errors=True)
        _LIVE.discard(self)


def _terminal_stdin() -> bool:
    import sys

    return sys.stdin is not None and sys.stdin.isatty()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _runtime_base() -> str:
    # ipc:// paths must stay under ~100 bytes; XDG_RUNTIME_DIR is private and short.
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base) and os.access(base, os.W_OK) and len(base) < 60:
        return base
    return tempfile.gettempdir()


def _describe_unpicklable(body: Any, exc: Exception) -> str:
    """Name the value that cannot be pickled: which argument, and its type."""
    items: list[tuple[str, Any]] = []
    if isinstance(body, dict):
        items += [(f"argument {i + 1}", v) for i, v in enumerate(body.get("args", ()))]
        items += [(f"keyword argument {k!r}", v) for k, v in body.get("kwargs", {}).items()]
        items += [(f"value {k!r}", v) for k, v in body.get("values", {}).items()]
        if "fn" in body:
            items.append(("the function", body["fn"]))
    for label, value in items:
        try:
            wire.dumps(value)
        except Exception as inner:
            return (f"{label} (a {type(value).__module__}.{type(value).__qualname__}) cannot be "
                    f"pickled: {inner}")
    return f"the request cannot be pickled: {exc}"


def _print_stray(event: Event) -> None:
    from .run import print_late

    print_late(event)


def _log(text: str) -> None:
    import sys

    print(f"meshbook: {text}", file=sys.__stderr__)


_LIVE: "weakref.WeakSet[Controller]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    from .launchers import discard_standby

    for controller in list(_LIVE):
        controller.stop("the Python process is exiting")
    discard_standby()
