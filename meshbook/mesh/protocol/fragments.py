"""A big message on a link between hosts travels in fragments, so that the link stays alive.

ZeroMQ hands a message over only once all of it arrived, and a link (:mod:`.ordering`) is one
connection: a 2 GiB pull over a 1 Gb/s link is 17 s in which the controller hears nothing from
that host (it declares a host lost after 15 s), and every ping and answer queued behind it
waits as long; the other way, an agent stops its ranks when it has not heard its controller
for as long. So a message of at least :data:`FRAGMENT_MIN` bytes goes as fragments of about
:data:`PIECE` bytes of its frames, each a link message of its own (numbered, kept, and heard
as it arrives), and a last fragment that carries the message itself with every frame empty.
The receiving side puts the frames together again (one copy) and passes the whole message on.

A fragment is ``[FRAGMENT, table, *frames]``: the table names the message (a random id), says
whether this is its first or its last fragment, and, for each piece that follows it, which
frame of the message it belongs to, at which offset, and that frame's size; the last fragment
carries the message's frames instead. Nothing else on a link starts with the one byte
``FRAGMENT``: a message from an agent starts with a signed envelope (at least 56 bytes), and
one to an agent with a route (empty, or a channel's letter and ranks). A sender sends a
message's fragments one after the other, so anything else arriving in between means the rest
was lost on a reset (:mod:`.ordering`, whose loss fails the work that waited on that host):
the message is dropped whole, and what came in between is passed on as it is. A fragment of
another message is never put into this one.

Pure state, no sockets: tested on its own (tests/test_ordering.py).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .payload import PIECE
from .wire import size

#: The first frame of a fragment.
FRAGMENT = b"\x00"
#: A message this big or bigger travels in fragments (of ``PIECE`` bytes).
FRAGMENT_MIN = 2 * PIECE

_FIRST, _LAST = 1, 2
_HEAD = struct.Struct("<8sB")  # the message's id, first/last
_PIECE = struct.Struct("<IQQ")  # the frame's index in the message, the piece's offset, the frame's size


def _view(frame: Any) -> memoryview:
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame).cast("B")


@dataclass(frozen=True)
class Cut:
    """A message as a link sends it: its fragments (none when small), then :meth:`last`."""

    fragments: list[list[Any]]
    rest: list[Any]
    head: bytes  # the last fragment's table ("": the message travels whole)
    nbytes: int  # the whole message's size

    def last(self, before: Sequence[Any] = ()) -> list[Any]:
        """The message's last part, ``before`` its frames (a route the sender puts first)."""
        if not self.head:
            return [*before, *self.rest]
        return [FRAGMENT, self.head, *before, *self.rest]


def split(frames: Sequence[Any], at: int = 0, piece: int = PIECE) -> Cut:
    """``frames`` cut into fragments of about ``piece`` bytes, uncopied, in order; a message
    under two pieces (:data:`FRAGMENT_MIN`) is not cut. ``at``: where ``frames`` start in the
    message the receiver gets (after a route the sender puts before them, see :meth:`Cut.last`)."""
    nbytes = size(frames)
    if nbytes < 2 * piece:
        return Cut([], list(frames), b"", nbytes)
    message = os.urandom(8)
    fragments: list[list[Any]] = []
    table: list[bytes] = []
    pieces: list[memoryview] = []
    filled = 0

    def close() -> None:
        fragments.append([FRAGMENT, _HEAD.pack(message, 0 if fragments else _FIRST) + b"".join(table), *pieces])

    for index, frame in enumerate(frames):
        view, offset = _view(frame), 0
        while True:  # an empty frame is one empty piece: the receiver learns its size
            cut = view[offset:offset + piece - filled]
            table.append(_PIECE.pack(index + at, offset, view.nbytes))
            pieces.append(cut)
            filled, offset = filled + cut.nbytes, offset + cut.nbytes
            if filled >= piece:
                close()
                table, pieces, filled = [], [], 0
            if offset >= view.nbytes:
                break
    if pieces:
        close()
    return Cut(fragments, [b""] * len(frames), _HEAD.pack(message, _LAST), nbytes)


class Assembly:
    """A link's receiving side: puts fragmented messages together again."""

    def __init__(self) -> None:
        self._message: bytes | None = None  # the id of the message being put together
        self._frames: dict[int, bytearray] = {}  # by index in the message
        self._filled: dict[int, int] = {}
        #: Messages dropped because a fragment of theirs never came.
        self.dropped = 0

    def take(self, message: list[Any]) -> list[Any] | None:
        """A message as the link delivered it (in order): the whole message, or None (a
        fragment, or the last of a message whose fragments did not all come)."""
        head = message[0]  # its length first: every message passes here, and few are fragments
        if len(head) != len(FRAGMENT) or (head.bytes if hasattr(head, "bytes") else head) != FRAGMENT:
            self.clear()  # what was being put together lost its last fragments
            return message
        table = _view(message[1])
        name, kind = _HEAD.unpack_from(table)
        if kind & _FIRST:
            self.clear()
            self._message = name
        if name != self._message:
            if kind & _LAST:
                self.dropped += 1  # its first fragments never came
            return None
        if kind & _LAST:
            return self._whole(message[2:])
        for i, frame in enumerate(message[2:]):
            index, offset, total = _PIECE.unpack_from(table, _HEAD.size + i * _PIECE.size)
            self._fill(index, offset, total, _view(frame))
        return None

    def clear(self) -> None:
        """Forget the message being put together (it is dropped: it cannot be whole now)."""
        if self._message is not None:
            self.dropped += 1
        self._message, self._frames, self._filled = None, {}, {}

    def _fill(self, index: int, offset: int, total: int, piece: memoryview) -> None:
        if offset == 0:
            self._frames[index], self._filled[index] = bytearray(total), 0
        if self._filled.get(index) != offset:
            return  # cannot happen on a link (in order, one message at a time); dropped when whole
        self._frames[index][offset:offset + piece.nbytes] = piece
        self._filled[index] = offset + piece.nbytes

    def _whole(self, rest: list[Any]) -> list[Any] | None:
        frames, filled = self._frames, self._filled
        self._message, self._frames, self._filled = None, {}, {}
        whole = list(rest)
        for index, frame in frames.items():
            if index >= len(whole) or _view(whole[index]).nbytes or filled[index] != len(frame):
                self.dropped += 1
                return None
            whole[index] = frame
        return whole
