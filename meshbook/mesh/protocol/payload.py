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

A pull from local ranks goes the same way back: each rank writes its value's buffers into a
file and answers with the file's name, and the notebook maps it copy-on-write. One copy, on
the rank, where a socket would cost two (into the kernel, out of it) and a reassembly. The
file is one the notebook offers (:class:`Landing`: the file of a value pulled before, which
nothing maps any more), or a new memfd the rank lends (:class:`Lent`) when none fits; the
notebook keeps that one too, for the pulls after. Each rank weighs its value as it pickles it
(:func:`pickled_for_pull`): one over its share of the pull's ``max_bytes`` is answered with an
:class:`Overweight` and stays where it is.

Every value held mapped from shared memory keeps a file descriptor open (Python's ``mmap``
keeps its own, before 3.13): :func:`raise_fd_limit` lifts the soft limit where a mesh starts
and before ranks are forked, and running out anyway says so and what to do. Buffers under
64 KiB (:data:`COPY_BELOW`) are copied out of the file as it is mapped: a small tensor kept
from a push or pull (a step count, a bias) must not keep the whole file mapped.

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

import collections
import contextlib
import errno
import math
import mmap
import os
import pickle
import resource
import secrets
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from . import wire
from .errors import MeshError, SendError
from .proc import exited

#: Below this many buffer bytes a shared-memory file costs more than frames on the wire.
SHARE_MIN = 1 << 20
#: The pieces a push to other hosts travels in; one that is not twice as big goes whole.
PIECE = 16 << 20
#: Buffers smaller than this are copied out of a mapped file, not viewed in it: a small tensor
#: kept (a step count, a bias) would otherwise keep the whole file mapped, its big neighbours'
#: pages and a descriptor with it. The size under which wire frames are copied too.
COPY_BELOW = wire.ZERO_COPY_MIN

_ALIGN = wire.ALIGNMENT  # buffers start on cache-line boundaries, as allocators would place them
_TOKEN_BYTES = 16
#: How deep into a value a pull that cannot pickle it looks for the part that does not.
_PART_DEPTH = 4
#: Python's ``mmap`` keeps a duplicate of the file's descriptor, one per mapped value, unless
#: told not to (3.13 on): a notebook holding thousands of pulled values would run out.
_MMAP_OPTIONS: dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) else {}
#: Put a mapping's pages in place for writing, in one call (Linux 5.14; Python names it from 3.14).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


@dataclass(frozen=True)
class SharedFile:
    """Where a rank finds the buffers: the controller's memfd, and each buffer's span in it."""

    pid: int
    fd: int
    token: bytes
    size: int
    spans: tuple[tuple[int, int], ...]  # (offset, length) per buffer, in pickle order


@dataclass(frozen=True)
class Slot:
    """A file the notebook offers a rank to write a pulled value into: where the rank opens it,
    and the token it starts with (so the rank never writes into a file that is not this one)."""

    pid: int
    fd: int
    token: bytes


@dataclass(frozen=True)
class Overweight:
    """What a rank answers a pull whose value weighs more than the rank may send (its share of
    the pull's ``max_bytes``): at least ``nbytes``. The value stays where it is: a value whose
    size its metadata cannot tell (an object of your own, bytes, a deep container) or that grew
    since the notebook asked is weighed as it is pickled, on the rank."""

    nbytes: int


class WriterExited(RuntimeError):
    """The process that wrote a payload's shared file exited before the file was opened here:
    the file went with it."""


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
        fd = _open(self.shared, what)
        try:
            mapped, views = _map(fd, self.shared)
        finally:
            os.close(fd)
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


def pickled_for_pull(name: str, value: Any, limit: int | None) -> tuple[bytes, list[memoryview], list[Any]]:
    """``value`` (the variable ``name``) pickled for a pull, as :func:`pickled` does. Raises
    :class:`~.wire.TooBig` once it weighs more than ``limit``: its tensors are weighed before
    they are copied off their device, the rest (bytes, strings, arrays) once pickled. Raises
    :class:`~meshbook.SendError` naming the part of it that cannot be pickled."""
    try:
        body, buffers = wire.dumps({"value": value}, limit)
    except wire.TooBig:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever pickling raises, name the part
        path, part, why = _unpicklable(name, value, exc)
        raise SendError(f"pull({name!r}): {path} (a {type(part).__module__}.{type(part).__qualname__}) "
                        f"cannot be pickled: {why}; nothing was moved. Pull a part of it that pickles: "
                        f"name it on the ranks (a %%mesh cell: part = ...) and pull that") from None
    views = [b.raw() for b in buffers]
    weight = len(body) + sum(view.nbytes for view in views)
    if limit is not None and weight > limit:
        raise wire.TooBig(weight)
    return body, views, list(buffers)


def _unpicklable(path: str, value: Any, exc: Exception, depth: int = _PART_DEPTH) -> tuple[str, Any, Exception]:
    """The innermost item, element or attribute of ``value`` (reached as ``path``) that does
    not pickle, with its error: ``value`` itself where no part of it fails alone."""
    for sub, part in _parts(path, value) if depth else ():
        try:
            wire.dumps(part, limit=0)
        except wire.TooBig:  # it holds a tensor (weighed, never copied here): look inside it too
            if (found := _unpicklable(sub, part, exc, depth - 1))[1] is not part:
                return found
        except Exception as inner:  # noqa: BLE001 - the part that fails
            return _unpicklable(sub, part, inner, depth - 1)
    return path, value, exc


def _parts(path: str, value: Any) -> list[tuple[str, Any]]:
    """What ``value`` holds, each with the expression that reaches it from ``path``."""
    if isinstance(value, dict):
        return [(f"{path}[{key!r}]", item) for key, item in value.items()]
    if isinstance(value, (list, tuple)):
        return [(f"{path}[{i}]", item) for i, item in enumerate(value)]
    attributes = getattr(value, "__dict__", None)
    return [(f"{path}.{key}", item) for key, item in attributes.items()] if isinstance(attributes, dict) else []


class FreeFiles:
    """Shared files no reader maps any more, kept to be written over: a new memfd costs a page
    allocation per 4 KiB written, at about a third of the copy's speed (on a 2-core machine, 8
    processes writing 256 MiB each: 2 GB/s into new files, 9 GB/s into files written before).
    The smallest file that fits is taken; past ``keep`` files, the one freed longest ago is
    closed. Its owner's lock guards it."""

    def __init__(self, keep: int, on_close: Callable[[int], None] = os.close) -> None:
        self.keep = keep
        self._files: list[tuple[int, float, int]] = []  # (size, when freed, fd)
        self._on_close = on_close  # closes a file it lets go of (and whatever its owner keeps of it)

    def __len__(self) -> int:
        return len(self._files)

    def take(self, need: int, most: int | None = None) -> int | None:
        """The smallest free file of at least ``need`` bytes (and at most ``most``), or None."""
        fits = [entry for entry in self._files if need <= entry[0] and (most is None or entry[0] <= most)]
        if not fits:
            return None
        entry = min(fits)
        self._files.remove(entry)
        return entry[2]

    def put(self, fd: int, now: float) -> None:
        """File ``fd`` is free (freed at ``now``)."""
        self._files.append((os.fstat(fd).st_size, now, fd))
        while len(self._files) > self.keep:
            self._close(min(self._files, key=lambda entry: entry[1]))

    def expire(self, now: float, idle_s: float) -> None:
        """Close the files freed ``idle_s`` or more before ``now``."""
        for entry in [entry for entry in self._files if now - entry[1] >= idle_s]:
            self._close(entry)

    def close(self) -> None:
        for entry in list(self._files):
            self._close(entry)

    def _close(self, entry: tuple[int, float, int]) -> None:
        self._files.remove(entry)
        self._on_close(entry[2])


class Segments:
    """Shared files to write payloads into, kept for reuse once every reader released them.

    A segment written over is written through a mapping of it this process keeps: ``pwrite``
    into shared memory does the kernel's bookkeeping page by page, at about a third of a
    copy's speed (256 MiB on a 2-core machine: 78 ms, against 27 ms through a mapping whose
    pages are in place). The mapping is made when the segment is first written over, its
    pages put in place in one call (``MADV_POPULATE_WRITE``, where the kernel has it), and
    goes with the file. A new segment is written with ``pwrite``: mapping a new file first
    would fault its pages in one by one (192 ms for the same 256 MiB, against 90)."""

    def __init__(self, keep: int = 4) -> None:
        self._free = FreeFiles(keep, on_close=self._close)
        self._lock = threading.Lock()
        self._maps: dict[int, mmap.mmap] = {}  # a writable mapping of each segment written over

    def share(self, body: bytes, views: list[memoryview]) -> tuple[Payload, int]:
        """A payload in a free segment big enough (or a new one), and that segment's fd."""
        with self._lock:
            fd = self._free.take(_layout(views)[1])
        if fd is None:
            shared, fd = in_new_file("meshbook-call", views)
            return Payload(body, shared=shared), fd
        try:  # cut short (an interrupt), the segment is half written: nobody may read it, or reuse it
            mapping = self._maps.get(fd)
            if mapping is None:  # its first reuse
                mapping = self._map(fd)
            return Payload(body, shared=_write(fd, views, mapping=mapping)), fd
        except BaseException:
            self._close(fd)
            raise

    def give_back(self, fd: int, reusable: bool) -> None:
        """Done with segment ``fd``: kept if every reader released it, else closed (the
        readers' mappings keep its pages as long as they need them)."""
        with self._lock:
            if reusable:
                self._free.put(fd, time.monotonic())
            else:
                self._close(fd)

    def _map(self, fd: int) -> mmap.mmap:
        with _descriptors():
            mapping = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE, **_MMAP_OPTIONS)
        with contextlib.suppress(OSError):  # a kernel before 5.14: the copy faults them in instead
            mapping.madvise(_MADV_POPULATE_WRITE)
        self._maps[fd] = mapping
        return mapping

    def _close(self, fd: int) -> None:
        mapping = self._maps.pop(fd, None)
        if mapping is not None:
            mapping.close()
        os.close(fd)


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

    def lend(self, body: bytes, views: list[memoryview], buffers: list[Any], slot: Slot | None = None) -> Payload:
        """A pickled value (:func:`pickled_for_pull`) as a payload: its buffers in shared memory
        when they are big enough, else inline (frames). In the reader's ``slot`` when it offers
        one (nothing is lent then), else in a new memfd: the reader maps it copy-on-write, so
        writing over a file this process lent before would change what the reader sees."""
        if not worth_sharing(views):
            return Payload(body, list(buffers))
        if slot is not None and (landed := _land(slot, views)) is not None:
            return Payload(body, shared=landed)
        self.expire(time.monotonic())
        token = secrets.token_bytes(_TOKEN_BYTES)
        with self._lock, _descriptors():  # known before a byte is written: release() closes it whatever happens next
            fd = os.memfd_create("meshbook-pull", os.MFD_CLOEXEC)
            self._open[token] = (fd, math.inf)  # not lent yet: expire() must not close it under the write
        try:
            shared = _write(fd, views, token)
            with self._lock:
                self._open[token] = (fd, time.monotonic())
        except BaseException:  # the pull was interrupted (the rank writes as user code): no reader comes
            self.release(token)
            raise
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


class Landing:
    """The files pulled values are mapped from, offered again once nothing maps their value
    (the notebook's side of a pull from local ranks).

    A rank writing into a new memfd is slow (see :class:`FreeFiles`). So the notebook keeps the
    file of every value it maps (a descriptor of its own: the rank closes its one), learns when
    the value's mapping is collected (a finalizer), and offers the file to a later pull
    (:meth:`offer`), whose rank writes over it. A file
    nothing maps holds memory nobody uses: it is closed after ``idle_s`` (:meth:`expire`, at
    every tick of the controller). No more than ``keep`` files are kept, mapped or free: each
    costs a descriptor besides the one Python's ``mmap`` keeps of its own, and a notebook that
    holds many pulled values must not run out of them; past that, a file is closed once
    mapped, as before.

    A notebook process that forks (``multiprocessing`` with ``fork``) while it holds a pulled
    value hands its child the mapping: once the parent drops the value, a later pull may write
    over pages the child still reads. Pass such values to children as copies.
    """

    def __init__(self, keep: int = 64, idle_s: float = 5.0) -> None:
        raise_fd_limit()  # each pulled value held keeps a descriptor
        self.keep, self.idle_s = keep, idle_s
        self._free = FreeFiles(keep)
        self._mapped: dict[int, weakref.finalize] = {}  # fd -> what tells when its mapping went
        self._unmapped: collections.deque[int] = collections.deque()  # finalizers append, lock-free
        self._offered: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False

    def offer(self, needs: Mapping[int, int]) -> dict[int, Slot]:
        """A free file for each key that will write ``needs[key]`` bytes: the smallest that is
        big enough and not more than twice too big (the rank cuts it to size)."""
        slots: dict[int, Slot] = {}
        with self._lock:
            self._collect()
            for key, need in needs.items():
                fd = self._free.take(need, 2 * need + SHARE_MIN) if need >= SHARE_MIN else None
                if fd is None:
                    continue
                self._offered.add(fd)  # first: settle() closes it whatever happens next
                slots[key] = Slot(os.getpid(), fd, secrets.token_bytes(_TOKEN_BYTES))
                os.pwrite(fd, slots[key].token, 0)
        return slots

    def load(self, payload: Payload, what: str) -> Any:
        """The value of a pull's answer, mapped from the file it names (one offered here, or the
        rank's own), which is kept to be offered again once nothing maps the value."""
        shared = payload.shared
        if shared is None:
            return payload.load(what)
        with self._lock:
            offered = shared.pid == os.getpid() and shared.fd in self._offered
            if offered:
                self._offered.remove(shared.fd)
        # The rank's own file is kept through a descriptor of ours, which writes the next token.
        fd = shared.fd if offered else _open(shared, what, os.O_RDWR)
        try:
            mapped, views = _map(fd, shared)
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            if not self._closed and len(self._mapped) + len(self._free) < self.keep:
                self._mapped[fd] = weakref.finalize(mapped, self._unmapped.append, fd)
                self._mapped[fd].atexit = False
                fd = -1
        if fd >= 0:
            os.close(fd)  # enough files kept: this one's pages live with its mapping alone
        return wire.loads(payload.body, views)

    def settle(self, slots: Mapping[int, Slot], clean: bool) -> None:
        """A pull ended: its offered files no answer was mapped from are free again if it ended
        ``clean`` (every rank answered), else closed (an interrupted rank may still write)."""
        with self._lock:
            for slot in slots.values():
                if slot.fd in self._offered:
                    self._offered.discard(slot.fd)
                    if clean:
                        self._free.put(slot.fd, time.monotonic())
                    else:
                        os.close(slot.fd)

    def expire(self, now: float | None = None) -> None:
        """Close the files nothing has mapped for ``idle_s`` (called at every tick)."""
        if not self._free and not self._unmapped:
            return
        with self._lock:
            self._collect()
            self._free.expire(time.monotonic() if now is None else now, self.idle_s)

    def close(self) -> None:
        """Close every file (the mesh stopped); a value still mapped keeps its pages. A pull
        still loading after this keeps no file."""
        with self._lock:
            self._closed = True
            self._unmapped.clear()
            for fd, finalizer in self._mapped.items():
                finalizer.detach()
                os.close(fd)
            for fd in self._offered:
                os.close(fd)
            self._free.close()
            self._mapped.clear()
            self._offered.clear()

    def _collect(self) -> None:
        """Free the files whose mappings went (under the lock)."""
        now = time.monotonic()
        while self._unmapped:
            fd = self._unmapped.popleft()
            if self._mapped.pop(fd, None) is not None:  # not closed with the mesh meanwhile
                self._free.put(fd, now)


@contextlib.contextmanager
def pack(values: Mapping[str, Any], shared: bool, what: str = "push", least: int = SHARE_MIN) -> Iterator[Payload]:
    """Pickle ``values`` once; with ``shared`` and buffers of ``least`` bytes or more, put the
    buffers in a memfd (a payload that travels as frames else).

    The memfd stays open while the ``with`` block runs: wait there for every rank to load it.
    Raises :class:`~meshbook.SendError` naming the value that cannot be pickled (and its type).
    """
    body, views, buffers = pickled(values, what)
    if not shared or not views or not worth_sharing(views, least):
        yield Payload(body, list(buffers))
        return
    file, fd = in_new_file("meshbook-push", views)
    del views, buffers  # in the file now: what pickling copied (a non-contiguous piece) goes at once
    try:
        yield Payload(body, shared=file)
    finally:
        os.close(fd)


def worth_sharing(views: list[memoryview], least: int = SHARE_MIN) -> bool:
    """Do these buffers weigh enough for a shared file (``least`` bytes, :data:`SHARE_MIN`)?"""
    return sum(v.nbytes for v in views) >= least


def in_new_file(name: str, views: list[memoryview]) -> tuple[SharedFile, int]:
    """``views`` written into a new memfd named ``name``: where they are, and the file's fd."""
    with _descriptors():
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
    return _write_or_close(fd, views), fd


def raise_fd_limit() -> None:
    """Raise this process's soft limit of open files to its hard one (often 1024 to far more).
    Every value mapped from shared memory keeps a descriptor open while it is held (before
    Python 3.13, ``mmap`` keeps its own): a notebook holding hundreds of pulled values, or a
    rank holding hundreds of pushed ones, would fail with EMFILE. Called where a mesh starts
    (:class:`Landing`) and by each host agent before it forks its ranks."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):  # no reason to fail a start: EMFILE says what to do
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@contextlib.contextmanager
def _descriptors() -> Iterator[None]:
    """Out of file descriptors (EMFILE) as an error that says why and what to do."""
    try:
        yield
    except OSError as exc:
        if exc.errno != errno.EMFILE:
            raise
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        raise MeshError(
            f"process {os.getpid()} may open no more files: it has the {soft} open that its limit "
            f"allows (ulimit -n), and every value it holds from shared memory (a pulled or pushed "
            f"tensor) keeps one. Drop the values you no longer need (del them, in the notebook or "
            f"on the ranks; in IPython also %reset -f out), or raise the limit (ulimit -n 65536 "
            f"where Jupyter starts)") from None


def _write_or_close(fd: int, views: list[memoryview]) -> SharedFile:
    """:func:`_write`, closing ``fd`` should it fail: a long write cut short by an interrupt
    (Ctrl-C during a big push) or a full ``/dev/shm`` happens before anyone else knows the
    file, so nothing else would ever close it."""
    try:
        return _write(fd, views)
    except BaseException:
        os.close(fd)
        raise


def _layout(views: list[memoryview]) -> tuple[list[tuple[int, int]], int]:
    """Where each buffer goes in a shared file, and the file's size."""
    spans, offset = [], _ALIGN
    for view in views:
        spans.append((offset, view.nbytes))
        offset += -(-view.nbytes // _ALIGN) * _ALIGN
    return spans, offset


def _write(fd: int, views: list[memoryview], token: bytes | None = None, fit: bool = False,
           mapping: mmap.mmap | None = None) -> SharedFile:
    """``views`` written into file ``fd`` after ``token`` (a new one by default): through
    ``mapping`` where the writer keeps one of the file (a segment written over: big enough, it
    was written before), else with ``pwrite``. The file only grows, since shrinking frees pages
    a reused one would allocate again, unless ``fit``."""
    token = token or secrets.token_bytes(_TOKEN_BYTES)
    spans, offset = _layout(views)
    if mapping is None and (os.fstat(fd).st_size < offset or fit and os.fstat(fd).st_size != offset):
        os.ftruncate(fd, offset)
    for view, start in zip([memoryview(token), *views], [0, *(start for start, _ in spans)]):
        if mapping is None:
            _pwrite_all(fd, view, start)
        else:
            mapping[start:start + view.nbytes] = view
    return SharedFile(os.getpid(), fd, token, offset, tuple(spans))


def _land(slot: Slot, views: list[memoryview]) -> SharedFile | None:
    """``views`` written into the file the reader offered (``slot``), cut to their size; None
    where it cannot be (the file is gone, or is not that one): a new file is lent then."""
    try:
        fd = os.open(f"/proc/{slot.pid}/fd/{slot.fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.pread(fd, _TOKEN_BYTES, 0) != slot.token:
            return None
        shared = _write(fd, views, slot.token, fit=True)
    finally:
        os.close(fd)
    return replace(shared, pid=slot.pid, fd=slot.fd)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    # One write moves at most ~2 GiB on Linux: loop until the whole buffer is in.
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)


def _open(shared: SharedFile, what: str, mode: int = os.O_RDONLY) -> int:
    """A descriptor of the file ``shared`` names, checked to be that file (its token)."""
    gone = f"the shared memory for this {what} is gone (the {what} was interrupted); {what} again"
    try:
        with _descriptors():
            fd = os.open(f"/proc/{shared.pid}/fd/{shared.fd}", mode | os.O_CLOEXEC)
    except FileNotFoundError:
        if exited(shared.pid):
            raise WriterExited(f"process {shared.pid}, which wrote the shared memory for this {what}, "
                               f"exited before it was read; {what} again") from None
        raise RuntimeError(gone) from None
    except OSError as exc:
        raise RuntimeError(f"cannot open the shared memory of this {what} ({exc}): this process may "
                           f"not read the files of process {shared.pid}") from None
    if os.pread(fd, _TOKEN_BYTES, 0) != shared.token:
        os.close(fd)
        raise RuntimeError(gone)  # the number now names another file of that process
    return fd


def _map(fd: int, shared: SharedFile) -> tuple[mmap.mmap, list[memoryview]]:
    # Private and writable: a reader that changes its tensor gets its own pages (copy on write).
    with _descriptors():
        mapped = mmap.mmap(fd, shared.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                           **_MMAP_OPTIONS)
    with memoryview(mapped) as whole:
        return mapped, [whole[start:start + length] if length >= COPY_BELOW
                        else memoryview(bytearray(whole[start:start + length])) for start, length in shared.spans]
