"""The host agent: imports torch once, forks this host's ranks and supervises them.

Run as ``python -m meshbook.mesh.agent`` by a launcher, one per host (this process imports
the protocol and the rank's entry point, :mod:`meshbook.mesh.rank.worker`, to fork ranks; never
the controller). It reads one JSON line
of configuration on stdin (the mesh key never appears on a command line), then:

* forks each rank from its clean, torch-imported state (no parallel op has run here, so the
  children's OpenMP pools are safe) in well under a second for 8 ranks;
* does what the controller asks of the host (signal, re-fork, native stacks); requests for
  the ranks do not pass through it: on the controller's own host the controller sends them to
  each rank's socket directly (see DESIGN.md, "Wire"), which saves a process hop per request;
* reports a rank's death (exit code, signal, OOM kill, its crash dump and last output) as
  soon as SIGCHLD arrives, and re-forks a rank under the same rank id on request;
* never outlives the controller: stdin is a pipe from the controller, and EOF on it (the
  controller died, however it died) kills every rank and ends the agent. ``PR_SET_PDEATHSIG``
  (SIGTERM, which the agent catches to clean up) backs this up where the launcher allows it,
  and ranks die with the agent the same way. The one exception is a kept mesh's agent
  (``lease_s`` in its bootstrap): it outlives the kernel until its lease runs out, answers the
  controller of the newest epoch only, and removes the mesh file when it ends;
* leaves nothing behind: it is a child subreaper, so whatever a rank starts stays in its tree
  however it detaches (``setsid``, a double fork), and on its way out it kills every
  descendant. Its log lives in the mesh's runtime directory, which it removes when the
  controller is gone (a SIGKILLed kernel cannot remove it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import IO, Any

from ..protocol import config
from ..protocol import messages as msg
from ..protocol.bodies import AgentConfig, Bootstrap
from ..protocol.cell import crash_report
from ..protocol.lastwords import LastWords
from ..protocol.proc import Liveness
from ..protocol.remote import AGENT_READY
from ..protocol.versions import mismatch, versions
from .gpus import GpuCount
from .link import LocalLink, Peer, RemoteLink
from .oom import killed_by_oom, oom_kills


@dataclass
class RankProcess:
    rank: int
    pid: int
    pipes: dict[str, int]  # stream -> read end, drained after death for the last words
    crash_path: str
    last_words: LastWords  # its last messages, sent on after its death (what had not left)
    oom_kills: int | None  # the cgroup's OOM-kill count when the rank started
    started: float  # time.monotonic() at the fork
    generation: int  # the process-group generation it was forked into


#: The terminal colour codes py-spy writes.
_COLOURS = re.compile(r"\x1b\[[0-9;]*m")
#: How long py-spy may take to dump one rank's stack.
PYSPY_TIMEOUT_S = 10.0


@dataclass
class Dump:
    """A py-spy run taking one rank's stack, beside the agent's loop, which answers with it
    when the run ends (:meth:`Agent.reap`) or runs out of time (:meth:`Agent.expire_dumps`)."""

    pid: int
    rank: int
    request: int
    out: IO[bytes]  # its stdout and stderr: files, since a pipe that fills would stall it
    err: IO[bytes]
    deadline: float

    def output(self) -> str:
        """What it printed: the stack, or why there is none (its colours left out: they came
        into the notebook as raw escape codes)."""
        with self.out, self.err:
            out, err = (_read(f) for f in (self.out, self.err))
        return _COLOURS.sub("", out or err)

    def close(self) -> None:
        self.out.close()
        self.err.close()


class Agent:
    def __init__(self, cfg: AgentConfig, ctx: Any, link: "LocalLink | RemoteLink", rundir: str,
                 own_rundir: bool, lost_s: float = config.HOST_LOST_S, leased: bool = False) -> None:
        from ..protocol import wire
        from ..protocol.topology import Topology

        self.cfg = cfg
        self.host = cfg.host
        self.my_ranks: list[int] = cfg.ranks
        self.topology = Topology(tuple((k, v) for k, v in cfg.dims))
        self.wire = wire.Wire(bytes.fromhex(cfg.key))
        #: A kept mesh's agent: its silence window is the lease.
        self.leased = leased
        self.rundir = rundir
        self.own_rundir = own_rundir
        self.ctx = ctx
        self.link = link
        self.procs: dict[int, RankProcess] = {}
        #: Messages of a kind (or an operation) no handler takes, by kind; each is logged too.
        self.unknown_kinds: Counter[str] = Counter()
        self._ops: dict[str | None, Callable[[list[int], dict[str, Any], int], None]] = {
            msg.AgentOp.SIGNAL: self._signal, msg.AgentOp.SPAWN: self._spawn,
            msg.AgentOp.PYSPY: self._pyspy, msg.AgentOp.PING: self._ping, msg.AgentOp.STOP: self._stop,
            msg.AgentOp.ATTACH: self._attach, msg.AgentOp.RESEND: self._resend, msg.AgentOp.LOST: self._lost}
        self.dead: set[int] = set()
        self.stopping = False
        self.threads, self.threads_note = omp_threads(len(self.my_ranks))
        #: How long this host may go without its controller; its ranks read when the agent last
        #: heard it from a page they share with it, and stop themselves when that is too long
        #: ago (an agent that is stopped or hung can no longer stop them).
        self.lost_s = float(lost_s)
        self.liveness = Liveness()
        #: Host 0 of a mesh across hosts keeps the store where its ranks meet (a rank could be
        #: restarted; the agent lives as long as the mesh).
        self.store = _serve_store(cfg) if cfg.serve_store else None
        #: py-spy runs under way, by pid.
        self.dumps: dict[int, Dump] = {}

    # -- ranks -------------------------------------------------------------------------------

    def spawn(self, rank: int, generation: int) -> None:
        from ..protocol.wire import rank_address
        from ..rank.context import RankConfig
        from ..rank.worker import run_rank

        local_rank = self.my_ranks.index(rank)
        pipes = {name: os.pipe() for name in ("stdout", "stderr")}
        self.link.connect_rank(rank, generation, self.rundir)
        store = self.cfg.store
        crash_path = os.path.join(self.rundir, f"crash-{rank}")
        cfg = RankConfig(
            rank=rank, local_rank=local_rank, local_world_size=len(self.my_ranks),
            group_rank=self.host, group_world_size=self.cfg.hosts,
            topology=self.topology, backend=self.cfg.backend, device_type=self.cfg.device_type,
            listen_addr=self.cfg.listen_addr, store_addr=(store[0], int(store[1])) if store else None,
            rundir=self.rundir, generation=generation, master_port=self.cfg.master_port,
            collective_timeout=self.cfg.collective_timeout, key=self.wire.key,
            agent_pid=os.getpid(), request_addr=rank_address(self.rundir, rank, generation, msg.MAIN),
            control_addr=rank_address(self.rundir, rank, generation, msg.CONTROL),
            events_addr=self.link.rank_events,
            pipes=pipes, crash_path=crash_path, threads=self.threads, threads_note=self.threads_note,
            liveness=self.liveness, lost_s=self.lost_s, last_words=LastWords())
        oom = oom_kills()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_rank(cfg)  # never returns
        for _, write in pipes.values():
            os.close(write)
        self.procs[rank] = RankProcess(rank, pid, {n: r for n, (r, _) in pipes.items()}, crash_path,
                                       cfg.last_words, oom, time.monotonic(), generation)
        self.dead.discard(rank)

    def reap(self) -> None:
        """Collect dead ranks and tell the controller how each died; send the stacks of the
        py-spy runs that ended."""
        from ..protocol.proc import describe_status, exited_children

        for pid, status in exited_children():
            dump = self.dumps.pop(pid, None)
            if dump is not None:
                self._answer_dump(dump.rank, dump.request, dump.output())
                continue
            proc = next((p for p in self.procs.values() if p.pid == pid), None)
            if proc is None:
                continue
            # What it started dies with it, as under torchrun (the group it leads, see kill): a
            # forked child (a DataLoader worker, a user's fork) still held its gloo connections
            # open, and the ranks blocked on it never heard of its death.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            cause = describe_status(status)
            if cause == "SIGKILL" and killed_by_oom(pid, proc.oom_kills, proc.started):
                cause = "SIGKILL (killed by the OOM killer)"
            output = {name: _drain(fd) for name, fd in proc.pipes.items()}
            crash = crash_report(_read_and_remove(proc.crash_path))  # here, where its files' lines are
            last = self.link.last_words(proc.last_words.read())  # before EXIT: what it said, first
            proc.last_words.close()
            del self.procs[proc.rank]
            self.dead.add(proc.rank)
            self.emit(msg.EXIT, None, {"cause": cause, "pid": pid, "output": output, "crash": crash,
                                       "last": last}, rank=proc.rank)

    def kill(self, ranks: list[int], sig: int = signal.SIGKILL) -> None:
        for rank in ranks:
            proc = self.procs.get(rank)
            if proc is not None:
                try:
                    # The rank leads its own session: take its children (os.system...) too.
                    os.killpg(proc.pid, sig) if sig == signal.SIGKILL else os.kill(proc.pid, sig)
                except ProcessLookupError:
                    pass

    def shutdown(self, controller_done: bool, why: str = "") -> None:
        """Kill every rank and whatever they started; remove the runtime directory when the
        controller no longer needs it (after a crash it may still read our log there). A remote
        agent says it stopped, and ``why``: what the controller's stop waits for, and, when the
        agent stops on its own, how the controller learns that its ranks are gone."""
        from ..protocol.proc import kill_descendants

        kill_descendants(5.0)
        if self.link.remote:
            self.emit(msg.HOST_BEAT, None, {"stopped": True, "why": why})
        self.link.close()
        if controller_done or self.own_rundir:
            shutil.rmtree(self.rundir, ignore_errors=True)

    # -- messages ----------------------------------------------------------------------------

    @property
    def remote_link(self) -> RemoteLink:
        """The link, for what only an agent on another host is sent (the controller pings,
        asks again and fences over the network only)."""
        assert isinstance(self.link, RemoteLink)
        return self.link

    def emit(self, kind: str, request: int | None, body: Any = None, ordered: bool = True, **header: Any) -> None:
        """A message of the agent's own to the controller (``ordered=False``: outside the link's
        numbering, for what must pass a gap: asking for messages again)."""
        frames = self.wire.pack({msg.KIND: kind, msg.ID: request, msg.HOST: self.host, **header}, body)
        if self.link.remote:
            self.link.send(frames, ordered=ordered)
        else:
            self.link.send(frames)

    def operate(self, message: Any) -> None:
        """An operation for the agent itself (the controller stops an agent by closing its stdin)."""
        body = message.body() if message.kind == msg.OP else {"op": None}
        handler = self._ops.get(body["op"])
        if handler is None:
            self._unknown(message.kind if message.kind != msg.OP else f"{msg.OP}:{body['op']}")
            return
        handler([r for r in message.header[msg.RANKS] if r in self.my_ranks], body, message.header[msg.ID])

    def _unknown(self, kind: str) -> None:
        """Count and log (to the agent's log) a message no handler takes; the agent keeps serving."""
        self.unknown_kinds[kind] += 1
        print(f"meshbook agent {self.host}: no handler for {kind!r} messages "
              f"({self.unknown_kinds[kind]} so far)", file=sys.stderr, flush=True)

    def _signal(self, ranks: list[int], body: dict[str, Any], request: int) -> None:
        self.kill(ranks, body["sig"])

    def _spawn(self, ranks: list[int], body: dict[str, Any], request: int) -> None:
        if body.get("store") is not None:  # host 0 re-formed elsewhere took the store with it
            self.cfg.store = list(body["store"])
        for rank in ranks:
            self.spawn(rank, body["generation"])

    def _pyspy(self, ranks: list[int], body: dict[str, Any], request: int) -> None:
        """Start py-spy on every rank at once, without waiting: a dump can take seconds, and an
        agent that waited, rank after rank, would stop hearing its controller (and refreshing
        the page its ranks read): its ranks would stop themselves as if it were gone."""
        for rank in ranks:
            dump = _start_pyspy(rank, request, self.procs.get(rank))
            if isinstance(dump, Dump):
                self.dumps[dump.pid] = dump
            else:
                self._answer_dump(rank, request, dump)

    def expire_dumps(self) -> None:
        """Stop the py-spy runs that are past their time (:meth:`reap` collects them), saying so."""
        now = time.monotonic()
        for dump in [d for d in self.dumps.values() if d.deadline <= now]:
            del self.dumps[dump.pid]
            os.kill(dump.pid, signal.SIGKILL)
            dump.close()
            self._answer_dump(dump.rank, dump.request, f"py-spy failed: no stack within {PYSPY_TIMEOUT_S:g} s")

    def _answer_dump(self, rank: int, request: int, text: str) -> None:
        header: dict[str, Any] = {msg.RANK: rank}  # a header field, not emit's option
        self.emit(msg.RESULT, request, text, **header)

    def _ping(self, ranks: list[int], body: dict[str, Any], request: int) -> None:
        """The controller's heartbeat: answer with ours (it times the round trip, and sets its
        clock against ours); each side acknowledges what it took in order."""
        link = self.remote_link
        link.outgoing.acknowledged(body.get("ack", 0))
        self.emit(msg.HOST_BEAT, request, {"sent": body["sent"], "wall": body.get("wall"),
                                           "agent_wall": time.time_ns(), "ranks": sorted(self.procs),
                                           "ack": link.incoming.acknowledged})

    def _resend(self, ranks: list[int], body: dict[str, Any], request: int) -> None:
        """The controller missed what we sent from ``from`` to ``to`` (its connection reset)."""
        self.remote_link.resend(body["from"], body["to"],
                                lambda gone: self.emit(msg.LOST, None, {"lost": gone}, ordered=False))

    def _lost(self, ranks: list[int], body: dict[str, Any], request: int) -> None:
        """What the controller sent under the numbers ``lost`` (ranges) is gone for good: skip
        what never came (the controller fails what it was for) and deliver what did."""
        link = self.remote_link
        link.deliver(link.incoming.give_up(body["lost"]), self._operate_frames)

    def _attach(self, ranks: list[int], body: dict[str, Any], request: int) -> None:
        """A new controller took over this (kept) mesh: what it needs to know of our ranks."""
        self.emit(msg.AGENT, request, {
            "pid": os.getpid(), "hostname": socket.gethostname(), "attached": True, "versions": versions(),
            "pids": {r: p.pid for r, p in self.procs.items()},
            "generations": {r: p.generation for r, p in self.procs.items()}, "dead": sorted(self.dead)})

    def refuse_stale(self) -> None:
        """Tell each controller of an older epoch that wrote to us that it is fenced off."""
        link = self.remote_link
        while link.stale:
            peer = link.stale.pop()
            print(f"meshbook agent {self.host}: refused a message of epoch {peer.epoch} (the mesh "
                  f"is now driven at epoch {link.peer.epoch})", file=sys.stderr, flush=True)
            link.send(self.wire.pack({msg.KIND: msg.FENCED, msg.ID: None, msg.HOST: self.host},
                                     {"epoch": link.peer.epoch}), to=peer)

    def _stop(self, ranks: list[int], body: dict[str, Any], request: int) -> None:
        """The controller stops a remote agent (a local one sees its stdin close instead)."""
        self.stopping = True

    def serve(self, watch_stdin: bool = True) -> str:
        """Fork the ranks, then serve until the controller is gone or stops us; returns why."""
        import zmq

        rfd, wfd = os.pipe()
        os.set_blocking(wfd, False)
        signal.set_wakeup_fd(wfd)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: None)  # handled below, through the wakeup fd
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        poller = zmq.Poller()
        for sock in self.link.sockets():
            poller.register(sock, zmq.POLLIN)
        if watch_stdin:
            poller.register(sys.stdin.fileno(), zmq.POLLIN)
        poller.register(rfd, zmq.POLLIN)
        for rank in self.my_ranks:
            self.spawn(rank, self.cfg.generation)
        self.emit(msg.AGENT, None, {"pid": os.getpid(), "hostname": socket.gethostname(),
                                  "pids": {r: p.pid for r, p in self.procs.items()}, "versions": versions()})
        lost_s = self.lost_s
        while not self.stopping:
            ready = dict(poller.poll(1000))
            # Silence first, before anything that came meanwhile is relayed: an agent that was
            # stopped (SIGSTOP) or cut off past the loss window has had its host declared lost,
            # and what was queued for it must never run (its ranks may live on elsewhere).
            if self.link.remote and time.monotonic() - self.link.last_heard > lost_s:
                what = "the lease of" if self.leased else "nothing from the controller for"
                print(f"meshbook agent {self.host}: {what} {lost_s:g} s ran out: stopping this "
                      f"host's ranks", file=sys.stderr, flush=True)
                return f"{what} {lost_s:g} s ran out"
            self.liveness.beat(self.link.last_heard if self.link.remote else time.monotonic())
            if rfd in ready:
                signals = os.read(rfd, 4096)
                if signal.SIGTERM in signals:
                    return "terminated by SIGTERM"
                self.reap()
            self.expire_dumps()
            if watch_stdin and sys.stdin.fileno() in ready and not os.read(sys.stdin.fileno(), 4096):
                return "its controller's session closed"  # the controller (or its ssh session) is gone
            for sock in self.link.sockets():
                if sock in ready:
                    self.link.drain(sock, self._operate_frames)
            if self.link.remote:
                self.refuse_stale()
                missing = self.link.incoming.ask(time.monotonic())
                if missing is not None:  # messages from the controller went missing: ask again
                    self.emit(msg.RESEND, None, {"from": missing[0], "to": missing[1]}, ordered=False)
        return "its controller stopped it"

    def _operate_frames(self, frames: list[Any]) -> None:
        """An operation for the agent itself: verified, then handled."""
        from ..protocol import wire

        try:
            message = self.wire.unpack(frames)
        except wire.BadMessage:
            return
        self.operate(message)


def omp_threads(local_ranks: int) -> tuple[int | None, str]:
    """The threads each rank's torch uses, as torchrun sets them: the user's
    ``OMP_NUM_THREADS`` if set, else 1 when several ranks share the host (torchrun's default, so
    that they do not overload it), else torch's own default. Sets the variable for the ranks."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value:
        try:
            return max(1, int(value)), f"OMP_NUM_THREADS={value} per rank (yours)"
        except ValueError:
            return None, f"OMP_NUM_THREADS={value!r} is not a number: torch's default threads per rank"
    if local_ranks > 1:
        os.environ["OMP_NUM_THREADS"] = "1"
        return 1, "OMP_NUM_THREADS=1 per rank, as torchrun sets it"
    return None, ""


def check_versions(theirs: dict[str, str] | None, who: str) -> None:
    """Refuse to serve a controller that runs other versions (its operations and pickles would
    fail somewhere deep): the message names both sides, and says what to install."""
    problem = mismatch(versions(), theirs, f"the host agent on {socket.gethostname()}", who, follow_theirs=True)
    if problem:
        raise SystemExit(f"meshbook agent: {problem}")


def apply_environment(env: dict[str, str] | None, replace: bool) -> None:
    """The environment the ranks start with: the notebook's as it is at ``start()`` (this
    host: ``replace``), or the variables the user named (other hosts: added to this host's)."""
    if env is None:
        return
    if replace:
        os.environ.clear()
    os.environ.update(env)


def _drain(fd: int) -> str:
    chunks = []
    os.set_blocking(fd, False)
    while True:
        try:
            data = os.read(fd, 1 << 16)
        except (BlockingIOError, OSError):
            break
        if not data:
            break
        chunks.append(data)
    os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace")


def _read(f: IO[bytes]) -> str:
    f.seek(0)
    return f.read().decode("utf-8", "replace")


def _read_and_remove(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
        os.unlink(path)
        return text
    except OSError:
        return ""


def _start_pyspy(rank: int, request: int, proc: RankProcess | None) -> Dump | str:
    """py-spy started on a rank whose own control thread cannot answer (for its native+Python
    stack), or why it could not be. Spawned, not a ``subprocess.Popen``: the agent reaps every
    child it has (it is a subreaper), behind a Popen's back."""
    if proc is None:
        return "the rank is not running"
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(exe):
        return "py-spy is not installed (pip install py-spy) so no native stack could be taken"
    files: list[IO[bytes]] = []
    try:  # no descriptors or disk left: this rank's answer says so, and the agent goes on
        for _ in range(2):
            files.append(tempfile.TemporaryFile())
        out, err = files
        pid = os.posix_spawn(exe, [exe, "dump", "--pid", str(proc.pid)], os.environ, file_actions=[
            (os.POSIX_SPAWN_DUP2, out.fileno(), 1), (os.POSIX_SPAWN_DUP2, err.fileno(), 2)])
    except OSError as exc:
        for f in files:
            f.close()
        return f"py-spy failed: {exc}"
    return Dump(pid, rank, request, out, err, time.monotonic() + PYSPY_TIMEOUT_S)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m meshbook.mesh.agent",
                                     description="meshbook host agent (started by a launcher)")
    parser.add_argument("mode", nargs="?", choices=("local", "listen", "join"), default="local",
                        help="local: configuration on stdin (this host's controller); listen: "
                             "bootstrap on stdin, the controller dials us (ssh launcher); join: "
                             "dial the controller with a join token (any external launcher)")
    parser.add_argument("--parent", type=int, default=None,
                        help="pid of the controller; die with it (PR_SET_PDEATHSIG)")
    parser.add_argument("--log", default=None,
                        help="the file our stderr goes to: moved into the runtime directory")
    parser.add_argument("--token-file", default=None,
                        help="join: read the token from this file (else from $MESHBOOK_JOIN_TOKEN)")
    parser.add_argument("--bootstrap-file", default=None,
                        help="listen: read the bootstrap from this private file, not stdin (a batch "
                             "scheduler's tasks have no stdin of the controller's)")
    parser.add_argument("--announce-dir", default=None,
                        help="listen: write the LISTENING line to a file in this directory, not stdout")
    args = parser.parse_args()
    from ..protocol.payload import raise_fd_limit
    from ..protocol.proc import become_subreaper, die_with_parent

    signal.signal(signal.SIGTERM, _stop)  # until serve() handles it: clean up on the way out
    become_subreaper()
    raise_fd_limit()  # inherited by the ranks: each pushed value a rank holds keeps a descriptor
    if args.parent is not None:
        die_with_parent(args.parent, signal.SIGTERM)
    code = 0
    try:
        if args.mode == "local":
            _run(args.log)
        else:
            _run_remote(args.mode, args.token_file, args.bootstrap_file, args.announce_dir)
    except SystemExit as exc:  # a message for whoever started us (a bad token...), or a stop
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr, flush=True)
        code = exc.code if isinstance(exc.code, int) else 1 if exc.code else 0
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)  # never run the interpreter's shutdown: forked ranks share our atexit state


def _stop(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _import_torch() -> None:
    import torch  # noqa: F401  - once, here, so every fork starts with it imported
    import torch.distributed  # noqa: F401
    import torch.distributed.device_mesh  # noqa: F401


def _run(log: str | None) -> None:
    """Wait for the configuration, then serve; clean up however that ends."""
    import zmq

    try:
        count = GpuCount()  # beside our own torch import: no wall time
        _import_torch()
        _say(AGENT_READY, {"gpus": count.result(), "pid": os.getpid(), "versions": versions()})
        data = _read_config()
    except BaseException:
        _remove(log)  # a standby agent whose controller went away, or died
        raise
    if data is None:
        _remove(log)
        return
    cfg = AgentConfig.from_dict(data)
    check_versions(cfg.versions, "its controller")
    apply_environment(cfg.env, replace=True)
    ctx = zmq.Context()
    rundir = cfg.rundir or tempfile.mkdtemp(prefix="meshbook-agent-")
    agent = Agent(cfg, ctx, LocalLink(ctx, cfg), rundir, own_rundir=not cfg.rundir)
    if log is not None and cfg.log:
        _move_log(log, cfg.log)
    _serve(agent, watch_stdin=True)


def _serve(agent: Agent, watch_stdin: bool) -> None:
    done, why = False, ""
    try:
        why = agent.serve(watch_stdin)
        done = True  # the controller is gone or stops us: nobody reads the runtime directory
    except SystemExit as exc:
        done, why = True, f"it exited ({exc.code})"
    except BaseException as exc:
        why = f"it failed: {type(exc).__name__}: {exc}"
        raise
    finally:
        agent.shutdown(done, why)


def _run_remote(mode: str, token_file: str | None, bootstrap_file: str | None = None,
                announce_dir: str | None = None) -> None:
    """An agent on another host: connect (listen or join), wait for the configuration over
    the connection, then serve as a relay for this host's ranks. With a bootstrap file (a
    batch scheduler started us) stdin is not the controller's: only the link's silence ends us."""
    import zmq

    from ..protocol.proc import owned_prefix, remove_stale, runtime_base
    from ..protocol.remote import decode_token
    from .link import Gatherer, RemoteLink, join, listen

    if mode == "listen" and bootstrap_file:
        with open(bootstrap_file) as f:
            raw = json.load(f)
    elif mode == "listen":
        raw = _read_config()
        if raw is None:
            return
    else:
        try:
            raw = decode_token(_read_token(token_file))
        except ValueError as exc:
            raise SystemExit(f"meshbook agent join: {exc}; copy it again from the notebook's "
                             f"output") from None
    data = Bootstrap.from_dict(raw)
    check_versions(data.versions, "the controller that started it")  # before torch: fail fast
    apply_environment(data.env, replace=False)  # the variables the user named
    count = GpuCount()  # with them (CUDA_VISIBLE_DEVICES...), beside our own torch import
    _import_torch()
    gpus = count.result()
    ctx = zmq.Context(io_threads=2)  # decrypting the link beside relaying to the ranks
    zap = None
    # A kept mesh (a lease): the agent outlives the kernel that started it, so it neither
    # watches stdin nor writes to stdout once it has said where it listens. Nor does one a
    # batch scheduler started (a bootstrap file): its stdin is not the controller's.
    lease = data.lease_s
    watch_stdin = mode == "listen" and lease is None and not bootstrap_file
    try:
        if mode == "listen":
            sock, zap = listen(ctx, data, gpus, announce_dir)
        else:
            sock = join(ctx, data, gpus, timeout=data.timeout)
        if lease is not None:
            _detach_stdio()
        configured = _await_configuration(sock, bytes.fromhex(data.key), watch_stdin, timeout=data.timeout)
        if configured is None:
            sock.close(linger=0)
            return
        cfg, peer, seq = configured
        remove_stale(runtime_base(), ("mb",))  # what agents killed on this host left behind
        rundir = tempfile.mkdtemp(prefix=owned_prefix("mb"), dir=runtime_base())
        try:
            link = RemoteLink(ctx, sock, rundir, peer, seq, Gatherer(bytes.fromhex(data.key), cfg.host))
            agent = Agent(replace(cfg, key=data.key), ctx, link, rundir, own_rundir=True,
                          lost_s=lease or data.lost_s, leased=lease is not None)
        except BaseException:  # e.g. host 0 could not bind its store: leave no directory behind
            shutil.rmtree(rundir, ignore_errors=True)
            raise
        _serve(agent, watch_stdin)
    finally:
        if zap is not None:
            zap.close()
        # What the link still holds (the stop's HOST_BEAT: how the controller learns that this
        # host's ranks are gone) leaves within the link's linger; the process ends with
        # os._exit, which would drop it unsent on an I/O thread. Sockets still open: dropped.
        ctx.destroy(linger=0)
        mesh_file = data.mesh_file
        for path in (mesh_file, mesh_file and mesh_file + ".lock", data.log) if lease is not None else ():
            _remove(path)  # the mesh ended (stopped, or its lease ran out): nothing to attach to


def _read_token(token_file: str | None) -> str:
    from ..protocol.remote import TOKEN_ENV

    if token_file:
        try:
            with open(token_file) as f:
                return f.read()
        except OSError as exc:
            raise SystemExit(f"meshbook agent join: cannot read the token file {token_file}: {exc.strerror}. "
                             f"The notebook removes it once the hosts have joined: copy the command again "
                             f"from the notebook, or pass the token in ${TOKEN_ENV}") from None
    token = os.environ.pop(TOKEN_ENV, "")
    if not token:
        raise SystemExit(f"meshbook agent join: no token: set ${TOKEN_ENV} or pass --token-file "
                         f"(the notebook's %mesh start --join prints both)")
    return token


def _say(what: str, info: dict[str, Any]) -> None:
    """One line for the launcher that started us, on stdout: ``WHAT {json}``."""
    sys.stdout.write(f"{what} {json.dumps(info)}\n")
    sys.stdout.flush()


def _detach_stdio() -> None:
    """stdin and stdout from /dev/null (the kernel that started a kept agent may be gone)."""
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)


def _await_configuration(sock: Any, key: bytes, watch_stdin: bool,
                         timeout: float) -> tuple[AgentConfig, Peer, int] | None:
    """The controller's CONFIGURE operation, who sent it and its number on the link, or None
    if it never comes (or stdin closes)."""
    import zmq

    from ..protocol import wire
    from .link import unwrap

    checker = wire.Wire(key)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    if watch_stdin:
        poller.register(sys.stdin.fileno(), zmq.POLLIN)
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        ready = dict(poller.poll(int(left * 1000)))
        if watch_stdin and sys.stdin.fileno() in ready and not os.read(sys.stdin.fileno(), 4096):
            return None
        if sock not in ready:
            continue
        peer, seq, route, frames = unwrap(wire.recv(sock), sock.getsockopt(zmq.TYPE) == zmq.ROUTER)
        try:
            message = checker.unpack(frames)
        except wire.BadMessage:
            continue
        if route == b"" and message.kind == msg.OP and message.body()["op"] == msg.AgentOp.CONFIGURE:
            cfg = AgentConfig.from_dict(message.body()["config"])
            check_versions(cfg.versions, "its controller")
            return cfg, peer, seq
    print(f"meshbook agent: no configuration from the controller within {timeout:g} s", file=sys.stderr)
    return None


def _serve_store(cfg: AgentConfig) -> Any:
    """The TCPStore where the ranks of a mesh across hosts meet, listening on this host's
    address only (torch's own server listens on every interface: it is handed a socket)."""
    from datetime import timedelta

    import torch.distributed as dist

    assert cfg.store is not None
    host, port = cfg.store
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(1024)
    store = dist.TCPStore(host, port, None, True, timedelta(seconds=cfg.collective_timeout),
                          wait_for_workers=False, master_listen_fd=listener.fileno())
    return store, listener  # the socket lives as long as the store


def _read_config() -> dict[str, Any] | None:
    """The configuration line from stdin, or None at EOF (the controller went away first)."""
    stdin = sys.stdin.fileno()
    line = b""
    while not line.endswith(b"\n"):
        select.select([stdin], [], [])
        chunk = os.read(stdin, 65536)
        if not chunk:
            return None
        line += chunk
    return json.loads(line)


def _move_log(old: str, new: str) -> None:
    """Point our stderr at ``new``, carrying over what ``old`` holds, and remove ``old``."""
    fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with open(old, "rb") as f:
        os.write(fd, f.read())
    os.dup2(fd, 2)
    os.close(fd)
    _remove(old)


def _remove(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass
