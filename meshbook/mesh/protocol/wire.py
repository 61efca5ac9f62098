"""Signed, zero-copy messages between controller, host agents and ranks.

A message is a list of ZeroMQ frames::

    [envelope, buffer_0, buffer_1, ...]
    envelope = signature (32 bytes) | stamp (20 bytes) | header length (4 bytes) | header | body
    stamp = sender (8 bytes) | stream (4 bytes) | sequence number (8 bytes), little-endian

* ``header`` is a small pickled ``dict`` that receivers read first (kind, request id, rank);
* ``body`` is the payload, pickled with protocol 5 by cloudpickle (so notebook-defined
  functions travel), with numpy arrays and CPU tensors (bf16 included, through a byte view)
  lifted out as separate ``buffer`` frames that are neither copied nor pickled;
* ``stamp`` names the sending stream (a random id per sending :class:`Wire`, one per process,
  and a number per sending thread) and numbers its messages 1, 2, 3...; a receiver refuses a
  message that is not newer than the last one it took from that stream (see
  :class:`ReplayGuard`), so a captured message sent again never runs again;
* ``signature`` is HMAC-SHA256, with the per-mesh key, over the rest of the envelope and the
  buffers' count and lengths. Like the Jupyter protocol, the bulk buffers themselves are not
  hashed: they are raw bytes that only a signed body can give meaning to, and hashing
  gigabytes would halve the throughput.

Signature, header and body share one frame because every frame costs a few microseconds at
each send and receive, and a dispatch to 8 ranks sends and receives 16 small messages.

Nothing is unpickled before its signature and stamp check out, so an unsigned, forged,
garbled or replayed message is dropped by :meth:`Wire.unpack` (raising :class:`BadMessage`)
and can never run code.

A stream is per sending *thread*: each thread's messages leave on a socket in the order it
packed them, whereas two threads sharing a socket may send in the other order than they
packed (signing happens outside the send lock). The receiving window is per receiving thread
for the same reason: every socket meshbook reads is drained by one thread, in order, while the
same sender may reach two threads of a rank (its ``x`` and ``c`` sockets) in either order.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import itertools
import logging
import pickle
import secrets
import struct
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence, cast

import cloudpickle
import zmq

from . import messages as msg

PROTOCOL = 5

#: Frames at least this big travel without a copy (smaller ones are cheaper to copy).
ZERO_COPY_MIN = 64 * 1024
#: Where a tensor's memory starts, as torch's own allocator places it (a cache line).
ALIGNMENT = 64


_log = logging.getLogger(__name__)


class BadMessage(Exception):
    """A message failed its signature check or could not be decoded; it is dropped."""


class ReplayedMessage(BadMessage):
    """A correctly signed message that is not newer than one already taken from its sender."""


class TooBig(Exception):
    """The tensors of a value being pickled already weigh more than its limit (raised before
    a GPU tensor is copied to host memory: copying 40 GB to find out would OOM the rank)."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(f"at least {nbytes} bytes of tensors")
        self.nbytes = nbytes


def _rebuild_tensor(buffer: Any, dtype: Any, shape: tuple[int, ...], requires_grad: bool,
                    parameter: bool, order: tuple[int, ...] | None = None) -> Any:
    import torch

    view = memoryview(buffer)
    if view.nbytes == 0:
        tensor = torch.empty(shape, dtype=dtype)
    else:
        with warnings.catch_warnings():
            # Received frames are private heap memory that libzmq exposes read-only; aliasing
            # them is the point of zero-copy, and nothing else holds them.
            warnings.simplefilter("ignore")
            tensor = torch.frombuffer(view, dtype=torch.uint8)
        # Copied where its bytes are in-band (immutable bytes are never aliased), and where the
        # message put them elsewhere than torch's allocator starts a tensor (an odd address,
        # for a small one): computed on there, the same numbers gave other last bits (its
        # matrix kernels go by alignment), so a rank's result depended on how its inputs
        # travelled. One copy, which starts where torch's allocator starts one.
        if isinstance(buffer, bytes) or tensor.data_ptr() % ALIGNMENT:
            tensor = tensor.clone()
        tensor = tensor.view(dtype).reshape(shape)
    if order is not None:  # laid out in memory in that order (channels_last...): as it was sent
        tensor = tensor.permute(sorted(range(len(order)), key=order.__getitem__))
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def _reduce_tensor(tensor: Any) -> Any:
    import torch

    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
        return NotImplemented  # torch's own pickling handles the exotic layouts
    parameter = isinstance(tensor, torch.nn.Parameter)
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()  # the notebook side is CPU; push moves it back to the rank's device
    data = data.resolve_conj().resolve_neg()
    order = _dense_order(data)
    data = data.permute(order) if order is not None else data.contiguous()  # the permuted one: no copy
    raw = data.reshape(-1).view(torch.uint8).numpy()
    return (_rebuild_tensor,
            (pickle.PickleBuffer(raw), tensor.dtype, tuple(data.shape),
             tensor.requires_grad, parameter, order))


def _dense_order(tensor: Any) -> tuple[int, ...] | None:
    """The order of ``tensor``'s dimensions in which its memory is contiguous, when that is
    not their own (channels_last: 0, 2, 3, 1; a transposed matrix: 1, 0): it travels in that
    order, uncopied, and arrives laid out as it was, as torch's own pickling keeps it. None:
    contiguous already, or not dense in any order (expanded, sliced), copied contiguous."""
    if tensor.dim() < 2 or tensor.is_contiguous():
        return None
    order = tuple(sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d)))
    return order if tensor.permute(order).is_contiguous() else None


class Pickler(cloudpickle.Pickler):
    """cloudpickle that sends CPU tensors' storage as out-of-band buffers (zero-copy frames).

    A DTensor travels as its local shard (what ``pull`` returns too): its DeviceMesh means
    nothing outside the ranks' process groups (unpickled in the notebook it warns, and a GPU
    mesh's would name ``cuda`` around a tensor now on the CPU); ``mesh.ref(name).full_tensor()``
    assembles the whole. With a ``limit``, the tensors' bytes are counted as they come, and
    :class:`TooBig` is raised before the one that would go over it is moved off its device.
    """

    def __init__(self, *args: Any, limit: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limit = limit
        self.tensor_bytes = 0

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None):
            obj = obj.to_local()
        if torch is not None and type(obj) in (torch.Tensor, torch.nn.Parameter):
            if self.limit is not None:
                self.tensor_bytes += obj.numel() * obj.element_size()
                if self.tensor_bytes > self.limit:
                    raise TooBig(self.tensor_bytes)
            return _reduce_tensor(obj)
        return super().reducer_override(obj)


#: Values that pickle the same whoever pickles them (no tensors, no code): see :func:`dumps`.
_PLAIN = frozenset({type(None), bool, int, float, str})
_CONTAINERS = frozenset({tuple, list, dict})


def _plain(obj: Any, depth: int = 2) -> bool:
    """``obj`` is a plain value, or a small tuple, list or dict (by name) of them, nested
    ``depth`` deep at most: a request's body (an endpoint's arguments in it), a no-op's result."""
    kind = type(obj)
    if kind in _PLAIN:
        return True
    if depth == 0 or kind not in _CONTAINERS or len(obj) > 16:
        return False
    if kind is dict:
        for key in obj:
            if type(key) is not str:
                return False
        obj = obj.values()
    for item in obj:  # a loop, not all(...): this runs for every request and every result
        if type(item) not in _PLAIN and not _plain(item, depth - 1):
            return False
    return True


def dumps(obj: Any, limit: int | None = None) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Pickle ``obj``; large contiguous buffers are returned separately, uncopied. With a
    ``limit``, raises :class:`TooBig` as soon as its tensors weigh more. A plain value (a
    cell's request, a no-op's ``None``) is pickled by :mod:`pickle` itself: the same bytes,
    without setting up cloudpickle's pickler (most of a small message's cost)."""
    if _plain(obj):
        return pickle.dumps(obj, protocol=PROTOCOL), []
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    Pickler(out, protocol=PROTOCOL, buffer_callback=buffers.append, limit=limit).dump(obj)
    return out.getvalue(), buffers


def loads(body: Any, buffers: Sequence[Any] = ()) -> Any:
    return pickle.loads(body, buffers=buffers)


@dataclass
class Message:
    """A verified message: its header, and its body still pickled until :meth:`body` is asked."""

    header: dict[str, Any]
    _body: memoryview = field(repr=False)
    _buffers: list[Any] = field(repr=False)
    _value: Any = field(default=None, repr=False)
    _decoded: bool = field(default=False, repr=False)

    @classmethod
    def gathered(cls, header: dict[str, Any], body: bytes) -> "Message":
        """A message an agent checked and gathered into a bundle it signed (:mod:`.bundle`)."""
        return cls(header, memoryview(body), [])

    @property
    def kind(self) -> str:
        return self.header["k"]

    def raw_body(self) -> bytes:
        """The body still pickled (what an agent gathers into a bundle); no buffers."""
        return bytes(self._body)

    def body(self) -> Any:
        if not self._decoded:
            self._value = loads(self._body, self._buffers) if self._body.nbytes else None
            self._decoded = True
        return self._value


def _buffer(frame: Any) -> Any:
    return frame.buffer if isinstance(frame, zmq.Frame) else frame


_SIGNATURE = 32
_STAMP = struct.Struct("<8sIQ")  # sender, stream, sequence number
_HEAD = struct.Struct("<I")
_OPEN = _SIGNATURE + _STAMP.size + _HEAD.size  # where the header starts


def stamp_sender(envelope: Any) -> bytes | None:
    """The sending process a message's stamp names, unchecked (None: too short to be one):
    what keeps one process's messages in order across two ways in (see :mod:`.lane`)."""
    view = memoryview(_buffer(envelope))
    if view.nbytes < _OPEN:
        return None
    return bytes(view[_SIGNATURE:_SIGNATURE + 8])


class _SendStream(threading.local):
    """This thread's stream of a :class:`Wire`: its number and its message counter."""

    def __init__(self, numbers: "itertools.count[int]") -> None:
        self.number = next(numbers)
        self.counter = itertools.count(1)


class ReplayGuard(threading.local):
    """The newest sequence number taken from each sending stream, per receiving thread."""

    def __init__(self) -> None:
        self.newest: dict[tuple[bytes, int], int] = {}

    def admit(self, sender: bytes, stream: int, number: int) -> None:
        """Take message ``number`` of a stream, or raise :class:`ReplayedMessage`."""
        newest = self.newest.get((sender, stream), 0)
        if number <= newest:
            raise ReplayedMessage(f"replayed message: number {number} of stream {sender.hex()}/{stream}, "
                                  f"which is at {newest} already")
        self.newest[sender, stream] = number

    def taken(self, sender: bytes, stream: int, number: int) -> bool:
        """Would :meth:`admit` refuse this number? Asked, not admitted: nothing is recorded."""
        return number <= self.newest.get((sender, stream), 0)


#: The buffers' count and lengths of a message without buffers, as signed.
_NO_BUFFERS = struct.pack("<Q", 0)


class _Keyed:
    """HMAC-SHA256 (RFC 2104) with one key, its pads hashed once: signing a message copies
    the two keyed states. :func:`hmac.new` computes the same bytes (the tests check), through
    a Python wrapper whose ``copy`` alone costs more than this whole signature (1.4 us against
    5.3 us for a small message here), and every message is signed once and checked once."""

    def __init__(self, key: bytes) -> None:
        block = hashlib.sha256().block_size
        if len(key) > block:
            key = hashlib.sha256(key).digest()
        key = key.ljust(block, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))

    def sign(self, data: Any, tail: bytes) -> bytes:
        """The HMAC of ``data`` followed by ``tail``."""
        inner = self._inner.copy()
        inner.update(data)
        inner.update(tail)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()


class Wire:
    """Signs, packs, verifies and unpacks messages with one mesh's key."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("the mesh key must be at least 16 bytes")
        #: The mesh's secret: handed to the agents (on stdin) and the ranks (through the fork).
        self.key = key
        self._mac = _Keyed(key)
        self.dropped = 0  # messages rejected by unpack(), for tests and diagnostics
        self.replayed = 0  # of which signed messages sent again
        #: Names this process's streams: a forked child must make its own Wire.
        self.sender = secrets.token_bytes(8)
        self._stream = _SendStream(itertools.count())
        self._guard = ReplayGuard()

    def _signature(self, signed: Any, buffers: Sequence[Any]) -> bytes:
        if not buffers:
            return self._mac.sign(signed, _NO_BUFFERS)
        lengths = [memoryview(b).nbytes for b in buffers]
        return self._mac.sign(signed, struct.pack(f"<{len(lengths) + 1}Q", len(lengths), *lengths))

    def pack(self, header: dict[str, Any], body: Any = None, *, raw_body: bytes | None = None,
             buffers: Sequence[Any] = (), limit: int | None = None) -> list[Any]:
        """Frames for ``header`` and ``body`` (or an already pickled ``raw_body``); a body whose
        tensors weigh more than ``limit`` raises :class:`TooBig` before they are copied."""
        head = pickle.dumps(header, protocol=PROTOCOL)
        if raw_body is None:
            raw_body, buffers = dumps(body, limit) if body is not None else (b"", [])
        stream = self._stream
        stamp = _STAMP.pack(self.sender, stream.number, next(stream.counter))
        signed = b"".join((stamp, _HEAD.pack(len(head)), head, raw_body))
        return [self._signature(signed, buffers) + signed, *buffers]

    def unpack(self, frames: Sequence[Any]) -> Message:
        """Verify and decode the header; raises :class:`BadMessage` (and counts it) otherwise."""
        try:
            if not frames:
                raise BadMessage("an empty message")
            envelope = memoryview(_buffer(frames[0]))
            if envelope.nbytes < _OPEN:
                raise BadMessage(f"an envelope of {envelope.nbytes} bytes; a message has at least {_OPEN}")
            buffers = [_buffer(f) for f in frames[1:]]
            expected = self._signature(envelope[_SIGNATURE:], buffers)
            if not hmac.compare_digest(envelope[:_SIGNATURE], expected):
                raise BadMessage("bad signature")
            self._guard.admit(*_STAMP.unpack_from(envelope, _SIGNATURE))
            (head_length,) = _HEAD.unpack_from(envelope, _OPEN - _HEAD.size)
            header = pickle.loads(envelope[_OPEN:_OPEN + head_length])
            if not isinstance(header, dict) or "k" not in header:
                raise BadMessage("header is not a message header")
        except ReplayedMessage as exc:
            self.dropped += 1
            self.replayed += 1
            _log.warning("meshbook: dropped a %s", exc)
            raise
        except BadMessage:
            self.dropped += 1
            raise
        except Exception as exc:  # garbled bytes must never take the receiver down
            self.dropped += 1
            raise BadMessage(f"undecodable message: {exc}") from None
        return Message(header, envelope[_OPEN + head_length:], buffers)

    def taken(self, frames: Sequence[Any]) -> bool:
        """Has this thread taken this message already (by its stamp)? For messages sent twice
        on purpose (a dead rank's last words, see :mod:`.lastwords`), which :meth:`unpack`
        would count and log as replays. A forged stamp only gets a message skipped."""
        envelope = memoryview(_buffer(frames[0]))
        return envelope.nbytes >= _OPEN and self._guard.taken(*_STAMP.unpack_from(envelope, _SIGNATURE))


def size(frames: Sequence[Any]) -> int:
    """Bytes of a packed message, its buffers included."""
    return sum(memoryview(_buffer(f)).nbytes for f in frames)


def rank_address(rundir: str, rank: int, generation: int, channel: str) -> str:
    """Where a rank forked in ``generation`` takes requests on ``channel``.

    ``"x"``: requests its main thread runs in order; ``"c"``: control calls its control thread
    answers while the main thread is busy. A re-forked rank gets a new address, so nothing
    sent to its dead predecessor can reach it.
    """
    return f"ipc://{rundir}/r{rank}g{generation}{channel}"


def connect_rank(ctx: zmq.Context, rundir: str, rank: int, generation: int,
                 affinity: int = 0) -> dict[str, zmq.Socket]:
    """PUSH sockets to each channel of ``rank`` forked in ``generation``, made before the rank
    exists: ZeroMQ queues what is sent until the rank binds, so a request never waits for, or
    races with, its start-up. ``affinity``: the I/O threads they may use (0: any)."""
    socks = {}
    for channel in msg.CHANNELS:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.AFFINITY, affinity)
        # Retry every 10 ms until the rank binds, never backing off: a backed-off retry
        # would hold the first request for up to the back-off after the rank is ready.
        sock.setsockopt(zmq.RECONNECT_IVL, 10)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 0)
        sock.connect(rank_address(rundir, rank, generation, channel))
        socks[channel] = sock
    return socks


def is_big(frames: Sequence[Any]) -> bool:
    """Does a packed message carry buffers worth sending without a copy (and tracking)?"""
    return any(memoryview(_buffer(f)).nbytes >= ZERO_COPY_MIN for f in frames[1:])


def send(sock: zmq.Socket, frames: list[Any], prefix: Sequence[bytes] = (), wait: bool = False,
         big: bool | None = None) -> None:
    """Send frames, big buffers without a copy (``big``: whether there are any, where the
    caller knows already).

    With ``wait=True`` the call returns only once ZeroMQ has released the big buffers, so the
    caller may mutate the tensors it sent (and a failure leaves nothing half-sent).
    """
    if not (is_big(frames) if big is None else big):
        _send_parts(sock, [*prefix, *frames], copy=True)
        return
    if not wait:
        sock.send_multipart([*prefix, *frames], copy=False)
        return
    send_tracked(sock, [*prefix, *frames]).wait()


def send_tracked(sock: zmq.Socket, frames: list[Any]) -> zmq.MessageTracker:
    """Send frames, each big buffer by reference, and return a tracker that is done once
    ZeroMQ released *every* one of them.

    Not ``send_multipart(track=True)``: that returns the last frame's tracker only, and pyzmq
    copies a last frame under its copy threshold (64 KiB: a bias, BatchNorm's step count),
    whose tracker is done at once, while the big buffers before it are still queued. A caller
    that then changed its tensor would send the changed bytes.
    """
    parts, tracked = [], []
    for frame in frames:
        if memoryview(_buffer(frame)).nbytes >= ZERO_COPY_MIN:
            frame = zmq.Frame(_buffer(frame), track=True)
            tracked.append(frame)
        parts.append(frame)
    sock.send_multipart(parts, copy=False)
    return zmq.MessageTracker(*tracked)


def fan_out(socks: Sequence[zmq.Socket], frames: list[Any]) -> list[zmq.MessageTracker]:
    """Send the same frames on every socket, big buffers by reference (never copied per socket).

    For a message with big buffers, returns one tracker per socket: done once ZeroMQ has
    released the buffers there, after which the caller may mutate the tensors it sent.
    """
    if not is_big(frames):
        for sock in socks:
            _send_parts(sock, frames, copy=True)
        return []
    return [send_tracked(sock, frames) for sock in socks]


def recv(sock: zmq.Socket, flags: int = 0) -> list[Any]:
    """Every frame of one message, uncopied."""
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    while frame.more:  # a frame knows; recv_multipart asks the socket (getsockopt) each time
        frame = sock.recv(flags, copy=False)
        frames.append(frame)
    return frames


#: ``zmq.SNDMORE`` as a plain int: or-ing pyzmq's enum flags costs more than the send itself.
_MORE = int(zmq.SNDMORE)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
#: ``zmq.NOBLOCK`` as a plain int, for the same reason.
NOBLOCK = int(zmq.NOBLOCK)
#: The compiled socket's own ``get``: ``zmq.Socket.getsockopt`` turns the events into pyzmq's
#: enum (1.7 us against 2.8 us a call), and every request a rank takes asks twice.
_get_option = zmq.backend.Socket.get


def readable(sock: zmq.Socket) -> bool:
    """Does ``sock`` hold a message now? Asking also re-arms its descriptor's signal."""
    return bool(cast(int, _get_option(sock, _EVENTS)) & _POLLIN)


def ready(sock: zmq.Socket) -> Iterator[list[Any]]:
    """Every message ``sock`` holds now, without waiting. Asking the socket's events before
    each costs about a microsecond; ending on a non-blocking receive's ``zmq.Again``, as the
    obvious loop does, costs several (pyzmq builds the exception), once per drain, and a
    round trip to 128 hosts drains 128 times."""
    while readable(sock):
        yield recv(sock, NOBLOCK)


#: The compiled socket's own ``send``. ``zmq.Socket.send`` wraps it in Python for the draft
#: options ``routing_id`` and ``group``, which meshbook never sets: 0.8 us a frame against 0.25,
#: and a request to 128 hosts sends 4 frames to each.
_send_frame = zmq.backend.Socket.send


def _send_parts(sock: zmq.Socket, parts: list[Any], copy: bool) -> None:
    # send_multipart's per-frame checks and enum flags cost half of a small message's send,
    # and a dispatch sends one message per rank at every hop.
    last = len(parts) - 1
    for i, part in enumerate(parts):
        _send_frame(sock, part, _MORE if i < last else 0, copy)


def describe_unpicklable(body: Any, exc: Exception) -> str:
    """Name the value that cannot be pickled: which argument, and its type."""
    items: list[tuple[str, Any]] = []
    if isinstance(body, dict):
        items += [(f"argument {i + 1}", v) for i, v in enumerate(body.get("args", ()))]
        items += [(f"keyword argument {k!r}", v) for k, v in body.get("kwargs", {}).items()]
        items += [(f"value {k!r}", v) for k, v in body.get("values", {}).items()]
        if "fn" in body:
            items.append(("the function", body["fn"]))
    for label, value in items:
        try:
            dumps(value)
        except Exception as inner:
            return (f"{label} (a {type(value).__module__}.{type(value).__qualname__}) cannot be "
                    f"pickled: {inner}")
    return f"the request cannot be pickled: {exc}"
