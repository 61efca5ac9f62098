"""Bulk values for push and scatter: serialized once, their big buffers shared, not copied per rank.

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
  zero-copy frames, the same frames sent by reference to each rank.

The message naming the shared file is signed like every other message; the file starts with
a random token the message carries too, so a rank never maps a file that is not this push's.

>>> with pack({"x": tensor}, shared=True) as payload:       # in the notebook process
...     mesh.call(ops.store, payload).result()               # on a rank: payload.load()
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import wire
from .errors import SendError

#: Below this many buffer bytes a shared-memory file costs more than frames on the wire.
SHARE_MIN = 1 << 20

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


@dataclass
class Payload:
    """A pickled value and its buffers (inline as frames, or in a :class:`SharedFile`)."""

    body: bytes
    buffers: list[Any] = field(default_factory=list)
    shared: SharedFile | None = None

    def load(self) -> Any:
        """The value, on a rank: its tensors alias the frames or the mapped file, uncopied."""
        if self.shared is None:
            return wire.loads(self.body, self.buffers)
        return wire.loads(self.body, _map(self.shared))


@contextlib.contextmanager
def pack(values: Mapping[str, Any], shared: bool, what: str = "push") -> Iterator[Payload]:
    """Pickle ``values`` once; with ``shared`` and enough bytes, put the buffers in a memfd.

    The memfd stays open while the ``with`` block runs: wait there for every rank to load it.
    Raises :class:`~meshbook.SendError` naming the value that cannot be pickled (and its type).
    """
    try:
        body, buffers = wire.dumps(dict(values))
    except Exception as exc:  # noqa: BLE001 - whatever pickling raises, name the value
        raise SendError(f"{what}: {wire.describe_unpicklable({'values': values}, exc)}; nothing was "
                        f"sent to any rank") from None
    views = [b.raw() for b in buffers]
    if not shared or sum(v.nbytes for v in views) < SHARE_MIN:
        yield Payload(body, list(buffers))
        return
    fd = os.memfd_create("meshbook-push", os.MFD_CLOEXEC)
    try:
        yield Payload(body, shared=_write(fd, views))
    finally:
        os.close(fd)


def _write(fd: int, views: list[memoryview]) -> SharedFile:
    token = secrets.token_bytes(_TOKEN_BYTES)
    spans, offset = [], _ALIGN
    for view in views:
        spans.append((offset, view.nbytes))
        offset += -(-view.nbytes // _ALIGN) * _ALIGN
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


def _map(shared: SharedFile) -> list[memoryview]:
    gone = "the notebook's shared memory for this push is gone (the push was interrupted); push again"
    try:
        fd = os.open(f"/proc/{shared.pid}/fd/{shared.fd}", os.O_RDONLY)
    except FileNotFoundError:
        raise RuntimeError(gone) from None
    except OSError as exc:
        raise RuntimeError(f"cannot open the notebook's shared memory ({exc}): this rank may not "
                           f"read the notebook process's files") from None
    try:
        if os.pread(fd, _TOKEN_BYTES, 0) != shared.token:
            raise RuntimeError(gone)  # the number now names another file of the notebook
        # Private and writable: a rank that changes its tensor gets its own pages (copy on write).
        mapped = mmap.mmap(fd, shared.size, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    whole = memoryview(mapped)
    return [whole[start:start + length] for start, length in shared.spans]

