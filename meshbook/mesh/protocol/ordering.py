"""Nothing lost, nothing twice: numbered messages on a link between a controller and an agent
on another host.

A TCP connection that resets (a switch flaps, a firewall drops state) loses what was in its
buffers, and ZeroMQ reconnects as if nothing happened: a rank's result in flight is gone, the
cell waits for it forever, and requests sent meanwhile never reach the ranks. So each side of a
link numbers what it sends (1, 2, 3...) and keeps it (:class:`Outgoing`) until the other side
acknowledges it: every ping and its answer carry the newest number taken in order. The
receiving side (:class:`Incoming`) delivers in order; a number beyond the next one expected
means messages went missing: the ones after the gap are held, and the sender is asked to send
again from the first missing. What it no longer keeps (a gigabyte push is not kept) cannot
come again: the receiver is told which numbers those are, skips the ones that never came
(and fails the work it waited for on that host, saying that messages were lost), delivers
the ones that did come in their place, and takes what is kept as it comes again.

Pure state, no sockets: tested on its own (tests/test_ordering.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: What a sender keeps for sending again, at most (older messages are let go first); a single
#: message bigger than ``KEEP_BYTES`` is sent but never kept.
KEEP_MESSAGES = 20_000
KEEP_BYTES = 256 << 20
#: How long a gap may wait for what was asked again before asking once more; twice as long
#: after each ask, up to ``ASK_AGAIN_MAX_S``, until the gap closes. Each ask has the sender send
#: the whole gap again: a resend still on its way behind a big transfer must not be asked for,
#: and sent, once a second.
ASK_AGAIN_S = 1.0
ASK_AGAIN_MAX_S = 8.0


def size(frames: Sequence[Any]) -> int:
    return sum(memoryview(f.buffer if hasattr(f, "buffer") else f).nbytes for f in frames)


class Outgoing:
    """A link's sender side: numbers each message and keeps it until acknowledged."""

    def __init__(self, keep_messages: int = KEEP_MESSAGES, keep_bytes: int = KEEP_BYTES) -> None:
        self.keep_messages, self.keep_bytes = keep_messages, keep_bytes
        self.next = 1
        self._kept: deque[tuple[int, list[Any], int]] = deque()
        self._bytes = 0
        self._acknowledged = 0  # the newest number the other side has

    def number(self, frames: list[Any], nbytes: int | None = None, of: int = 0) -> int:
        """The number of a message about to be sent; it is kept for sending again. ``nbytes``:
        its size, where the caller knows it (one request fanned out to many links); ``of``: the
        size of the message it is a fragment of (:mod:`.fragments`): no part of a message too
        big to keep is kept (its pieces would pin all of it, and half of it cannot come again)."""
        seq = self.next
        self.next += 1
        nbytes = size(frames) if nbytes is None else nbytes
        if max(nbytes, of) > self.keep_bytes:
            return seq
        self._kept.append((seq, frames, nbytes))
        self._bytes += nbytes
        while len(self._kept) > self.keep_messages or self._bytes > self.keep_bytes:
            self._bytes -= self._kept.popleft()[2]
        return seq

    def acknowledged(self, seq: int) -> None:
        """The other side has everything up to ``seq``: let it go."""
        self._acknowledged = max(self._acknowledged, seq)
        while self._kept and self._kept[0][0] <= seq:
            self._bytes -= self._kept.popleft()[2]

    def since(self, seq: int, until: int | None = None) -> list[tuple[int, list[Any]]]:
        """Every message from ``seq`` on (to ``until``) that is still kept, to send again."""
        last = self.next - 1 if until is None else until
        return [(n, frames) for n, frames, _ in self._kept if seq <= n <= last]

    def gone(self, seq: int, until: int | None = None) -> list[tuple[int, int]]:
        """The numbers from ``seq`` on (to ``until``) that are no longer kept (too big, or let go
        for room), as ranges (first, last): they cannot come again. ``seq`` is what the other
        side asked for; past what it acknowledged (an ask that crossed an acknowledgement names
        numbers it has), every number missing from what is kept is gone."""
        seq, last = max(seq, self._acknowledged + 1), self.next - 1 if until is None else min(until, self.next - 1)
        ranges: list[tuple[int, int]] = []
        for n, _, _ in self._kept:
            if n > last:
                break
            if n > seq:
                ranges.append((seq, n - 1))
            seq = max(seq, n + 1)
        if seq <= last:
            ranges.append((seq, last))
        return ranges

    @property
    def kept(self) -> int:
        return len(self._kept)


@dataclass
class Incoming:
    """A link's receiver side: delivers in order, holds what comes after a gap."""

    expected: int = 1
    held: dict[int, list[Any]] = field(default_factory=dict)
    #: Since when a gap waits (monotonic seconds), when it was last asked for, and how long
    #: the next ask waits.
    gap_since: float | None = None
    asked_at: float = 0.0
    ask_every: float = ASK_AGAIN_S
    #: Numbers ahead that the sender no longer keeps and that never came: skipped when reached.
    gone: set[int] = field(default_factory=set)
    #: The newest number lost for good (0: none): a loss told again is no news.
    newest_lost: int = 0

    @property
    def acknowledged(self) -> int:
        """The newest number taken in order (what a ping acknowledges)."""
        return self.expected - 1

    def take(self, seq: int, frames: list[Any], now: float) -> list[list[Any]]:
        """A message arrived: what can be delivered now, in order (maybe nothing)."""
        if seq == self.expected and not self.held and not self.gone:  # the usual case, per host and answer
            self.expected = seq + 1
            return [frames]
        if seq < self.expected or seq in self.held:
            return []  # sent again, and already here
        self.held[seq] = frames
        out = self._go_on()
        if self.held and self.gap_since is None:
            self.gap_since = now
        return out

    def ask(self, now: float) -> tuple[int, int] | None:
        """The numbers to ask the sender for again (first, last: the gap before what is held),
        when a gap waits and it is time to ask."""
        if self.gap_since is None or now - self.asked_at < self.ask_every:
            return None
        if self.asked_at >= self.gap_since:  # asked for this gap before
            self.ask_every = min(2 * self.ask_every, ASK_AGAIN_MAX_S)
        self.asked_at = now
        return self.expected, min(self.held) - 1

    def give_up(self, gone: Iterable[Sequence[int]]) -> list[list[Any]]:
        """The sender no longer keeps these numbers (ranges first, last): those that never came
        are lost, and skipped; those that did come are delivered in their place. What can be
        delivered now, in order (what is before a gap waits for it)."""
        for first, last in gone:
            lost = set(range(max(first, self.expected), last + 1)).difference(self.held)
            self.gone |= lost
            self.newest_lost = max(self.newest_lost, max(lost, default=0))
        return self._go_on()

    def _go_on(self) -> list[list[Any]]:
        """Deliver what is held from the number expected on, skipping what is lost."""
        out = []
        while self.expected in self.held or self.expected in self.gone:
            if self.expected in self.held:
                out.append(self.held.pop(self.expected))
            self.gone.discard(self.expected)
            self.expected += 1
        if not self.held:  # the gap closed: the next one is asked for promptly
            self.gap_since, self.ask_every = None, ASK_AGAIN_S
        return out
