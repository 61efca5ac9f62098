"""Rank-side output capture: every byte a rank writes reaches the controller, tagged.

Two paths, both ending in the rank's single outbound socket:

* **Python writes** (``print``, logging to ``sys.stderr``) go through :class:`RankStream`,
  which tags each write with the request of the *thread* that wrote it. A thread inherits the
  request that was running when it was started, so a background thread's prints keep going
  to the cell that started it, never to a later one.
* **C-level writes** to fds 1 and 2 (C++ warnings, ``os.system``, NCCL/gloo logs) land in
  pipes that :class:`FdPump` reads on a thread and tags with the request running now.
* **A forked child's Python writes** (a DataLoader worker, a ``multiprocessing`` pool, a bare
  ``os.fork()``): the rank's sockets are not the child's to use, so in the child the streams
  write to fds 1 and 2 instead, the pipes the rank's pump reads, and the lines reach the cell
  that runs as they come.

Before a request's result is sent, :meth:`FdPump.drain` and :meth:`RankStream.flush` push out
everything written so far, so output always arrives before the result it belongs to.
"""

from __future__ import annotations

import codecs
import io
import os
import re
import select
import threading
from functools import partial
from typing import Callable

from ..protocol.proc import let_go_in_children

#: Called with (request id or None, stream name, text) to send output to the controller.
Sink = Callable[["int | None", str, str], None]

_REQUEST_ATTR = "_meshbook_request"


def request_of(thread: threading.Thread, main_request: int | None) -> int | None:
    if thread is threading.main_thread():
        return main_request
    return getattr(thread, _REQUEST_ATTR, main_request)


def install_thread_tagging(current_request: Callable[[], "int | None"]) -> None:
    """Make threads remember the request running when they were started.

    This wraps ``threading.Thread.start`` inside the rank process only (ipykernel does the same
    to route threads' output to their cell); nothing outside the rank is touched.
    """
    original = threading.Thread.start

    def start(self: threading.Thread) -> None:
        setattr(self, _REQUEST_ATTR, request_of(threading.current_thread(), current_request()))
        original(self)

    threading.Thread.start = start  # type: ignore[method-assign]


class RankStream(io.TextIOBase):
    """``sys.stdout``/``sys.stderr`` of a rank: line-buffered per request, thread-aware."""

    def __init__(self, name: str, fd: int, sink: Sink, current_request: Callable[[], "int | None"]) -> None:
        super().__init__()
        self.name = name
        self._fd = fd
        self._sink = sink
        self._current = current_request
        # Re-entrant: a signal handler that prints runs on the main thread, maybe inside write()
        # or flush(); it must not deadlock here (its line may land amid the outer one's).
        self._lock = threading.RLock()
        self._partial: dict[int | None, str] = {}
        self.buffer = RankBytes(self)
        let_go_in_children(self, "write_to_fd")

    def write_to_fd(self) -> None:
        """In a child the rank forked: write what comes to the stream's fd (the rank's pipe,
        which its pump reads), not through the rank's sockets. The parent's partial lines stay
        the parent's, and a lock another thread held at the fork is not the child's to wait for."""
        self._lock = threading.RLock()
        self._partial = {}
        self._sink = partial(_write_fd, self._fd)

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def fileno(self) -> int:
        return self._fd  # C-level writers (faulthandler, subprocess) use the captured fd

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        request = request_of(threading.current_thread(), self._current())
        with self._lock:  # sent under it too: see flush()
            pending = self._partial.get(request, "") + text
            cut = pending.rfind("\n") + 1
            self._partial[request] = pending[cut:]
            if cut:
                self._sink(request, self.name, pending[:cut])
        return len(text)

    def flush(self) -> None:
        """Send the partial lines. Taken and sent under the lock (as :class:`FdPump` does): the
        main thread's flush before its result must wait for a line the control thread's flush
        took but has not sent yet, else that line arrives after the result."""
        with self._lock:
            pending, self._partial = self._partial, {}
            for request, text in pending.items():
                if text:
                    self._sink(request, self.name, text)


class RankBytes(io.RawIOBase):
    """``sys.stdout.buffer`` of a rank: bytes written here are decoded (UTF-8, split
    characters kept for the next write) and go the way of the text stream."""

    def __init__(self, text: RankStream) -> None:
        super().__init__()
        self._text = text
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._text.fileno()

    def write(self, data: bytes) -> int:  # type: ignore[override]
        view = memoryview(data)
        self._text.write(self._decoder.decode(view.tobytes()))
        return view.nbytes

    def flush(self) -> None:
        self._text.flush()


#: Lines C code writes that say nothing to a user: c10d warns of each peer whose address has no
#: name (hosts without reverse DNS, every namespace-host), in every start and restart.
NOISE = re.compile(r"^\[W[^\]]*\] \[c10d\] The hostname of the client socket cannot be retrieved\. "
                   r"err=-?\d+\n", re.M)


class FdPump:
    """Redirects fds 1 and 2 into pipes and forwards what C code writes there (less the
    :data:`NOISE` lines)."""

    def __init__(self, pipes: dict[str, tuple[int, int]], sink: Sink,
                 current_request: Callable[[], "int | None"]) -> None:
        # pipes: stream name -> (read end, write end); the write ends become fds 1 and 2.
        self._sink = sink
        self._current = current_request
        self._lock = threading.Lock()
        self._readers = {read: name for name, (read, _) in pipes.items()}
        self._decoders = {read: codecs.getincrementaldecoder("utf-8")("replace") for read in self._readers}
        #: Asked after each request (one system call, where asking each pipe what it holds took two).
        self._drainer = select.poll()
        for read in self._readers:
            os.set_blocking(read, False)
            self._drainer.register(read, select.POLLIN)
        threading.Thread(target=self._pump, name="meshbook-fd-pump", daemon=True).start()

    def _pump(self) -> None:
        poller = select.poll()
        for read in self._readers:
            poller.register(read, select.POLLIN)
        while True:
            for read, _ in poller.poll():
                with self._lock:
                    self._forward(read)

    def _forward(self, read: int) -> None:
        try:
            data = os.read(read, 1 << 16)
        except BlockingIOError:
            return
        text = NOISE.sub("", self._decoders[read].decode(data))
        if text:
            self._sink(self._current(), self._readers[read], text)

    def drain(self) -> None:
        """Forward everything already written to fds 1 and 2 (call after flushing stdio)."""
        with self._lock:
            while ready := [read for read, events in self._drainer.poll(0) if events & select.POLLIN]:
                for read in ready:
                    self._forward(read)


def _write_fd(fd: int, request: int | None, stream: str, text: str) -> None:
    data = text.encode("utf-8", "replace")
    while data:
        data = data[os.write(fd, data):]

