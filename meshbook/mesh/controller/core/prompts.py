"""The notebook's end of a rank's debugger: prompts answered one rank's session at a time.

A rank's ``breakpoint()`` (:mod:`meshbook.mesh.rank.debugger`) sends an input request per
line pdb wants; whoever renders the run feeds its events to a :class:`PromptServer`, which
asks the user and sends the answer to the rank's control thread.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from ...protocol.events import DebugEnd, Event, InputRequest


class PromptServer:
    """Answers ranks' debugger prompts from the notebook, one rank's session at a time.

    Fed every event of a run by whoever renders it; ``show(rank, text)`` shows what the rank's
    debugger printed before a prompt, when that prompt is asked; ``ask(prompt)`` reads a line
    from the user (``input``), ``send(rank, text, question)`` delivers it to the rank.
    """

    def __init__(self, ask: Callable[[str], str], send: Callable[[int, str, int], None],
                 show: Callable[[int, str], None]) -> None:
        self._ask = ask
        self._send = send
        self._show = show
        self._serving: int | None = None
        self._waiting: deque[InputRequest] = deque()
        #: A rank asked for input: the run has been in a debugger session.
        self.used = False
        #: Seconds spent waiting for the user's answers: a cell's ``--timeout`` leaves them out.
        self.answering_s = 0.0
        #: Called with the rank before each of its prompts is asked (whoever follows the run
        #: says there what the other ranks do meanwhile).
        self.before_asking: Callable[[int], None] = lambda rank: None

    def feed(self, event: Event) -> None:
        if isinstance(event, InputRequest):
            self._waiting.append(event)
            self.used = True
        elif isinstance(event, DebugEnd):
            if event.rank == self._serving:
                self._serving = None
            else:  # it gave up waiting (interrupted): its question is not asked any more
                self._waiting = deque(r for r in self._waiting if r.rank != event.rank)
        while self._waiting:
            request = next((r for r in self._waiting if r.rank == self._serving), None)
            if request is None and self._serving is not None:
                return  # the current rank's next prompt has not come yet
            request = request or self._waiting[0]
            self._waiting.remove(request)
            self._serving = request.rank
            if request.before:
                self._show(request.rank, request.before)
            self.before_asking(request.rank)
            asked = time.monotonic()
            answer = self._ask(request.prompt)
            self.answering_s += time.monotonic() - asked
            self._send(request.rank, answer, request.question)
