"""``breakpoint()`` on a rank, answered from the notebook.

On a rank, ``breakpoint()`` (and ``mesh.debug(rank)``'s post-mortem) opens a pdb whose
prompt reads ``(Pdb rank 2)``. Each time pdb wants a line it sends an ``input`` request to the
controller, after flushing its output; the notebook shows the prompt through the kernel's
stdin, and the answer comes back on the rank's control channel. Several ranks at a breakpoint
are served one after another: the notebook keeps talking to one rank until its pdb session
ends (``c``, ``q``), then takes the next.

Where nobody can answer (nbval, a script without a terminal), the request said so up front:
the breakpoint is skipped with a one-line note instead of hanging the mesh.
"""

from __future__ import annotations

import pdb
import sys
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from .run import DebugEnd, Event, InputRequest

if TYPE_CHECKING:
    from .worker import Worker


class RemoteStdin:
    """pdb's stdin on a rank: each ``readline`` is a prompt answered by the notebook."""

    def __init__(self, worker: "Worker") -> None:
        self.worker = worker
        self.prompt = f"(Pdb rank {worker.rank}) "

    def readline(self) -> str:
        worker = self.worker
        worker.stdout.flush()
        worker.stderr.flush()
        worker.emit("input", worker.current_request(), {"prompt": self.prompt})
        try:
            line = worker.input_replies.get()
        except KeyboardInterrupt:
            return "q\n"
        return line if line.endswith("\n") else line + "\n"


class RankPdb(pdb.Pdb):
    """pdb talking to the notebook; announces the end of its session (so the next rank can
    be served) when the user continues or quits."""

    def __init__(self, worker: "Worker") -> None:
        super().__init__(stdin=RemoteStdin(worker), stdout=sys.stdout, nosigint=True)  # type: ignore[arg-type]
        self.use_rawinput = False
        self.prompt = ""  # the prompt travels with each input request instead
        self.worker = worker

    def set_continue(self) -> None:
        super().set_continue()
        self._session_over()

    def set_quit(self) -> None:
        super().set_quit()
        self._session_over()

    def _session_over(self) -> None:
        self.worker.stdout.flush()
        self.worker.emit("debug_end", self.worker.current_request(), None)


def breakpoint_hook(worker: "Worker") -> Any:
    """``sys.breakpointhook`` of a rank."""

    def hook(*args: Any, **kwargs: Any) -> None:
        frame = sys._getframe(1)
        if not worker.stdin_available:
            line = frame.f_lineno
            print(f"breakpoint() at line {line} skipped: this frontend cannot answer a debugger "
                  f"prompt (no stdin)", file=sys.stderr)
            return
        RankPdb(worker).set_trace(frame)

    return hook


def post_mortem(worker: "Worker") -> str:
    """``%mesh debug RANK``: pdb on the rank's last exception (runs on its main thread)."""
    exc = worker.last_exception
    if exc is None or exc.__traceback__ is None:
        return f"rank {worker.rank} has no exception to debug"
    if not worker.stdin_available:
        return "post-mortem skipped: this frontend cannot answer a debugger prompt (no stdin)"
    print(f"post-mortem of rank {worker.rank}: {type(exc).__name__}: {exc}")
    debugger = RankPdb(worker)
    debugger.reset()
    debugger.interaction(None, exc.__traceback__)
    worker.emit("debug_end", worker.current_request(), None)
    return f"left the post-mortem of rank {worker.rank}"


class PromptServer:
    """Answers ranks' debugger prompts from the notebook, one rank's session at a time.

    Fed every event of a run by whoever renders it; ``ask(prompt)`` reads a line from the
    user (``input``), ``send(rank, text)`` delivers it to the rank.
    """

    def __init__(self, ask: Callable[[str], str], send: Callable[[int, str], None]) -> None:
        self._ask = ask
        self._send = send
        self._serving: int | None = None
        self._waiting: deque[InputRequest] = deque()
        #: A rank asked for input: the run has been in a debugger session.
        self.used = False

    def feed(self, event: Event) -> None:
        if isinstance(event, InputRequest):
            self._waiting.append(event)
            self.used = True
        elif isinstance(event, DebugEnd) and event.rank == self._serving:
            self._serving = None
        while self._waiting:
            request = next((r for r in self._waiting if r.rank == self._serving), None)
            if request is None and self._serving is not None:
                return  # the current rank's next prompt has not come yet
            request = request or self._waiting[0]
            self._waiting.remove(request)
            self._serving = request.rank
            self._send(request.rank, self._ask(request.prompt))
