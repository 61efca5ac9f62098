"""The planner zygote: torch imported once, a fresh planner forked from it in milliseconds.

Why: a planner process spends seconds importing torch before it traces anything, and a plan
started its planners anew every time, so each plan (and each mistake a plan reports, a build
that raises, a batch of the wrong shape) cost those seconds again. The zygote imports torch and
the tracer once, runs nothing else, and forks a planner for each request: every planner is still
a process that ran no code of any plan before it, as a freshly started one would be.

Started by the controller as ``python -m meshbook.mesh.planner FD``, with stdin, stdout and
stderr its own, ignoring SIGINT (a Ctrl-C in a terminal stops the plan, not the zygote). FD is
one end of a Unix packet socket (a message each). A fork request carries its number, the
directory to work in, and three file descriptors: the planner's stdin, stdout and stderr (its
jobs, its answers, its log). The zygote answers ``FORKED`` with the planner's pid and the
request's number, and ``EXITED`` with its exit code once it ends
(:data:`~meshbook.mesh.protocol.plan.ZYGOTE_NOTE`): the controller cannot wait for a process
that is not its child. A ``KILL`` request is done here, where a pid is known to be the
planner's until the zygote reaps it. The zygote ends when the socket closes or the process
that started it is gone.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import traceback

from ..protocol.plan import EXITED, FORK, FORKED, KILL, ZYGOTE_NOTE
from ..protocol.proc import exited_children

#: Seconds between looks at whether the process that started the zygote still lives: a fork
#: of that process (a DataLoader worker, say) may hold the socket open after it died.
PARENT_CHECK_S = 1.0


def serve(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    parent = os.getppid()
    woken, wake = os.pipe()  # a planner exited: told at once, so a plan's end is not kept waiting
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    from . import jobs  # noqa: F401 - torch and the tracer, imported here once, so in every planner forked

    children: set[int] = set()
    while os.getppid() == parent:
        ready, _, _ = select.select([sock.fileno(), woken], [], [], PARENT_CHECK_S)
        if woken in ready:
            os.read(woken, 512)
        for pid, status in exited_children():
            children.discard(pid)
            sock.send(ZYGOTE_NOTE.pack(EXITED, pid, os.waitstatus_to_exitcode(status)))
        if sock.fileno() not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, 65536, 3)
        except OSError:
            return
        if not data:
            return  # the controller's end closed
        what, number, cwd = (data.split(b"\n", 2) + [b"", b""])[:3]
        note = b""
        try:
            if what == KILL and number.isdigit():
                if int(number) in children:  # not reaped: the pid is still that planner's
                    os.kill(int(number), signal.SIGKILL)
            elif what == FORK and number.isdigit():
                pid = os.fork()
                if pid == 0:
                    _planner(fds, cwd, (sock, woken, wake))  # never returns
                children.add(pid)
                note = ZYGOTE_NOTE.pack(FORKED, pid, int(number))
            # anything else is not a request of this version: dropped, and the zygote serves on
        finally:
            for received in fds:  # the planner has its own copies
                os.close(received)
        if note:  # once the zygote let go of them: the planner's ends are its own
            sock.send(note)


def _planner(fds: list[int], cwd: bytes, zygotes: tuple[socket.socket, int, int]) -> None:
    """In the forked child: the zygote's socket and wake-up pipe (``zygotes``) let go, its
    jobs, answers and log as fds 0-2, in the notebook's directory (first on ``sys.path`` too,
    as ``python -m`` started there puts it), then a planner's life; it ends as the interpreter
    would end it, whatever fails on the way (never back in the zygote's loop)."""
    code: int = 0
    try:
        sock, woken, wake = zygotes
        sock.close()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(woken)
        os.close(wake)
        from .jobs import answer_jobs

        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a planner started anew has it
        for target, received in enumerate(fds):
            os.dup2(received, target)
            os.close(received)
        os.chdir(cwd)
        sys.path[0] = os.fsdecode(cwd)
        answer_jobs()
    except SystemExit as exc:  # a build's sys.exit(): None is 0, a number is the code, else said
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - told in the log, which the controller quotes
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - exiting whatever happens
                pass
        if code == -signal.SIGINT:  # as the interpreter ends on a KeyboardInterrupt: by the signal
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)
