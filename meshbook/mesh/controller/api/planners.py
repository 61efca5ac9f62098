"""The planner processes a plan traces its layouts in, forked by a zygote that outlives plans.

Why: a planner imports torch before it traces anything, seconds on a small machine, and every
plan (every mistake it reports: a build that raises, a batch of the wrong shape) paid them
again. The zygote (:mod:`meshbook.mesh.planner.zygote`) imports torch once, runs no plan's
code, and forks each planner: a fresh process in milliseconds. It is started at the first plan
and lives while a mesh that planned runs, or a plan is under way: the last of those to end
stops it (nothing a mesh started outlives it; the next plan, after ``%mesh restart`` too,
starts a zygote again), as does this process's exit. A zygote is only as fresh as the
environment it started with, so one started before ``os.environ`` or ``sys.path`` changed is
replaced at the next plan (as a standby agent is, :mod:`..launch.local`); each planner works
in the directory the notebook is in when the plan starts, which is first on its ``sys.path``
as it was on a planner started there.
"""

from __future__ import annotations

import atexit
import os
import queue
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, BinaryIO

from ...protocol.errors import MeshError
from ...protocol.plan import EXITED, FORK, FORKED, KILL, ZYGOTE_NOTE, read_frame, write_frame

if TYPE_CHECKING:
    from ..core.controller import Controller

#: Seconds a plan may take before it is given up (planner processes are stopped).
PLAN_TIMEOUT_S = 600.0
#: The zygote's module (``python -m``), which its planners' command lines name too.
PLANNER_MODULE = "meshbook.mesh.planner"


class Zygote:
    """The zygote process, and its socket: forks asked, exits heard."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.TemporaryFile()
        with theirs:
            self.proc = subprocess.Popen([sys.executable, "-m", PLANNER_MODULE, str(theirs.fileno())],
                                         pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                         stdout=self.log, stderr=self.log, env=env)
        self.sock = ours
        self.exits: dict[int, int] = {}
        self._asked = 0
        self._lock = threading.Lock()

    def fork(self, cwd: str) -> "Planner":
        """A planner, working in ``cwd``: its jobs go to its stdin, its answers come on its
        stdout, and its stderr goes to a file kept to quote should it die. Interrupted, it
        leaves no planner waiting: one forked meanwhile finds its stdin closed and exits, and
        its note (numbered) is passed over by the next fork."""
        jobs_in, jobs_out = os.pipe()
        answers_in, answers_out = os.pipe()
        log = tempfile.TemporaryFile()
        try:
            with self._lock:
                self._asked += 1
                request = b"\n".join([FORK, str(self._asked).encode(), os.fsencode(cwd)])
                socket.send_fds(self.sock, [request], [jobs_in, answers_out, log.fileno()])
                pid = self._forked(self._asked)
        except BaseException as exc:
            for fd in (jobs_out, answers_in):
                os.close(fd)
            log.close()
            if isinstance(exc, (OSError, EOFError)):
                raise MeshError(f"the planner zygote died ({self.death()}); the mesh and the kernel are "
                                f"untouched") from None
            raise
        finally:
            os.close(jobs_in)
            os.close(answers_out)
        return Planner(self, pid, os.fdopen(jobs_out, "wb"), os.fdopen(answers_in, "rb"), log)

    def exit_code(self, pid: int, timeout: float) -> int | None:
        """``pid``'s exit code once the zygote says it exited, waiting up to ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while pid not in self.exits and self._hear(max(0.0, deadline - time.monotonic())):
                pass
            return self.exits.get(pid)

    def kill(self, pid: int) -> None:
        """SIGKILL to planner ``pid``, sent by the zygote, which knows it has not reaped it (a pid
        reaped may be another process's by now)."""
        try:
            self.sock.send(b"\n".join([KILL, str(pid).encode(), b""]))
        except OSError:
            pass  # the zygote is gone: its planners end as their stdin closes

    def _forked(self, asked: int) -> int:
        """The pid of the planner of request ``asked`` (exits heard meanwhile are kept)."""
        while True:
            kind, pid, number = self._read()
            if kind == FORKED and number == asked:
                return pid

    def _hear(self, timeout: float) -> bool:
        """One note, if one comes within ``timeout`` (0: one that came already): False when
        none did, or the zygote was stopped (its planners' ends are not heard any more)."""
        try:
            if not select.select([self.sock], [], [], timeout)[0]:
                return False
            self._read()
            return True
        except (OSError, ValueError, EOFError):  # ValueError: the socket was closed
            return False

    def _read(self) -> tuple[bytes, int, int]:
        """The next note (a message each: never half of one)."""
        got = self.sock.recv(ZYGOTE_NOTE.size)
        if not got:
            raise EOFError("the zygote's socket closed")
        note = ZYGOTE_NOTE.unpack(got)
        if note[0] == EXITED:
            self.exits[note[1]] = note[2]
        elif note[0] == FORKED:
            self.exits.pop(note[1], None)  # a pid used again: the exit kept is an earlier planner's
        return note

    def alive(self) -> bool:
        return self.proc.poll() is None

    def death(self) -> str:
        try:
            code: int | None = self.proc.wait(1)
        except subprocess.TimeoutExpired:
            code = None
        return _ended(code, self.log)

    def stop(self) -> None:
        """Close its socket (it exits, and the planners it forked finish their jobs alone).
        Shut down first: a thread waiting in recv on it wakes, where a close alone leaves it
        and the zygote waiting."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class Planner:
    """One forked planner: its pipes, its log, and what the zygote says of its end."""

    def __init__(self, zygote: Zygote, pid: int, stdin: BinaryIO, stdout: BinaryIO, log: BinaryIO) -> None:
        self.zygote, self.pid, self.stdin, self.stdout, self.log = zygote, pid, stdin, stdout, log

    def kill(self) -> None:
        self.zygote.kill(self.pid)  # the zygote skips a planner it reaped already

    def death(self) -> str:
        """How it ended, and the last lines of its log."""
        return _ended(self.zygote.exit_code(self.pid, 5), self.log)

    def close(self) -> None:
        for stream in (self.stdin, self.stdout, self.log):
            try:
                stream.close()
            except OSError:
                pass


def _ended(code: int | None, log: BinaryIO) -> str:
    """``exit 3`` or ``signal 9``, and the last lines of the process's log."""
    log.seek(0)
    tail = log.read().decode(errors="replace").strip().splitlines()[-3:]
    how = f"signal {-code}" if code is not None and code < 0 else f"exit {code}"
    return how + (": " + " | ".join(tail) if tail else "")


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()
#: The meshes that planned with the zygote: it goes once none of them runs (and no plan is
#: under way); with none, it is kept until this process exits.
_holders: "weakref.WeakSet[Controller]" = weakref.WeakSet()
#: The plans under way (open :class:`Planners`): a mesh that stops meanwhile leaves the zygote
#: to the plan, which reaps its planners through it.
_open_plans = 0


def zygote(holder: Controller | None = None, planning: bool = False) -> Zygote:
    """The zygote, started with this process's environment as it is now (one started with
    another is replaced), kept while ``holder``'s mesh runs; ``planning``: for a plan that
    starts now, counted as the zygote is handed over (see :func:`plan_ended`), so that nothing
    stops it in between and a failure before leaves no plan counted."""
    global _zygote, _open_plans
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    while True:
        with _zygote_lock:
            if holder is not None and holder not in _holders:
                _holders.add(holder)
                holder.add_stop_listener(_let_go)  # one that stopped already: the plan's end sees to it
            stale = _zygote if _zygote is not None and (not _zygote.alive() or _zygote.env != env) else None
            if stale is None:
                if _zygote is None:
                    _zygote = Zygote(env)
                if planning:
                    _open_plans += 1
                return _zygote
            _zygote = None
        stale.stop()  # outside the lock (it waits for the process to end), then a new one under it


def plan_ended() -> None:
    """A plan (its planners reaped) that :func:`zygote` was asked for with ``planning`` ended."""
    global _open_plans
    with _zygote_lock:
        _open_plans -= 1
    _let_go()


def discard_zygote(unless_held: bool = False) -> None:
    """Stop the zygote, if any (a new one starts at the next plan); ``unless_held``: only once
    meshes planned with it, none of them runs, and no plan is under way."""
    global _zygote
    with _zygote_lock:
        if unless_held and (_open_plans or not _holders or any(not holder.stopped for holder in _holders)):
            return
        old, _zygote = _zygote, None
        _holders.clear()
    if old is not None:
        old.stop()


def _let_go() -> None:
    """A mesh that planned stopped, or a plan ended: the zygote goes with the last of them."""
    discard_zygote(unless_held=True)


atexit.register(discard_zygote)


class Planners:
    """Planner processes for one plan, fed jobs over their stdin; all stopped on leaving. Their
    zygote is kept while the plan is under way and while ``holder``'s mesh runs."""

    def __init__(self, n: int, holder: Controller | None = None) -> None:
        cwd = os.getcwd()  # first: what fails here (a directory deleted) fails before the plan counts
        forks = zygote(holder, planning=True)
        self.procs: list[Planner] = []
        self._open = True
        try:
            for _ in range(n):
                self.procs.append(forks.fork(cwd))
        except BaseException:
            self.__exit__()
            raise

    def __enter__(self) -> "Planners":
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._open:
            return
        self._open = False
        try:
            for proc in self.procs:
                proc.kill()
            for proc in self.procs:
                proc.zygote.exit_code(proc.pid, 5)  # reaped: nothing of the plan outlives it
                proc.close()
        finally:
            plan_ended()

    def ask(self, i: int, kind: str, *args: Any) -> Any:
        proc = self.procs[i]
        try:
            write_frame(proc.stdin, (kind, args))
            answer = read_frame(proc.stdout)
        except (BrokenPipeError, OSError):
            answer = None
        if answer is None:
            raise MeshError(f"a planner process died ({proc.death()}); the mesh and the kernel are untouched")
        status, value = answer
        if status == "error":
            raise MeshError(value)
        return value

    def map(self, kind: str, jobs: list[tuple[Any, ...]], deadline: float) -> list[Any]:
        """Each job on the next free process, answers in the jobs' order."""
        todo: queue.Queue[int] = queue.Queue()
        for i in range(len(jobs)):
            todo.put(i)
        answers: list[Any] = [None] * len(jobs)
        failures: list[BaseException] = []

        def drive(p: int) -> None:
            while not failures:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    answers[i] = self.ask(p, kind, *jobs[i])
                except BaseException as exc:  # reported below, in the caller's thread
                    failures.append(exc)

        threads = [threading.Thread(target=drive, args=(p,), daemon=True) for p in range(len(self.procs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise MeshError(f"planning took longer than {PLAN_TIMEOUT_S:.0f} s; narrow it with only=...")
        if failures:
            raise failures[0]
        return answers
