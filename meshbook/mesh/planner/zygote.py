"""The planner zygote: torch imported once, a fresh planner forked from it in milliseconds.

Why: a planner process spends seconds importing torch before it traces anything, and a plan
started its planners anew every time, so each plan (and each mistake a plan reports, a build
that raises, a batch of the wrong shape) cost those seconds again. The zygote imports torch and
the tracer once, runs nothing else, and forks a planner for each request: every planner is still
a process that ran no code of any plan before it, as a freshly started one would be.

Started by the controller as ``python -m meshbook.mesh.planner FD``, with stdin, stdout and
stderr its own, ignoring SIGINT (a Ctrl-C in a terminal stops the plan, not the zygote). FD is
one end of a Unix socket; each request on it carries its number, the directory to work in, and
three file descriptors: the planner's stdin, stdout and stderr (its jobs, its answers, its
log). The zygote answers ``FORKED`` with the planner's pid and the request's number, and
``EXITED`` with its exit code once it ends (:data:`~meshbook.mesh.protocol.plan.ZYGOTE_NOTE`):
the controller cannot wait for a process that is not its child. It ends when the socket closes
(the controller's process ended, or it chose another zygote).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import traceback

from ..protocol.plan import EXITED, FORKED, ZYGOTE_NOTE
from ..protocol.proc import exited_children


def serve(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    woken, wake = os.pipe()  # a planner exited: told at once, so a plan's end is not kept waiting
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    from . import jobs  # noqa: F401 - torch and the tracer, imported here once, so in every planner forked

    while True:
        ready, _, _ = select.select([sock.fileno(), woken], [], [])
        if woken in ready:
            os.read(woken, 512)
        _reap(sock)
        if sock.fileno() not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, 4096, 3)
        except OSError:
            return
        if not data:
            return  # the controller's end closed
        asked, _, cwd = data.decode().partition("\n")
        pid = os.fork()
        if pid == 0:
            sock.close()
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(woken)
            os.close(wake)
            _planner(fds, cwd)
        for received in fds:
            os.close(received)
        sock.sendall(ZYGOTE_NOTE.pack(FORKED, pid, int(asked)))


def _reap(sock: socket.socket) -> None:
    for pid, status in exited_children():
        sock.sendall(ZYGOTE_NOTE.pack(EXITED, pid, os.waitstatus_to_exitcode(status)))


def _planner(fds: list[int], cwd: str) -> None:
    """In the forked child: its jobs, answers and log as fds 0-2, then a planner's life."""
    from .jobs import answer_jobs

    code: int = 0
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a planner started anew has it
        for target, received in enumerate(fds):
            os.dup2(received, target)
            os.close(received)
        os.chdir(cwd)
        answer_jobs()
    except SystemExit as exc:  # what a build's sys.exit() says, as the interpreter would
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - told in the log, which the controller quotes
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - exiting whatever happens
                pass
        os._exit(code)
