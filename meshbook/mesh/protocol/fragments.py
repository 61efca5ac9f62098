"""A big message on a link between hosts travels in fragments, so that the link stays alive.

ZeroMQ hands a message over only once all of it arrived, and a link (:mod:`.ordering`) is one
connection: a 2 GiB pull over a 1 Gb/s link is 17 s in which the controller hears nothing from
that host (it declares a host lost after 15 s), and every ping and answer queued behind it
waits as long; the other way, an agent stops its ranks when it has not heard its controller
for as long. So a message of at least :data:`FRAGMENT_MIN` bytes goes as fragments of about
:data:`PIECE` bytes, each a link message of its own (numbered, kept, and heard as it arrives),
followed by the message itself with what the fragments carried left empty. The receiving side
puts those frames together again (one copy) and passes the whole message on.

A fragment is ``[FRAGMENT, table, *pieces]``: ``table`` says which frame of the message each
piece belongs to, at which offset, and that frame's size; the first fragment of a message says
so (what was being put together before it belonged to a message that was lost). Nothing else
on a link starts with the one byte ``FRAGMENT``: a message from an agent starts with a signed
envelope (at least 56 bytes), and one to an agent with a route (empty, or a channel's letter
and ranks). A message whose fragments did not all come (lost on a reset, see
:mod:`.ordering`, whose loss fails the work that waited on that host) is dropped whole.

Pure state, no sockets: tested on its own (tests/test_ordering.py).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from .payload import PIECE
from .wire import size

#: The first frame of a fragment.
FRAGMENT = b"\x00"
#: A message this big or bigger travels in fragments (of ``PIECE`` bytes).
FRAGMENT_MIN = 2 * PIECE

_FIRST = struct.Struct("<B")
_PIECE = struct.Struct("<IQQ")  # the frame's index in the message, the piece's offset, the frame's size


def _view(frame: Any) -> memoryview:
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame).cast("B")


def split(frames: Sequence[Any], at: int = 0, piece: int = PIECE) -> tuple[list[list[Any]], list[Any]]:
    """``frames`` as (fragments, what is left of them): the fragments carry every frame but
    the first, uncopied, in order and about ``piece`` bytes each; what is left has those
    frames empty. A message under two pieces (:data:`FRAGMENT_MIN`) is no fragments and
    itself. ``at``: where ``frames`` start in the message the receiver gets (after a route the
    sender puts before them)."""
    if size(frames) < 2 * piece:
        return [], list(frames)
    fragments: list[list[Any]] = []
    table: list[bytes] = []
    pieces: list[memoryview] = []
    filled = 0
    for index in range(1, len(frames)):
        view, offset = _view(frames[index]), 0
        while True:  # an empty frame is one empty piece: the receiver learns its size
            cut = view[offset:offset + piece - filled]
            table.append(_PIECE.pack(index + at, offset, view.nbytes))
            pieces.append(cut)
            filled, offset = filled + cut.nbytes, offset + cut.nbytes
            if filled >= piece:
                fragments.append([FRAGMENT, _FIRST.pack(not fragments) + b"".join(table), *pieces])
                table, pieces, filled = [], [], 0
            if offset >= view.nbytes:
                break
    if pieces:
        fragments.append([FRAGMENT, _FIRST.pack(not fragments) + b"".join(table), *pieces])
    return fragments, [frames[0], *(b"" for _ in frames[1:])]


class Assembly:
    """A link's receiving side: puts fragmented messages together again."""

    def __init__(self) -> None:
        self._frames: dict[int, bytearray] = {}  # by index in the message
        self._filled: dict[int, int] = {}
        #: Messages dropped because a fragment of theirs never came.
        self.dropped = 0

    def take(self, message: list[Any]) -> list[Any] | None:
        """A message as the link delivered it (in order): the whole message, or None (a
        fragment, or a message whose fragments did not all come)."""
        head = message[0]  # its length first: every message passes here, and few are fragments
        if len(head) != len(FRAGMENT) or (head.bytes if hasattr(head, "bytes") else head) != FRAGMENT:
            return self._whole(message)
        table = _view(message[1])
        if _FIRST.unpack_from(table)[0]:
            self._frames, self._filled = {}, {}
        for i, frame in enumerate(message[2:]):
            index, offset, total = _PIECE.unpack_from(table, _FIRST.size + i * _PIECE.size)
            self._fill(index, offset, total, _view(frame))
        return None

    def _fill(self, index: int, offset: int, total: int, piece: memoryview) -> None:
        if offset == 0:
            self._frames[index], self._filled[index] = bytearray(total), 0
        if self._filled.get(index) != offset:
            return  # a fragment before this one never came: the message is dropped when it comes
        self._frames[index][offset:offset + piece.nbytes] = piece
        self._filled[index] = offset + piece.nbytes

    def _whole(self, message: list[Any]) -> list[Any] | None:
        if not self._frames:
            return message
        frames, filled = self._frames, self._filled
        self._frames, self._filled = {}, {}
        whole = list(message)
        for index, frame in frames.items():
            if index >= len(whole) or _view(whole[index]).nbytes or filled[index] != len(frame):
                self.dropped += 1
                return None
            whole[index] = frame
        return whole
