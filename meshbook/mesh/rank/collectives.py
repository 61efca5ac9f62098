"""When this rank enters and leaves each collective, exactly: the clock behind the computing /
waiting split and the straggler verdict.

Sampling the main thread a few times a second cannot split an 8 s cell exactly (one run read
"0.00 s computing" for ranks that each slept 2 s). So ``torch.distributed``'s collectives are
wrapped, thinly: each call of the main thread records its group, its number in that group (the
n-th collective a rank issues in a group pairs with every member's n-th), when it was entered
and, for a blocking call, when it returned (wall-clock nanoseconds: the controller lines ranks
up by them, correcting other hosts' clocks). A nested call (``all_gather_object`` calls
``all_gather``) counts once, as the call the user made.

The controller (:mod:`meshbook.mesh.controller.insight.clock`) pairs each collective's entries across
its members: a rank's waiting is its time inside blocking calls, and its *lateness* is how long
after the group's first member it arrived; the rank that keeps arriving last is the straggler.
An async call (``async_op=True``) has no end here (its ``wait()`` runs in C): its waiting is
counted as the time from its entry to the last member's. So is an NCCL collective on GPU
tensors: it returns as soon as it is enqueued, and the rank waits for it later, in a sync; its
arrival (when the rank's Python enqueued it) is what lines the ranks up.

What is not wrapped, torch's flight recorder still sees: collectives issued from C++ (DDP's
gradient all-reduce in ``backward()``, its broadcasts in ``forward()``) and the functional ones
DTensor uses. When the groups issued more collectives than the wrappers saw (a counter read, no
recorder dump), :meth:`CollectiveClock.take` reads the recorder and adds each collective no
wrapped call issued: numbered by the recorder's sequence in its group, negated (its own
numbering: the n-th of each member is the same collective), entered when the recorder created
it, with no end (as an async call), and the request that ran then. Those are timed only:
their request is known by time, not by the call, so the controller never judges their pairing.

Point-to-point operations (``send``, ``recv``, their async forms, which ``batch_isend_irecv`` and
pipeline schedules run) are not timed but counted, per group, and kept while they run: gloo's
flight recorder leaves them out, and the hang diagnosis needs to know that a pipeline stage
waits on a receive from the stage that failed (:meth:`CollectiveClock.open_point_to_point`).
"""

from __future__ import annotations

import bisect
import functools
import inspect
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from ..protocol.reports import Collective
from .torch_compat import (
    finished_and_pending_collectives,
    group_description,
    group_name,
    issued_by_groups,
    process_groups,
)

#: The collectives timed (point-to-point ``send``/``recv`` pair two ranks, not a group).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast",
               "broadcast_object_list", "barrier", "reduce", "gather", "scatter", "gather_object",
               "scatter_object_list", "monitored_barrier", "all_reduce_coalesced")

#: Point-to-point operations: not timed, but counted (see :meth:`CollectiveClock.point_to_point`).
POINT_TO_POINT = ("send", "recv", "isend", "irecv")

#: The collectives whose tensor (the argument named) must have the same size and dtype on every
#: member: torch checks it nowhere (gloo completes a broadcast into a bigger tensor; NCCL may
#: do anything), so the controller compares them (see :func:`_called`).
SAME_ON_EVERY_MEMBER = {"all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor",
                        "all_gather_into_tensor": "input_tensor", "reduce_scatter_tensor": "input"}

#: One record: (request, group key, number in its group, entered, left or 0 for an async call,
#: what was called: ``(op,)``, or ``(op, elements, dtype, shape)`` for the collectives above;
#: None for the flight recorder's). A number below 0 is the flight recorder's (see above).
Entry = tuple[int | None, int, int, int, int, tuple[Any, ...] | None]
#: Wrapped calls, and request changes, remembered to place the recorder's entries by time.
REMEMBERED = 1024
#: Point-to-point operations kept while not completed (works never waited for: the newest).
OPEN_KEPT = 64


class _Opened(NamedTuple):
    """A point-to-point operation running (``work`` None: a blocking call), or issued and its
    work maybe not completed."""

    op: str  # "send" or "recv"
    group: Any
    peer: int | None  # global rank; None: a receive from any rank
    number: int
    shape: Any
    dtype: Any
    since: int
    work: Any = None


class CollectiveClock:
    """This rank's record of its collectives, taken in batches for the controller.

    ``request`` says what the main thread runs. :meth:`take` hands over what was recorded
    since it was last called (with the groups met meanwhile), from any thread.
    """

    def __init__(self, request: Callable[[], int | None], enqueues_gpu_work: bool = False) -> None:
        self._request = request
        #: An NCCL mesh: a collective on GPU tensors returns once enqueued (see above).
        self._enqueues = enqueues_gpu_work
        self._main = threading.main_thread().ident
        #: Outermost collective calls the main thread has entered, and the number of the one
        #: it is in now (``None`` outside; a nested call counts as the outer one): how the
        #: sampler tells one call from the next.
        self._entered = 0
        self.call: int | None = None
        self._generation = 0
        self._groups: dict[int, tuple[Any, int]] = {}  # id(group) -> (group, key): kept alive
        self._counts: list[int] = []  # per key: collectives issued so far
        self._p2p: dict[tuple[int, str], int] = {}  # (id(group), device type) -> operations run
        self._p2p_run = 0  # all of them, over every generation: what the groups' counts hold besides collectives
        self._in_p2p = threading.local()
        self._p2p_numbers: dict[tuple[int, str, int | None], int] = {}  # (id(group), op, peer) -> issued
        self._opened: list[_Opened] = []  # not completed, as far as the wrapper knows (any thread)
        self._open_lock = threading.Lock()
        self._entries: list[Entry] = []
        self._new_keys: dict[int, tuple[int, str, tuple[int, ...]]] = {}
        #: The wrappers' code objects: the sampler walks through them (see sampling.py).
        self.codes: set[Any] = set()
        #: For the recorder's entries: when each wrapped call ran (and the one running now,
        #: since when), when each request began, the groups' count and the wrapped calls at the
        #: last read, and each group's newest entry taken.
        self._calls: deque[tuple[int, int]] = deque(maxlen=REMEMBERED)
        self._in_call_since: int | None = None
        self._began: deque[tuple[int, int | None]] = deque(maxlen=REMEMBERED)
        self._since_ns = time.time_ns()  # what the recorder kept from before is not this clock's
        self._read_at = (0, 0)
        self._taken: dict[str, int] = {}
        self._keys_lock = threading.Lock()

    def install(self) -> None:
        """Wrap the collectives of ``torch.distributed`` (and of ``distributed_c10d``, where
        torch's own modules call them), and count its point-to-point operations."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        for names, wrap in ((COLLECTIVES, self.wrap), (POINT_TO_POINT, self._counted)):
            for name in names:
                fn = getattr(c10d, name, None)
                if fn is None:
                    continue
                wrapped = wrap(fn)
                for module in (dist, c10d):
                    if getattr(module, name, None) is fn:
                        setattr(module, name, wrapped)

    def point_to_point(self, group: Any, devices: list[str]) -> int:
        """How many point-to-point operations ran on ``group`` with tensors on ``devices``
        (device types). gloo and NCCL count them with the collectives in the group's sequence,
        and a pipeline's stages run different numbers of them: a step check that compared the
        raw counts found the ranks out of step after every pipelined step."""
        return sum(self._p2p.get((id(group), device), 0) for device in devices)

    def _counted(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, a point-to-point operation, counted by group and device type (any thread)."""
        params = list(inspect.signature(fn).parameters)
        group_at = params.index("group") if "group" in params else None

        direction = "send" if fn.__name__.endswith("send") else "recv"
        peer_at = [(name, params.index(name) if name in params else None)
                   for name in (("dst", "group_dst") if direction == "send" else ("src", "group_src"))]
        blocks = not fn.__name__.startswith("i")

        def point_to_point(*args: Any, **kwargs: Any) -> Any:
            import torch.distributed as dist

            inside = self._in_p2p
            if getattr(inside, "on", False):  # send() runs isend(): one operation
                return fn(*args, **kwargs)
            group = _argument(args, kwargs, "group", group_at) or dist.group.WORLD
            tensor = args[0] if args else kwargs.get("tensor")
            key = (id(group), getattr(getattr(tensor, "device", None), "type", "cpu"))
            self._p2p[key] = self._p2p.get(key, 0) + 1  # counted before: an interrupt may cut it short
            self._p2p_run += 1
            peer, group_peer = (_argument(args, kwargs, name, at) for name, at in peer_at)
            opened = self._opening(direction, group, peer, group_peer, tensor)
            try:  # opened inside: an interrupt must never leave a blocking call open for later snapshots
                if blocks:
                    self._open(opened)
                inside.on = True
                work = fn(*args, **kwargs)
            finally:
                inside.on = False
                if blocks:
                    self._close(opened)
            if not blocks and work is not None:  # None inside NCCL's coalescing (batch_isend_irecv)
                self._open(opened._replace(work=work))
            return work

        self.codes.add(point_to_point.__code__)  # the sampler walks through it to the caller's line
        return functools.wraps(fn)(point_to_point)

    def open_point_to_point(self, frame: Any = None) -> list[Collective]:
        """The point-to-point operations not completed, the one the main thread waits in last:
        the ``send``/``recv`` it blocks in; else the work whose ``wait()`` its innermost frame
        (``frame``) is in (a pipeline schedule waits on its batch's works one by one); else the
        oldest receive (a stage waits to receive: its sends complete as the peers receive them).
        gloo's flight recorder leaves them out, so without these a rank waiting for a pipeline
        stage that failed looked idle to the hang diagnosis, and waited out the collective
        timeout."""
        with self._open_lock:
            opened = list(self._opened)
        waiting = [o for o in opened if o.work is None or not _completed(o.work)]
        awaited = {id(v) for v in _locals(frame)}
        waiting.sort(key=lambda o: (o.work is None, id(o.work) in awaited, o.op == "recv", -o.since))
        return [Collective(o.op, o.number, group_description(o.group), (tuple(o.shape),), (_dtype_name(o.dtype),), (),
                           o.peer) for o in waiting]

    def _opening(self, op: str, group: Any, peer: int | None, group_peer: int | None, tensor: Any) -> _Opened:
        """A point-to-point operation about to run: numbered by its group, peer and direction
        (the n-th send from a rank to a peer pairs with the peer's n-th receive from it)."""
        import torch.distributed as dist

        if peer is None and group_peer is not None:
            peer = dist.get_global_rank(group, group_peer)
        key = (id(group), op, peer)
        number = self._p2p_numbers[key] = self._p2p_numbers.get(key, 0) + 1
        return _Opened(op, group, peer, number, getattr(tensor, "shape", ()), getattr(tensor, "dtype", None),
                       time.monotonic_ns())

    def _open(self, opened: _Opened) -> None:
        """Keep ``opened``; drop the works completed since (a work holds its tensors: a
        pipeline's activations)."""
        with self._open_lock:
            self._opened = [o for o in self._opened if o.work is None or not _completed(o.work)][-OPEN_KEPT:]
            self._opened.append(opened)

    def _close(self, opened: _Opened) -> None:
        with self._open_lock:
            self._opened = [o for o in self._opened if o is not opened]

    def new_generation(self, generation: int) -> None:
        """The process groups were re-created: numbering starts again in the new ones."""
        self._generation = generation
        self._groups, self._p2p, self._p2p_numbers = {}, {}, {}
        with self._open_lock:
            self._opened = [o for o in self._opened if o.work is None]  # the old groups' works are done for
        self._since_ns, self._taken, self._read_at = time.time_ns(), {}, (0, self._seen())

    def began(self, request: int | None) -> None:
        """The main thread runs ``request`` from now on (None: nothing)."""
        self._began.append((time.time_ns(), request))

    def take(self) -> dict[str, Any] | None:
        """What was recorded since the last call: ``{"keys": {key: (generation, group name,
        members)}, "entries": [Entry...]}``, or None if nothing was."""
        self._read_recorder()
        entries, self._entries = self._entries, []
        keys, self._new_keys = self._new_keys, {}
        if not entries and not keys:
            return None
        return {"keys": keys, "entries": entries}

    # -- recording (main thread) -------------------------------------------------------------

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, a collective of ``torch.distributed``, timed when the main thread calls it."""
        params = list(inspect.signature(fn).parameters)
        group_at = params.index("group") if "group" in params else None
        async_at = params.index("async_op") if "async_op" in params else None
        op = fn.__name__
        matched = SAME_ON_EVERY_MEMBER.get(op)
        matched_at = params.index(matched) if matched in params else None

        def collective(*args: Any, **kwargs: Any) -> Any:
            if self.call is not None or threading.get_ident() != self._main:
                return fn(*args, **kwargs)
            waits = not _argument(args, kwargs, "async_op", async_at) and not (self._enqueues and _on_gpu(args))
            # Numbered first: a SIGINT that came during the call is raised once it returns, maybe
            # in the finally below; the call counts all the same, or the next pairs with the
            # members' one after it. Its entry is what such an interrupt may lose.
            number = self._number(_argument(args, kwargs, "group", group_at))
            self._entered += 1
            entered = self._in_call_since = time.time_ns()
            try:  # set inside: an interrupt can never leave the clock thinking it is in a call
                self.call = self._entered
                return fn(*args, **kwargs)
            finally:
                self.call = None
                try:
                    returned = time.time_ns()
                    self._calls.append((entered, returned))  # before it is let go: see _read_recorder
                    if number is not None:
                        called = _called(op, _argument(args, kwargs, matched, matched_at)) if matched else (op,)
                        self._entries.append((self._request(), *number, entered, returned if waits else 0, called))
                finally:
                    self._in_call_since = None

        self.codes.add(collective.__code__)
        return functools.wraps(fn)(collective)

    def _number(self, group: Any) -> tuple[int, int] | None:
        """The key of ``group`` and this call's number in it; None for a group torch does not know."""
        try:
            key = self._key(group)
        except Exception:  # noqa: BLE001 - a group torch does not know: leave it untimed
            return None
        self._counts[key] += 1
        return key, self._counts[key]

    def _key(self, group: Any) -> int:
        import torch.distributed as dist

        pg = group if group is not None else dist.group.WORLD
        found = self._groups.get(id(pg))
        if found is not None and found[0] is pg:
            return found[1]
        with self._keys_lock:  # the control thread keys the recorder's groups
            found = self._groups.get(id(pg))
            if found is not None and found[0] is pg:
                return found[1]
            key = len(self._counts)
            self._counts.append(0)
            self._groups[id(pg)] = (pg, key)
            self._new_keys[key] = (self._generation, group_name(pg), tuple(dist.get_process_group_ranks(pg)))
            return key

    # -- what the wrappers did not see (either thread, under the worker's send lock) ---------

    def _read_recorder(self) -> None:
        """Add the collectives no wrapped call issued, from the flight recorder, when the
        groups' count says there are any."""
        if "torch.distributed" not in sys.modules:
            return
        try:
            issued, seen = issued_by_groups(), self._seen()
        except Exception:  # noqa: BLE001 - no group yet, or one being destroyed
            return
        before, self._read_at = self._read_at, (issued, seen)
        if issued - before[0] <= seen - before[1]:
            return  # every operation issued since was a wrapped call (a pipeline's sends read nothing)
        recorded = finished_and_pending_collectives()
        # Read after the recorder (a call that began since has no entry there), and the call
        # running before the calls that ended: one that ends between the two reads is in both.
        running = self._in_call_since
        calls, began = list(self._calls), list(self._began)
        groups = dict(process_groups())
        for entry in recorded:
            name, seq = str(entry["process_group"][0]), int(entry["collective_seq_id"])
            created = int(entry["time_created_ns"])
            if created < self._since_ns or seq <= self._taken.get(name, 0) or name not in groups:
                continue
            self._taken[name] = seq
            if not _issued_by(calls, running, created):
                self._entries.append((_request_at(began, created), self._key(groups[name]), -seq, created, 0, None))

    def _seen(self) -> int:
        """Operations the wrappers saw: the outermost collective calls, and the point-to-point ones."""
        return self._entered + self._p2p_run


def _request_at(began: list[tuple[int, int | None]], ns: int) -> int | None:
    """The request the main thread ran at ``ns``, from when each began."""
    at = bisect.bisect_right(began, ns, key=lambda b: b[0]) - 1
    return began[at][1] if at >= 0 else None


def _issued_by(calls: list[tuple[int, int]], running: int | None, created: int) -> bool:
    """Was a collective the recorder created at ``created`` issued by a wrapped call?"""
    if running is not None and created >= running:
        return True
    at = bisect.bisect_right(calls, (created, 1 << 63)) - 1
    return at >= 0 and calls[at][0] <= created <= calls[at][1]


def _called(op: str, tensor: Any) -> tuple[Any, ...]:
    """``(op, elements, dtype, shape)`` of a collective whose ``tensor`` must match on every member."""
    try:
        return op, tensor.numel(), _dtype_name(tensor.dtype), tuple(tensor.shape)
    except Exception:  # noqa: BLE001 - not a tensor: torch's own error says so
        return (op,)


def _locals(frame: Any) -> list[Any]:
    """The values of ``frame``'s local variables (none without a frame). Read from another
    thread while the frame waits in C: it runs no bytecode meanwhile."""
    try:
        return list(frame.f_locals.values()) if frame is not None else []
    except Exception:  # noqa: BLE001 - a frame that ended meanwhile
        return []


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a work of a group since destroyed: nothing waits there
        return True


def _dtype_name(dtype: Any) -> str:
    """``Float`` for ``torch.float32``, as the flight recorder names it."""
    return {"float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16", "int64": "Long",
            "int32": "Int", "bool": "Bool", "uint8": "Byte", "int8": "Char"}.get(str(dtype).split(".")[-1],
                                                                                 str(dtype).split(".")[-1])


def _on_gpu(args: tuple[Any, ...]) -> bool:
    """Is the call's first argument a GPU tensor (or a list of them)?"""
    first = args[0] if args else None
    if isinstance(first, (list, tuple)) and first:
        first = first[0]
    return bool(getattr(first, "is_cuda", False))


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, at: int | None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[at] if at is not None and len(args) > at else None
