"""``breakpoint()`` and ``input()`` on a rank, answered from the notebook.

On a rank, ``breakpoint()`` (and ``mesh.debug(rank)``'s post-mortem) opens a pdb whose
prompt reads ``(Pdb rank 2)``. Each time pdb wants a line it sends an ``input`` request to the
controller, after flushing its output; the notebook shows the prompt through the kernel's
stdin, and the answer comes back on the rank's control channel. Several ranks at a breakpoint
are served one after another: the notebook keeps talking to one rank until its pdb session
ends (``c``, ``q``), then takes the next.

``input(prompt)`` in a cell's code asks the same way, ``[2] prompt``, one line per call (the
session ends with it). Where nobody can answer (nbval, a script without a terminal), the
request said so up front: the breakpoint is skipped with a one-line note instead of hanging
the mesh, and ``input()`` raises ``EOFError`` saying why, as it does without a terminal.
"""

from __future__ import annotations

import io
import itertools
import pdb
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable

from ..protocol import messages as msg

if TYPE_CHECKING:
    from .context import RankContext


class RemoteStdin:
    """pdb's stdin on a rank: each ``readline`` is a prompt answered by the notebook, which
    shows what pdb printed since the last one (``held``) right above it."""

    def __init__(self, worker: "RankContext", held: io.StringIO) -> None:
        self.worker = worker
        self.prompt = f"(Pdb rank {worker.rank}) "
        self.held = held

    def readline(self) -> str:
        worker = self.worker
        worker.stdout.flush()
        worker.stderr.flush()
        try:
            line = ask_notebook(worker, worker.current_request(), self.prompt, take(self.held))
        except KeyboardInterrupt:
            return "q\n"
        if line is None:  # the end of input: nobody waits for this cell any more
            return "q\n"
        return line if line.endswith("\n") else line + "\n"


class RankPdb(pdb.Pdb):
    """pdb talking to the notebook; announces the end of its session (so the next rank can
    be served) when the user continues or quits, or when its request ends.

    What pdb prints (where it stopped, ``p x``) travels with its next prompt, not on the rank's
    output: with several ranks at a breakpoint, each one's "where it stopped" is shown when the
    notebook comes to it, not all of them before the first prompt.

    Stepping never stops in meshbook's own frames (``skip``), and stepping past the end of the
    cell (or of the function ``apply`` called) ends the session, as the cell ends: it would
    otherwise go on into the rank's worker and what that calls. Its stack (``where``, ``up``)
    starts at the cell too. A session still open when its request ends ends with it
    (:meth:`close`): the rank's next request must neither stop in pdb nor run traced."""

    def __init__(self, worker: "RankContext") -> None:
        self.held = io.StringIO()
        super().__init__(stdin=RemoteStdin(worker, self.held), stdout=self.held, nosigint=True,  # type: ignore[arg-type]
                         skip=["meshbook.*"])
        self.use_rawinput = False
        self.prompt = ""  # the prompt travels with each input request instead
        self.worker = worker
        worker.debugger = self

    def get_stack(self, f: Any, t: Any) -> tuple[list[tuple[Any, int]], int]:
        """The stack from the cell (or the applied function, the endpoint) on: the rank's own
        frames below it (its worker, its agent, runpy) are no place to go ``up`` to."""
        stack, index = super().get_stack(f, t)
        own = [i for i, (frame, _) in enumerate(stack[:index])
               if self.is_skipped_module(frame.f_globals.get("__name__", ""))]
        start = own[-1] + 1 if own else 0
        return stack[start:], index - start

    def user_return(self, frame: Any, return_value: Any) -> None:
        caller = frame.f_back
        if caller is None or self.is_skipped_module(caller.f_globals.get("__name__")):
            self.set_continue()  # stepped past the end of the cell (or of the applied function)
            return
        super().user_return(frame, return_value)

    def close(self) -> None:
        """The request ends while this session steps: it ends too."""
        self.clear_all_breaks()
        self.set_continue()

    def set_continue(self) -> None:
        super().set_continue()
        self._session_over()

    def set_quit(self) -> None:
        super().set_quit()
        self._session_over()

    def _session_over(self) -> None:
        if self.worker.debugger is self:
            self.worker.debugger = None
        self.worker.stdout.write(take(self.held))  # what no prompt took along
        self.worker.stdout.flush()
        self.worker.emit(msg.DEBUG_END, self.worker.current_request(), None)


def input_hook(worker: "RankContext") -> Callable[..., str]:
    """``builtins.input`` of a rank: a cell's own code asks the notebook."""

    def ask(prompt: object = "") -> str:
        worker.stdout.flush()
        worker.stderr.flush()
        request = worker.request
        if request is None or not worker.stdin_available or threading.current_thread() is not threading.main_thread():
            raise EOFError("input(): nobody can answer it here (a cell's own code may ask "
                           "when its notebook lets cells read input; not a batch run or a background "
                           "thread); send the value instead: mesh.push(name=value)")
        try:
            line = ask_notebook(worker, request, f"[{worker.rank}] {prompt}")
        finally:
            worker.emit(msg.DEBUG_END, request, None)  # one line: the next rank's question may come
        if line is None:
            raise EOFError("input(): nobody in the notebook will answer it (its cell "
                           "stopped waiting at its timeout, or waits without showing the ranks' output)")
        return line.rstrip("\n")

    return ask


#: This process's questions, numbered: a rank's answers name the question they answer.
_questions = itertools.count(1)


def take(held: io.StringIO) -> str:
    """What ``held`` holds, emptied."""
    text = held.getvalue()
    held.seek(0)
    held.truncate()
    return text


def ask_notebook(worker: "RankContext", request: int | None, prompt: str, before: str = "") -> str | None:
    """Ask the notebook for a line (None: the end of input), showing ``before`` (this rank's
    output) right above the prompt. An answer that comes after its question was given up
    (interrupted) names that question, and is dropped here, where draining the queue before
    asking would miss one still on its way."""
    question = next(_questions)
    worker.emit(msg.INPUT, request, {"prompt": prompt, "question": question, "before": before})
    while True:
        answers, line = worker.input_replies.get()
        if answers == question:
            return line


def breakpoint_hook(worker: "RankContext") -> Any:
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


