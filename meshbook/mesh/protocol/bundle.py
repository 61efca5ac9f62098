"""A host's answers gathered into one message up its link, checked and signed once there.

Why: a request to 1,024 ranks on 128 hosts used to come back as 1,024 signed messages, and the
controller checked each (its HMAC, its replay stamp, its header), then booked each answer on its
own: about 20 us a rank, all on one thread of the notebook's process. An agent on another host
is inside the mesh's trust boundary (it holds the mesh key and forks the ranks), so it checks
its ranks' messages itself, exactly as the controller did (signature, then replay stamp, then
the header), and sends what one drain of its relay socket found as a single ``BUNDLE``, signed
once. Per host, not per rank, is then what the controller pays to check, order and unpickle.

A bundle's body is a list of entries, in the order the messages arrived:

* ``[RESULTS, request, ranks, durations, has_group, type, value]``: consecutive ``RESULT``
  messages for one request with the same pickled value (a no-op's ``None``), the same
  process-group flag and type, as one entry: the ranks and each one's duration, the value
  once. The controller books them as one group (:class:`~.events.Results`).
* ``[MESSAGE, header, body]``: any other message, its checked header and its pickled body.

Results group only across consecutive results, so every rank's messages keep their order (its
output before its result). A message with out-of-band buffers (a pulled tensor) is never
bundled: the agent sends what it gathered so far, then that message as the rank signed it,
zero-copy, and the controller checks that one itself.
"""

from __future__ import annotations

from typing import Any

from . import messages as msg
from .wire import Message

RESULTS = 0
MESSAGE = 1


class Bundle:
    """Checked messages of one host, gathered until :meth:`take` (pure: no sockets)."""

    def __init__(self) -> None:
        self.entries: list[list[Any]] = []
        self._open: list[Any] | None = None  # the results entry a matching result joins

    def __bool__(self) -> bool:
        return bool(self.entries)

    def add(self, message: Message) -> None:
        if message.kind != msg.RESULT:
            self._open = None
            self.entries.append([MESSAGE, message.header, message.raw_body()])
            return
        entry = results_entry(message)
        if self._open is None or not join(self._open, entry):
            self._open = entry
            self.entries.append(entry)

    def take(self) -> list[list[Any]]:
        """The entries gathered, in order; the bundle starts empty again."""
        entries, self.entries, self._open = self.entries, [], None
        return entries


def results_entry(message: Message) -> list[Any]:
    """A rank's ``RESULT`` (without buffers) as a results entry of its one rank."""
    header = message.header
    return [RESULTS, header[msg.ID], [header[msg.RANK]], [header.get(msg.DURATION, 0.0)],
            header.get(msg.HAS_GROUP), header.get(msg.TYPE), message.raw_body()]


def join(entry: list[Any], other: list[Any]) -> bool:
    """Add ``other``'s ranks to ``entry`` if both are the same results (one request, one
    value, the same group flag and type); say whether it did. The agent gathers its ranks'
    results with it, and the controller the hosts' (consecutive entries only: order is kept)."""
    if entry[1] != other[1] or entry[4] is not other[4] or entry[5] != other[5] or entry[6] != other[6]:
        return False
    entry[2] += other[2]
    entry[3] += other[3]
    return True
