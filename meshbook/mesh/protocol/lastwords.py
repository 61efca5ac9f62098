"""A rank's last messages, kept where its agent reads them once the rank has died.

A rank sends through ZeroMQ, whose I/O thread writes a message to the socket a little after
``send`` returns. A rank that dies abruptly in between (``os._exit``, a segfault or an abort
in native code, the OOM killer) takes what was still queued with it, and that is often the
line that says why it died: tried as a new user would, ``print("...", flush=True)`` followed
by ``os._exit(3)`` lost its line 14 times in 15, on one host and across hosts alike.

So a rank first writes each small message it sends into memory it shares with its agent (an
anonymous shared mapping the agent makes before the fork, like
:class:`~.proc.Liveness`), in one of :data:`SLOTS` slots taken in turn. When the agent reaps
the rank it reads the slots back (:meth:`LastWords.read`) and sends them on before the rank's
``EXIT``. They are the rank's own signed messages, so whoever checks them drops the ones that
did arrive (:meth:`~.wire.Wire.taken`): each arrives once, in the order the rank sent them.

A slot is committed by writing its number last, after its length and bytes: a rank killed in
the middle of a write leaves a slot numbered 0, which is skipped. Messages with buffers (a
pulled tensor) or bigger than a slot are not kept; they are not a rank's last words.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

#: How many of a rank's last messages are kept, and how big each may be.
SLOTS = 32
SLOT_BYTES = 16 << 10

_WORD = 8


class LastWords:
    """The last :data:`SLOTS` small messages of one rank process (made by its agent)."""

    def __init__(self) -> None:
        self._header = SLOTS * 2 * _WORD  # per slot: its message's number, then its length
        self._page = mmap.mmap(-1, self._header + SLOTS * SLOT_BYTES)  # shared, anonymous
        self._numbers = memoryview(self._page)[:SLOTS * _WORD].cast("q")
        self._lengths = memoryview(self._page)[SLOTS * _WORD:self._header].cast("q")
        self._count = 0
        self._writer = 0  # the process that writes: the rank, not a child it forks

    def claim(self) -> None:
        """The rank, once forked: its messages are the ones kept (not a child's it forks)."""
        self._writer = os.getpid()

    def keep(self, frames: list[Any]) -> None:
        """The rank, under its send lock, just before it sends ``frames``."""
        if len(frames) != 1 or self._writer != os.getpid():
            return
        data = frames[0] if isinstance(frames[0], bytes) else memoryview(frames[0]).cast("B")
        size = len(data)
        if size > SLOT_BYTES:
            return
        self._count += 1
        slot = self._count % SLOTS
        start = self._header + slot * SLOT_BYTES
        self._numbers[slot] = 0  # a write cut short leaves the slot empty, not half old
        self._page[start:start + size] = data
        self._lengths[slot] = size
        self._numbers[slot] = self._count

    def read(self) -> list[bytes]:
        """The agent, once the rank died: the kept messages, oldest first."""
        kept = sorted((number, slot) for slot, number in enumerate(self._numbers) if number > 0)
        out = []
        for _, slot in kept:
            start = self._header + slot * SLOT_BYTES
            out.append(self._page[start:start + self._lengths[slot]])
        return out

    def close(self) -> None:
        self._numbers.release()
        self._lengths.release()
        self._page.close()
