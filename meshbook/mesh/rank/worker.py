"""The rank process: a persistent namespace that runs what the controller sends.

A rank is forked by its host agent (see :mod:`meshbook.mesh.agent.host`) and runs four threads:

* the **main thread** takes requests from the controller in order and runs them: cell code
  (``EXEC``, the value of a last expression is the result), notebook functions (``APPLY``) and
  meshbook's own operations (``CALL``, :mod:`.ops`). It is the only thread that runs user
  code, and the one SIGINT interrupts;
* the **control thread** answers control calls (stacks, ports) while the main thread is busy
  (torch.distributed releases the GIL while it waits), sends heartbeats and flushes partial
  output lines;
* the **watchdog** exits the rank if its agent is gone or its host is declared lost: it takes
  no lock and sends nothing, so no send stuck on a stopped agent can hold it up;
* the **fd pump** forwards C-level output (see :mod:`meshbook.mesh.rank.streams`).

Every reply and every output line leaves through one PUSH socket straight to the controller,
shared under a lock, so a rank's output always precedes the result it belongs to. Each thread
dispatches the kinds of :mod:`meshbook.mesh.protocol.messages` through a handler table; a kind
it has no handler for is counted in ``unknown_kinds`` and logged.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import hmac
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
import types
from _signal import getsignal as _getsignal
from collections import Counter
from dataclasses import replace
from functools import partial
from types import FunctionType
from typing import Any, Callable, Sequence

import psutil
import zmq

from ..protocol import messages as msg
from ..protocol import proc, wire
from ..protocol.cell import (
    VALUE_NAME,
    cell_filename,
    compile_cell,
    current_cell_line,
    failure_from,
    is_async,
    module_functions,
    place_code,
    register_source,
)
from ..protocol.config import HEARTBEAT_S
from ..protocol.errors import BROKEN_GROUP, RankFailure, SendError, home_of, knock_on, remaking, stale_names
from ..protocol.lane import Inbox, Uplink
from ..protocol.limits import KeptOnRank
from ..protocol.payload import Lent
from ..protocol.versions import versions
from . import connections, torchrun
from .actors import ActorHost
from .collectives import CollectiveClock
from .context import RankConfig
from .groups import DESTROYED_GROUP, stale_in_failure
from .ipython import route_display
from .memory import CudaStats, host_memory_probe
from .sampling import MainThreadSampler, see_through
from .streams import FdPump, RankStream, install_thread_tagging
from .torch_compat import FLIGHT_RECORDER_ENTRIES, flight_records, forget_device_meshes, oldest_nccl_pending

TICK_S = 0.2
#: How often a control thread whose ticks keep failing says so again: the first failure is
#: logged with its traceback at once, later ones are counted (a persistent error fails 5 a second).
TICK_ERRORS_EVERY_S = 60.0
#: How much before its controller declares its host lost a rank stops itself.
LOST_MARGIN_S = 1.0

#: Why a request interrupted before its user code started failed.
NOTHING_RAN = "interrupted before it started: nothing ran"


class NotRun(Exception):
    """A cell or function a rank did not run: it failed an earlier one, and the step check of
    that failure has not told it yet that the ranks are in step (see :meth:`Worker.handle`)."""

#: How a rank runs NCCL unless the user says otherwise (see DESIGN.md, "GPU paths"): a
#: collective that times out aborts its communicator and raises, keeping the process and its
#: variables (torch's default, 3, tears the process down: a rank paused in ``breakpoint()``
#: past the timeout would kill its peers); no dump on timeout, whose signal makes every rank's
#: heartbeat monitor kill its process minutes later (meshbook reads the flight recorder itself).
NCCL_ENVIRONMENT = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}


class Worker:
    """One rank: its namespace, its sockets and the loop that serves requests."""

    def __init__(self, cfg: RankConfig) -> None:
        self.cfg = cfg
        self.rank = cfg.rank
        self.wire = wire.Wire(cfg.key)
        #: The namespace cells run in: the ``__dict__`` of a real ``__main__`` module, as a
        #: script has, so a class defined in a cell pickles by reference (``pickle.dumps``,
        #: ``all_gather_object``, ``torch.save`` of a module) as it does under torchrun.
        self.namespace: dict[str, Any] = _main_module().__dict__
        #: This rank's ``torch.device``, set with its process group (see :class:`RankContext`).
        self.device: Any = None
        self.request: int | None = None  # what the main thread runs now (None: idle)
        self.last_request: int | None = None
        self.started_at = 0.0
        self.executing = False  # SIGINT raises KeyboardInterrupt only in user code
        self.last_exception: BaseException | None = None
        #: Whether the request being run can answer a debugger prompt (the notebook has stdin).
        self.stdin_available = False
        self.debugger: Any = None  # the pdb session open on the main thread (see RankContext)
        #: The most the running request's result may weigh (None: no limit, meshbook's own calls).
        self.result_limit: int | None = None
        #: Lines typed in the notebook for this rank's debugger, delivered by the control thread,
        #: each with the number of the question it answers.
        self.input_replies: queue.Queue[tuple[int, str | None]] = queue.Queue()
        #: Verdicts of step checks (see :mod:`meshbook.mesh.controller.recovery.step`), delivered by the control thread.
        self.verdicts: queue.Queue[tuple[int, int | None]] = queue.Queue()
        #: Requests interrupted before their user code started: dropped when their turn comes,
        #: or stopped where their user code starts (interrupted while their arguments unpickled).
        self.cancelled: set[int] = set()
        #: When this rank's process groups were made (wall clock ns, as the flight recorder's).
        self.group_since_ns = 0
        #: Where cells with a top-level ``await`` run: one loop for the rank's life, as a
        #: kernel's, so what a cell leaves bound to it (a session, a queue) works in the next.
        self._loop: Any = None
        #: The request a targeted interrupt is meant for (None: any user code, e.g. SIGINT).
        self.interrupt_target: int | None = None
        #: Held while the main thread takes a request and while an interrupt decides whether
        #: that request runs or waits: so it is either signalled or found cancelled, never neither.
        self._taking = threading.Lock()
        self._failed_ticks = _FailedTicks()
        #: How the user's last code (a cell, an applied function, an endpoint) ended, in words
        #: (the hang diagnosis quotes it), and whether the request running now is user code.
        self.last_outcome = ""
        self.last_knock_on = False
        self.last_user_request: int | None = None
        self.running_user_code = False
        #: Why meshbook aborted a request's collective, for its error, and whether the rank waited
        #: in one when told (request -> (reason, waited)).
        self.abort_reasons: dict[int, tuple[str, bool]] = {}
        #: The cell or function this rank failed (its request, and "failed cell [3]"), from its failure
        #: until a step check lets it go (``hold``), its groups are re-created (``reinit``) or the
        #: controller says no check will come for it (``resume``): cells and functions sent
        #: before that are not run.
        self.failed_before: tuple[int, str] | None = None
        #: Requests below this number came from a kernel that let this kept mesh go: a step
        #: check of theirs gets no verdict (``ops.supersede``).
        self.superseded_below = 0
        #: Messages of a kind no handler takes, by kind (each is logged too).
        self.unknown_kinds: Counter[str] = Counter()
        #: This rank's actors (spawned, called from the notebook and from other ranks).
        self.actors = ActorHost(self)
        #: Pieces of a push to another host, put together until its store (see ops.stage).
        self.staged: dict[bytes, dict[int, bytearray]] = {}
        #: Values of pulls in shared memory, until the notebook mapped them (see ops.fetch).
        self.lent = Lent()
        self._main_handlers: dict[str, Callable[[dict[str, Any], int], Any]] = {
            msg.EXEC: self._exec, msg.APPLY: self._apply, msg.CALL: self._call,
            msg.ACTOR: self.actors.serve, msg.PEER: self.actors.serve}
        #: Where the answer to a request goes when not to the controller, by kind: a
        #: rank-to-rank actor call is answered straight to its caller.
        self._reply_routes: dict[str, Callable[[wire.Message, list[Any]], None]] = {msg.PEER: self.actors.reply}
        self._control_handlers: dict[str, Callable[[wire.Message], None]] = {
            msg.CALL: self._control_call, msg.INPUT: self._control_input, msg.PEER_STOP: self._control_peer_stop}
        self._noted_in: int | None = None
        self._noted: set[str] = set()
        self.generation = cfg.generation
        #: The DeviceMesh of the mesh's dims (``device_mesh`` in the namespace, which user code may rebind).
        self.device_mesh: Any = None
        self._ctx = zmq.Context()
        self._out = self._ctx.socket(zmq.PUSH)
        self._out.setsockopt(zmq.LINGER, 2000)
        self._out.connect(cfg.events_addr)
        self._uplink = Uplink(cfg.events_addr)  # the same way up, past ZeroMQ where it can
        cfg.last_words.claim()
        self._out_lock = threading.Lock()
        self._next_beat = 0.0  # when the control thread sends the next heartbeat
        self._process = psutil.Process()
        self._process.cpu_percent()
        #: Extra fields for heartbeats, filled by other rooms (e.g. straggler sampling).
        self.heartbeat_extras: dict[str, Callable[[], Any]] = {}
        #: When the main thread enters and leaves each collective (see collectives.py).
        self.clock = CollectiveClock(lambda: self.request, enqueues_gpu_work="nccl" in cfg.backend)
        #: Where the main thread spends its time (for straggler detection), and memory headroom.
        self.sampler = MainThreadSampler(self.main_frame, lambda: self.request,
                                         device_wait=oldest_nccl_pending if "nccl" in cfg.backend else None,
                                         call=lambda: self.clock.call)
        self.heartbeat_extras["sampling"] = self.sampler.report
        self.heartbeat_extras["memory"] = host_memory_probe()
        #: CUDA memory, read off the control thread (an NCCL rank's GPU is its memory pool).
        self.cuda = CudaStats(cfg.local_rank if cfg.device_type == "cuda" else None)

    # -- sending ---------------------------------------------------------------------------

    def emit(self, kind: str, request: int | None, body: Any = None, wait: bool = False,
             **header: Any) -> None:
        frames = self.wire.pack({msg.KIND: kind, msg.ID: request, msg.RANK: self.rank, **header}, body)
        with self._out_lock:
            self._send(frames, wait)

    def _send(self, frames: list[Any], wait: bool) -> None:
        """Up to the controller (under the send lock), kept first for the agent, which sends it
        on should this rank die before ZeroMQ did (:mod:`~..protocol.lastwords`)."""
        self.cfg.last_words.keep(frames)
        if not self._uplink.send(frames):
            wire.send(self._out, frames, wait=wait)
            self._uplink.sent_by_zmq()

    def _output(self, request: int | None, stream: str, text: str) -> None:
        self.emit(msg.OUTPUT, request if request is not None else self.last_request,
                  {"stream": stream, "text": text})

    def lane_use(self) -> tuple[int, int]:
        """Requests that came by the lane, and messages that went up by it (see
        :mod:`~..protocol.lane`)."""
        return self._requests.by_lane, self._uplink.by_lane

    def current_request(self) -> int | None:
        return self.request if self.request is not None else self.last_request

    # -- start-up --------------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.cfg
        self.stdout = RankStream("stdout", 1, self._output, self.current_request)
        self.stderr = RankStream("stderr", 2, self._output, self.current_request)
        sys.stdout, sys.stderr = self.stdout, self.stderr
        install_thread_tagging(self.current_request)
        self.pump = FdPump(cfg.pipes, self._output, self.current_request)
        signal.signal(signal.SIGINT, self._on_sigint)
        sys.argv = ["mesh-rank"]  # the agent's own arguments would confuse a script's argparse
        self.init_group, self.destroy_group = torchrun.install(self)
        self.clock.install()
        see_through(self.clock.codes)
        from .debugger import breakpoint_hook, input_hook
        sys.breakpointhook = breakpoint_hook(self)
        builtins.input = input_hook(self)
        route_display(self.display)
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        self._requests = Inbox(cfg.request_addr, self._listen(cfg.request_addr))
        self._control_requests = self._listen(cfg.control_addr)  # handed to the control thread
        threading.Thread(target=self._control_loop, name="meshbook-control", daemon=True).start()
        threading.Thread(target=self._watch, name="meshbook-watchdog", daemon=True).start()
        self.emit(msg.HELLO, None, {"pid": os.getpid(), "host": socket.gethostname(), "versions": versions()})
        self.reinit(cfg.generation)

    def move_store(self, store: tuple[str, int]) -> None:
        """Meet the other ranks at ``store`` from the next generation on (across hosts)."""
        self.cfg = replace(self.cfg, store_addr=store)

    def reinit(self, generation: int, lost_hosts: Sequence[str] = ()) -> None:
        """Join process-group ``generation`` and tell the controller (start and recovery)."""
        header: dict[str, Any] = {msg.GENERATION: generation}  # header fields, not emit's options
        try:
            self.init_distributed(generation, lost_hosts)
        except BaseException as exc:
            self.emit(msg.INIT_FAILED, None, failure_from(self.rank, exc), **header)
            raise
        self.emit(msg.READY, None, self.ready_report(), **header)

    def ready_report(self) -> dict[str, Any]:
        """What READY says of this rank: its device, its pid, how its threads were set; and
        the request its main thread runs (for a kernel that attaches: a run of the one before)."""
        return {"device": str(self.namespace["device"]), "pid": os.getpid(), "threads": self.cfg.threads_note,
                "running": self.request}

    def init_distributed(self, generation: int, lost_hosts: Sequence[str] = ()) -> None:
        """(Re)create the process group and the namespace's ``device_mesh``; leaving the old
        one with work pending, shut the connections that would keep gloo's destroy waiting:
        those on this rank's listening ports, and those it opened to ``lost_hosts``."""
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        cfg = self.cfg
        self.failed_before = None  # new groups: every rank at their first collective
        if dist.is_initialized():
            if "nccl" not in cfg.backend and flight_records():  # else gloo's destroy waits for that work
                connections.shut_down(connections.listening_ports(), hosts=lost_hosts)  # (see there; NCCL: not tried)
            self.destroy_group()
            forget_device_meshes()  # DTensor's decisions name the old groups
        self.group_since_ns = time.time_ns()  # the flight recorder's calls of these groups come after
        if cfg.device_type == "cuda":
            torch.cuda.set_device(cfg.local_rank)
            device = torch.device("cuda", cfg.local_rank)
        else:
            device = torch.device("cpu")
        self.device = device
        topo = cfg.topology
        from datetime import timedelta
        timeout = timedelta(seconds=cfg.collective_timeout)
        os.environ.update(torchrun.environment(
            self.rank, topo.world_size, cfg.local_rank, cfg.local_world_size, cfg.group_rank,
            cfg.group_world_size, cfg.store_addr or (cfg.listen_addr, cfg.master_port)))
        store = make_store(cfg, generation, timeout)
        # On NCCL, binding the device connects the communicator now (not at the first
        # collective, with a warning in the user's cell), and lets DeviceMesh split groups.
        bound = {"device_id": device} if "nccl" in cfg.backend else {}
        self.init_group(cfg.backend, store=store, rank=self.rank, world_size=topo.world_size, timeout=timeout,
                        **bound)
        device_mesh = init_device_mesh(cfg.device_type, topo.shape, mesh_dim_names=topo.names)
        self.device_mesh = device_mesh  # the namespace's may be replaced by the user's code
        self.generation = generation
        self.clock.new_generation(generation)
        self.namespace.update(
            rank=self.rank, world_size=topo.world_size, local_rank=cfg.local_rank,
            coords=topo.coords(self.rank), device=device, torch=torch, dist=dist,
            device_mesh=device_mesh, display=self.display)
        self.namespace.setdefault("__builtins__", __builtins__)

    # -- the main loop ---------------------------------------------------------------------

    def _listen(self, addr: str) -> zmq.Socket:
        """A PULL socket the controller sends to; it connected (and queued) before we bound."""
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(addr)
        return sock

    def serve(self) -> None:
        requests = self._requests
        while True:
            try:
                frames = requests.next()
            except KeyboardInterrupt:
                # Idle: an interrupt stops nothing here, as this rank's own handler decides. The
                # user's code may have installed Python's (signal.default_int_handler), which
                # raised it here, and the rank died of an interrupt while it waited.
                continue
            try:
                message = self.wire.unpack(frames)
            except wire.BadMessage:
                continue
            self.handle(message)

    def handle(self, message: wire.Message) -> None:
        self.check_alive()  # never run what came for a host already declared lost
        request = message.header[msg.ID]
        handler = self._main_handlers.get(message.kind)
        if handler is None:
            self.note_unknown(message.kind, "main")
        route = self._reply_routes.get(message.kind)
        reply = partial(route, message) if route is not None else None
        self.started_at = time.monotonic()
        self.running_user_code = message.kind != msg.CALL  # a cell, an applied function, an endpoint
        in_step = message.kind in msg.USER_KINDS  # read again with the body (a rank operation's says)
        try:
            # Dropped if interrupted before it started, unless it is one of meshbook's collective
            # operations, which every rank runs to its end (see _call; its body, cheap to read, says).
            taken = self._take(request)
            if not taken and message.kind != msg.CALL:
                raise KeyboardInterrupt(NOTHING_RAN)
            if handler is None:
                raise ValueError(f"this rank has no handler for requests of kind {message.kind!r}")
            body = message.body()
            in_step = msg.pairs_collectives(message.kind, body)
            if not taken and not in_step:
                raise KeyboardInterrupt(NOTHING_RAN)
            if in_step and self.failed_before is not None:
                raise NotRun(self.not_run_because())
            self.stdin_available = bool(body.get("stdin"))
            self.result_limit = body.get("max_bytes")
            value = _clean_exit_is_none(handler, body, request)
        except NotRun as exc:  # nothing ran: the failure it follows stays the rank's last (debug, diagnosis)
            self.running_user_code = False
            self._finish(request, failure=RankFailure(self.rank, NotRun.__name__, str(exc)), reply=reply)
        except BaseException as exc:  # noqa: BLE001 - anything the user's code raises is a result
            failure = _explain_stale(exc, failure_from(self.rank, exc), self.namespace)
            if in_step and self.failed_before is None:
                # Sent before anyone knew: the others may run it, and its collectives would
                # pair with the ones they still issue in this (a wrong number, as a success).
                self.failed_before = (request, f"failed {_described(message)}")
            if _out_of_memory(exc):  # its frames hold the tensors that filled the memory: let go
                traceback.clear_frames(exc.__traceback__)
            self.last_exception = exc
            reason, waited = self.abort_reasons.pop(request, ("", False))
            if reason and (waited or not _interrupted_in_python(exc)):
                failure = replace(failure, type_name="CollectiveAborted", message=reason, detail="")
            self._finish(request, failure=_stopped_pipeline(exc, failure), reply=reply)
        else:
            if value is not None and _holds_dtensors(value):
                print(DTENSOR_RESULT, file=sys.stderr)  # before the answer: flushed with the run's output
            self._finish(request, value=value, reply=reply)

    def not_run_because(self) -> str:
        """Why a cell or function sent before the step check of this rank's failure did not run."""
        assert self.failed_before is not None
        # No rank number: the ranks that failed alike group as one line ("[0-3] NotRun: ...").
        return (f"not run: this rank {self.failed_before[1]} before this reached it, and "
                f"runs nothing sent before meshbook has checked that the ranks are still in step after that "
                f"(what you run next runs as usual)")

    def _take(self, request: int) -> bool:
        """Make ``request`` the running one; False if it was interrupted while it waited.
        Under the lock :meth:`interrupt` decides under: an interrupt that saw it waiting
        cancelled it before this looks."""
        with self._taking:
            self.request = request
            self.clock.began(request)
            if request not in self.cancelled:
                return True
            self.cancelled.discard(request)
            return False

    def interrupt(self, request: int) -> None:
        """Interrupt ``request`` only (control thread): signal the main thread if it runs it
        now, cancel it if it still waits, nothing if it finished."""
        with self._taking:
            if self.request == request:
                self.interrupt_target = request
                # To the main thread itself: a blocking call there (sleep, select, a socket) returns
                # with EINTR and the handler runs now; a process-wide SIGINT may land on any thread.
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]
            elif request < 0 or self.last_request is None or request > self.last_request:
                # (a rank-to-rank call's number says nothing of its order: dropped when its turn
                # comes, or, had it ended already, kept here as a number no request will take)
                self.cancelled.add(request)

    def _exec(self, body: dict[str, Any], request: int) -> Any:
        filename = cell_filename(body.get("name", request))
        source, first = body["code"], body.get("first_line", 1)
        code = compile_cell(source, filename, first)
        register_source(filename, source, first)
        ns = self.namespace
        # Python remembers a warning shown from these globals by its text and line: every cell
        # shares them, so a cell run again (or another warning at that line) showed nothing. Per
        # cell, as IPython does locally.
        ns.pop("__warningregistry__", None)
        try:
            with self.user_code():
                self._evaluate(code, ns)
        finally:  # never left in the namespace, however the cell ends
            value = ns.pop(VALUE_NAME, None)
        if value is not None:
            ns["_"] = value
        return value

    def _evaluate(self, code: types.CodeType, ns: dict[str, Any]) -> Any:
        """Run a cell's code; one that awaits at the top level runs on the rank's event loop
        (an interrupt cancels what it awaits)."""
        if not is_async(code):
            return eval(code, ns)
        return self.run_awaitable(eval(code, ns))

    def run_awaitable(self, coroutine: Any) -> Any:
        """Run ``coroutine`` to its end on the rank's event loop: one per rank, kept across
        requests (what a cell's top-level ``await`` started stays on it); an interrupt cancels
        what it awaits."""
        import asyncio

        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
        task = self._loop.create_task(coroutine)
        try:
            return self._loop.run_until_complete(task)
        finally:
            task.cancel()  # a no-op once done; else (Ctrl-C) it stops at its next await

    def _apply(self, body: dict[str, Any], request: int) -> Any:
        fn = body["fn"]
        if isinstance(fn, FunctionType) and _travelled_by_value(fn):
            place_code(module_functions(fn), body.get("code", {}))  # what the controller placed
            self._rebind(fn)
        with self.user_code():
            return fn(*body["args"], **body["kwargs"])

    def _call(self, body: dict[str, Any], request: int) -> Any:
        # One of meshbook's operations that every rank runs together (plan's measuring,
        # parallelize) makes process groups as it goes: an interrupt that stopped it on some
        # ranks (in their Python, or before they started it) while others waited in C for a
        # group they join left those waiting for good. Every rank runs it to its end,
        # interrupted or not (a second interrupt of a cell still frees the ranks).
        with self.shielded() if msg.pairs_collectives(msg.CALL, body) else self.user_code():
            return body["fn"](self, *body["args"], **body["kwargs"])

    def note_unknown(self, kind: str, channel: str) -> None:
        """Count and log a message no handler takes (a controller of another version?)."""
        self.unknown_kinds[kind] += 1
        self._log(f"has no handler for {kind!r} messages on its {channel} channel "
                  f"({self.unknown_kinds[kind]} so far)")

    def _log(self, text: str) -> None:
        """``meshbook: rank N <text>``, output of no request: the notebook shows it at once.
        Not through fd 2, whose pump tags a line with the request running when it reads it:
        a control call answered meanwhile took the line into its own run, which nobody shows.
        Where the socket fails (a tick that fails may be failing on it), the rank's stderr."""
        line = f"meshbook: rank {self.rank} {text}\n"
        try:
            self.emit(msg.OUTPUT, None, {"stream": "stderr", "text": line})
        except Exception:  # noqa: BLE001 - a log line must never end the thread that logs
            stderr = sys.__stderr__
            assert stderr is not None  # a rank inherits its agent's
            stderr.write(line)
            stderr.flush()

    def _rebind(self, fn: FunctionType) -> None:
        """A notebook function sees the rank's namespace first, then what it carried along, and
        so do the notebook's functions it calls: they travelled with it, and share the globals
        cloudpickle made for them on arrival (a fresh dict, not a module's), updated here."""
        fn.__globals__.update(self.namespace)

    def user_code(self) -> "_Interruptible":
        return _Interruptible(self, True)

    def shielded(self) -> "_Interruptible":
        """meshbook's own work that an interrupt must not cut in half: a rank left halfway
        into a new process group, or past a step check without its verdict, is out of step."""
        return _Interruptible(self, False)

    def _finish(self, request: int, value: Any = None, failure: RankFailure | None = None,
                reply: Callable[[list[Any]], None] | None = None) -> None:
        if _getsignal(signal.SIGINT) is signal.default_int_handler:  # not signal.getsignal: 4.7 us a request, its enum
            # The user's code installed Python's own (as scripts do). In user code this rank's
            # raises alike; in meshbook's own work Python's raised too: in the answer's send,
            # after the notebook had it, and the rank died of it, out of the mesh.
            signal.signal(signal.SIGINT, self._on_sigint)
        # Not user code from here on, whatever a block left: an interrupt that lands as a block
        # ends (before its __exit__ restored this) raises there and leaves it set.
        self.executing = False
        duration = time.monotonic() - self.started_at
        self.stdout.flush()
        self.stderr.flush()
        proc.flush_c_stdio()
        self.pump.drain()
        if self.debugger is not None:  # stepped past the cell's end: the session ends with it
            self.debugger.close()
        self.last_request, self.request = request, None
        self.clock.began(None)
        self.cancelled.discard(request)  # an interrupt kept for user code it never reached
        self.abort_reasons.pop(request, None)  # told by a recovery whose abort it never needed
        if self.running_user_code:  # how the user's last code ended: meshbook's own requests say nothing of it
            self.last_outcome, self.last_user_request = describe_outcome(failure), request
            self.last_knock_on = failure is not None and knock_on(failure)
        # The collectives it ran go first, so the controller has them when the run ends (and
        # before the answer is signed: a thread's messages must leave in the order it signs).
        self.send_collectives()
        # False tells the controller this rank lost its process group: a step check follows.
        header = {msg.DURATION: duration, msg.HAS_GROUP: _has_process_group()}
        if failure is None:
            try:
                frames = self._pack_result(request, value, header)
            except Exception as exc:
                self.namespace["_"] = value  # an apply's or an endpoint's too: what the message says
                failure = RankFailure(
                    self.rank, SendError.__name__,
                    f"the result (a {type(value).__module__}.{type(value).__qualname__}) cannot be "
                    f"sent to the notebook: {exc}. It is kept on the rank as `_`; return something "
                    f"picklable, e.g. a tensor, a number or a dict of them")
            else:
                self._answer(frames, reply)
                return
        self._answer(self.wire.pack({msg.KIND: msg.ERROR, msg.ID: request, msg.RANK: self.rank, **header},
                                    failure), reply)

    def _answer(self, frames: list[Any], reply: Callable[[list[Any]], None] | None) -> None:
        """A request's answer: to the controller, or where its kind's reply route says."""
        if reply is not None:
            reply(frames)
            return
        with self._out_lock:
            self._send(frames, True)

    def send_collectives(self) -> None:
        """What the collective clock recorded since it was last sent (either thread): taken,
        signed and sent under the send lock, so batches reach the controller in the order they
        were taken."""
        with self._out_lock:
            batch = self.clock.take()
            if batch is not None:
                self._send(self.wire.pack({msg.KIND: msg.COLLECTIVES, msg.ID: None, msg.RANK: self.rank}, batch),
                           False)

    def note_once(self, key: str, text: str) -> None:
        """Print ``text`` to the cell once per request (a loop calling init_process_group...)."""
        if self._noted_in != self.request:
            self._noted_in, self._noted = self.request, set()
        if key not in self._noted:
            self._noted.add(key)
            print(text, file=sys.stderr)

    def _pack_result(self, request: int, value: Any, fields: dict[str, Any]) -> list[Any]:
        """The result's message; a result over the request's limit stays here as ``_`` and a
        :class:`KeptOnRank` travels instead. Its tensors are weighed before they are copied off
        their device, so a 40 GB CUDA result is never copied to host memory to be weighed."""
        type_name = f"{type(value).__module__}.{type(value).__qualname__}"
        header = {msg.KIND: msg.RESULT, msg.ID: request, msg.RANK: self.rank, msg.TYPE: type_name, **fields}
        limit = self.result_limit
        try:
            frames = self.wire.pack(header, value, limit=limit)
        except wire.TooBig as exc:
            nbytes = exc.nbytes
        else:
            if limit is None:
                return frames
            nbytes = wire.size(frames)
            if nbytes <= limit:
                return frames
        assert limit is not None
        self.namespace["_"] = value
        return self.wire.pack(header, KeptOnRank(type_name, nbytes, limit))

    def _on_sigint(self, signum: int, frame: Any) -> None:
        """KeyboardInterrupt in user code. One for the running request (targeted, or a blind
        SIGINT) that lands in meshbook's own work for it (its arguments unpickling, a shielded
        step) is kept: it stops the request where its user code starts, if it has yet to. One
        for a request that finished, or while idle, is dropped."""
        target, self.interrupt_target = self.interrupt_target, None
        request = self.request
        if request is None or target not in (None, request):
            return
        if self.executing:
            raise KeyboardInterrupt
        self.cancelled.add(request)

    def display(self, *objs: Any, raw: bool = False, **kwargs: Any) -> None:
        """``display()`` on a rank (IPython's too): each object's rich representations go to
        the notebook; with ``raw``, objects that are such representations already (a dict of
        MIME type to data) go as they are."""
        for obj in objs:
            self.stdout.flush()
            self.emit(msg.DISPLAY, self.current_request(), obj if raw and isinstance(obj, dict) else mimebundle(obj))

    # -- the control thread ----------------------------------------------------------------

    def _control_loop(self) -> None:
        """Tick after tick; an error in one (a message that does not unpickle, a file closed
        already, a result that does not pickle) is logged, and the next tick comes: heartbeats,
        interrupts and answers while the main thread is busy would end with this thread. An
        error that fails every tick is logged once, then counted (:class:`_FailedTicks`)."""
        while True:
            try:
                self._control_tick()
            except BaseException:  # noqa: BLE001 - nothing may end this thread
                said = self._failed_ticks.failed(traceback.format_exc(), time.monotonic())
                if said:
                    self._log(said)

    def _control_tick(self) -> None:
        """Answer what came (waiting a tick for it), flush partial lines, sample the main thread,
        close what no pull claimed, and send a heartbeat when one is due."""
        sock = self._control_requests
        if sock.poll(int(TICK_S * 1000)):
            try:
                message = self.wire.unpack(wire.recv(sock))
            except wire.BadMessage:
                return
            self._control(message)
        self.stdout.flush()
        self.stderr.flush()
        now = time.monotonic()
        self.sampler.tick(now)
        self.lent.expire(now)  # what an interrupted pull never claimed
        if now >= self._next_beat:
            self._next_beat = now + HEARTBEAT_S
            self.emit(msg.HEARTBEAT, None, self.metrics())
            self.send_collectives()

    def _watch(self) -> None:
        """The watchdog thread. Not a part of the control thread, whose sends wait for the send
        lock: a send to a stopped agent (a big result, output past the high-water mark) holds
        that as long as the agent stays stopped, and the host is declared lost meanwhile."""
        while True:
            if os.getppid() != self.cfg.agent_pid:
                os._exit(1)  # the agent is gone: never outlive it
            self.check_alive()
            time.sleep(TICK_S)

    def check_alive(self) -> None:
        """Stop this rank (and what it started) when its agent has not heard the controller for
        the loss window: the controller declares the host lost then, and may start this rank
        anew elsewhere; two copies must never act at once (a checkpoint written twice). A little
        before the controller does, so that nothing more happens here after it has."""
        silence = self.cfg.liveness.silence()
        if silence > max(1.0, self.cfg.lost_s - LOST_MARGIN_S):
            # Said in the crash file: its agent sends it with the death, so the error says why
            # this rank died of SIGKILL (the signal it sends itself, to take its children too).
            # Said if it can be: a full disk must not keep the rank from stopping.
            with contextlib.suppress(OSError), open(self.cfg.crash_path, "a") as crash:
                crash.write(f"meshbook: rank {self.rank} stopped itself: its agent had not heard the "
                            f"controller for {silence:.1f} s (the host is lost after {self.cfg.lost_s:g} s)\n")
            os.killpg(0, signal.SIGKILL)

    def _control(self, message: wire.Message) -> None:
        handler = self._control_handlers.get(message.kind)
        if handler is not None:
            handler(message)
            return
        self.note_unknown(message.kind, "control")
        if message.header[msg.ID] is not None:  # someone waits for an answer: say why none comes
            failure = RankFailure(self.rank, "ValueError", f"no handler for {message.kind!r} messages")
            self.emit(msg.ERROR, message.header[msg.ID], failure)

    def _control_peer_stop(self, message: wire.Message) -> None:
        """A rank that called one of this rank's actors gave up waiting: stop that call."""
        self.interrupt(message.header[msg.ID])

    def _control_input(self, message: wire.Message) -> None:
        """A line for this rank's debugger, typed in the notebook."""
        body = message.body()
        self.input_replies.put((body["question"], body["text"]))

    def _control_call(self, message: wire.Message) -> None:
        request = message.header[msg.ID]
        try:
            body = message.body()
            value = body["fn"](self, *body["args"], **body["kwargs"])
        except Exception as exc:
            self.emit(msg.ERROR, request, failure_from(self.rank, exc))
        else:
            self.emit(msg.RESULT, request, value)

    def main_frame(self) -> Any:
        return sys._current_frames().get(threading.main_thread().ident)  # type: ignore[arg-type]

    def metrics(self) -> dict[str, Any]:
        """A heartbeat: what the rank is doing and what it uses."""
        busy = self.request is not None
        out: dict[str, Any] = {
            "request": self.request,
            "busy_s": time.monotonic() - self.started_at if busy else 0.0,
            "line": current_cell_line(self.main_frame()) if busy else None,
            "rss": self._process.memory_info().rss,
            "cpu": self._process.cpu_percent(),
            "generation": self.generation,
        }
        for name, extra in self.heartbeat_extras.items():
            out[name] = extra()
        out.update(self.cuda.latest())  # the GPU's pool replaces the host's on an NCCL rank
        return out


def _described(message: wire.Message) -> str:
    """``cell [7]``, ``an earlier run``, ``an applied function``, ``a call of policy.step`` or
    ``meshbook's parallelize``: what the user sent, in words."""
    if message.kind == msg.APPLY:
        return "an applied function"
    try:
        body = message.body()
    except Exception:  # noqa: BLE001 - a body that would not unpickle: that was the failure
        body = {}
    if message.kind == msg.CALL:
        return f"meshbook's {getattr(body.get('fn'), '__name__', 'operation')}"
    if message.kind == msg.ACTOR:
        return (f"the spawn of {body.get('actor')}" if "cls" in body
                else f"a call of {body.get('actor')}.{body.get('endpoint')}")
    name = body.get("name")
    return f"cell [{name}]" if isinstance(name, int) else "an earlier run"


def _interrupted_in_python(exc: BaseException) -> bool:
    """Did an interrupt stop this rank in Python, where an abort of its collectives came too (a
    recovery aborts those of every rank still busy after a moment, in Python or not)? The caller
    also asks whether it waited in a collective when told. A ``KeyboardInterrupt`` raised while
    a collective's error (a ``RuntimeError``: gloo's, or a send or recv no flight recorder
    lists) unwound has that error in its context: that rank was freed by the abort. One raised
    in the cleanup of an earlier interrupt has only that one there. (An NCCL wait the abort
    ends returns without an error: such a rank said it waited.)"""
    if not isinstance(exc, KeyboardInterrupt):
        return False
    context = exc.__context__
    while context is not None and not isinstance(context, RuntimeError):
        context = context.__context__
    return context is None


def describe_outcome(failure: RankFailure | None) -> str:
    """``stopped with KeyboardInterrupt at cell line 4 (time.sleep(600))``."""
    if failure is None:
        return "finished the cell"
    frame = next((f for f in reversed(failure.frames) if f.in_cell), None)
    where = f" at {frame.place(home_of(failure.frames))}" + (f" ({frame.line})" if frame.line else "") if frame else ""
    return f"stopped with {failure.type_name}{where}"


def _main_module() -> types.ModuleType:
    """A fresh ``__main__`` for the rank (the agent's entry module was ``__main__`` so far)."""
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    return main


def _explain_stale(exc: BaseException, failure: RankFailure, namespace: dict[str, Any]) -> RankFailure:
    """A collective that failed on a closed or destroyed group, where the namespace holds
    objects built on groups meshbook has re-created since, and the failure came from them (see
    ``stale_in_failure``): the headline says which to re-create (gloo's own "Connection closed
    by peer" says a peer crashed, which it did not, and torch's "not initialized in the world
    group map" names no variable)."""
    if not (BROKEN_GROUP.search(failure.message) or DESTROYED_GROUP.search(failure.message)):
        return failure
    stale = stale_in_failure(exc, failure.message, namespace)
    if not stale:
        return failure
    return replace(failure, message=(
        f"{stale_names(stale)} still use{'s' if len(stale) == 1 else ''} process groups meshbook re-created "
        f"since {'it was' if len(stale) == 1 else 'they were'} built (the old ones are closed): re-create "
        f"{'it' if len(stale) == 1 else 'them'} on the new groups: {remaking(stale)}. The collective said: "
        f"{failure.message}"))


#: What a rank whose failure stopped a pipeline schedule mid-step is told (the same on every stage).
STOPPED_PIPELINE = ("meshbook: the pipeline schedule stopped in the middle of its step: its stages keep that step's "
                    "micro-batches, and its next step fails or hangs. Make the stages and the schedule again before "
                    "the next step (for parallelize's step: mesh.parallelize(...) again)")
_SCHEDULES = os.path.join("pipelining", "schedules.py")


def _stopped_pipeline(exc: BaseException, failure: RankFailure) -> RankFailure:
    """A failure raised inside a torch pipeline schedule's step (a stage's own error, or a
    receive meshbook aborted): the schedule is not fit for another step, which failed with
    "Expecting 4 losses but got 5" or "Trying to backward through the graph a second time"."""
    tb = exc.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.endswith(_SCHEDULES):
        tb = tb.tb_next
    if tb is None:
        return failure
    return replace(failure, detail="\n".join(filter(None, [failure.detail, STOPPED_PIPELINE])))


#: What a rank says of a result that holds DTensors (each travels as its local shard): the
#: same words on every rank, so they merge into one line.
DTENSOR_RESULT = ("meshbook: the result holds DTensors, and the notebook gets each rank's local shard of them "
                  "(not the whole tensor); .full_tensor() on the ranks, or mesh.ref(NAME).full_tensor(), gives "
                  "the whole")


def _holds_dtensors(value: Any) -> bool:
    """Is ``value`` a DTensor, or a dict, list or tuple with one among its items?"""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None:
        return False
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
    return any(isinstance(item, dtensor) for item in items)


def _out_of_memory(exc: BaseException) -> bool:
    """A CUDA (or host) out-of-memory error: keeping its frames alive keeps the memory full."""
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"


def _has_process_group() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is None or not dist.is_available() or dist.is_initialized()


def make_store(cfg: RankConfig, generation: int, timeout: Any) -> Any:
    """The store where the ranks of process-group ``generation`` meet.

    On one host, a file in the mesh's private (0700) runtime directory: only the mesh's own
    processes can open it, where a ``TCPStore`` listens on every interface and lets anyone set
    and get its keys. One file per generation, so ranks re-forked by a recovery never read the
    keys of the group they replace.

    Across hosts, the ``TCPStore`` its host 0's agent keeps. torch's store authenticates no
    one, so the keys of each generation live under a prefix derived from the mesh's secret
    key: a peer that reaches the port can neither read nor plant the mesh's keys, since it
    cannot name them.
    """
    import torch.distributed as dist

    if cfg.store_addr is None:
        store = dist.FileStore(os.path.join(cfg.rundir, f"store-g{generation}"), cfg.topology.world_size)
        store.set_timeout(timeout)
        return dist.PrefixStore(f"gen{generation}", store)
    host, port = cfg.store_addr
    secret = hmac.new(cfg.key, b"store", hashlib.sha256).hexdigest()[:32]
    client = dist.TCPStore(host, port, None, False, timeout)
    return dist.PrefixStore(f"gen{generation}-{secret}", client)


def _travelled_by_value(fn: FunctionType) -> bool:
    """True for a function cloudpickle sent by value (defined in a notebook or a test),
    whose globals are a fresh dict rather than an importable module's namespace."""
    module = sys.modules.get(fn.__module__ or "")
    return module is None or fn.__globals__ is not vars(module)


class _FailedTicks:
    """The control thread's failed ticks, logged without flooding the rank's log: the first
    with its traceback, then at most one line per :data:`TICK_ERRORS_EVERY_S` saying how many
    failed since, with the traceback only where it is not the one shown last."""

    def __init__(self) -> None:
        self.count = 0  # failed since the last line
        self.logged_at: float | None = None
        self.shown = ""

    def failed(self, text: str, now: float) -> str:
        """What to log for a tick that failed with traceback ``text`` (empty: nothing now)."""
        self.count += 1
        if self.logged_at is None:
            said = f"failed a tick of its control thread:\n{text}"
        elif now - self.logged_at < TICK_ERRORS_EVERY_S:
            return ""
        else:
            how = " (the same error as before)" if text == self.shown else f", the last one with:\n{text}"
            said = (f"failed {self.count} more tick{'s' if self.count > 1 else ''} of its control "
                    f"thread in the last {now - self.logged_at:.0f} s{how}")
        self.count, self.logged_at, self.shown = 0, now, text
        return said


class _Interruptible:
    """Whether SIGINT becomes KeyboardInterrupt inside the block (restored after it): yes in
    user code, no in meshbook's own work within a request (joining a group, a step check).
    User code does not start for a request interrupted before it (see ``Worker._on_sigint``);
    ``executing`` is set first, so an interrupt landing between the two raises in the handler."""

    def __init__(self, worker: Worker, interruptible: bool) -> None:
        self.worker, self.interruptible, self.before = worker, interruptible, False

    def __enter__(self) -> None:
        worker = self.worker
        self.before, worker.executing = worker.executing, self.interruptible
        if self.interruptible and worker.request in worker.cancelled:
            worker.executing = self.before
            worker.cancelled.discard(worker.request)
            raise KeyboardInterrupt(NOTHING_RAN)

    def __exit__(self, *exc: Any) -> None:
        self.worker.executing = self.before


def mimebundle(obj: Any) -> dict[str, Any]:
    """Rich representations of ``obj`` computed on the rank (IPython's display protocol)."""
    data: dict[str, Any] = {}
    method = getattr(obj, "_repr_mimebundle_", None)
    if callable(method):
        try:
            result = method()
            data.update(result[0] if isinstance(result, tuple) else result or {})
        except Exception:
            pass
    for mime, attr in (("text/html", "_repr_html_"), ("text/markdown", "_repr_markdown_"),
                       ("image/png", "_repr_png_"), ("image/svg+xml", "_repr_svg_"),
                       ("text/latex", "_repr_latex_"), ("application/json", "_repr_json_")):
        method = getattr(obj, attr, None)
        if mime not in data and callable(method):
            try:
                value = method()
            except Exception:
                continue
            if value is not None:
                data[mime] = value
    data.setdefault("text/plain", repr(obj))
    return data


def run_rank(cfg: RankConfig) -> None:
    """Entry point in the freshly forked child; never returns."""
    code = 1
    try:
        os.setsid()  # its own session: a kernel interrupt reaches it only when forwarded
        signal.set_wakeup_fd(-1)  # the agent's wakeup pipe is not ours
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        proc.die_with_parent(cfg.agent_pid)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for name, fd in (("stdout", 1), ("stderr", 2)):
            os.dup2(cfg.pipes[name][1], fd)
        keep = {0, 1, 2, *(r for r, _ in cfg.pipes.values())}
        crash = open(cfg.crash_path, "w")
        keep.add(crash.fileno())
        for fd in _open_fds():
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        cfg.pipes = {name: (read, fd) for (name, (read, _)), fd in zip(cfg.pipes.items(), (1, 2))}
        import faulthandler
        faulthandler.enable(file=crash, all_threads=True)
        proc.listen_only_on(cfg.listen_addr)
        # The Flight Recorder tells which collectives a stuck rank waits in (hang diagnosis).
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)
        if "nccl" in cfg.backend:
            for name, value in NCCL_ENVIRONMENT.items():
                os.environ.setdefault(name, value)  # a user's own setting wins
        import torch
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        torchrun.reseed()  # a fork shares its agent's random state; a torchrun process would not
        worker = Worker(cfg)
        worker.start()
        worker.serve()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback
        traceback.print_exc(file=sys.__stderr__)
    finally:
        os._exit(code)


def _clean_exit_is_none(handler: Callable[[dict[str, Any], int], Any], body: dict[str, Any],
                        request: int) -> Any:
    """Run ``handler``; a ``sys.exit(0)`` in it (``exit()``, or ``sys.exit(main())`` ending a
    pasted script whose ``main`` returns None) ends it as it ends a script under torchrun:
    cleanly, with no value. The rank stays up, with its variables. Another exit status is the
    failure it is under torchrun, and is reported as one."""
    try:
        return handler(body, request)
    except SystemExit as exc:
        if exc.code is None or exc.code == 0:
            return None
        raise


def _open_fds() -> list[int]:
    try:
        return [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, 1024))
