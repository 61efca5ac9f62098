"""Bulk values for push, scatter and pull: serialized once, their big buffers shared, not copied per rank.

A value pushed to the ranks is pickled exactly once, by :func:`pack`, with its large buffers
(tensor and array payloads, bf16 and non-contiguous tensors included, see :mod:`.wire`)
lifted out of the pickle. Those buffers then reach the ranks one of
two ways:

* **shared memory**, when every target rank runs on this machine under an agent this process
  started (the local launcher): the buffers are written once into an anonymous ``memfd`` and
  each rank maps it copy-on-write (``MAP_PRIVATE``) through ``/proc/<controller>/fd/<n>``.
  One copy in the notebook process, none on the ranks, whether one rank or eight receive it;
  a rank that writes to its tensor gets private pages, the others still see the original.
  The file has no name, so nothing can outlive the notebook process: it is closed when the
  push completes, and its pages go away with the last rank that still maps them;
* **wire frames** otherwise (ranks on other hosts, small values): the buffers travel as
  zero-copy frames, the same frames sent by reference to each rank. A big push to other hosts
  travels in pieces (:func:`pieces`, a request each, in order before the one that stores the
  values, which names them with a :class:`Staged`): one piece crosses the network, encrypted,
  while the one before is decrypted and handed to the ranks, where one message would take each
  stage in turn (measured: about a third faster to one host).

A pull from local ranks goes the same way back (:class:`Lent`): each rank writes its value's
buffers into a memfd of its own and answers with the file's name; the notebook maps it
copy-on-write and tells the rank to close its copy. One copy, on the rank, where a socket
would cost two (into the kernel, out of it) and a reassembly.

The message naming the shared file is signed like every other message; the file starts with
a random token the message carries too, so a rank never maps a file that is not this push's.

Rank-to-rank actor calls (:mod:`meshbook.mesh.rank.actors`) share the same way, from a
:class:`Segments` pool: a fresh memfd costs a page allocation per 4 KiB written (about a third
of the copy's speed on a small machine), so a segment every target has unmapped again
(:meth:`Payload.open`'s ``release``) is written over by the next call instead.

>>> with pack({"x": tensor}, shared=True) as payload:       # in the notebook process
...     mesh.call(ops.store, payload).result()               # on a rank: payload.load()
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import wire
from .errors import SendError

#: Below this many buffer bytes a shared-memory file costs more than frames on the wire.
SHARE_MIN = 1 << 20
#: The pieces a push to other hosts travels in; one that is not twice as big goes whole.
PIECE = 16 << 20

_ALIGN = 64  # buffers start on cache-line boundaries, as allocators would place them
_TOKEN_BYTES = 16


@dataclass(frozen=True)
class SharedFile:
    """Where a rank finds the buffers: the controller's memfd, and each buffer's span in it."""

    pid: int
    fd: int
    token: bytes
    size: int
    spans: tuple[tuple[int, int], ...]  # (offset, length) per buffer, in pickle order


@dataclass(frozen=True)
class Staged:
    """Where a rank finds buffers that came before the payload in pieces: put together under
    ``token`` by the ``stage`` requests, ``sizes`` bytes each."""

    token: bytes
    sizes: tuple[int, ...]


@dataclass
class Payload:
    """A pickled value and its buffers (inline as frames, in a :class:`SharedFile`, or sent
    ahead in pieces, :class:`Staged`)."""

    body: bytes
    buffers: list[Any] = field(default_factory=list)
    shared: SharedFile | None = None
    staged: Staged | None = None

    def load(self, what: str = "push") -> Any:
        """The value, where it arrived: its tensors alias the frames or the mapped file, uncopied."""
        return self.open(what)[0]

    def open(self, what: str = "push") -> tuple[Any, Callable[[], bool]]:
        """The value, and ``release()``: once nothing uses the value any more, it unmaps the
        shared file and says True; False while something still holds a tensor of it (the
        mapping then lives on with that tensor)."""
        if self.shared is None:
            return wire.loads(self.body, self.buffers), lambda: True
        mapped, views = _map(self.shared, what)
        value = wire.loads(self.body, views)

        def release() -> bool:
            try:
                for view in views:
                    view.release()
                mapped.close()
            except BufferError:
                return False  # a tensor of it is still alive somewhere
            return True

        return value, release


def pieces(payload: Payload, piece: int = PIECE) -> tuple[Payload, list[tuple[int, int, int, Any]]]:
    """A payload whose buffers travel ahead in pieces: the payload to send last (naming them),
    and each piece as ``(buffer index, offset, buffer size, piece)``, the piece zero-copy."""
    views = [memoryview(b.raw() if isinstance(b, pickle.PickleBuffer) else b).cast("B") for b in payload.buffers]
    out = [(i, start, view.nbytes, pickle.PickleBuffer(view[start:start + piece]))
           for i, view in enumerate(views) for start in range(0, view.nbytes, piece)]
    staged = Staged(secrets.token_bytes(8), tuple(v.nbytes for v in views))
    return Payload(payload.body, staged=staged), out


def pickled(values: Mapping[str, Any], what: str) -> tuple[bytes, list[memoryview], list[Any]]:
    """``values`` pickled once: the body, its buffers' raw views and the buffers themselves.
    Raises :class:`~meshbook.SendError` naming the value that cannot be pickled (and its type)."""
    try:
        body, buffers = wire.dumps(dict(values))
    except Exception as exc:  # noqa: BLE001 - whatever pickling raises, name the value
        raise SendError(f"{what}: {wire.describe_unpicklable({'values': values}, exc)}; nothing was "
                        f"sent to any rank") from None
    return body, [b.raw() for b in buffers], list(buffers)


class Segments:
    """Shared files to write payloads into, kept for reuse once every reader released them."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._free: list[tuple[int, int]] = []  # (size, fd)
        self._lock = threading.Lock()

    def share(self, body: bytes, views: list[memoryview]) -> tuple[Payload, int]:
        """A payload in a free segment big enough (or a new one), and that segment's fd."""
        need = _layout(views)[1]
        with self._lock:
            fits = [seg for seg in self._free if seg[0] >= need]
            if fits:
                self._free.remove(min(fits))
        if not fits:
            shared, fd = in_new_file("meshbook-call", views)
            return Payload(body, shared=shared), fd
        fd = min(fits)[1]
        return Payload(body, shared=_write(fd, views)), fd

    def give_back(self, fd: int, reusable: bool) -> None:
        """Done with segment ``fd``: kept if every reader released it, else closed (the
        readers' mappings keep its pages as long as they need them)."""
        if not reusable:
            os.close(fd)
            return
        with self._lock:
            self._free.append((os.fstat(fd).st_size, fd))
            self._free.sort()
            while len(self._free) > self.keep:
                os.close(self._free.pop(0)[1])


class Lent:
    """Files this process wrote values into for a reader on this machine (a rank's answer to
    a pull), open until the reader has mapped them and says so (:meth:`release`). One the
    reader never claims (its pull was interrupted, its process died) is closed after
    ``keep_s`` by :meth:`expire` (the rank's control loop calls it every tick, and each
    :meth:`lend`): only the reader's mapping may keep a file's pages alive
    for long."""

    def __init__(self, keep_s: float = 60.0) -> None:
        self.keep_s = keep_s
        self._open: dict[bytes, tuple[int, float]] = {}  # token -> (fd, when lent)
        self._lock = threading.Lock()

    def lend(self, value: Any, what: str) -> Payload:
        """``value`` as a payload: its buffers in a new memfd when they are big enough, else
        inline (frames). A new file each time: the reader maps it copy-on-write, so writing
        over it would change what the reader sees."""
        body, views, buffers = pickled({"value": value}, what)
        if not worth_sharing(views):
            return Payload(body, list(buffers))
        self.expire(time.monotonic())
        shared, fd = in_new_file("meshbook-pull", views)
        with self._lock:
            self._open[shared.token] = (fd, time.monotonic())
        return Payload(body, shared=shared)

    def expire(self, now: float) -> None:
        """Close the files lent more than ``keep_s`` before ``now`` (called every tick)."""
        if not self._open:
            return
        with self._lock:
            for token, (fd, lent) in list(self._open.items()):
                if now - lent > self.keep_s:
                    os.close(self._open.pop(token)[0])

    def release(self, token: bytes | None) -> None:
        """The reader mapped the file lent under ``token``: close ours."""
        with self._lock:
            fd = self._open.pop(token, None) if token is not None else None
        if fd is not None:
            os.close(fd[0])


@contextlib.contextmanager
def pack(values: Mapping[str, Any], shared: bool, what: str = "push") -> Iterator[Payload]:
    """Pickle ``values`` once; with ``shared`` and enough bytes, put the buffers in a memfd.

    The memfd stays open while the ``with`` block runs: wait there for every rank to load it.
    Raises :class:`~meshbook.SendError` naming the value that cannot be pickled (and its type).
    """
    body, views, buffers = pickled(values, what)
    if not shared or not worth_sharing(views):
        yield Payload(body, list(buffers))
        return
    file, fd = in_new_file("meshbook-push", views)
    try:
        yield Payload(body, shared=file)
    finally:
        os.close(fd)


def worth_sharing(views: list[memoryview]) -> bool:
    """Do these buffers weigh enough for a shared file (:data:`SHARE_MIN`)?"""
    return sum(v.nbytes for v in views) >= SHARE_MIN


def in_new_file(name: str, views: list[memoryview]) -> tuple[SharedFile, int]:
    """``views`` written into a new memfd named ``name``: where they are, and the file's fd."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    return _write(fd, views), fd


def _layout(views: list[memoryview]) -> tuple[list[tuple[int, int]], int]:
    """Where each buffer goes in a shared file, and the file's size."""
    spans, offset = [], _ALIGN
    for view in views:
        spans.append((offset, view.nbytes))
        offset += -(-view.nbytes // _ALIGN) * _ALIGN
    return spans, offset


def _write(fd: int, views: list[memoryview]) -> SharedFile:
    token = secrets.token_bytes(_TOKEN_BYTES)
    spans, offset = _layout(views)
    if os.fstat(fd).st_size < offset:  # a reused segment only grows: shrinking frees its pages
        os.ftruncate(fd, offset)
    _pwrite_all(fd, memoryview(token), 0)
    for view, (start, _) in zip(views, spans):
        _pwrite_all(fd, view, start)
    return SharedFile(os.getpid(), fd, token, offset, tuple(spans))


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    # One write moves at most ~2 GiB on Linux: loop until the whole buffer is in.
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)


def _map(shared: SharedFile, what: str) -> tuple[mmap.mmap, list[memoryview]]:
    gone = f"the shared memory for this {what} is gone (the {what} was interrupted); {what} again"
    try:
        fd = os.open(f"/proc/{shared.pid}/fd/{shared.fd}", os.O_RDONLY)
    except FileNotFoundError:
        raise RuntimeError(gone) from None
    except OSError as exc:
        raise RuntimeError(f"cannot open the shared memory of this {what} ({exc}): this process may "
                           f"not read the files of process {shared.pid}") from None
    try:
        if os.pread(fd, _TOKEN_BYTES, 0) != shared.token:
            raise RuntimeError(gone)  # the number now names another file of the notebook
        # Private and writable: a rank that changes its tensor gets its own pages (copy on write).
        mapped = mmap.mmap(fd, shared.size, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    with memoryview(mapped) as whole:
        return mapped, [whole[start:start + length] for start, length in shared.spans]

