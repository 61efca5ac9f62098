"""A rank's last messages, kept where its agent reads them once the rank has died.

A rank sends through ZeroMQ, whose I/O thread writes a message to the socket a little after
``send`` returns. A rank that dies abruptly in between (``os._exit``, a segfault or an abort
in native code, the OOM killer) takes what was still queued with it, and that is often the
line that says why it died: tried as a new user would, ``print("...", flush=True)`` followed
by ``os._exit(3)`` lost its line 14 times in 15, on one host and across hosts alike.

So a rank first writes each message it sends (without buffers, up to :data:`BIGGEST`) into
memory it shares with its agent (an anonymous shared mapping the agent makes before the fork,
like :class:`~.proc.Liveness`): a ring of :data:`RING` bytes, with an index of the last
:data:`INDEX` messages. That is room for thousands of lines of output: on a busy 2-core machine a
rank's ZeroMQ thread may not run at all while its main thread prints hundreds, so a ring of a
few messages would still lose most of them. When the agent reaps the rank it reads them back
(:meth:`LastWords.read`) and sends them on ahead of the rank's ``EXIT``, after what reached it
from the rank before (the agent drains its relay, the controller its socket). They are the
rank's own signed messages, so whoever checks them drops the ones that did arrive
(:meth:`~.wire.Wire.taken`): each arrives once, in the order the rank sent them. A message
still in the dead rank's socket buffer when that drain ran arrives after the ``EXIT``, and is
refused as a replay if it is older than the last words.

A message is committed by writing its number last, after its place and bytes: a rank killed in
the middle of a write leaves an index entry numbered 0, which is skipped. Places are absolute
byte counts, so the reader tells a message that newer bytes wrote over (more than :data:`RING`
behind the newest end) from one still whole.
"""

from __future__ import annotations

import mmap
from typing import Any

from .proc import let_go_in_children

#: The last messages kept: how many at most, in how many bytes, and the biggest one kept.
INDEX = 4096
RING = 1 << 20
BIGGEST = 64 << 10

_WORD = 8


class LastWords:
    """The last small messages of one rank process (made by its agent, written by the rank)."""

    def __init__(self) -> None:
        self._data = INDEX * 3 * _WORD  # per entry: the message's number, place and length
        self._page = mmap.mmap(-1, self._data + RING)  # shared, anonymous
        view = memoryview(self._page)
        self._numbers = view[:INDEX * _WORD].cast("q")
        self._places = view[INDEX * _WORD:2 * INDEX * _WORD].cast("q")
        self._lengths = view[2 * INDEX * _WORD:self._data].cast("q")
        view.release()
        self._count = 0
        self._end = 0  # where the next message goes, counted in bytes since the first
        self._writing = False  # in the rank, not in the agent nor in a child the rank forks

    def claim(self) -> None:
        """The rank, once forked: its messages are the ones kept (not a child's it forks)."""
        self._writing = True
        let_go_in_children(self, "disown")

    def disown(self) -> None:
        """A child the rank forked: what it sends is not the rank's to keep."""
        self._writing = False

    def keep(self, frames: list[Any]) -> None:
        """The rank, under its send lock, just before it sends ``frames``."""
        if not self._writing or len(frames) != 1:
            return
        data = frames[0] if isinstance(frames[0], bytes) else memoryview(frames[0]).cast("B")
        size = len(data)
        if size > BIGGEST:
            return
        place = self._end
        if place % RING + size > RING:  # a message never wraps: it starts the ring again
            place += RING - place % RING
        self._count += 1
        entry = self._count % INDEX
        self._numbers[entry] = 0  # a write cut short leaves the entry empty, not half old
        self._places[entry] = place
        self._lengths[entry] = size
        start = self._data + place % RING
        self._page[start:start + size] = data
        self._numbers[entry] = self._count
        self._end = place + size

    def read(self) -> list[bytes]:
        """The agent, once the rank died: the kept messages, oldest first."""
        end = max((place + length for place, length in zip(self._places, self._lengths)), default=0)
        kept = sorted((number, entry) for entry, number in enumerate(self._numbers)
                      if number > 0 and self._places[entry] >= end - RING)
        out = []
        for _, entry in kept:
            start = self._data + self._places[entry] % RING
            out.append(self._page[start:start + self._lengths[entry]])
        return out

    def close(self) -> None:
        """The agent, once it read them: the memory goes (the rank's copy went with it)."""
        self._numbers.release()
        self._places.release()
        self._lengths.release()
        self._page.close()

